"""A Llama-style byte-level decoder in Flax NNX.

``tokens -> Embed -> N x [x + Attn(RMSNorm(x)); x + MLP(RMSNorm(x))] -> RMSNorm -> lm_head -> logits``

- attention: grouped-query (``n_heads`` query heads share ``n_kv_heads`` key/value heads), rotary position
  embedding (RoPE, rotate-half form, base ``rope_theta``) on queries and keys, causal mask;
- MLP: SwiGLU, ``down_proj(silu(gate_proj(x)) * up_proj(x))``;
- every projection is a plain bias-free ``nnx.Linear``, so ``jaxlowfp.nnx.quantize`` can replace one by its
  graph path, e.g. ``blocks/3/mlp/gate_proj`` or ``blocks/0/attn/q_proj``.

Parameters are stored in ``param_dtype`` (float32); matmuls run in the compute ``dtype`` (float32 on CPU,
bfloat16 on GPU by default); normalisation statistics, softmax and logits are float32.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

__all__ = [
    "PRESETS",
    "Llama",
    "ModelConfig",
    "compute_dtype_for_backend",
    "loss_fn",
    "mlp_paths",
    "preset",
    "token_log_likelihood",
]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def compute_dtype_for_backend(backend: str | None = None) -> Any:
    """float32 on CPU, bfloat16 on GPU/TPU (the high-precision compute dtype of the baseline)."""
    backend = jax.default_backend() if backend is None else backend
    return jnp.float32 if backend == "cpu" else jnp.bfloat16


def _dtype_name(value: Any, what: str, allow_auto: bool) -> str:
    if allow_auto and value == "auto":
        return "auto"
    try:
        name = jnp.dtype(value).name
    except TypeError:
        name = None
    if name not in _DTYPES:
        allowed = ("'auto', " if allow_auto else "") + ", ".join(map(repr, _DTYPES))
        raise ValueError(f"{what}={value!r} is not supported; allowed: {allowed}")
    return name


def _check_int(value: Any, what: str, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}; got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Sizes of the decoder. Hashable: usable as static jit configuration.

    ``dtype`` is the compute dtype name (``"auto"``: `compute_dtype_for_backend` at model construction);
    ``param_dtype`` the storage dtype of parameters. Dtypes are normalised to their names.
    """

    vocab: int = 256
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    max_seq_len: int
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    dtype: str = "auto"
    param_dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("vocab", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len"):
            _check_int(getattr(self, name), name)
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(f"head_dim = d_model / n_heads = {self.d_model // self.n_heads} must be even for RoPE")
        if self.n_kv_heads > self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"grouped-query attention needs n_kv_heads to divide n_heads; got n_heads={self.n_heads}, "
                f"n_kv_heads={self.n_kv_heads}"
            )
        for name in ("rope_theta", "norm_eps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a positive number; got {v!r}")
            object.__setattr__(self, name, float(v))
        object.__setattr__(self, "dtype", _dtype_name(self.dtype, "dtype", allow_auto=True))
        object.__setattr__(self, "param_dtype", _dtype_name(self.param_dtype, "param_dtype", allow_auto=False))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def compute_dtype(self) -> Any:
        """The compute dtype, with ``"auto"`` resolved for the current default backend."""
        return compute_dtype_for_backend() if self.dtype == "auto" else _DTYPES[self.dtype]

    def num_params(self) -> int:
        d, kv = self.d_model, self.n_kv_heads * self.head_dim
        per_block = d * (2 * d + 2 * kv) + 3 * d * self.d_ff + 2 * d
        return 2 * self.vocab * d + self.n_layers * per_block + d


PRESETS: dict[str, ModelConfig] = {
    # tests: compiles and runs in seconds on one CPU core; 4 blocks so there are middle blocks to quantize
    "tiny": ModelConfig(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=192, max_seq_len=64),
    # the CPU demo default (~1.2 M parameters)
    "small": ModelConfig(d_model=128, n_layers=6, n_heads=4, n_kv_heads=2, d_ff=384, max_seq_len=128),
    # GPUs (~85 M parameters)
    "base": ModelConfig(d_model=768, n_layers=12, n_heads=12, n_kv_heads=4, d_ff=2048, max_seq_len=1024),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """``PRESETS[name]`` with fields replaced by ``overrides`` (validated again)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; allowed: {', '.join(map(repr, PRESETS))}")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown ModelConfig field(s) {unknown}; allowed: {sorted(fields)}")
    return dataclasses.replace(PRESETS[name], **overrides)


def _rope(x: jax.Array, theta: float) -> jax.Array:
    """Rotate-half RoPE on ``x [B, T, H, D]`` at positions ``0..T-1``; angles computed in float32.

    Pairs ``(x_i, x_{i+D/2})`` rotate by ``t * theta**(-2i/D)``.
    """
    t, d = x.shape[1], x.shape[-1]
    inv_freq = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * (2.0 / d))
    angles = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = jnp.cos(angles)[None, :, None, :]
    sin = jnp.sin(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _causal_gqa(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(D) + causal mask) v with q [B, T, N, D] and k, v [B, T, K, D], K dividing N.

    Query head ``n`` uses key/value head ``n // (N / K)``. Scores and softmax are float32 (written out here:
    ``jax.nn.dot_product_attention`` promotes bfloat16 with float32 implicitly, which strict promotion refuses).
    """
    b, t, n, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, n // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * (1.0 / d**0.5)
    causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
    scores = jnp.where(causal, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.astype(v.dtype).reshape(b, t, n, d)


def _linear(d_in: int, d_out: int, cfg: ModelConfig, dtype: Any, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=False, dtype=dtype, param_dtype=_DTYPES[cfg.param_dtype], rngs=rngs)


def _rmsnorm(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
    # statistics in float32; the output is cast to the compute dtype by the next Linear
    return nnx.RMSNorm(
        cfg.d_model, epsilon=cfg.norm_eps, dtype=jnp.float32, param_dtype=_DTYPES[cfg.param_dtype], rngs=rngs
    )


class Attention(nnx.Module):
    """Causal grouped-query self-attention with RoPE."""

    def __init__(self, cfg: ModelConfig, dtype: Any, *, rngs: nnx.Rngs) -> None:
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.dtype = dtype
        kv = cfg.n_kv_heads * cfg.head_dim
        self.q_proj = _linear(cfg.d_model, cfg.d_model, cfg, dtype, rngs)
        self.k_proj = _linear(cfg.d_model, kv, cfg, dtype, rngs)
        self.v_proj = _linear(cfg.d_model, kv, cfg, dtype, rngs)
        self.o_proj = _linear(cfg.d_model, cfg.d_model, cfg, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.n_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim)
        q, k = _rope(q, self.rope_theta), _rope(k, self.rope_theta)
        # one dtype for q, k, v (a quantized projection may return another float dtype)
        q, k, v = (a.astype(self.dtype) for a in (q, k, v))
        out = _causal_gqa(q, k, v)
        return self.o_proj(out.reshape(b, t, self.n_heads * self.head_dim))


class MLP(nnx.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, cfg: ModelConfig, dtype: Any, *, rngs: nnx.Rngs) -> None:
        self.gate_proj = _linear(cfg.d_model, cfg.d_ff, cfg, dtype, rngs)
        self.up_proj = _linear(cfg.d_model, cfg.d_ff, cfg, dtype, rngs)
        self.down_proj = _linear(cfg.d_ff, cfg.d_model, cfg, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(nnx.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    """Pre-norm residual block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``; the residual stream is float32."""

    def __init__(self, cfg: ModelConfig, dtype: Any, *, rngs: nnx.Rngs) -> None:
        self.attn_norm = _rmsnorm(cfg, rngs)
        self.attn = Attention(cfg, dtype, rngs=rngs)
        self.mlp_norm = _rmsnorm(cfg, rngs)
        self.mlp = MLP(cfg, dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x)).astype(jnp.float32)
        return x + self.mlp(self.mlp_norm(x)).astype(jnp.float32)


class Llama(nnx.Module):
    """The decoder: ``__call__(tokens int32 [B, T]) -> logits float32 [B, T, vocab]``; T <= max_seq_len."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs) -> None:
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig; got {type(config).__name__}")
        self.config = config
        dtype = config.compute_dtype
        pdt = _DTYPES[config.param_dtype]
        self.embed = nnx.Embed(config.vocab, config.d_model, dtype=jnp.float32, param_dtype=pdt, rngs=rngs)
        self.blocks = nnx.List([Block(config, dtype, rngs=rngs) for _ in range(config.n_layers)])
        self.final_norm = _rmsnorm(config, rngs)
        self.lm_head = _linear(config.d_model, config.vocab, config, dtype, rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise TypeError(f"tokens must be an integer array [batch, seq]; got shape {tokens.shape} {tokens.dtype}")
        if tokens.shape[1] > self.config.max_seq_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq_len={self.config.max_seq_len}")
        x = self.embed(tokens.astype(jnp.int32))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.final_norm(x)).astype(jnp.float32)


def mlp_paths(config: ModelConfig) -> list[str]:
    """Graph paths of every MLP projection, ``blocks/<i>/mlp/{gate,up,down}_proj`` (for quantization rules)."""
    return [f"blocks/{i}/mlp/{p}" for i in range(config.n_layers) for p in ("gate_proj", "up_proj", "down_proj")]


def _split_batch(batch: jax.Array) -> tuple[jax.Array, jax.Array]:
    if batch.ndim != 2 or batch.shape[1] < 2:
        raise ValueError(f"batch must be int [batch, seq_len + 1] with seq_len >= 1; got shape {batch.shape}")
    return batch[:, :-1], batch[:, 1:]


def token_log_likelihood(model: Llama, batch: jax.Array) -> jax.Array:
    """``log p(batch[:, t+1] | batch[:, :t+1])`` for every position: float32 [B, T] from a [B, T+1] batch."""
    inputs, targets = _split_batch(jnp.asarray(batch))
    logp = jax.nn.log_softmax(model(inputs), axis=-1)
    return jnp.take_along_axis(logp, targets.astype(jnp.int32)[..., None], axis=-1)[..., 0]


def loss_fn(model: Llama, batch: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean next-token cross-entropy (float32, nats/byte) of an int [B, T+1] batch, and aux metrics.

    aux: ``accuracy`` (top-1 next-byte accuracy, float32) and ``n_tokens`` (B*T, int32).
    """
    inputs, targets = _split_batch(jnp.asarray(batch))
    logits = model(inputs)
    targets = targets.astype(jnp.int32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    accuracy = (logits.argmax(-1) == targets).astype(jnp.float32).mean()
    return loss, {"accuracy": accuracy, "n_tokens": jnp.asarray(targets.size, jnp.int32)}
