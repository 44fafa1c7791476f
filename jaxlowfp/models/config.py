"""The Llama-family decoder's configuration: `ModelConfig` (sizes, RoPE options, dtypes; validated, hashable),
the demo `PRESETS`, Llama-3 RoPE scaling (`llama3_rope_factors`) and what a config says about its layers' paths
(`mlp_paths`, `smoothing_folds` for SmoothQuant / AWQ). The module itself is `jaxlowfp.models.llama.Llama`;
`jaxlowfp.models.llama` re-exports every name here.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["DTYPES", "PRESETS", "ModelConfig", "check_int", "compute_dtype_for_backend", "llama3_rope_factors",
           "mlp_paths", "preset", "smoothing_folds"]

# the dtype names a ModelConfig accepts for dtype and param_dtype
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


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
    if name not in DTYPES:
        allowed = ("'auto', " if allow_auto else "") + ", ".join(map(repr, DTYPES))
        raise ValueError(f"{what}={value!r} is not supported; allowed: {allowed}")
    return name


def check_int(value: Any, what: str, minimum: int = 1) -> None:
    """A ValueError naming `what` unless `value` is an int (not a bool) >= `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what} must be an int >= {minimum}; got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Sizes of the decoder. Hashable: usable as static jit configuration.

    ``dtype`` is the compute dtype name (``"auto"``: `compute_dtype_for_backend` at model construction);
    ``param_dtype`` the storage dtype of parameters. Dtypes are normalised to their names.

    Real-checkpoint options (the defaults are the demo model): ``explicit_head_dim`` (None: ``d_model /
    n_heads``; Qwen3 sets it), ``tie_embeddings`` (the head is the embedding matrix), ``qkv_bias`` (Qwen2),
    ``qk_norm`` (Qwen3: RMSNorm over ``head_dim`` of every query and key head, before RoPE),
    ``rope_freq_factors`` (``head_dim / 2`` divisors of the RoPE frequencies, `llama3_rope_factors`) and
    ``qk_norm_all_heads`` (with ``qk_norm``, OLMoE's: one RMSNorm over all query heads together, ``n_heads *
    head_dim`` features, and one over all key heads).
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
    explicit_head_dim: int | None = None
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_freq_factors: tuple[float, ...] | None = None
    qk_norm_all_heads: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len"):
            check_int(getattr(self, name), name)
        if self.explicit_head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
            if (self.d_model // self.n_heads) % 2:
                raise ValueError(
                    f"head_dim = d_model / n_heads = {self.d_model // self.n_heads} must be even for RoPE"
                )
        else:
            check_int(self.explicit_head_dim, "explicit_head_dim")
            if self.explicit_head_dim % 2:
                raise ValueError(f"explicit_head_dim={self.explicit_head_dim} must be even for RoPE")
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
        for name in ("tie_embeddings", "qkv_bias", "qk_norm", "qk_norm_all_heads"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool; got {getattr(self, name)!r}")
        if self.qk_norm_all_heads and not self.qk_norm:
            raise ValueError("qk_norm_all_heads=True needs qk_norm=True")
        if self.rope_freq_factors is not None:
            f = tuple(float(v) for v in np.asarray(self.rope_freq_factors, np.float64).reshape(-1))
            if len(f) != self.head_dim // 2 or not all(math.isfinite(v) and v > 0 for v in f):
                raise ValueError(
                    f"rope_freq_factors must be {self.head_dim // 2} (head_dim / 2) positive finite numbers; "
                    f"got {len(f)} values"
                )
            object.__setattr__(self, "rope_freq_factors", f)
        object.__setattr__(self, "dtype", _dtype_name(self.dtype, "dtype", allow_auto=True))
        object.__setattr__(self, "param_dtype", _dtype_name(self.param_dtype, "param_dtype", allow_auto=False))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads if self.explicit_head_dim is None else self.explicit_head_dim

    @property
    def compute_dtype(self) -> Any:
        """The compute dtype, with ``"auto"`` resolved for the current default backend."""
        return compute_dtype_for_backend() if self.dtype == "auto" else DTYPES[self.dtype]

    def num_params(self) -> int:
        d, q, kv = self.d_model, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        per_block = d * (2 * q + 2 * kv) + 3 * d * self.d_ff + 2 * d
        per_block += (q + 2 * kv) * self.qkv_bias + self.qk_norm * ((q + kv) if self.qk_norm_all_heads
                                                                   else 2 * self.head_dim)
        return (1 if self.tie_embeddings else 2) * self.vocab * d + self.n_layers * per_block + d


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


def llama3_rope_factors(
    head_dim: int, theta: float, *, factor: float, low_freq_factor: float, high_freq_factor: float,
    original_max_position_embeddings: int,
) -> tuple[float, ...]:
    """Llama-3 ``rope_scaling`` as divisors of the ``head_dim / 2`` RoPE frequencies ``w_i = theta^(-2i/D)``.

    With wavelength ``l_i = 2 pi / w_i``, ``L = original_max_position_embeddings``: ``w_i`` is kept where
    ``l_i < L / high_freq_factor``, divided by ``factor`` where ``l_i > L / low_freq_factor``, and in between
    interpolated, ``w_i' = (1 - s) w_i / factor + s w_i`` with ``s = (L / l_i - low) / (high - low)``.
    The divisor is ``w_i / w_i'`` (what llama.cpp stores as ``rope_freqs``).
    """
    w = theta ** (-np.arange(0, head_dim // 2, dtype=np.float64) * (2.0 / head_dim))
    wavelen = 2 * np.pi / w
    s = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    scaled = np.where(
        wavelen < original_max_position_embeddings / high_freq_factor,
        w,
        np.where(wavelen > original_max_position_embeddings / low_freq_factor, w / factor,
                 (1 - s) * w / factor + s * w),
    )
    return tuple(float(v) for v in w / scaled)


def smoothing_folds(config: ModelConfig) -> tuple[list[tuple[str, tuple[str, ...]]], list[tuple[str, str]]]:
    """Which op's output feeds which projections, for scale folding (SmoothQuant, AWQ in `jaxlowfp.ptq`).

    Per block: ``attn_norm -> attn/{q,k,v}_proj``, ``attn/v_proj -> attn/o_proj`` (only without grouped-query
    attention, where v_proj's outputs are o_proj's inputs one to one), ``mlp_norm -> mlp/{gate,up}_proj`` and
    ``mlp/up_proj -> mlp/down_proj`` (SwiGLU: ``down(silu(gate(x)) * up(x))`` is linear in ``up``'s outputs).
    Returns ``(folds, skipped)``: ``folds`` as ``(prev_path, layer_paths)``, ``skipped`` as ``(layer, reason)``.
    """
    folds, skipped = [], []
    q_out, kv_out = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    for i in range(config.n_layers):
        b = f"blocks/{i}"
        folds.append((f"{b}/attn_norm", tuple(f"{b}/attn/{n}_proj" for n in "qkv")))
        if kv_out == q_out:
            folds.append((f"{b}/attn/v_proj", (f"{b}/attn/o_proj",)))
        else:
            skipped.append((f"{b}/attn/o_proj", f"grouped-query attention: v_proj has {kv_out} outputs, o_proj "
                            f"{q_out} inputs, so o_proj's input channels cannot be scaled through v_proj one to one "
                            "(llm-awq skips it too)"))
        folds.append((f"{b}/mlp_norm", (f"{b}/mlp/gate_proj", f"{b}/mlp/up_proj")))
        folds.append((f"{b}/mlp/up_proj", (f"{b}/mlp/down_proj",)))
    return folds, skipped


def mlp_paths(config: ModelConfig) -> list[str]:
    """Graph paths of every MLP projection, ``blocks/<i>/mlp/{gate,up,down}_proj`` (for quantization rules)."""
    return [f"blocks/{i}/mlp/{p}" for i in range(config.n_layers) for p in ("gate_proj", "up_proj", "down_proj")]
