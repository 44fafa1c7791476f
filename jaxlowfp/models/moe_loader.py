"""Load Qwen3-MoE, Mixtral and OLMoE checkpoints (Hugging Face directories, GGUF files) into
`jaxlowfp.models.moe.MoEDecoder`; `jaxlowfp.models.load` dispatches here.

Hugging Face (``config.json`` ``model_type`` ``"qwen3_moe"``, ``"mixtral"`` or ``"olmoe"``). Attention, norms and
the head are the dense loader's (`jaxlowfp.models.hf_loader`: Qwen3's per-head q/k norms, Mistral's attention,
OLMoE's Llama attention with q/k norms over all heads, ``qk_norm_all_heads``). Expert tensors in either layout
transformers writes:

- the original (``save_pretrained``'s default, and the Hub's checkpoints), one ``[out, in]`` tensor per expert:
  Qwen3-MoE and OLMoE ``model.layers.N.mlp.gate.weight`` (router) and ``model.layers.N.mlp.experts.E.{gate,up,down}_proj
  .weight``; Mixtral ``model.layers.N.block_sparse_moe.gate.weight`` and ``...block_sparse_moe.experts.E.w1
  .weight`` (gate), ``w3`` (up), ``w2`` (down);
- transformers 5's fused in-memory layout (``save_pretrained(save_original_format=False)``), both families:
  ``model.layers.N.mlp.gate.weight``, ``model.layers.N.mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows
  first, as transformers' ``chunk(2)`` splits it) and ``model.layers.N.mlp.experts.down_proj`` ``[E, H, I]``.

Names are first mapped to one canonical set (Mixtral's ``block_sparse_moe`` -> ``mlp``, ``w1/w3/w2`` ->
``gate/up/down_proj``: transformers' own ``conversion_mapping`` renames), then per-expert tensors are stacked.

Routing: Qwen3-MoE ``num_experts`` (transformers 5 writes ``num_local_experts``), ``num_experts_per_tok``,
``norm_topk_prob`` (transformers' default False), ``moe_intermediate_size``; dense layers where transformers puts
them (``mlp_only_layers``, or ``(i + 1) % decoder_sparse_step != 0``). Mixtral ``num_local_experts``,
``num_experts_per_tok``, experts of ``intermediate_size``, always renormalised. OLMoE ``num_experts``,
``num_experts_per_tok``, ``norm_topk_prob`` (default False), experts of ``intermediate_size``; ``clip_qkv`` refused.

GGUF (llama.cpp's ``convert_hf_to_gguf.py``): architecture ``qwen3moe``, ``olmoe`` (q/k norms of ``n_heads *
head_dim`` features: over all heads) or ``llama`` with experts (Mixtral; its q/k rows are RoPE-permuted like dense
Llama's), metadata ``{arch}.expert_count``, ``{arch}.expert_used_count``, ``{arch}.expert_feed_forward_length``
(else ``{arch}.feed_forward_length``), tensors ``blk.N.ffn_gate_inp.weight`` (router) and
``blk.N.ffn_{gate,up,down}_exps.weight`` (``[E, out, in]`` in numpy order; the converter does not fuse gate and up
for these architectures); an NVFP4 tensor's optional F32 decode scale ``<name>.scale`` (what
`jaxlowfp.ptq.export_gguf` writes) multiplies it, as in the dense GGUF loader. The top-k weights are
renormalised as llama.cpp's graph of the architecture does (``build_moe_ffn(..., norm_w, ...)``: true for
``qwen3moe`` and ``llama``, false for ``olmoe``);
files asking for what that graph does differently (``expert_weights_scale``, non-softmax ``expert_gating_func``) or
having shared experts are refused.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
from pathlib import Path
from typing import Any, cast

import numpy as np
from safetensors import SafetensorError

from jaxlowfp.models import gguf_loader, hf_loader
from jaxlowfp.models.common import CheckpointError, TensorSpec, Tokenizer, build_model, tensor_specs
from jaxlowfp.models.llama import ModelConfig
from jaxlowfp.models.moe import MoEConfig, MoEDecoder

__all__ = ["GGUF_ARCHITECTURES", "HF_MODEL_TYPES", "is_moe_gguf", "is_moe_hf", "load_gguf", "load_hf",
           "moe_tensor_specs", "read_gguf_config", "read_hf_config"]

# model_type -> the dense family whose attention it has (hf_loader.config_fields)
HF_MODEL_TYPES = {"qwen3_moe": "qwen3", "mixtral": "mistral", "olmoe": "llama"}
# GGUF architecture -> whether the converter permuted the q/k rows (gguf_loader.ARCHITECTURES)
GGUF_ARCHITECTURES = {"qwen3moe": False, "llama": True, "olmoe": False}
_EXPERTS = (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps"))
_MIXTRAL_W = {"1": "gate_proj", "3": "up_proj", "2": "down_proj"}
_LLAMACPP_SOFTMAX = 1  # LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
# whether llama.cpp's graph of the architecture renormalises the top-k weights (build_moe_ffn's norm_w)
_NORM_TOPK = {"qwen3moe": True, "llama": True, "olmoe": False}


def moe_tensor_specs(config: MoEConfig) -> list[TensorSpec]:
    """Every parameter of ``MoEDecoder(config)`` with its canonical Hugging Face and GGUF names.

    Expert weights carry the per-expert Hugging Face name with an ``{expert}`` field; `load_hf` stacks those (or
    slices the fused tensors)."""
    sparse = [i for i in range(config.n_layers) if config.is_moe_layer(i)]
    prefixes = tuple(f"blocks/{i}/mlp/" for i in sparse)
    dense = ModelConfig(**{f.name: getattr(config, f.name) for f in dataclasses.fields(ModelConfig)})
    specs = [s for s in tensor_specs(dense) if not s.path.startswith(prefixes)]
    for i in sparse:
        b, hb, gb = f"blocks/{i}/mlp/", f"model.layers.{i}.mlp.", f"blk.{i}."
        specs.append(TensorSpec(b + "router/kernel", hb + "gate.weight", gb + "ffn_gate_inp.weight", transpose=True))
        for w, g in _EXPERTS:
            specs.append(TensorSpec(f"{b}experts/{w}", f"{hb}experts.{{expert}}.{w}.weight", f"{gb}{g}.weight",
                                    transpose=True))
    return specs


def _expert_spec(spec: TensorSpec) -> tuple[int, str] | None:
    """``(layer, weight name)`` of an expert weight's spec, else None."""
    m = re.fullmatch(r"blocks/(\d+)/mlp/experts/(\w+)", spec.path)
    return None if m is None else (int(m[1]), m[2])


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face


def is_moe_hf(directory: str | Path) -> bool:
    """Whether ``directory/config.json`` names a mixture-of-experts ``model_type`` this module loads."""
    where = Path(directory) / "config.json"
    return where.is_file() and hf_loader.read_json(where).get("model_type") in HF_MODEL_TYPES


def read_hf_config(directory: str | Path, *, dtype: str = "float32", param_dtype: str = "float32") -> MoEConfig:
    """The `MoEConfig` of a Qwen3-MoE or Mixtral ``config.json``."""
    where = Path(directory) / "config.json"
    cfg = hf_loader.read_json(where)
    mt = cfg.get("model_type")
    if mt not in HF_MODEL_TYPES:
        raise CheckpointError(f"{where}: model_type {mt!r} is not a supported mixture of experts; allowed: "
                              f"{', '.join(map(repr, HF_MODEL_TYPES))}")
    if cfg.get("attention_bias"):
        raise CheckpointError(f"{where}: attention_bias=true (biases on all four attention projections) is not "
                              "supported")
    if cfg.get("clip_qkv") is not None:
        raise CheckpointError(f"{where}: clip_qkv={cfg['clip_qkv']} (OLMoE's clamp of q, k, v) is not supported")
    fields = hf_loader.config_fields(cfg, where, HF_MODEL_TYPES[mt])
    if mt == "olmoe":  # RMSNorm over all query heads and over all key heads (transformers' OlmoeAttention)
        fields |= dict(qk_norm=True, qk_norm_all_heads=True)

    def need(key: str, *alternatives: str) -> int:
        for k in (key, *alternatives):
            if cfg.get(k) is not None:
                return int(cfg[k])
        raise CheckpointError(f"{where}: key {key!r} is missing")

    n_layers = fields["n_layers"]
    if mt == "qwen3_moe":
        n_experts = need("num_experts", "num_local_experts")
        d_expert = need("moe_intermediate_size")
        norm = bool(cfg.get("norm_topk_prob", False))  # transformers' Qwen3MoeConfig default
        step = int(cfg.get("decoder_sparse_step") or 1)
        only = set(cfg.get("mlp_only_layers") or ())
        # transformers' Qwen3MoeDecoderLayer: sparse iff not in mlp_only_layers and (i + 1) % step == 0
        dense = tuple(i for i in range(n_layers) if i in only or (i + 1) % step)
    elif mt == "olmoe":  # experts of intermediate_size; transformers' OlmoeConfig: norm_topk_prob False
        n_experts, d_expert, dense = need("num_experts"), fields["d_ff"], ()
        norm = bool(cfg.get("norm_topk_prob", False))
    else:
        n_experts, d_expert, norm, dense = need("num_local_experts"), fields["d_ff"], True, ()
    if cfg.get("shared_expert_intermediate_size") or cfg.get("n_shared_experts"):
        raise CheckpointError(f"{where}: shared experts are not supported")
    try:
        return MoEConfig(**fields, dtype=dtype, param_dtype=param_dtype, n_experts=n_experts,
                         n_experts_per_tok=need("num_experts_per_tok"), d_expert=d_expert, norm_topk_prob=norm,
                         dense_layers=dense)
    except ValueError as e:
        raise CheckpointError(f"{where}: invalid model config: {e}") from e


def _canonical(name: str, model_type: str) -> str:
    """transformers' renames to one naming: Mixtral's ``block_sparse_moe`` -> ``mlp`` and ``w1, w3, w2`` ->
    ``gate_proj, up_proj, down_proj``; fused expert tensors without their optional ``.weight``."""
    if model_type == "mixtral":
        name = name.replace(".block_sparse_moe.", ".mlp.")
        name = re.sub(r"(\.mlp\.experts\.\d+)\.w([123])\.weight$", lambda m: f"{m[1]}.{_MIXTRAL_W[m[2]]}.weight",
                      name)
    return re.sub(r"(\.mlp\.experts\.(gate_up_proj|down_proj))\.weight$", r"\1", name)


def _rules(mesh: Any, rules: Any) -> Any:
    if mesh is None or rules is not None:
        return rules
    from jaxlowfp import sharding

    return sharding.moe_rules()


EXPORT_META = "jaxlowfp_ptq.json"  # jaxlowfp.ptq.checkpoint.META_FILE: what marks a jaxlowfp.ptq.export directory


def is_export(directory: str | Path) -> bool:
    """Whether `directory` is a `jaxlowfp.ptq.export` of a mixture of experts (compressed-tensors NVFP4 tensors and
    jaxlowfp's own description of what each layer holds)."""
    return is_moe_hf(directory) and (Path(directory) / EXPORT_META).is_file()


def load_hf(directory: str | Path, *, dtype: str = "float32", param_dtype: str = "float32", mesh: Any = None,
            rules: Any = None, tokenizer: str | Path | None = "auto") -> tuple[MoEDecoder, Tokenizer | None]:
    """`MoEDecoder` and `Tokenizer` of a Qwen3-MoE, Mixtral or OLMoE Hugging Face checkpoint directory (`tokenizer`:
    `jaxlowfp.models.hf_loader.checkpoint_tokenizer`: "auto", a path, or None for a directory without one); with
    ``mesh``, each tensor (an expert stack: its experts read and stacked on the host) is placed by ``rules`` (default
    `jaxlowfp.sharding.moe_rules`), one device's slice at a time (`jaxlowfp.models.common.build_model`)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    if (directory / "hf_quant_config.json").is_file() or hf_loader.read_json(directory / "config.json").get(
            "quantization_config"):
        raise CheckpointError(f"{directory}: a quantized mixture-of-experts checkpoint; models.load reads float "
                              f"checkpoints of Qwen3-MoE / Mixtral, and jaxlowfp.models.load_export(directory) the "
                              f"quantized ones jaxlowfp.ptq.export wrote")
    config = read_hf_config(directory, dtype=dtype, param_dtype=param_dtype)
    mt = hf_loader.read_json(directory / "config.json")["model_type"]
    tok = hf_loader.checkpoint_tokenizer(directory, tokenizer, config.vocab)
    files = {_canonical(n, mt): (f, n) for n, f in hf_loader.weight_files(directory).items()}
    handles: dict[Path, Any] = {}
    used: set[str] = set()

    def get(name: str) -> tuple[np.ndarray, str]:
        f, stored = files[name]
        where = f"{f}: tensor {stored}"
        if f not in handles:
            handles[f] = stack.enter_context(hf_loader.open_safetensors(f))
        try:
            array = handles[f].get_tensor(stored)
        except (SafetensorError, OSError, KeyError) as e:
            raise CheckpointError(f"{where} cannot be read (truncated file or wrong index?): {e}") from e
        used.add(name)
        return np.asarray(array, np.float32), where

    def missing(name: str) -> CheckpointError:
        return CheckpointError(f"{directory}: tensor {name} is missing (looked in "
                               f"{', '.join(sorted({p.name for p, _ in files.values()}))})")

    def fetch(spec: TensorSpec) -> tuple[np.ndarray, str]:
        expert = _expert_spec(spec)
        if expert is None:
            if spec.hf not in files:
                raise missing(spec.hf)
            return get(spec.hf)
        layer, w = expert
        names = [spec.hf.format(expert=e) for e in range(config.n_experts)]
        if any(n in files for n in names):
            for n in names:
                if n not in files:
                    raise missing(n)
            arrays = [get(n) for n in names]
            shapes = {a.shape for a, _ in arrays}
            if len(shapes) != 1:
                raise CheckpointError(f"{arrays[0][1]}: the experts of layer {layer} have different shapes "
                                      f"{sorted(shapes)}")
            return np.stack([a for a, _ in arrays]), f"{arrays[0][1]} (and the other {config.n_experts - 1} experts)"
        fused = f"model.layers.{layer}.mlp.experts.{'down_proj' if w == 'down_proj' else 'gate_up_proj'}"
        if fused not in files:
            raise CheckpointError(f"{directory}: the {w} weights of layer {layer}'s experts are missing: neither "
                                  f"per-expert tensors ({names[0]}, ...) nor transformers' fused {fused}")
        array, where = get(fused)
        if w == "down_proj":
            return array, where
        i = config.d_expert
        if array.ndim != 3 or array.shape[1] != 2 * i:
            raise CheckpointError(f"{where} has shape {array.shape}; [{config.n_experts}, 2 x {i}, "
                                  f"{config.d_model}] (gate rows, then up rows) expected")
        return (array[:, :i] if w == "gate_proj" else array[:, i:]), f"{where} ({w} half)"

    with contextlib.ExitStack() as stack:  # closes the shard files
        model = cast(MoEDecoder, build_model(config, fetch, directory / "config.json", model_class=MoEDecoder,
                                             specs=moe_tensor_specs(config), mesh=mesh, rules=_rules(mesh, rules)))
    extra = sorted(files[n][1] for n in set(files) - used if not n.endswith(hf_loader.IGNORED_SUFFIXES)
                   and not (config.tie_embeddings and n == "lm_head.weight"))
    if extra:
        raise CheckpointError(f"{directory}: tensors this model class does not have: {', '.join(extra[:5])}"
                              f"{' ...' if len(extra) > 5 else ''} (an unsupported architecture variant?)")
    return model, tok


# ---------------------------------------------------------------------------------------------------------------
# GGUF


def is_moe_gguf(reader: Any, path: Path) -> bool:
    """Whether a GGUF file is a mixture of experts (``{arch}.expert_count`` > 0)."""
    arch = gguf_loader.read_field(reader, "general.architecture", path)
    return bool(gguf_loader.read_field(reader, f"{arch}.expert_count", path, 0))


def read_gguf_config(reader: Any, path: Path, *, dtype: str = "float32", param_dtype: str = "float32"
                     ) -> MoEConfig:
    """The `MoEConfig` of a Qwen3-MoE (``qwen3moe``) or Mixtral (``llama`` with experts) GGUF file."""
    arch = gguf_loader.read_field(reader, "general.architecture", path)
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(f"{path}: mixture-of-experts architecture {arch!r} is not supported; allowed: "
                              f"{', '.join(map(repr, GGUF_ARCHITECTURES))}")

    def field(key: str, default: Any = ...) -> Any:
        return gguf_loader.read_field(reader, f"{arch}.{key}", path, default)

    scale = float(field("expert_weights_scale", 0.0))
    if scale not in (0.0, 1.0):
        raise CheckpointError(f"{path}: {arch}.expert_weights_scale={scale} (llama.cpp scales the routing weights) "
                              "is not supported")
    gating = int(field("expert_gating_func", _LLAMACPP_SOFTMAX))
    if gating != _LLAMACPP_SOFTMAX:
        raise CheckpointError(f"{path}: {arch}.expert_gating_func={gating} is not supported; allowed: "
                              f"{_LLAMACPP_SOFTMAX} (softmax)")
    if field("expert_shared_count", 0):
        raise CheckpointError(f"{path}: shared experts ({arch}.expert_shared_count) are not supported")
    fields = gguf_loader.config_fields(reader, path, arch)
    names = {t.name: t for t in reader.tensors}
    dense = tuple(i for i in range(fields["n_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in names)
    sparse = [i for i in range(fields["n_layers"]) if i not in dense]
    d_expert = field("expert_feed_forward_length", None)
    if d_expert is None and sparse:  # Mixtral's and OLMoE's converters write the expert width as feed_forward_length
        d_expert = fields["d_ff"]
    head_dim = fields["explicit_head_dim"] or fields["d_model"] // fields["n_heads"]
    q_norm = names.get("blk.0.attn_q_norm.weight")
    if q_norm is not None and int(np.prod(q_norm.shape)) == fields["n_heads"] * head_dim != head_dim:
        fields["qk_norm_all_heads"] = True  # OLMoE: one norm over all query heads (and one over all key heads)
    try:
        return MoEConfig(**fields, dtype=dtype, param_dtype=param_dtype, n_experts=int(field("expert_count")),
                         n_experts_per_tok=int(field("expert_used_count")), d_expert=int(d_expert or 1),
                         norm_topk_prob=_NORM_TOPK[arch], dense_layers=dense)
    except ValueError as e:
        raise CheckpointError(f"{path}: metadata gives an invalid model config: {e}") from e


def _scale_name(name: str) -> str:
    """``blk.N.x.weight`` -> ``blk.N.x.scale`` (the GGUF NVFP4 per-tensor decode scale's name)."""
    return name.removesuffix(".weight") + ".scale" if name.endswith(".weight") else name


def load_gguf(path: str | Path, *, dtype: str = "float32", param_dtype: str = "float32", mesh: Any = None,
              rules: Any = None) -> tuple[MoEDecoder, Tokenizer]:
    """`MoEDecoder` (weights dequantized to ``param_dtype``) and `Tokenizer` of a Qwen3-MoE / Mixtral / OLMoE GGUF
    file; ``mesh``, ``rules`` as `load_hf`."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file")
    reader = gguf_loader.open_reader(path)
    config = read_gguf_config(reader, path, dtype=dtype, param_dtype=param_dtype)
    tokenizer = gguf_loader.read_tokenizer(reader, path)
    tokenizer.check_fits(config.vocab, str(path))
    names = {t.name: t for t in reader.tensors}
    permuted = GGUF_ARCHITECTURES[gguf_loader.read_field(reader, "general.architecture", path)]
    specs = moe_tensor_specs(config)

    def fetch(spec: TensorSpec) -> tuple[np.ndarray, str]:
        w, where = gguf_loader.read_tensor(names, spec, path, config, permuted)
        scale = names.get(_scale_name(spec.gguf))
        if scale is None:
            return w, where
        # NVFP4's per-tensor decode scale (`jaxlowfp.ptq.export_gguf` writes it for a dense NVFP4 projection, e.g.
        # the attention's): w = (E2M1 * s) * S_dec, as the dense GGUF loader and the in-memory model compute it
        return w * gguf_loader.decode_scale(scale, path), f"{where} (x {scale.name})"

    used = {s.gguf for s in specs}
    used |= {_scale_name(n) for n in used}
    extra = sorted(set(names) - used - {"rope_freqs.weight"})
    if extra:
        raise CheckpointError(f"{path}: tensors this model class does not have: {', '.join(extra[:5])}"
                              f"{' ...' if len(extra) > 5 else ''} (an unsupported architecture variant?)")
    return cast(MoEDecoder, build_model(config, fetch, path, model_class=MoEDecoder, specs=specs, mesh=mesh,
                                        rules=_rules(mesh, rules))), tokenizer
