"""How a `jaxlowfp.models.Llama` is exported: the export protocol of `jaxlowfp.ptq.protocol` for the Llama family
(Llama, Mistral, Qwen2, Qwen3), as functions of its `jaxlowfp.models.ModelConfig`, which `Llama.export_tensors` /
`Llama.export_config` return.

Targets:

- ``"hf"``: Hugging Face names and ``[out, in]`` layout (`jaxlowfp.models.common.tensor_specs`), and a
  ``config.json`` (`hf_config`);
- ``"gguf"``: llama.cpp's names (``convert_hf_to_gguf.py``), the q/k row permutation of the ``llama``
  architecture, the Llama-3 RoPE frequency divisors as ``rope_freqs.weight`` (F32 ``[head_dim / 2]``, what
  ``LlamaModel.generate_extra_tensors`` writes and ``src/llama-model.cpp`` reads as ``layer.rope_freqs`` for the
  ``llama`` architecture), a uniform divisor as ``rope.scaling.type = linear`` (every architecture), and the
  hyperparameter keys of ``llama-arch.cpp`` (``{arch}.context_length`` ...).
"""
from __future__ import annotations

from typing import Any

from jaxlowfp.models.tensor_names import tensor_specs
from jaxlowfp._core.export_spec import ExportTensor

__all__ = ["architecture", "export_config", "export_tensors", "hf_config"]

_PERMUTED = {"llama": True, "qwen2": False, "qwen3": False}  # llama.cpp RoPE NORM (adjacent pairs) vs NEOX


def architecture(cfg: Any) -> str:
    """The llama.cpp / Hugging Face family of a config: qwen3 (q/k norm), qwen2 (q/k/v bias) or llama."""
    return "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"


def _uniform_factor(cfg: Any) -> float | None:
    f = cfg.rope_freq_factors
    return f[0] if f is not None and len(set(f)) == 1 else None


def hf_config(cfg: Any) -> dict:
    """A Hugging Face ``config.json`` for `cfg`. Linear RoPE scaling is written as ``rope_scaling``; per-frequency
    (Llama-3) divisors cannot be: their ``rope_scaling`` parameters are not kept in the config (refused, pass the
    source ``config.json`` as ``model_config``)."""
    arch = architecture(cfg)
    out = {"architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                              "qwen3": "Qwen3ForCausalLM"}[arch]], "model_type": arch,
           "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
           "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
           "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "vocab_size": cfg.vocab,
           "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": cfg.tie_embeddings,
           "hidden_act": "silu", "torch_dtype": "float32"}
    if cfg.rope_freq_factors is not None:
        u = _uniform_factor(cfg)
        if u is None:
            raise ValueError("this model has per-frequency (Llama-3) RoPE divisors, whose rope_scaling parameters "
                             "(factor, low/high_freq_factor, original_max_position_embeddings) the ModelConfig does "
                             "not keep; pass the source config.json as model_config=")
        out["rope_scaling"] = {"rope_type": "linear", "factor": u}
    return out


def export_tensors(cfg: Any, target: str) -> list[ExportTensor]:
    """Every tensor of the ``target`` file for ``Llama(cfg)`` (module docstring)."""
    if target not in ("hf", "gguf"):
        raise ValueError(f"target={target!r} is not supported; allowed: 'hf', 'gguf'")
    arch = architecture(cfg)
    out = []
    for s in tensor_specs(cfg):
        if target == "hf":
            out.append(ExportTensor(name=s.hf, path=s.path, transpose=s.transpose))
            continue
        heads = None
        if _PERMUTED[arch] and s.rope is not None:
            heads = cfg.n_heads if s.rope == "q" else cfg.n_kv_heads
        out.append(ExportTensor(name=s.gguf, path=s.path, transpose=s.transpose, permute_heads=heads))
    if target == "gguf" and cfg.rope_freq_factors is not None and _uniform_factor(cfg) is None:
        if not _PERMUTED[arch]:
            raise ValueError(f"llama.cpp's {arch} graph applies no rope_freqs tensor, so this model's per-frequency "
                             "RoPE divisors cannot be written for it; refusing to write a file llama.cpp would run "
                             "with plain RoPE")
        out.insert(0, ExportTensor(name="rope_freqs.weight", value=list(cfg.rope_freq_factors)))
    return out


def export_config(cfg: Any, target: str) -> dict[str, Any]:
    """``config.json`` ("hf") or ``{"architecture", "metadata"}`` ("gguf") for ``Llama(cfg)``."""
    if target == "hf":
        return hf_config(cfg)
    if target != "gguf":
        raise ValueError(f"target={target!r} is not supported; allowed: 'hf', 'gguf'")
    a = architecture(cfg)
    meta: dict[str, Any] = {
        f"{a}.context_length": cfg.max_seq_len, f"{a}.embedding_length": cfg.d_model,
        f"{a}.block_count": cfg.n_layers, f"{a}.feed_forward_length": cfg.d_ff,
        f"{a}.attention.head_count": cfg.n_heads, f"{a}.attention.head_count_kv": cfg.n_kv_heads,
        f"{a}.attention.key_length": cfg.head_dim, f"{a}.attention.value_length": cfg.head_dim,
        f"{a}.rope.dimension_count": cfg.head_dim, f"{a}.rope.freq_base": cfg.rope_theta,
        f"{a}.attention.layer_norm_rms_epsilon": cfg.norm_eps, f"{a}.vocab_size": cfg.vocab,
    }
    u = _uniform_factor(cfg)
    if u is not None:
        meta[f"{a}.rope.scaling.type"] = "linear"
        meta[f"{a}.rope.scaling.factor"] = u
    return {"architecture": a, "metadata": meta}
