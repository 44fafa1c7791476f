"""`QuantLinear`, the drop-in for `nnx.Linear`, and the NNX variable types that hold its QAT state."""
from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes
from flax.nnx.nn.linear import default_bias_init, default_kernel_init
from jax import lax

from jaxlowfp import qat
from jaxlowfp._core.checks import bool_flag

class AmaxState(nnx.Variable):
    """A QuantLinear's `RecipeState` (amax histories): the functional QAT state, separate from `nnx.Param`.

    With delayed gradient scaling its `PendingAmax` slot is written by the backward pass, as a gradient:
    `jaxlowfp.training.make_step` differentiates w.r.t. it (see `jaxlowfp.scaling.pending_amaxes` for a custom
    loop); a loop that differentiates w.r.t. the params only leaves the gradient history empty."""


class QuantStatsState(nnx.Variable):
    """The `RecipeStats` (weight and activation `QuantStats`) of a QuantLinear's last call: telemetry, not
    trained and not needed to resume."""


class QuantPhase(nnx.Variable):
    """Bool scalar: True = observe only (high-precision warmup), False = fake-quantized."""


_PathParts = tuple[Any, ...]


def _check_layer_shape(recipe: qat.Recipe, in_features: int, out_features: int, where: str) -> None:
    """Block-scaled formats need whole blocks: the activation [.., in] is blocked along `in`, the kernel
    [in, out] along `in` (its contraction axis) and, for 2D tiles (r, c), along `out` by r; a quantized output
    gradient [.., out] along `out`. (The wgrad blocks run along the tokens: that count is checked per call.)"""
    for role in ("activation", "weight", "grad"):
        spec = getattr(recipe, role, None)
        block = getattr(spec, "block_shape", None) if spec is not None else None
        if block is None:
            continue
        block = tuple(int(b) for b in block)
        problems = []
        if role == "grad":  # dgrad quantizes dy [.., out] in blocks along `out`
            if out_features % block[-1]:
                problems.append(f"out_features={out_features} is not a multiple of the block size {block[-1]}")
        elif in_features % block[-1]:
            problems.append(f"in_features={in_features} is not a multiple of the block size {block[-1]}")
        if role == "weight" and block[0] > 1 and out_features % block[0]:
            problems.append(f"out_features={out_features} is not a multiple of the tile height {block[0]}")
        if problems:
            raise ValueError(
                f"{where}: recipe {recipe.name!r} quantizes the {role} as {spec.format} with block_shape={block}, "
                f"but {' and '.join(problems)}. Keep this layer in high precision (a Rule with recipe=None) "
                f"or use a recipe without block scaling."
            )


@functools.lru_cache(maxsize=256)
def _stats_shapes(recipe: qat.Recipe, in_features: int, out_features: int, dtype: np.dtype) -> Any:
    x = jax.ShapeDtypeStruct((1, in_features), dtype)
    w = jax.ShapeDtypeStruct((in_features, out_features), dtype)
    fn = lambda x, w, s, k: qat.linear(x, w, recipe=recipe, state=s, key=k)[2]  # noqa: E731
    return jax.eval_shape(fn, x, w, recipe.init(), jax.random.key(0))


def _zero_stats(recipe: qat.Recipe, in_features: int, out_features: int, dtype: Any, where: str) -> Any:
    """A zero RecipeStats pytree with the structure `qat.linear` returns, found by abstract evaluation (cached
    per recipe and shape; it also surfaces any incompatibility the QAT op itself detects, named by path)."""
    try:
        shapes = _stats_shapes(recipe, int(in_features), int(out_features), np.dtype(dtype))
    except (ValueError, TypeError, NotImplementedError) as e:
        raise ValueError(f"{where}: recipe {recipe.name!r} cannot quantize this layer: {e}") from e
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


class QuantLinear(nnx.Module):
    """Drop-in for `nnx.Linear` that fake-quantizes weight and input with a `qat.Recipe`.

        y = Q_a(x) @ Q_w(W) + b        (straight-through gradients; Q = identity while observe_only)

    Same `kernel` [in, out] and `bias` [out] Params, initializers, dtypes and promotion as `nnx.Linear`, so a
    checkpoint of either loads into the other. In observe-only mode the output is bitwise that of `nnx.Linear`.
    Each call stores the updated amax histories in `self.amax` and the stats in `self.stats`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        recipe: qat.Recipe,
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        kernel_init: Any = default_kernel_init,
        bias_init: Any = default_bias_init,
        promote_dtype: Any = nnx_dtypes.promote_dtype,
        preferred_element_type: Any = None,
        observe_only: bool = False,
        path: str = "",
        rngs: nnx.Rngs | None = None,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
        _from: nnx.Linear | None = None,  # private: from_linear's way to adopt existing Params
    ):
        if not isinstance(recipe, qat.Recipe):
            raise TypeError(f"recipe must be a jaxlowfp.qat.Recipe; got {type(recipe).__name__}: {recipe!r}")
        if not isinstance(path, str):
            raise TypeError(f"path must be a str; got {type(path).__name__}")
        where = path or f"QuantLinear({in_features}, {out_features})"
        _check_layer_shape(recipe, int(in_features), int(out_features), where)
        if recipe.needs_key and rngs is None:
            raise TypeError(f"{where}: recipe {recipe.name!r} uses stochastic rounding and needs rngs=nnx.Rngs(...) "
                            f"(its 'quant' stream, or 'default') to draw a key per call")
        if _from is None:
            if rngs is None:
                raise TypeError("QuantLinear needs rngs=nnx.Rngs(...) to initialize its parameters")
            self.kernel = nnx.Param(
                kernel_init(rngs.params(), (in_features, out_features), param_dtype), **kernel_metadata
            )
            self.bias = (
                nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype), **bias_metadata)
                if use_bias
                else nnx.data(None)
            )
        else:  # adopt the Param objects of an existing Linear: no copy of the weights
            self.kernel = _from.kernel
            self.bias = _from.bias if use_bias else nnx.data(None)
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.promote_dtype = promote_dtype
        self.preferred_element_type = preferred_element_type
        self.recipe = recipe
        self.path = path
        compute_dtype = dtype if dtype is not None else param_dtype
        self.amax = AmaxState(recipe.init())
        self.stats = QuantStatsState(_zero_stats(recipe, in_features, out_features, compute_dtype, where))
        self.observe_only = QuantPhase(jnp.asarray(bool_flag(observe_only)))
        self.rngs = rngs["quant"].fork() if recipe.needs_key else nnx.data(None)

    @classmethod
    def from_linear(
        cls,
        linear: nnx.Linear,
        recipe: qat.Recipe,
        *,
        path: str = "",
        observe_only: bool = False,
        rngs: nnx.Rngs | None = None,
    ) -> "QuantLinear":
        """A QuantLinear sharing `linear`'s kernel and bias `nnx.Param` objects (same arrays, no copy).

        `rngs` is needed only by recipes with stochastic rounding (a forked 'quant' stream per layer).
        """
        where = path or "from_linear"
        if not isinstance(linear, nnx.Linear):
            raise TypeError(f"{where}: expected an nnx.Linear; got {type(linear).__name__}")
        if linear.dot_general is not lax.dot_general:
            raise ValueError(
                f"{where}: this nnx.Linear uses a custom dot_general ({linear.dot_general!r}); QuantLinear would "
                f"replace it. Keep the layer out of the rules or build the QuantLinear yourself."
            )
        return cls(
            linear.in_features,
            linear.out_features,
            recipe=recipe,
            use_bias=linear.use_bias,
            dtype=linear.dtype,
            param_dtype=linear.param_dtype,
            precision=linear.precision,
            promote_dtype=linear.promote_dtype,
            preferred_element_type=linear.preferred_element_type,
            observe_only=observe_only,
            path=path,
            rngs=rngs,
            _from=linear,
        )

    def __call__(self, inputs: jax.Array, out_sharding: Any = None, *, key: jax.Array | None = None) -> jax.Array:
        """`key` overrides the layer's own stream (used only by stochastic-rounding recipes)."""
        if out_sharding is not None:
            raise NotImplementedError(
                f"{self.path or 'QuantLinear'}: out_sharding is not supported by the quantized matmul; shard the "
                f"inputs and parameters instead"
            )
        if key is None and self.rngs is not None:
            key = self.rngs()
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        y, new_state, stats = qat.linear(
            inputs,
            kernel,
            recipe=self.recipe,
            state=self.amax.get_value(),
            observe_only=self.observe_only[...],
            key=key,
            precision=self.precision,
            preferred_element_type=self.preferred_element_type,
        )
        self.amax.set_value(new_state)
        self.stats.set_value(stats)
        if bias is not None:
            y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        return y


