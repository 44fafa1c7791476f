"""How a `jaxlowfp.models.moe.MoEDecoder` is exported (the export protocol of `jaxlowfp.ptq.protocol`, which
`MoEDecoder.export_tensors` / `export_config` return): the dense model's tensors (`jaxlowfp.models.export`) for
embeddings, attention, norms, dense layers and the head, and in each sparse layer

- ``"hf"``: the per-expert layout transformers' ``save_pretrained`` writes and vLLM loads (one ``[out, in]`` tensor
  per expert, ``ExportTensor.expert``): Qwen3-MoE and OLMoE ``model.layers.N.mlp.gate.weight`` (router) and
  ``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``; Mixtral ``model.layers.N.block_sparse_moe.gate
  .weight`` and ``...block_sparse_moe.experts.E.{w1,w3,w2}.weight`` (gate, up, down);
- ``"gguf"``: llama.cpp's ``blk.N.ffn_gate_inp.weight`` (router ``[E, d_model]``) and the 3-D
  ``blk.N.ffn_{gate,up,down}_exps.weight`` (``[E, out, in]`` in numpy order), architectures ``qwen3moe``,
  ``llama`` (Mixtral, q/k rows RoPE-permuted) and ``olmoe`` with ``{arch}.expert_count``,
  ``{arch}.expert_used_count`` and ``{arch}.expert_feed_forward_length`` (what `jaxlowfp.models.moe_loader` reads).

The family is the config's: OLMoE (q/k norms over all heads), Qwen3-MoE (per-head q/k norms), else Mixtral.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from jaxlowfp._core.export_spec import ExportTensor
from jaxlowfp.models import export as dense_export
from jaxlowfp.models.llama import ModelConfig

__all__ = ["HF_EXPERT_NAMES", "export_config", "export_tensors", "family", "hf_config"]

# our expert weight -> its per-expert Hugging Face name, per family (transformers' modeling_*.py)
HF_EXPERT_NAMES = {"qwen3_moe": {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"},
                   "olmoe": {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"},
                   "mixtral": {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}}
_HF_MLP = {"qwen3_moe": "mlp", "olmoe": "mlp", "mixtral": "block_sparse_moe"}
_GGUF_ARCH = {"qwen3_moe": "qwen3moe", "olmoe": "olmoe", "mixtral": "llama"}
_GGUF_EXPS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
_ARCHS = {"qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM", "mixtral": "MixtralForCausalLM"}


def family(cfg: Any) -> str:
    """``"olmoe"``, ``"qwen3_moe"`` or ``"mixtral"`` (the Hugging Face ``model_type``) of a `MoEConfig`."""
    return "olmoe" if cfg.qk_norm_all_heads else "qwen3_moe" if cfg.qk_norm else "mixtral"


def _dense(cfg: Any) -> ModelConfig:
    return ModelConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(ModelConfig)})


def export_tensors(cfg: Any, target: str) -> list[ExportTensor]:
    """Every tensor of the ``target`` file for ``MoEDecoder(cfg)`` (module docstring), in model order."""
    fam = family(cfg)
    sparse = [i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)]
    out = []
    for t in dense_export.export_tensors(_dense(cfg), target):
        parts = (t.path or "").split("/")
        if len(parts) > 2 and parts[0] == "blocks" and int(parts[1]) in sparse and parts[2] == "mlp":
            continue  # the dense MLP the sparse layer does not have
        out.append(t)
        if not (t.path or "").endswith("mlp_norm/scale") or int(parts[1]) not in sparse:
            continue
        i, b = int(parts[1]), f"blocks/{parts[1]}/mlp/"
        if target == "hf":
            hb = f"model.layers.{i}.{_HF_MLP[fam]}."
            out.append(ExportTensor(name=hb + "gate.weight", path=b + "router/kernel", transpose=True))
            for e in range(cfg.n_experts):
                for w, hw in HF_EXPERT_NAMES[fam].items():
                    out.append(ExportTensor(name=f"{hb}experts.{e}.{hw}.weight", path=f"{b}experts/{w}",
                                            transpose=True, expert=e))
        else:
            out.append(ExportTensor(name=f"blk.{i}.ffn_gate_inp.weight", path=b + "router/kernel", transpose=True))
            for w, g in _GGUF_EXPS.items():
                out.append(ExportTensor(name=f"blk.{i}.{g}.weight", path=f"{b}experts/{w}", transpose=True))
    return out


def hf_config(cfg: Any) -> dict:
    """A Hugging Face ``config.json`` (transformers 5's keys) for ``MoEDecoder(cfg)``."""
    fam = family(cfg)
    out = dense_export.hf_config(_dense(cfg))
    out.update(architectures=[_ARCHS[fam]], model_type=fam, num_experts_per_tok=cfg.n_experts_per_tok,
               rope_parameters={"rope_theta": cfg.rope_theta, "rope_type": "default"})
    if fam == "qwen3_moe":
        out.update(num_experts=cfg.n_experts, moe_intermediate_size=cfg.d_expert, norm_topk_prob=cfg.norm_topk_prob,
                   mlp_only_layers=list(cfg.dense_layers), decoder_sparse_step=1)
    elif fam == "olmoe":
        if cfg.dense_layers:
            raise ValueError("OLMoE has no dense layers; this config has dense_layers=%r" % (cfg.dense_layers,))
        out.update(num_experts=cfg.n_experts, intermediate_size=cfg.d_expert, norm_topk_prob=cfg.norm_topk_prob)
    else:
        if cfg.dense_layers or not cfg.norm_topk_prob:
            raise ValueError("Mixtral has only sparse layers and always renormalises its top-k weights; this config "
                             f"has dense_layers={cfg.dense_layers!r}, norm_topk_prob={cfg.norm_topk_prob}")
        out.update(num_local_experts=cfg.n_experts, intermediate_size=cfg.d_expert)
    return out


def export_config(cfg: Any, target: str) -> dict[str, Any]:
    """``config.json`` ("hf") or ``{"architecture", "metadata"}`` ("gguf") for ``MoEDecoder(cfg)``."""
    if target == "hf":
        return hf_config(cfg)
    fam = family(cfg)
    dense = dense_export.export_config(_dense(cfg), target)
    old, arch = dense["architecture"], _GGUF_ARCH[fam]
    meta = {arch + k[len(old):]: v for k, v in dense["metadata"].items()}
    meta[f"{arch}.expert_count"] = cfg.n_experts
    meta[f"{arch}.expert_used_count"] = cfg.n_experts_per_tok
    meta[f"{arch}.expert_feed_forward_length"] = cfg.d_expert
    if fam != "qwen3_moe":  # Mixtral's and OLMoE's converters write the expert width as feed_forward_length
        meta[f"{arch}.feed_forward_length"] = cfg.d_expert
    if fam == "qwen3_moe" and not cfg.norm_topk_prob:
        raise ValueError("llama.cpp's qwen3moe graph always renormalises the top-k weights; this model does not "
                         "(norm_topk_prob=False): a GGUF file would route differently")
    if fam == "olmoe" and cfg.norm_topk_prob:
        raise ValueError("llama.cpp's olmoe graph never renormalises the top-k weights; this model does "
                         "(norm_topk_prob=True): a GGUF file would route differently")
    return {"architecture": arch, "metadata": meta}
