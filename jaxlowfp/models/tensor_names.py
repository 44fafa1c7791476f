"""The tensor-name table of the Llama family: every parameter of ``Llama(config)`` (a
`jaxlowfp.models.ModelConfig`) with its Hugging Face and GGUF names (re-exported by `jaxlowfp.models.common`;
a module of its own so that `jaxlowfp.models.export` uses it without importing the model)."""
from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["TensorSpec", "tensor_specs"]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One parameter: its NNX path in `Llama`, its checkpoint names and how to lay it out.

    ``transpose``: the checkpoint stores ``[out, in]`` (PyTorch and GGUF order), NNX kernels are ``[in, out]``
    (the last two axes are swapped: expert weights ``[E, out, in]`` become ``[E, in, out]``).
    ``rope``: a q or k projection weight/bias whose rows GGUF conversion permutes for llama.cpp's RoPE
    (``"q"`` or ``"k"``; None otherwise).
    """

    path: str
    hf: str
    gguf: str
    transpose: bool = False
    rope: str | None = None


def tensor_specs(config: Any) -> list[TensorSpec]:
    """Every parameter of ``Llama(config)`` with its Hugging Face and GGUF tensor names.

    A mixture-of-experts config is refused: its experts have other names and layouts
    (`jaxlowfp.models.moe_loader.moe_tensor_specs`), so a writer that asks here for a MoE model's names stops
    instead of writing a dense checkpoint (MoE exports: `jaxlowfp.models.moe_export`).
    """
    if getattr(config, "n_experts", None) is not None:  # a jaxlowfp.models.moe.MoEConfig (not imported: no cycle)
        raise ValueError(f"tensor_specs names the tensors of the dense Llama family; {type(config).__name__} is a "
                         "mixture of experts (its tensors: jaxlowfp.models.moe_loader.moe_tensor_specs; its exported "
                         "names: MoEDecoder.export_tensors, jaxlowfp.models.moe_export)")
    specs = [TensorSpec("embed/embedding", "model.embed_tokens.weight", "token_embd.weight")]
    for i in range(config.n_layers):
        b, hb, gb = f"blocks/{i}/", f"model.layers.{i}.", f"blk.{i}."
        specs.append(TensorSpec(b + "attn_norm/scale", hb + "input_layernorm.weight", gb + "attn_norm.weight"))
        for p, g in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
            rope = p if p in "qk" else None
            specs.append(TensorSpec(f"{b}attn/{p}_proj/kernel", f"{hb}self_attn.{p}_proj.weight", f"{gb}{g}.weight",
                                    transpose=True, rope=rope))
            if config.qkv_bias and p != "o":
                specs.append(TensorSpec(f"{b}attn/{p}_proj/bias", f"{hb}self_attn.{p}_proj.bias", f"{gb}{g}.bias",
                                        rope=rope))
        if config.qk_norm:
            for p in "qk":
                specs.append(TensorSpec(f"{b}attn/{p}_norm/scale", f"{hb}self_attn.{p}_norm.weight",
                                        f"{gb}attn_{p}_norm.weight"))
        specs.append(TensorSpec(b + "mlp_norm/scale", hb + "post_attention_layernorm.weight", gb + "ffn_norm.weight"))
        for p, g in (("gate", "ffn_gate"), ("up", "ffn_up"), ("down", "ffn_down")):
            specs.append(TensorSpec(f"{b}mlp/{p}_proj/kernel", f"{hb}mlp.{p}_proj.weight", f"{gb}{g}.weight",
                                    transpose=True))
    specs.append(TensorSpec("final_norm/scale", "model.norm.weight", "output_norm.weight"))
    if not config.tie_embeddings:
        specs.append(TensorSpec("lm_head/kernel", "lm_head.weight", "output.weight", transpose=True))
    return specs
