"""A Llama-family decoder in Flax NNX: the byte-level demo model and real checkpoints (`jaxlowfp.models.load`).

``tokens -> Embed -> N x [x + Attn(RMSNorm(x)); x + MLP(RMSNorm(x))] -> RMSNorm -> head -> logits``

- attention: grouped-query (``n_heads`` query heads share ``n_kv_heads`` key/value heads), rotary position
  embedding (RoPE, rotate-half form, base ``rope_theta``, optional per-frequency divisors for Llama-3 or linear
  rope scaling) on queries and keys, causal mask; optional q/k/v biases (Qwen2) and per-head RMSNorm of queries
  and keys before RoPE (Qwen3);
- MLP: SwiGLU, ``down_proj(silu(gate_proj(x)) * up_proj(x))``;
- head: ``lm_head`` (an ``nnx.Linear``), or with ``tie_embeddings`` the embedding matrix: ``logits = x @ E^T``;
- every projection is a plain ``nnx.Linear``, so ``jaxlowfp.qnnx.quantize_model`` can replace one by its graph path,
  e.g. ``blocks/3/mlp/gate_proj`` or ``blocks/0/attn/q_proj``.

``model(tokens)`` is the plain causal forward pass over positions ``0..T-1``. ``model(tokens, attention_mask=m)``
masks padding (keys where ``m`` is 0 are never attended to; positions count the real tokens, so a left-padded row
gives the logits of the unpadded one), and ``model(tokens, cache=c)`` appends to a `KVCache` and returns
``(logits, new_cache)``; `generate` uses it.

Parameters are stored in ``param_dtype`` (float32); matmuls run in the compute ``dtype`` (float32 on CPU,
bfloat16 on GPU by default); normalisation statistics, softmax and logits are float32.

The configuration (`ModelConfig`, `PRESETS`, `preset`, `llama3_rope_factors`, `mlp_paths`, `smoothing_folds`) lives
in `jaxlowfp.models.config` and is re-exported here.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Sequence, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxlowfp.models.config import (DTYPES, PRESETS, ModelConfig, check_int, compute_dtype_for_backend,
                                    llama3_rope_factors, mlp_paths, preset, smoothing_folds)

__all__ = [
    "PRESETS",
    "KVCache",
    "Llama",
    "cache_shardings",
    "ModelConfig",
    "compute_dtype_for_backend",
    "generate",
    "llama3_rope_factors",
    "loss_fn",
    "mlp_paths",
    "preset",
    "smoothing_folds",
    "token_log_likelihood",
]

# a masked attention score: finite, so that a row with no visible key (a padding query) gives no NaN
_MASKED = float(np.finfo(np.float32).min)


def _rope(x: jax.Array, theta: float, positions: jax.Array | None = None,
          factors: tuple[float, ...] | None = None) -> jax.Array:
    """Rotate-half RoPE on ``x [B, T, H, D]``; angles computed in float32.

    Pairs ``(x_i, x_{i+D/2})`` at position ``p`` rotate by ``p * theta**(-2i/D) / factors[i]``; positions are
    ``0..T-1`` when ``positions`` (int [B, T]) is None.
    """
    t, d = x.shape[1], x.shape[-1]
    inv_freq = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * (2.0 / d))
    if factors is not None:
        inv_freq = inv_freq / jnp.asarray(factors, jnp.float32)
    if positions is None:
        angles = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
        cos = jnp.cos(angles)[None, :, None, :]
        sin = jnp.sin(angles)[None, :, None, :]
    else:
        angles = positions.astype(jnp.float32)[:, :, None] * inv_freq[None, None, :]  # [B, T, D/2]
        cos = jnp.cos(angles)[:, :, None, :]
        sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _gqa(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """softmax(q k^T / sqrt(D) + mask) v with q [B, T, N, D] and k, v [B, S, K, D], K dividing N.

    Query head ``n`` uses key/value head ``n // (N / K)``. ``mask`` is bool [B, T, S] (True: visible); None is
    the causal mask of ``T == S``. Scores and softmax are float32 (written out here: ``jax.nn.dot_product_attention``
    promotes bfloat16 with float32 implicitly, which strict promotion refuses).
    """
    b, t, n, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, n // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * (1.0 / d**0.5)
    if mask is None:
        causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
        scores = jnp.where(causal, scores, -jnp.inf)
    else:  # a finite fill: a query that sees no key (padding) gets uniform weights instead of NaN
        scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.astype(v.dtype).reshape(b, t, n, d)


def linear_layer(d_in: int, d_out: int, cfg: ModelConfig, dtype: Any, rngs: nnx.Rngs, bias: bool = False
                 ) -> nnx.Linear:
    """A projection of the decoder: an ``nnx.Linear`` computing in `dtype`, parameters in ``cfg.param_dtype``."""
    return nnx.Linear(d_in, d_out, use_bias=bias, dtype=dtype, param_dtype=DTYPES[cfg.param_dtype], rngs=rngs)


def _rmsnorm(cfg: ModelConfig, rngs: nnx.Rngs, features: int | None = None) -> nnx.RMSNorm:
    # statistics in float32; the output is cast to the compute dtype by the next Linear
    return nnx.RMSNorm(
        cfg.d_model if features is None else features, epsilon=cfg.norm_eps, dtype=jnp.float32,
        param_dtype=DTYPES[cfg.param_dtype], rngs=rngs,
    )


class KVCache(NamedTuple):
    """Keys and values of the tokens seen so far, for incremental decoding (a pytree).

    ``k[l]``, ``v[l]``: [B, S, K, D] of layer ``l`` (after RoPE) in ``S`` slots; ``valid`` bool [B, S] marks the
    slots holding a real (non-padding) token; ``index`` (int32 scalar) is the next free slot. A call with
    ``T`` new tokens writes slots ``index .. index+T-1``; the caller keeps ``index + T <= S``.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    valid: jax.Array
    index: jax.Array  # type: ignore[assignment]  # a NamedTuple field named like tuple.index

    @classmethod
    def init(cls, config: ModelConfig, batch: int, capacity: int, dtype: Any = None) -> "KVCache":
        """An empty cache of ``capacity`` slots; ``dtype`` defaults to the compute dtype."""
        check_int(batch, "batch")
        check_int(capacity, "capacity")
        dt = config.compute_dtype if dtype is None else dtype
        shape = (batch, capacity, config.n_kv_heads, config.head_dim)
        k, v = (tuple(jnp.zeros(shape, dt) for _ in range(config.n_layers)) for _ in range(2))  # distinct buffers
        return cls(k, v, jnp.zeros((batch, capacity), jnp.bool_), jnp.zeros((), jnp.int32))


def cache_shardings(config: ModelConfig, mesh: jax.sharding.Mesh, batch: int) -> KVCache:
    """Where a `KVCache` of ``batch`` rows lives on ``mesh``: keys and values ``[B, S, K, D]`` with their rows over
    the data axes (`jaxlowfp.sharding.rows_sharding`: when they divide ``batch``) and their key/value heads over
    ``tensor`` (when it divides ``n_kv_heads``: the heads that the tensor-parallel k/v projections compute on each
    device); ``valid`` by rows, ``index`` replicated."""
    from jaxlowfp import sharding

    rows = sharding.rows_sharding(mesh, batch).spec
    row = rows[0] if len(rows) else None
    tensor = mesh.shape.get("tensor", 1)
    heads = "tensor" if tensor > 1 and config.n_kv_heads % tensor == 0 else None
    kv = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(row, None, heads, None))
    return KVCache((kv,) * config.n_layers, (kv,) * config.n_layers,  # type: ignore[arg-type]
                   jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(row)), sharding.replicated(mesh))  # type: ignore[arg-type]


class Attention(nnx.Module):
    """Causal grouped-query self-attention with RoPE (optional q/k/v biases and q/k norms)."""

    def __init__(self, cfg: ModelConfig, dtype: Any, *, rngs: nnx.Rngs) -> None:
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.rope_freq_factors = cfg.rope_freq_factors
        self.dtype = dtype
        q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.q_proj = linear_layer(cfg.d_model, q, cfg, dtype, rngs, cfg.qkv_bias)
        self.k_proj = linear_layer(cfg.d_model, kv, cfg, dtype, rngs, cfg.qkv_bias)
        self.v_proj = linear_layer(cfg.d_model, kv, cfg, dtype, rngs, cfg.qkv_bias)
        self.o_proj = linear_layer(q, cfg.d_model, cfg, dtype, rngs)
        self.qk_norm_all_heads = cfg.qk_norm_all_heads
        self.q_norm: nnx.RMSNorm | None
        self.k_norm: nnx.RMSNorm | None
        if cfg.qk_norm:
            self.q_norm = _rmsnorm(cfg, rngs, q if cfg.qk_norm_all_heads else cfg.head_dim)
            self.k_norm = _rmsnorm(cfg, rngs, kv if cfg.qk_norm_all_heads else cfg.head_dim)
        else:
            self.q_norm = self.k_norm = None

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array | None = None,
        mask: jax.Array | None = None,
        kv_cache: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """``x [B, T, d_model]`` -> (output, updated ``(k, v)`` cache of this layer or None).

        ``kv_cache = (k, v, index)`` writes this call's keys/values at slots ``index..index+T-1`` and attends
        over all slots (``mask`` [B, T, S] says which are visible).
        """
        b, t, _ = x.shape
        if self.qk_norm_all_heads:  # OLMoE: one norm over all heads, before the split into heads
            assert self.q_norm is not None and self.k_norm is not None  # qk_norm_all_heads implies qk_norm
            q = self.q_norm(self.q_proj(x)).reshape(b, t, self.n_heads, self.head_dim)
            k = self.k_norm(self.k_proj(x)).reshape(b, t, self.n_kv_heads, self.head_dim)
        else:
            q = self.q_proj(x).reshape(b, t, self.n_heads, self.head_dim)
            k = self.k_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None and not self.qk_norm_all_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q = _rope(q, self.rope_theta, positions, self.rope_freq_factors)
        k = _rope(k, self.rope_theta, positions, self.rope_freq_factors)
        # one dtype for q, k, v (a quantized projection may return another float dtype)
        q, k, v = (a.astype(self.dtype) for a in (q, k, v))
        new_cache = None
        if kv_cache is not None:
            ck, cv, index = kv_cache
            zero = jnp.zeros((), jnp.int32)
            ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (zero, index, zero, zero))
            cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (zero, index, zero, zero))
            new_cache = (ck, cv)
            k, v = ck.astype(self.dtype), cv.astype(self.dtype)
        out = _gqa(q, k, v, mask)
        return self.o_proj(out.reshape(b, t, self.n_heads * self.head_dim)), new_cache


class MLP(nnx.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, cfg: ModelConfig, dtype: Any, *, rngs: nnx.Rngs) -> None:
        self.gate_proj = linear_layer(cfg.d_model, cfg.d_ff, cfg, dtype, rngs)
        self.up_proj = linear_layer(cfg.d_model, cfg.d_ff, cfg, dtype, rngs)
        self.down_proj = linear_layer(cfg.d_ff, cfg.d_model, cfg, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(nnx.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    """Pre-norm residual block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``; the residual stream is float32."""

    def __init__(self, cfg: ModelConfig, dtype: Any, *, rngs: nnx.Rngs,
                 mlp: Callable[[nnx.Rngs], nnx.Module] | None = None) -> None:
        self.attn_norm = _rmsnorm(cfg, rngs)
        self.attn = Attention(cfg, dtype, rngs=rngs)
        self.mlp_norm = _rmsnorm(cfg, rngs)
        # ``mlp(rngs)`` builds another feed-forward module (the experts of `jaxlowfp.models.moe`); default SwiGLU
        self.mlp = MLP(cfg, dtype, rngs=rngs) if mlp is None else mlp(rngs)

    def __call__(self, x: jax.Array, positions: jax.Array | None = None, mask: jax.Array | None = None,
                 kv_cache: Any = None) -> tuple[jax.Array, Any]:
        a, new_cache = self.attn(self.attn_norm(x), positions, mask, kv_cache)
        x = x + a.astype(jnp.float32)
        return x + self.mlp(self.mlp_norm(x)).astype(jnp.float32), new_cache


class Llama(nnx.Module):
    """The decoder: ``__call__(tokens int [B, T]) -> logits float32 [B, T, vocab]``; T <= max_seq_len.

    Keyword arguments (all optional; see the module docstring):
      attention_mask: int or bool [B, T], 1 for real tokens, 0 for padding (left or right).
      positions: int [B, T] RoPE positions; default: the number of real tokens before each one (with a cache,
        including the cached ones), i.e. ``0..T-1`` without padding.
      cache: a `KVCache`; the call then returns ``(logits, new_cache)``.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs) -> None:
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig; got {type(config).__name__}")
        self.config = config
        dtype = config.compute_dtype
        self.dtype = dtype
        pdt = DTYPES[config.param_dtype]
        self.embed = nnx.Embed(config.vocab, config.d_model, dtype=jnp.float32, param_dtype=pdt, rngs=rngs)
        self.blocks = nnx.List([Block(config, dtype, rngs=rngs, mlp=self._mlp(i)) for i in range(config.n_layers)])
        self.final_norm = _rmsnorm(config, rngs)
        if not config.tie_embeddings:
            self.lm_head = linear_layer(config.d_model, config.vocab, config, dtype, rngs)

    def _mlp(self, index: int) -> Callable[[nnx.Rngs], nnx.Module] | None:
        """How block ``index`` builds its feed-forward module (None: the SwiGLU `MLP`); subclasses override it."""
        return None

    def smoothing_folds(self) -> tuple[list[tuple[str, tuple[str, ...]]], list[tuple[str, str]]]:
        """The model family's scale folds for `jaxlowfp.ptq` (SmoothQuant, AWQ): `smoothing_folds` of the config."""
        return smoothing_folds(self.config)

    def fused_groups(self) -> list[tuple[str, ...]]:
        """The projections a serving engine runs as one GEMM (vLLM: q/k/v, gate/up), for `jaxlowfp.ptq`."""
        return [layers for prev, layers in smoothing_folds(self.config)[0] if prev.endswith("_norm")]

    def export_tensors(self, target: str) -> list[Any]:
        """Every tensor of an exported file, ``target`` "hf" or "gguf" (`jaxlowfp.ptq.protocol`,
        `jaxlowfp.models.export`)."""
        from jaxlowfp.models import export

        return export.export_tensors(self.config, target)

    def export_config(self, target: str) -> dict[str, Any]:
        """``config.json`` ("hf") or GGUF architecture and metadata ("gguf") (`jaxlowfp.models.export`)."""
        from jaxlowfp.models import export

        return export.export_config(self.config, target)

    def ptq_blocks(self) -> tuple[Any, list[tuple[str, Any]], Any]:
        """The model's block structure for sequential PTQ (`jaxlowfp.ptq.sequential`): ``(embed, blocks, head)``
        with ``embed(model, tokens) -> x`` (the first block's input), ``blocks`` the ``(path, call)`` of every
        block in order, ``call(block, x) -> x`` (the plain causal pass), and ``head(model, x) -> logits``."""
        return _ptq_embed, [(f"blocks/{i}", _ptq_block) for i in range(self.config.n_layers)], _ptq_head

    def _head(self, x: jax.Array) -> jax.Array:
        h = self.final_norm(x)
        if self.config.tie_embeddings:  # logits = h @ E^T
            e = self.embed.embedding[...].astype(self.dtype)
            return jnp.einsum("btd,vd->btv", h.astype(self.dtype), e, preferred_element_type=jnp.float32)
        return self.lm_head(h).astype(jnp.float32)

    def __call__(
        self,
        tokens: jax.Array,
        *,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        cache: KVCache | None = None,
    ) -> jax.Array | tuple[jax.Array, KVCache]:
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise TypeError(f"tokens must be an integer array [batch, seq]; got shape {tokens.shape} {tokens.dtype}")
        b, t = tokens.shape
        if cache is None and t > self.config.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len={self.config.max_seq_len}")
        for name, a in (("attention_mask", attention_mask), ("positions", positions)):
            if a is not None and tuple(a.shape) != (b, t):
                raise ValueError(f"{name} must have the shape of tokens {(b, t)}; got {tuple(a.shape)}")
        x = self.embed(tokens.astype(jnp.int32))
        if attention_mask is None and positions is None and cache is None:
            for block in self.blocks:  # the plain causal pass over positions 0..T-1
                x, _ = block(x)
            return self._head(x)

        if cache is not None and len(cache.k) != self.config.n_layers:
            raise ValueError(f"cache has {len(cache.k)} layers; the model has {self.config.n_layers}")
        positions, mask, valid = _layout(b, t, attention_mask, positions,
                                         None if cache is None else (cache.valid, cache.index))
        ks, vs = [], []
        for i, block in enumerate(self.blocks):
            layer_cache = None if cache is None else (cache.k[i], cache.v[i], cache.index)
            x, kv = block(x, positions, mask, layer_cache)
            if kv is not None:
                ks.append(kv[0])
                vs.append(kv[1])
        logits = self._head(x)
        if cache is None:
            return logits
        return logits, KVCache(tuple(ks), tuple(vs), valid, cache.index + jnp.int32(t))


def _layout(b: int, t: int, attention_mask: jax.Array | None, positions: jax.Array | None,
            cached: tuple[jax.Array, jax.Array] | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(positions [B, T], attention mask [B, T, S], valid slots [B, S])`` of a call on ``T`` new tokens, with
    ``cached = (cache.valid, cache.index)`` of a `KVCache` (``S`` its capacity) or None (``S = T``)."""
    new = jnp.ones((b, t), jnp.bool_) if attention_mask is None else attention_mask.astype(jnp.bool_)
    seen = jnp.zeros((b, 1), jnp.int32)
    if cached is None:
        valid, q_slot, k_slot = new, jnp.arange(t), jnp.arange(t)
    else:
        valid0, index = cached
        seen = jnp.sum(valid0, axis=1, keepdims=True, dtype=jnp.int32)
        valid = jax.lax.dynamic_update_slice(valid0, new, (jnp.zeros((), jnp.int32), index))
        q_slot, k_slot = index + jnp.arange(t), jnp.arange(valid0.shape[1])
    if positions is None:
        positions = jnp.maximum(seen + jnp.cumsum(new, axis=1, dtype=jnp.int32) - 1, 0)
    mask = (k_slot[None, None, :] <= q_slot[None, :, None]) & valid[:, None, :]  # [B, T, S]
    return positions, mask, valid


def _ptq_embed(model: Llama, tokens: jax.Array) -> jax.Array:
    return model.embed(tokens.astype(jnp.int32))


def _ptq_block(block: Block, x: jax.Array) -> jax.Array:
    return block(x)[0]


def _ptq_head(model: Llama, x: jax.Array) -> jax.Array:
    return model._head(x)


def _split_batch(batch: jax.Array) -> tuple[jax.Array, jax.Array]:
    if batch.ndim != 2 or batch.shape[1] < 2:
        raise ValueError(f"batch must be int [batch, seq_len + 1] with seq_len >= 1; got shape {batch.shape}")
    return batch[:, :-1], batch[:, 1:]


def token_log_likelihood(model: Llama, batch: jax.Array) -> jax.Array:
    """``log p(batch[:, t+1] | batch[:, :t+1])`` for every position: float32 [B, T] from a [B, T+1] batch."""
    inputs, targets = _split_batch(jnp.asarray(batch))
    logp = jax.nn.log_softmax(cast(jax.Array, model(inputs)), axis=-1)  # no cache given: logits only
    return jnp.take_along_axis(logp, targets.astype(jnp.int32)[..., None], axis=-1)[..., 0]


def loss_fn(model: Llama, batch: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean next-token cross-entropy (float32, nats/byte) of an int [B, T+1] batch, and aux metrics.

    aux: ``accuracy`` (top-1 next-byte accuracy, float32) and ``n_tokens`` (B*T, int32).
    """
    inputs, targets = _split_batch(jnp.asarray(batch))
    logits = cast(jax.Array, model(inputs))  # no cache given: logits only
    targets = targets.astype(jnp.int32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    accuracy = (logits.argmax(-1) == targets).astype(jnp.float32).mean()
    return loss, {"accuracy": accuracy, "n_tokens": jnp.asarray(targets.size, jnp.int32)}


# ---------------------------------------------------------------------------------------------------------------
# generation


def _sample(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_k: int) -> jax.Array:
    """Next tokens from float32 [B, V] logits: argmax when ``temperature == 0``, else a draw from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` largest (all when ``top_k == 0``)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(temperature, jnp.float32(1e-6))
    if top_k:
        kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]
        scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    drawn = jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)


@functools.partial(jax.jit, static_argnums=(0, 7), donate_argnums=(4,))
def _generate_step(graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array, mask: jax.Array, cache: KVCache,
                   key: jax.Array, temperature: jax.Array, top_k: int) -> tuple[jax.Array, KVCache]:
    model = nnx.merge(graphdef, state)  # state writes of quantized layers (amax histories) are dropped
    logits, cache = model(tokens, attention_mask=mask, cache=cache)
    return _sample(logits[:, -1], key, temperature, top_k), cache


# Block by block (a model with quantized ops): one program for the embedding and the attention layout, one per
# distinct block structure and token count (prefill, decode), shared by identical blocks, one for the head and the
# draw. A fake-quantized layer is thousands of HLO ops, and one program for the whole model took 7.6 GB to compile
# with NVFP4 on every SmolLM2 projection (`jaxlowfp.evaluation` scores the same way).
@functools.partial(jax.jit, static_argnums=(0,))
def _gen_embed(graphdef: nnx.GraphDef, state: nnx.State, tokens: jax.Array, mask: jax.Array, valid: jax.Array,
               index: jax.Array) -> tuple[jax.Array, ...]:
    b, t = tokens.shape
    positions, amask, valid = _layout(b, t, mask, None, (valid, index))
    return nnx.merge(graphdef, state)(tokens.astype(jnp.int32)), positions, amask, valid


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(5, 6))
def _gen_block(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, positions: jax.Array, mask: jax.Array,
               k: jax.Array, v: jax.Array, index: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, nnx.State]:
    from jaxlowfp.execution import records

    block = nnx.merge(graphdef, state)
    x, (k, v) = block(x, positions, mask, (k, v, index))
    return x, k, v, records(block)  # the block's execution records: the only state that comes back


@functools.partial(jax.jit, static_argnums=(0, 5))
def _gen_head(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, key: jax.Array, temperature: jax.Array,
              top_k: int) -> jax.Array:
    return _sample(nnx.merge(graphdef, state)._head(x)[:, -1], key, temperature, top_k)


class _BlockwiseStep:
    """`_generate_step` block by block (same arguments and results)."""

    def __init__(self, model: Llama):
        from jaxlowfp.execution import SharedPrograms

        self.embed = nnx.split(model.embed)
        self.model = nnx.split(model)
        self.blocks = SharedPrograms(list(model.blocks))

    def __call__(self, tokens: jax.Array, mask: jax.Array, cache: KVCache, key: jax.Array, temperature: jax.Array,
                 top_k: int) -> tuple[jax.Array, KVCache]:
        x, positions, amask, valid = _gen_embed(*self.embed, tokens, mask, cache.valid, cache.index)
        ks, vs = [], []
        for i, ((g, s), k, v) in enumerate(zip(self.blocks.split, cache.k, cache.v)):
            x, k, v, recs = _gen_block(g, s, x, positions, amask, k, v, cache.index)
            self.blocks.record(i, recs)
            ks.append(k)
            vs.append(v)
        nxt = _gen_head(*self.model, x, key, temperature, top_k)
        return nxt, KVCache(tuple(ks), tuple(vs), valid, cache.index + jnp.int32(tokens.shape[1]))


def generate(
    model: Llama,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    eos_id: int | None = None,
    seed: int = 0,
    stop: Callable[[int, list[int]], bool] | None = None,
    pad_to: int | None = None,
    mesh: jax.sharding.Mesh | None = None,
    blockwise: bool | None = True,
) -> list[list[int]]:
    """Continue each prompt (a list of token ids) by up to ``max_new_tokens`` tokens with a `KVCache`.

    Prompts are left-padded into one batch (positions count real tokens only, so every row is continued as if
    alone). ``temperature == 0`` is greedy decoding; otherwise tokens are drawn from ``softmax(logits / T)``,
    restricted to the ``top_k`` most likely when given, with keys from ``seed``. A row stops after ``eos_id``
    (included), or when ``stop(row, new_tokens)``, asked after each new token of a row, returns True (e.g. a stop
    string appeared in the decoded text). ``pad_to`` left-pads to at least that many prompt tokens, so batches of
    different prompt lengths share one compiled shape. Returns the new tokens of every prompt. Never changes the
    model (block by block, its ops' execution records are written: `jaxlowfp.execution`).
    ``mesh``: the model's parameters are on it (`jaxlowfp.models.load(..., mesh=...)`); the prompt rows and
    the KV cache are sharded (`cache_shardings`). ``blockwise`` (default; None means the same): run each step block
    by block, one compiled program per token count shared by identical blocks, so compile time and compile memory
    do not grow with depth; False: each step as one whole-model program (the same tokens, more compilation).
    """
    check_int(max_new_tokens, "max_new_tokens")
    if pad_to is not None:
        check_int(pad_to, "pad_to")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0; got {temperature!r}")
    if top_k is not None:
        check_int(top_k, "top_k")
        if top_k > model.config.vocab:
            raise ValueError(f"top_k={top_k} exceeds the vocabulary size {model.config.vocab}")
    rows = [list(map(int, p)) for p in prompts]
    if not rows or any(not r for r in rows):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    if any(t < 0 or t >= model.config.vocab for r in rows for t in r):
        raise ValueError(f"prompt token ids must be in [0, {model.config.vocab})")
    p = max(max(map(len, rows)), pad_to or 0)
    capacity = p + max_new_tokens
    if capacity > model.config.max_seq_len:
        raise ValueError(f"prompt length {p} + max_new_tokens {max_new_tokens} exceeds max_seq_len="
                         f"{model.config.max_seq_len}")
    tokens = np.zeros((len(rows), p), np.int32)
    mask = np.zeros((len(rows), p), bool)
    for i, r in enumerate(rows):  # left padding
        tokens[i, p - len(r):] = r
        mask[i, p - len(r):] = True
    graphdef, state = nnx.split(model)
    cache = KVCache.init(model.config, len(rows), capacity)
    if mesh is not None:
        from jaxlowfp import sharding

        sharding.check_on_mesh(state, mesh)
        cache = sharding.shard(cache, cache_shardings(model.config, mesh, len(rows)))
        tokens, mask = sharding.put_batch(tokens, mesh), sharding.put_batch(mask, mesh)  # type: ignore[assignment]
    keys = jax.random.split(jax.random.key(seed), max_new_tokens)
    temp = jnp.float32(temperature)
    if blockwise is None:
        blockwise = True
    elif not isinstance(blockwise, bool):
        raise TypeError(f"blockwise must be True, False or None (auto); got {blockwise!r}")
    step_fn = _BlockwiseStep(model) if blockwise else functools.partial(_generate_step, graphdef, state)
    nxt, cache = step_fn(jnp.asarray(tokens), jnp.asarray(mask), cache, keys[0], temp, top_k or 0)
    out: list[list[int]] = [[] for _ in rows]
    done = np.zeros(len(rows), bool)
    ones = jnp.ones((len(rows), 1), jnp.bool_)
    to_host: Callable[[Any], np.ndarray] = np.asarray
    if mesh is not None:
        to_host = sharding.to_host  # gathers the rows of a multi-process mesh
    for step in range(max_new_tokens):
        host = to_host(nxt)
        for i in np.flatnonzero(~done).tolist():
            out[i].append(int(host[i]))
            done[i] |= (eos_id is not None and int(host[i]) == eos_id) or (stop is not None and bool(stop(i, out[i])))
        if done.all() or step == max_new_tokens - 1:
            break
        nxt, cache = step_fn(nxt[:, None], ones, cache, keys[step + 1], temp, top_k or 0)
    return out
