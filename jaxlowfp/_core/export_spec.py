"""What an exporter asks a model (issue 27; public as `jaxlowfp.ptq.protocol`, defined on the bottom floor so that
the model families of `jaxlowfp.models` implement it without importing `jaxlowfp.ptq`): the model says its tensors
in the target layout, its fused groups and its config; `jaxlowfp.ptq.export` (compressed-tensors, target ``"hf"``)
and `jaxlowfp.ptq.export_gguf` (target ``"gguf"``) call these methods and never test the model's class. Any
``nnx.Module`` that has them exports.

    model.export_tensors(target) -> list[ExportTensor]   every tensor the file holds, in the file's order
    model.export_config(target)  -> dict                 "hf": config.json (quantization_config is added);
                                                         "gguf": {"architecture": str, "metadata": {key: value}}
    model.fused_groups()         -> list[tuple[str, ...]]  (optional) layer paths a serving engine fuses into one
                                                           GEMM (one NVFP4 global scale); default: vLLM's names

An `ExportTensor` is a parameter (``path``, an NNX parameter path such as ``blocks/0/attn/q_proj/kernel``) or a
computed constant (``value``, e.g. llama.cpp's ``rope_freqs.weight``), written as ``name`` after ``transpose``
(NNX kernels are ``[in, out]``, files ``[out, in]``) and, for GGUF's ``llama`` architecture, the q/k row
permutation of llama.cpp's converter over ``permute_heads`` heads; ``transform`` (a function of the float32
parameter, e.g. ``A = -exp(A_log)`` for a state-space model) is applied first, and not allowed on a quantized
kernel. ``expert`` (an int) selects one expert of a grouped ``[E, K, N]`` weight (a mixture of experts'
``blocks/<i>/mlp/experts/gate_proj``, written as one ``[out, in]`` tensor per expert in the Hugging Face layout);
``transpose`` swaps the last two axes, so a 3-D expert weight written whole (GGUF's ``ffn_*_exps``) keeps its
expert axis first. Tensors of one dimension are written in float32, the others in the exporter's ``dtype``.

GGUF metadata values are Python ``str`` / ``bool`` / ``int`` (written as UINT32) / ``float`` (FLOAT32) or lists
of them; keys as in llama.cpp (``llama.context_length``...). The tokenizer is not the model's: exporters take it
as an argument.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np

TARGETS = ("hf", "gguf")

__all__ = ["TARGETS", "ExportTensor", "Exportable", "require_exportable"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportTensor:
    """One tensor of an exported file (module docstring)."""

    name: str
    path: str | None = None
    value: Any = None
    transpose: bool = False
    permute_heads: int | None = None
    transform: Callable[[np.ndarray], np.ndarray] | None = None
    expert: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ExportTensor.name must be a non-empty str; got {self.name!r}")
        if (self.path is None) == (self.value is None):
            raise ValueError(f"ExportTensor {self.name!r}: give exactly one of path (a parameter) and value (a "
                             f"constant); got path={self.path!r}, value={'None' if self.value is None else 'set'}")
        if self.transform is not None and not callable(self.transform):
            raise ValueError(f"ExportTensor {self.name!r}: transform must be callable or None")
        if self.permute_heads is not None and (isinstance(self.permute_heads, bool)
                                               or not isinstance(self.permute_heads, int) or self.permute_heads < 1):
            raise ValueError(f"ExportTensor {self.name!r}: permute_heads must be a positive int or None; got "
                             f"{self.permute_heads!r}")
        if self.expert is not None and (isinstance(self.expert, bool) or not isinstance(self.expert, int)
                                        or self.expert < 0 or self.path is None):
            raise ValueError(f"ExportTensor {self.name!r}: expert must be a non-negative int selecting one expert "
                             f"of a parameter (path); got expert={self.expert!r}, path={self.path!r}")

    @property
    def module(self) -> str | None:
        """The layer path of a ``.../kernel`` parameter (what quantization rules select), else None."""
        if self.path is None or not self.path.endswith("/kernel"):
            return None
        return self.path.rsplit("/", 1)[0]

    def array(self, params: dict[str, Any]) -> np.ndarray:
        """The tensor's float32 values in the file's layout, before any quantization or permutation."""
        v = np.asarray(params[self.path][...] if self.path is not None else self.value, np.float32)
        if self.expert is not None:
            v = v[self.expert]
        if self.transform is not None:
            v = np.asarray(self.transform(v), np.float32)
        return np.swapaxes(v, -1, -2) if self.transpose else v


@runtime_checkable
class Exportable(Protocol):
    """A model the exporters can write (module docstring)."""

    def export_tensors(self, target: str) -> list[ExportTensor]: ...

    def export_config(self, target: str) -> dict[str, Any]: ...


def require_exportable(model: Any, target: str, caller: str, *, with_config: bool = True
                       ) -> tuple[list[ExportTensor], dict[str, Any]]:
    """The model's tensors and (`with_config`) config for `target`, checked: TypeError naming what to implement
    if it cannot say them; ValueError for duplicate names."""
    if target not in TARGETS:
        raise ValueError(f"target={target!r} is not supported; allowed: {', '.join(map(repr, TARGETS))}")
    if not isinstance(model, Exportable):
        raise TypeError(f"{caller}: a {type(model).__name__} does not say how it is exported; implement "
                        f"export_tensors(target) -> list[jaxlowfp.ptq.protocol.ExportTensor] and "
                        f"export_config(target) -> dict (jaxlowfp.ptq.protocol; jaxlowfp.models.Llama does)")
    tensors = list(model.export_tensors(target))
    config = dict(model.export_config(target)) if with_config else {}
    names = [t.name for t in tensors]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{caller}: {type(model).__name__}.export_tensors({target!r}) names {dup[:4]} twice")
    bad = [t for t in tensors if not isinstance(t, ExportTensor)]
    if bad:
        raise TypeError(f"{caller}: export_tensors must return ExportTensor objects; got {type(bad[0]).__name__}")
    return tensors, config
