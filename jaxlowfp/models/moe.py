"""Mixture-of-experts decoders (Qwen3-MoE, Mixtral, OLMoE): the `jaxlowfp.models.llama.Llama` decoder whose
feed-forward layers are sparse mixtures of SwiGLU experts.

``x -> router logits r = x W_r [N, E] -> p = softmax(r) (float32) -> top-k (w, e) -> w / sum(w) if norm_topk_prob
-> y = sum_j w_j * expert_{e_j}(x)``, ``expert_e(x) = (silu(x G_e) * (x U_e)) D_e``,

as transformers computes the families (``Qwen3MoeTopKRouter``, ``OlmoeTopKRouter``, ``MixtralTopKRouter`` in
transformers 5: softmax over all experts in float32, ``torch.topk``, then Qwen3-MoE and OLMoE renormalise the k
weights only with ``norm_topk_prob`` and Mixtral always, which equals Mixtral's original softmax over the top-k
logits). No capacity limit, no token dropping. Router logits are computed in the compute dtype, as transformers
does in the model dtype; the routing weights stay float32 and weight the experts' outputs in float32
(transformers' Mixtral keeps them float32 too, its Qwen3-MoE and OLMoE cast them to the model dtype first: the same
in float32, not in bfloat16).
Qwen3-MoE may keep dense SwiGLU layers (``mlp_only_layers``, ``decoder_sparse_step``): `MoEConfig.dense_layers`.

Module paths (for quantization rules): the router is an ``nnx.Linear`` at ``blocks/<i>/mlp/router`` (kernel
``[d_model, E]``); the experts are three ``nnx.Param`` with a leading expert axis at
``blocks/<i>/mlp/experts/{gate_proj,up_proj}`` ``[E, d_model, d_expert]`` and ``.../down_proj``
``[E, d_expert, d_model]``. Attention, norms, RoPE, the KV cache, `jaxlowfp.models.generate` and ``ptq_blocks()``
are the dense model's.

Two implementations of the experts, the same math (`MoEConfig.experts_impl`, `with_experts_impl`):

- ``"ragged"``: the ``N * k`` (token, expert) assignments sorted by expert, each expert's rows contiguous, and the
  three grouped GEMMs as ``jax.lax.ragged_dot(x_sorted, W [E, K, M], group_sizes)`` (what MaxText's MoE layers
  call), all through one method, `Experts.grouped_matmul`;
- ``"dense"``: the reference, every token through every expert (``einsum`` over the expert axis), combined with
  the routing weights scattered to ``[N, E]`` (zero for experts not chosen). E times the work; for tests.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlowfp.models.config import DTYPES, ModelConfig, check_int
from jaxlowfp.models.llama import Llama, linear_layer
from jaxlowfp.models.llama import smoothing_folds as _dense_smoothing_folds

__all__ = ["EXPERTS_IMPLS", "Experts", "MoEConfig", "MoEDecoder", "MoEMLP", "expert_paths", "route",
           "with_experts_impl"]

EXPERTS_IMPLS = ("ragged", "dense")
_EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


def _check_impl(impl: Any) -> None:
    if impl not in EXPERTS_IMPLS:
        raise ValueError(f"experts_impl={impl!r} is not supported; allowed: {', '.join(map(repr, EXPERTS_IMPLS))}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig(ModelConfig):
    """`ModelConfig` of a mixture-of-experts decoder (hashable, static jit configuration).

    ``n_experts`` experts of width ``d_expert`` per sparse layer, ``n_experts_per_tok`` (k) routed per token,
    ``norm_topk_prob``: renormalise the k routing weights to sum 1 (Mixtral, Qwen3-MoE's checkpoints; transformers'
    Qwen3-MoE default is False). ``dense_layers``: block indices with a dense SwiGLU MLP of width ``d_ff``
    instead (Qwen3-MoE ``mlp_only_layers``). ``experts_impl``: ``"ragged"`` or the ``"dense"`` reference.
    """

    n_experts: int
    n_experts_per_tok: int
    d_expert: int
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()
    experts_impl: str = "ragged"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("n_experts", "n_experts_per_tok", "d_expert"):
            check_int(getattr(self, name), name)
        if self.n_experts_per_tok > self.n_experts:
            raise ValueError(f"n_experts_per_tok={self.n_experts_per_tok} exceeds n_experts={self.n_experts}")
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"norm_topk_prob must be a bool; got {self.norm_topk_prob!r}")
        dense = tuple(self.dense_layers)
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n_layers for i in dense):
            raise ValueError(f"dense_layers must be block indices in [0, {self.n_layers}); got {self.dense_layers!r}")
        object.__setattr__(self, "dense_layers", tuple(sorted(set(dense))))
        _check_impl(self.experts_impl)

    def is_moe_layer(self, index: int) -> bool:
        return index not in self.dense_layers

    def num_params(self) -> int:
        dense = super().num_params()
        moe = 3 * self.n_experts * self.d_model * self.d_expert + self.d_model * self.n_experts
        n_moe = self.n_layers - len(self.dense_layers)
        return dense + n_moe * (moe - 3 * self.d_model * self.d_ff)


def route(logits: jax.Array, k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Top-k routing of router logits [N, E]: ``(weights float32 [N, k], experts int32 [N, k])``.

    ``p = softmax(logits)`` in float32, the k largest in descending order, divided by their sum when ``normalize``.
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


class Experts(nnx.Module):
    """E SwiGLU experts: ``gate_proj``, ``up_proj`` [E, d_model, d_expert], ``down_proj`` [E, d_expert, d_model]
    (``nnx.Param``; expert e maps ``x -> (silu(x G_e) * (x U_e)) D_e``). Matmuls in the compute ``dtype``."""

    # the grouped-GEMM protocol of jaxlowfp.qnnx.quantize: a rule matching e.g. blocks/1/mlp/experts/gate_proj
    # attaches a QuantRaggedOp as quant_gate_proj, and grouped_matmul runs through it (jaxlowfp.ops.ragged_dot)
    grouped_weights = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, n_experts: int, d_model: int, d_expert: int, dtype: Any, param_dtype: Any, *,
                 rngs: nnx.Rngs) -> None:
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.dtype = dtype
        self.gate_proj = nnx.Param(init(rngs.params(), (n_experts, d_model, d_expert), param_dtype))
        self.up_proj = nnx.Param(init(rngs.params(), (n_experts, d_model, d_expert), param_dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (n_experts, d_expert, d_model), param_dtype))

    @property
    def n_experts(self) -> int:
        return self.gate_proj.shape[0]

    def grouped_matmul(self, x: jax.Array, name: str, group_sizes: jax.Array) -> jax.Array:
        """``x [M, K]`` (rows sorted by expert, ``group_sizes[e]`` rows for expert e) times weight ``name``
        ``[E, K, N]`` of each row's expert: ``jax.lax.ragged_dot``, the one grouped GEMM of the ragged path."""
        var = getattr(self, name)
        decode = getattr(var, "decode_after", None)  # packed experts (jaxlowfp.ptq.PackedExperts): decoded after x
        x, w = decode(x) if decode is not None else (x, var[...])
        op = getattr(self, "quant_" + name, None)  # a jaxlowfp.qnnx.QuantRaggedOp (QAT), if quantized
        if op is not None:
            out = op.ragged_dot(x.astype(self.dtype), w.astype(self.dtype), group_sizes,
                                preferred_element_type=jnp.float32)
        else:
            out = jax.lax.ragged_dot(x.astype(self.dtype), w.astype(self.dtype), group_sizes,
                                     preferred_element_type=jnp.float32)
        return out.astype(self.dtype)

    def _ragged(self, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
        n, k = experts.shape
        flat = experts.reshape(-1)  # assignment a = token * k + j
        order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
        group_sizes = jnp.bincount(flat, length=self.n_experts).astype(jnp.int32)
        xs = x[order // k]
        h = nnx.silu(self.grouped_matmul(xs, "gate_proj", group_sizes)) * self.grouped_matmul(xs, "up_proj",
                                                                                             group_sizes)
        ys = self.grouped_matmul(h, "down_proj", group_sizes)
        y = ys[jnp.argsort(order)].reshape(n, k, -1)  # back to assignment order
        return jnp.einsum("nk,nkd->nd", weights, y.astype(jnp.float32))

    def _dense(self, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
        quantized = [n for n in self.grouped_weights if getattr(self, "quant_" + n, None) is not None]
        if quantized:
            raise ValueError(f"the dense per-expert reference computes no quantized product, and {quantized} are "
                             f"quantized (jaxlowfp.qnnx.quantize): use impl='ragged'")
        dt = self.dtype
        x = x.astype(dt)
        g = jnp.einsum("nd,edf->enf", x, self.gate_proj[...].astype(dt))
        u = jnp.einsum("nd,edf->enf", x, self.up_proj[...].astype(dt))
        y = jnp.einsum("enf,efd->end", nnx.silu(g) * u, self.down_proj[...].astype(dt))
        combine = jnp.einsum("nk,nke->ne", weights, jax.nn.one_hot(experts, self.n_experts, dtype=jnp.float32))
        return jnp.einsum("ne,end->nd", combine, y.astype(jnp.float32))

    def __call__(self, x: jax.Array, weights: jax.Array, experts: jax.Array, impl: str = "ragged") -> jax.Array:
        """``sum_j weights[n, j] * expert_{experts[n, j]}(x[n])``: x [N, d_model], weights float32 [N, k],
        experts int [N, k] -> float32 [N, d_model]."""
        _check_impl(impl)
        return (self._ragged if impl == "ragged" else self._dense)(x, weights, experts)


class MoEMLP(nnx.Module):
    """Sparse feed-forward layer: ``router`` (``nnx.Linear`` d_model -> E, no bias), top-k `route`, `Experts`."""

    def __init__(self, cfg: MoEConfig, dtype: Any, *, rngs: nnx.Rngs) -> None:
        self.router = linear_layer(cfg.d_model, cfg.n_experts, cfg, dtype, rngs)
        self.experts = Experts(cfg.n_experts, cfg.d_model, cfg.d_expert, dtype, DTYPES[cfg.param_dtype], rngs=rngs)
        self.top_k = cfg.n_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.impl = cfg.experts_impl

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``x [N, d_model]`` -> routing ``(weights float32 [N, k], experts int32 [N, k])``; the router's
        logits are computed in the compute dtype (as transformers does), the softmax in float32."""
        return route(self.router(x), self.top_k, self.norm_topk_prob)

    def __call__(self, x: jax.Array) -> jax.Array:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts = self.route(x)
        return self.experts(x, weights, experts, self.impl).reshape(shape)


class MoEDecoder(Llama):
    """The `Llama` decoder with `MoEMLP` feed-forward layers (``config.dense_layers`` keep the dense `MLP`).

    Same call signature, cache and generation as `Llama`; built from `MoEConfig`. Loaded by
    `jaxlowfp.models.load` from Qwen3-MoE / Mixtral Hugging Face directories and GGUF files.
    """

    config: MoEConfig

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs) -> None:
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig; got {type(config).__name__}")
        super().__init__(config, rngs=rngs)

    def _mlp(self, index: int) -> Callable[[nnx.Rngs], nnx.Module] | None:
        if not self.config.is_moe_layer(index):
            return None
        return lambda rngs: MoEMLP(self.config, self.config.compute_dtype, rngs=rngs)

    def smoothing_folds(self) -> tuple[list[tuple[str, tuple[str, ...]]], list[tuple[str, str]]]:
        """The dense model's folds (`jaxlowfp.models.llama.smoothing_folds`) for attention and dense layers; in
        sparse layers the router and the experts are listed as skipped (folding scales into routed experts is not
        implemented)."""
        folds, skipped = _dense_smoothing_folds(self.config)
        def sparse_mlp(path: str) -> bool:  # "blocks/<i>/mlp_norm" or "blocks/<i>/mlp/..." of a sparse layer
            _, block, op = path.split("/", 2)
            return op.startswith("mlp") and self.config.is_moe_layer(int(block))

        kept = [(prev, layers) for prev, layers in folds if not sparse_mlp(prev)]
        for i in range(self.config.n_layers):
            if self.config.is_moe_layer(i):
                skipped += [(f"blocks/{i}/mlp/router", "a mixture-of-experts router: kept out of scale folding"),
                            (f"blocks/{i}/mlp/experts", "routed experts: scale folding (SmoothQuant, AWQ) into "
                             "experts is not implemented")]
        return kept, skipped

    def fused_groups(self) -> list[tuple[str, ...]]:
        """The dense model's q/k/v and dense-layer gate/up groups (an expert's gate and up weights share one global
        scale in `jaxlowfp.ptq.experts`)."""
        return [g for g in super().fused_groups() if not any(p.startswith(f"blocks/{i}/mlp/")
                                                             for p in g for i in range(self.config.n_layers)
                                                             if self.config.is_moe_layer(i))]

    def export_tensors(self, target: str) -> list[Any]:
        """Every tensor of an exported file, ``target`` "hf" (per-expert tensors) or "gguf" (``ffn_*_exps``)
        (`jaxlowfp.models.moe_export`)."""
        from jaxlowfp.models import moe_export

        return moe_export.export_tensors(self.config, target)

    def export_config(self, target: str) -> dict[str, Any]:
        """``config.json`` ("hf") or GGUF architecture and metadata ("gguf") (`jaxlowfp.models.moe_export`)."""
        from jaxlowfp.models import moe_export

        return moe_export.export_config(self.config, target)


def expert_paths(config: MoEConfig) -> list[str]:
    """Graph paths of every expert weight, ``blocks/<i>/mlp/experts/{gate,up,down}_proj`` (sparse layers only)."""
    return [f"blocks/{i}/mlp/experts/{w}" for i in range(config.n_layers) if config.is_moe_layer(i)
            for w in _EXPERT_WEIGHTS]


def with_experts_impl(model: MoEDecoder, impl: str) -> MoEDecoder:
    """A copy of ``model`` (sharing its parameter arrays) whose experts run ``impl`` (``"ragged"`` or ``"dense"``)."""
    _check_impl(impl)
    if not isinstance(model, MoEDecoder):
        raise TypeError(f"model must be a MoEDecoder; got {type(model).__name__}")
    out = nnx.clone(model)
    out.config = dataclasses.replace(model.config, experts_impl=impl)
    for block in out.blocks:
        if isinstance(block.mlp, MoEMLP):
            block.mlp.impl = impl
    return out
