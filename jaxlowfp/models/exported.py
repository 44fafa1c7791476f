"""A directory written by `jaxlowfp.ptq.export`, loaded as a model: ``load_export(directory) -> (model, tokenizer)``.

The model is built here, from the directory's ``config.json`` (a `jaxlowfp.models.Llama`, or for Qwen3-MoE /
Mixtral a `jaxlowfp.models.MoEDecoder`), created abstract (``nnx.eval_shape``: no float copy of the quantized
kernels is ever made) and filled by `jaxlowfp.ptq.load`, which knows the export's tensors and formats but never
builds a model: `jaxlowfp.ptq` imports nothing of `jaxlowfp.models`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from flax import nnx

from jaxlowfp._core.deprecation import renamed_kwarg
from jaxlowfp.models.common import abstract_model
from jaxlowfp.models.llama import Llama
from jaxlowfp.models.moe import MoEDecoder

__all__ = ["load_export"]


def load_export(directory: str | Path, *, packed: bool = False, gemm: str = "auto", dtype: str = "float32",
                param_dtype: str = "float32", tokenizer: Any = "auto", backend: str | None = None
                ) -> tuple[nnx.Module, Any]:
    """``(model, tokenizer)`` of a directory written by `jaxlowfp.ptq.export`, the model built from its
    ``config.json``: a `jaxlowfp.models.Llama` or, for Qwen3-MoE / Mixtral, a `jaxlowfp.models.MoEDecoder`, created
    abstract (``nnx.eval_shape``) and filled by `jaxlowfp.ptq.load` (NVFP4 / FP8 decoded, or ``packed=True``: the
    file's codes and scales as they are, nothing decoded, products on ``gemm``). `tokenizer`: "auto" (the
    directory's ``tokenizer.json``), a path, or None."""
    gemm = renamed_kwarg("models.load_export", "backend", backend, "gemm", gemm, "auto")
    from jaxlowfp.models import hf_loader, moe_loader  # on use: the jaxlowfp[models] extra
    from jaxlowfp.ptq.checkpoint import META_FILE, load

    directory = Path(directory)
    if not (directory / META_FILE).is_file():
        raise FileNotFoundError(f"{directory}: no {META_FILE} (not written by jaxlowfp.ptq.export); load other "
                                f"checkpoints with jaxlowfp.models.load")
    if moe_loader.is_moe_hf(directory):
        config: Any = moe_loader.read_hf_config(directory, dtype=dtype, param_dtype=param_dtype)
        make: Any = MoEDecoder
    else:
        config, make = hf_loader.read_config(directory, dtype=dtype, param_dtype=param_dtype), Llama
    tok = hf_loader.checkpoint_tokenizer(directory, tokenizer, config.vocab)
    model = abstract_model(make, config)
    load(model, directory, packed=packed, gemm=gemm)
    return model, tok
