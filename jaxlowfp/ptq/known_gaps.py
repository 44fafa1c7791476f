"""Known gaps of the consumers of our exports: files that are valid by the format's specification but that a
consumer is known to misrun (refused unless the caller overrides) or to reject (a warning).

Each entry was observed with the versions named by ``scripts/interop_live.py`` (records:
``tests/fixtures/interop/record.json`` and ``record_issue31.json``: a tiny qwen2 with NVFP4 MLP weights gives 8,320
NaN logits of 8,320 in llama.cpp, with NVFP4 attention 0):

=================  ============================================  ========  ==========================================
consumer           file                                          action    what happens
=================  ============================================  ========  ==========================================
llama.cpp 0.3.36   GGUF ``qwen2`` with NVFP4 MLP weights         refuse    NaN logits: its qwen2 graph applies no
                   (``ffn_gate`` / ``ffn_up`` / ``ffn_down``)              ``.scale`` tensor to the MLP (NVFP4 on
                                                                           q/k/v alone runs)
compressed-tensors compressed-tensors NVFP4 with W4A4 layers     warn      its model-free ``CompressedTensors
0.20                                                                       Dequantizer.validate`` rejects the
                                                                           ``input_global_scale`` tensors (as it
                                                                           rejects llm-compressor's own W4A4
                                                                           export); vLLM and transformers load it
=================  ============================================  ========  ==========================================
"""
from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable, Mapping, Sequence


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gap:
    """One known gap: `applies(architecture, {tensor name: type}, {layer: has activation quantization})`."""

    consumer: str
    target: str
    action: str
    what: str
    applies: Callable[[str, Mapping[str, str], Mapping[str, bool]], Sequence[str]]

    def __post_init__(self) -> None:
        if self.action not in ("refuse", "warn") or self.target not in ("hf", "gguf"):
            raise ValueError(f"Gap: action must be 'refuse' or 'warn', target 'hf' or 'gguf'; got {self.action!r}, "
                             f"{self.target!r}")


def _qwen2_nvfp4_mlp(arch: str, types: Mapping[str, str], act: Mapping[str, bool]) -> list[str]:
    if arch != "qwen2":
        return []
    return [n for n, t in types.items() if t == "NVFP4" and re.search(r"\.ffn_(gate|up|down)\.weight$", n)]


def _w4a4(arch: str, types: Mapping[str, str], act: Mapping[str, bool]) -> list[str]:
    return [p for p, a in act.items() if a]


GAPS: tuple[Gap, ...] = (
    Gap(consumer="llama.cpp 0.3.36", target="gguf", action="refuse", applies=_qwen2_nvfp4_mlp,
        what="its qwen2 graph applies no .scale tensor to the MLP projections, so NVFP4 MLP weights give NaN "
             "logits (NVFP4 on q/k/v alone runs)"),
    Gap(consumer="compressed-tensors 0.20", target="hf", action="warn", applies=_w4a4,
        what="its model-free CompressedTensorsDequantizer rejects W4A4 checkpoints (the input_global_scale "
             "tensors are 'residual quantization params'), llm-compressor's own W4A4 exports included; vLLM and "
             "transformers load them"),
)


def check(target: str, arch: str, types: Mapping[str, str], activations: Mapping[str, bool], *,
          allow_known_gaps: bool, caller: str) -> list[str]:
    """Refuse (ValueError, unless `allow_known_gaps`) or warn for every gap of `GAPS` that the file hits; returns
    the messages of the gaps that apply (for the export report)."""
    out = []
    for gap in GAPS:
        if gap.target != target:
            continue
        hit = list(gap.applies(arch, types, activations))
        if not hit:
            continue
        msg = f"{gap.consumer}: {gap.what} ({len(hit)} tensors/layers, e.g. {hit[0]})"
        if gap.action == "refuse" and not allow_known_gaps:
            raise ValueError(f"{caller}: {msg}; refusing to write a file that consumer is known to misrun. Keep "
                             f"those layers in high precision, or pass allow_known_gaps=True to write it anyway")
        warnings.warn(f"{caller}: {msg}", stacklevel=3)
        out.append(msg)
    return out
