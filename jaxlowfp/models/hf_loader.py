"""Load a Hugging Face checkpoint directory (Llama, Mistral, Qwen2, Qwen3) into `jaxlowfp.models.llama.Llama`.

A directory holds ``config.json``, the weights as ``*.safetensors`` (one file, or shards listed by
``model.safetensors.index.json``) and ``tokenizer.json``; read with the ``safetensors`` and ``tokenizers``
libraries. Tensors keep Hugging Face's names and ``[out, in]`` layout (rotate-half RoPE: no permutation).
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from safetensors import SafetensorError, safe_open

from jaxlowfp._core.checks import optional_module
from jaxlowfp.models.common import (CheckpointError, LazyTensor, TensorSpec, Tokenizer, build_model,
                                    tensor_specs)
from jaxlowfp.models.llama import Llama, ModelConfig, llama3_rope_factors

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizer

tokenizers = optional_module("tokenizers", extra="models", feature="loading a Hugging Face checkpoint")

__all__ = ["MODEL_TYPES", "checkpoint_tokenizer", "config_fields", "load_hf", "read_config", "read_tokenizer"]

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some exports carry; recomputed here


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file of a checkpoint directory, parsed; a CheckpointError when missing or not valid JSON."""
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON: {e}") from e


def _rope_factors(cfg: dict[str, Any], head_dim: int, theta: float, where: Path) -> tuple[float, ...] | None:
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return (float(rs["factor"]),) * (head_dim // 2)
    if kind == "llama3":
        try:
            return llama3_rope_factors(
                head_dim, theta, factor=float(rs["factor"]), low_freq_factor=float(rs["low_freq_factor"]),
                high_freq_factor=float(rs["high_freq_factor"]),
                original_max_position_embeddings=int(rs["original_max_position_embeddings"]))
        except KeyError as e:
            raise CheckpointError(f"{where}: rope_scaling of type 'llama3' lacks {e.args[0]!r}") from e
    raise CheckpointError(f"{where}: rope scaling type {kind!r} is not supported; allowed: 'default', 'linear', "
                          "'llama3'")


def read_config(directory: str | Path, *, dtype: str = "float32", param_dtype: str = "float32") -> ModelConfig:
    """The `ModelConfig` of a Hugging Face ``config.json``."""
    where = Path(directory) / "config.json"
    cfg = read_json(where)
    mt = cfg.get("model_type")
    if mt not in MODEL_TYPES:
        raise CheckpointError(f"{where}: model_type {mt!r} (architectures {cfg.get('architectures')}) is not "
                              f"supported; allowed: {', '.join(map(repr, MODEL_TYPES))}")
    try:
        return ModelConfig(**config_fields(cfg, where, mt), dtype=dtype, param_dtype=param_dtype)
    except ValueError as e:
        raise CheckpointError(f"{where}: invalid model config: {e}") from e


def config_fields(cfg: dict[str, Any], where: Path, mt: str) -> dict[str, Any]:
    """The `ModelConfig` fields (all but the dtypes) of a parsed ``config.json`` of the dense family ``mt``
    (one of `MODEL_TYPES`; `jaxlowfp.models.moe_loader` passes the family its attention matches)."""

    def need(key: str) -> Any:
        if key not in cfg:
            raise CheckpointError(f"{where}: key {key!r} is missing")
        return cfg[key]

    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported; allowed: 'silu'")
    if cfg.get("mlp_bias"):
        raise CheckpointError(f"{where}: mlp_bias=true is not supported")
    if mt in ("llama", "mistral") and cfg.get("attention_bias"):
        raise CheckpointError(f"{where}: attention_bias=true (biases on all four attention projections) is not "
                              "supported")
    if cfg.get("use_sliding_window"):
        raise CheckpointError(f"{where}: use_sliding_window=true is not supported")
    d_model, n_heads = int(need("hidden_size")), int(need("num_attention_heads"))
    head_dim = int(cfg.get("head_dim") or d_model // n_heads)
    theta = float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10_000.0)
    max_len = int(need("max_position_embeddings"))
    window = cfg.get("sliding_window") if mt == "mistral" else None
    if window:  # sliding-window attention equals full attention up to the window length
        max_len = min(max_len, int(window))
    return dict(
        vocab=int(need("vocab_size")),
        d_model=d_model,
        n_layers=int(need("num_hidden_layers")),
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        d_ff=int(need("intermediate_size")),
        max_seq_len=max_len,
        rope_theta=theta,
        norm_eps=float(need("rms_norm_eps")),
        explicit_head_dim=None if head_dim * n_heads == d_model else head_dim,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=mt == "qwen2",
        qk_norm=mt == "qwen3",
        rope_freq_factors=_rope_factors(cfg, head_dim, theta, where),
    )


def _token_id(cfg: dict[str, Any], tok_cfg: dict[str, Any], tk: HFTokenizer, name: str) -> int | None:
    v = cfg.get(f"{name}_token_id")
    if isinstance(v, list):
        v = v[0] if v else None
    if v is None:
        t = tok_cfg.get(f"{name}_token")
        t = t.get("content") if isinstance(t, dict) else t
        v = tk.token_to_id(t) if isinstance(t, str) else None
    return None if v is None else int(v)


def read_tokenizer(directory: str | Path, tokenizer: str | Path | None = None) -> Tokenizer:
    """``tokenizer.json`` with BOS/EOS ids from ``config.json`` (or ``tokenizer_config.json``). `tokenizer`: another
    ``tokenizer.json`` (or a directory holding one) for a checkpoint saved without it; its own
    ``tokenizer_config.json`` is read, BOS/EOS ids from the checkpoint's ``config.json`` first."""
    directory = Path(directory)
    path = directory / "tokenizer.json"
    tok_dir = directory
    if tokenizer is not None:
        path = Path(tokenizer) / "tokenizer.json" if Path(tokenizer).is_dir() else Path(tokenizer)
        tok_dir = path.parent
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found (only tokenizer.json tokenizers are supported)")
    try:
        tk = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a plain Exception subclass
        raise CheckpointError(f"{path}: not a readable tokenizer: {e}") from e
    cfg = read_json(directory / "config.json") if (directory / "config.json").is_file() else {}
    tok_cfg = read_json(tok_dir / "tokenizer_config.json") if (tok_dir / "tokenizer_config.json").is_file() else {}
    return Tokenizer(tk, bos_id=_token_id(cfg, tok_cfg, tk, "bos"), eos_id=_token_id(cfg, tok_cfg, tk, "eos"),
                     source=str(path))


def checkpoint_tokenizer(directory: str | Path, tokenizer: str | Path | None, vocab: int) -> Tokenizer | None:
    """The tokenizer `load` returns (checked to fit `vocab`): ``tokenizer="auto"`` the checkpoint's own
    ``tokenizer.json`` (a clear error when it has none, as llm-compressor saves a model given no tokenizer), a path
    (a ``tokenizer.json`` or a directory holding one), or None (no tokenizer)."""
    directory = Path(directory)
    if tokenizer is None:
        return None
    if isinstance(tokenizer, str) and tokenizer == "auto":
        if not (directory / "tokenizer.json").is_file():
            raise CheckpointError(f"{directory / 'tokenizer.json'}: file not found (llm-compressor saves none when "
                                  f"oneshot is given no tokenizer). Pass tokenizer=<a tokenizer.json, or a directory "
                                  f"holding one, e.g. the source model's> or tokenizer=None to load the weights "
                                  f"without a tokenizer")
        tk = read_tokenizer(directory)
    elif isinstance(tokenizer, (str, Path)):
        tk = read_tokenizer(directory, tokenizer)
    else:
        raise TypeError(f"tokenizer must be 'auto', a path or None; got {type(tokenizer).__name__}")
    tk.check_fits(vocab, tk.source)
    return tk


def weight_files(directory: Path) -> dict[str, Path]:
    """tensor name -> the safetensors file that holds it."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no 'weight_map'")
        files: dict[str, Path] = {name: directory / f for name, f in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise CheckpointError(f"{f}: shard listed in {index.name} not found")
        return files
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{directory}: no *.safetensors weights (and no model.safetensors.index.json)")
    files = {}
    for f in shards:
        with open_safetensors(f) as handle:
            names = list(handle.keys())
        for name in names:
            if name in files:
                raise CheckpointError(f"{f}: tensor {name} is also in {files[name]}")
            files[name] = f
    return files


def open_safetensors(f: Path) -> Any:
    """``safetensors.safe_open`` of `f` for numpy; a CheckpointError for a corrupt file."""
    try:
        return safe_open(str(f), framework="numpy")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{f}: not a readable safetensors file (truncated or corrupt?): {e}") from e


def load_hf(directory: str | Path, *, dtype: str = "float32", param_dtype: str = "float32", mesh: Any = None,
            rules: Any = None, tokenizer: str | Path | None = "auto") -> tuple[Llama, Tokenizer | None]:
    """`Llama` and `Tokenizer` of a Hugging Face checkpoint directory (`tokenizer`: `checkpoint_tokenizer`); with
    ``mesh``, every parameter is read slice by slice into its shards (`jaxlowfp.models.common.build_model`,
    ``rules`` as there)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    if ((directory / "hf_quant_config.json").is_file()
            or read_json(directory / "config.json").get("quantization_config")):
        raise CheckpointError(f"{directory}: a quantized checkpoint; load it with jaxlowfp.models.load (NVFP4 of "
                              "compressed-tensors and ModelOpt: jaxlowfp.models.quantized)")
    config = read_config(directory, dtype=dtype, param_dtype=param_dtype)
    tok = checkpoint_tokenizer(directory, tokenizer, config.vocab)
    files = weight_files(directory)
    specs = tensor_specs(config)
    wanted = {s.hf for s in specs}
    extra = sorted(n for n in files if n not in wanted and not n.endswith(IGNORED_SUFFIXES)
                   and not (config.tie_embeddings and n == "lm_head.weight"))
    if extra:
        raise CheckpointError(f"{directory}: tensors this model class does not have: {', '.join(extra[:5])}"
                              f"{' ...' if len(extra) > 5 else ''} (an unsupported architecture variant?)")
    handles: dict[Path, Any] = {}

    def fetch(spec: TensorSpec) -> LazyTensor:
        f = files.get(spec.hf)
        if f is None:
            raise CheckpointError(f"{directory}: tensor {spec.hf} is missing (looked in "
                                  f"{', '.join(sorted({p.name for p in files.values()}))})")
        where = f"{f}: tensor {spec.hf}"
        if f not in handles:
            handles[f] = stack.enter_context(open_safetensors(f))
        try:
            part = handles[f].get_slice(spec.hf)  # reads the header only; part[index] reads that slice
            shape = tuple(int(n) for n in part.get_shape())
        except (SafetensorError, OSError, KeyError) as e:
            raise CheckpointError(f"{where} cannot be read (truncated file or wrong index?): {e}") from e

        def read(index: tuple[slice, ...]) -> np.ndarray:
            try:
                return np.asarray(part[index] if index else part[...], np.float32)
            except (SafetensorError, OSError, KeyError) as e:
                raise CheckpointError(f"{where} cannot be read (truncated file or wrong index?): {e}") from e

        return LazyTensor(shape, where, read)

    with contextlib.ExitStack() as stack:  # closes the shard files
        return build_model(config, fetch, directory / "config.json", mesh=mesh, rules=rules), tok
