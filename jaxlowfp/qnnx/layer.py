"""The quantized NNX layers: `QuantLinear`, `QuantEinsum`, `QuantLinearGeneral` (drop-ins for `nnx.Linear`,
`nnx.Einsum`, `nnx.LinearGeneral`), their common base `QuantOp` (the QAT state of one quantized contraction), and
the NNX variable types that hold that state (`ExecutionRecord`, the op's execution record, is
`jaxlowfp.execution`'s)."""
from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes
from flax.nnx.nn.linear import default_bias_init, default_kernel_init
from jax import lax

from jaxlowfp import qat
from jaxlowfp._core.checks import bool_flag
from jaxlowfp import ops
from jaxlowfp._core.executed import new_record
from jaxlowfp.ops import check_blocks, needs_linear_layout, parse_einsum

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


def _zero_quant_stats() -> qat.QuantStats:
    # one buffer per leaf (a state donated to a jit must not hold one buffer twice), each a device_put of a NumPy
    # zero: no trace (jnp.asarray stages an eager primitive, traced on its first use)
    def f32() -> jax.Array:
        return jax.device_put(np.zeros((), np.float32))

    return qat.QuantStats(amax=f32(), amax_estimate=f32(), scale=f32(), saturated_fraction=f32(),
                          underflow_fraction=f32(), nonfinite_count=jax.device_put(np.zeros((), np.int32)))


def _zero_stats(recipe: qat.Recipe) -> qat.RecipeStats:
    """The zero `RecipeStats` of a call of `recipe`'s op, read from the recipe alone (no trace): a `QuantStats` of
    scalars per quantized forward operand (float32 amax, estimate, scale and fractions, int32 non-finite count, as
    `jaxlowfp.qat.dot_general` and `jaxlowfp.ops.ragged_dot` report them, whatever the operands' shapes and dtype),
    None for an operand kept in high precision."""
    return qat.RecipeStats(weight=None if recipe.weight is None else _zero_quant_stats(),
                           activation=None if recipe.activation is None else _zero_quant_stats())


def _check_types(recipe: Any, path: Any) -> None:
    """A quantized op's recipe is a `qat.Recipe` and its path a str."""
    if not isinstance(recipe, qat.Recipe):
        raise TypeError(f"recipe must be a jaxlowfp.qat.Recipe; got {type(recipe).__name__}: {recipe!r}")
    if not isinstance(path, str):
        raise TypeError(f"path must be a str; got {type(path).__name__}")


def _check_rngs(recipe: qat.Recipe, rngs: nnx.Rngs | None, where: str) -> None:
    """A stochastic-rounding recipe draws a key per call: its op needs `rngs`."""
    if recipe.needs_key and rngs is None:
        raise TypeError(f"{where}: recipe {recipe.name!r} uses stochastic rounding and needs rngs=nnx.Rngs(...) "
                        f"(its 'quant' stream, or 'default') to draw a key per call")


class QuantOp(nnx.Module):
    """The QAT state of one quantized contraction, and the contraction itself.

    Holds the recipe, the amax histories (`amax`, an `AmaxState`), the last stats (`stats`), the observe-only
    flag (`observe_only`, a `QuantPhase`), its execution record (`record`, a `jaxlowfp.execution.ExecutionRecord`:
    whether the op ran and on which GEMM) and, for stochastic rounding, a forked 'quant' rng stream. The layers
    (`QuantLinear`, `QuantEinsum`, `QuantLinearGeneral`) are QuantOps with parameters; the Qwix provider
    (`jaxlowfp.qwix_provider`) attaches a bare QuantOp to each module whose matmul it intercepts. Telemetry and
    the warmup switch (`jaxlowfp.qnnx.set_observe_only`) reach every QuantOp in a model.

    `contract(lhs, rhs, dimension_numbers, weight=...)` is `jaxlowfp.ops.dot_general` with this op's state:
    it records the new histories and stats in the variables.

    Construction is pure: it checks the recipe against the contraction sizes (K, M) and against its ``gemm``'s
    formats, but traces nothing and asks JAX for no device; the device's GEMM is chosen at the first call. `dtype`
    (the compute dtype) is accepted for the layers' sake: the state does not depend on it.
    """

    def __init__(self, recipe: qat.Recipe, *, k: int = 16, m: int = 16, dtype: Any = jnp.float32,
                 observe_only: bool = False, path: str = "", rngs: nnx.Rngs | None = None):
        where = path or "QuantOp"
        self._init_quant(recipe, observe_only=observe_only, path=path, rngs=rngs, where=where)
        check_blocks(recipe, int(k), int(m), where, k_name="the contraction size K", m_name="the weight's free size M")

    def _init_quant(self, recipe: qat.Recipe, *, observe_only: bool, path: str, rngs: nnx.Rngs | None, where: str,
                    grouped: bool = False, amax: qat.RecipeState | None = None) -> None:
        """Validate `recipe` (its type, rng needs and ``gemm``; no trace, no device) and create the state variables;
        `amax`: the initial histories (default ``recipe.init()``)."""
        _check_types(recipe, path)
        _check_rngs(recipe, rngs, where)
        qat.gemm.check(recipe, where=where, grouped=grouped)
        self.recipe = recipe
        self.path = path
        self.record = new_record()  # written by each forward (jaxlowfp.ops): state, not part of the graphdef
        self.amax = AmaxState(recipe.init() if amax is None else amax)
        self.stats = QuantStatsState(_zero_stats(recipe))
        self.observe_only = QuantPhase(jax.device_put(np.asarray(bool_flag(observe_only))))  # no trace
        self.rngs = rngs["quant"].fork() if recipe.needs_key and rngs is not None else nnx.data(None)

    def contract(self, lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, *, weight: int = 1,
                 key: jax.Array | None = None, precision: Any = None,
                 preferred_element_type: Any = None) -> jax.Array:
        """``lax.dot_general(lhs, rhs, dimension_numbers)`` quantized by this op's recipe (`weight`: which operand
        is the weight, 0 or 1); the new amax histories and stats are stored in the variables."""
        if key is None and self.rngs is not None:
            key = self.rngs()
        y, new_state, stats = ops.dot_general(
            lhs, rhs, dimension_numbers, recipe=self.recipe, state=self.amax.get_value(), weight=weight,
            observe_only=self.observe_only[...], key=key, precision=precision,
            preferred_element_type=preferred_element_type, where=self.path or type(self).__name__,
            record=self.record)
        self.amax.set_value(new_state)
        self.stats.set_value(stats)
        return y


GROUPED_PREFIX = "quant_"  # a grouped-GEMM module's QuantRaggedOp for weight <name> is its attribute quant_<name>


class QuantRaggedOp(QuantOp):
    """The QAT state of one quantized grouped GEMM (`jaxlowfp.ops.ragged_dot`): the expert weight [E, K, N] of a
    mixture-of-experts layer and the rows routed to each expert. Its `AmaxState` holds one amax history per
    expert (``expert_scales="per_expert"``, default: leaves with a leading [E] axis; an expert no token reaches in a
    step keeps its history) or one shared by all (``"shared"``). Attached by `jaxlowfp.qnnx.quantize` to modules
    that declare ``grouped_weights``; telemetry, the warmup switch and `jaxlowfp.training` reach it as any
    QuantOp (microbatch merging by max, expert by expert). `dtype` is accepted and unused (the state does not
    depend on it)."""

    def __init__(self, recipe: qat.Recipe, *, n_experts: int, k: int, m: int, expert_scales: str = "per_expert",
                 dtype: Any = jnp.float32, observe_only: bool = False, path: str = "",
                 rngs: nnx.Rngs | None = None):
        where = path or "QuantRaggedOp"
        _check_types(recipe, path)
        if recipe.grad is not None:
            raise ValueError(f"{where}: recipe {recipe.name!r} quantizes gradients; the quantized grouped GEMM has a "
                             f"straight-through backward only (use hif8_w8a8, nvfp4_w4a4, an FP8 or MX recipe "
                             f"without grad)")
        if expert_scales not in ops.EXPERT_SCALES:
            raise ValueError(f"{where}: expert_scales={expert_scales!r}; allowed: {ops.EXPERT_SCALES}")
        check_blocks(recipe, int(k), int(m), where, k_name="the experts' input size K", m_name="their output size N")
        self._init_quant(recipe, observe_only=observe_only, path=path, rngs=rngs, where=where, grouped=True,
                         amax=ops.ragged_state(recipe, int(n_experts), expert_scales))
        self.expert_scales = expert_scales

    def ragged_dot(self, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, key: jax.Array | None = None,
                   precision: Any = None, preferred_element_type: Any = None) -> jax.Array:
        """``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` quantized by this op's recipe; the new histories and stats
        are stored in the variables."""
        if key is None and self.rngs is not None:
            key = self.rngs()
        y, new_state, stats = ops.ragged_dot(
            lhs, rhs, group_sizes, recipe=self.recipe, state=self.amax.get_value(), expert_scales=self.expert_scales,
            observe_only=self.observe_only[...], key=key, precision=precision,
            preferred_element_type=preferred_element_type, where=self.path, record=self.record)
        self.amax.set_value(new_state)
        self.stats.set_value(stats)
        return y


def _refuse_sharding(out_sharding: Any, where: str) -> None:
    if out_sharding is not None:
        raise NotImplementedError(f"{where}: out_sharding is not supported by the quantized matmul; shard the "
                                  f"inputs and parameters instead")


def _adopt_params(dst: QuantEinsum | QuantLinearGeneral, src: nnx.Einsum | nnx.LinearGeneral) -> None:
    """`dst` holds `src`'s kernel and bias `nnx.Param` objects (the same arrays, no copy)."""
    dst.kernel = src.kernel
    dst.bias = src.bias if src.bias is not None else nnx.data(None)


class QuantLinear(QuantOp):
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
        _check_types(recipe, path)
        where = path or f"QuantLinear({in_features}, {out_features})"
        check_blocks(recipe, int(in_features), int(out_features), where)
        _check_rngs(recipe, rngs, where)
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
        self._init_quant(recipe, observe_only=observe_only, path=path, rngs=rngs, where=where)

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
        _refuse_sharding(out_sharding, self.path or "QuantLinear")
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        y = self.contract(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())), key=key,
                          precision=self.precision, preferred_element_type=self.preferred_element_type)
        if bias is not None:
            y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        return y


def _einsum_sizes(spec: str, kernel_shape: tuple[int, ...]) -> tuple[tuple[int, ...], int, int] | None:
    """(kernel batch axes, K, M) of ``einsum(spec, inputs, kernel)`` read from the letters alone; None when the
    kernel's part of the spec has an ellipsis (its shape then decides, at the first call)."""
    lhs_out = spec.replace(" ", "").split("->")
    operands, out = lhs_out[0].split(","), lhs_out[1]
    a, b = operands
    if "." in b:
        return None
    if len(b) != len(kernel_shape):
        raise ValueError(f"einsum {spec!r}: the kernel operand {b!r} has {len(b)} axes, but kernel_shape is "
                         f"{tuple(kernel_shape)}")
    batch = tuple(i for i, c in enumerate(b) if c in a and c in out)
    contracted = [i for i, c in enumerate(b) if c in a and c not in out]
    k = int(np.prod([kernel_shape[i] for i in contracted]))
    m = int(np.prod([d for i, d in enumerate(kernel_shape) if i not in contracted and i not in batch]))
    return batch, k, m


class QuantEinsum(QuantOp):
    """Drop-in for `nnx.Einsum` (``y = einsum(spec, x, W) + b``) with the input and kernel fake-quantized by a
    `qat.Recipe`: the einsum runs as the GEMM ``x' [.., K] @ W' [K, M]`` of `jaxlowfp.ops` (K the
    product of the contracted axes, M of the kernel's free axes), so NVFP4 blocks run along the contraction.

    Same `kernel` and `bias` Params (and initialization, from `nnx.Einsum` itself) as `nnx.Einsum`. An einsum
    whose kernel shares an axis with the input and the output (a batch axis, e.g. experts) takes the per-tensor
    8-bit recipes only; block-scaled ones raise at construction when the spec shows it, else at the first call.
    """

    if TYPE_CHECKING:  # set in __init__ from the nnx.Einsum (adopted Params, then a setattr loop)
        kernel: nnx.Param[jax.Array]
        bias: nnx.Param[jax.Array] | None
        einsum_str: str | None
        kernel_shape: Any
        bias_shape: Any
        dtype: Any
        param_dtype: Any
        precision: Any
        promote_dtype: Any
        preferred_element_type: Any

    def __init__(self, einsum_str: str, kernel_shape: Any, bias_shape: Any = None, *, recipe: qat.Recipe,
                 observe_only: bool = False, path: str = "", rngs: nnx.Rngs | None = None,
                 _from: nnx.Einsum | None = None, **einsum_kwargs: Any):
        if _from is None:
            if rngs is None:
                raise TypeError("QuantEinsum needs rngs=nnx.Rngs(...) to initialize its parameters")
            _from = nnx.Einsum(einsum_str, kernel_shape, bias_shape, rngs=rngs, **einsum_kwargs)
        where = path or f"QuantEinsum({_from.einsum_str!r})"
        if _from.einsum_op is not jnp.einsum:
            raise ValueError(f"{where}: this nnx.Einsum uses a custom einsum_op ({_from.einsum_op!r}); QuantEinsum "
                             f"would replace it. Keep the layer out of the rules or quantize it yourself.")
        sizes = _einsum_sizes(_from.einsum_str, tuple(_from.kernel_shape)) if _from.einsum_str else None
        if sizes is not None:
            batch, k, m = sizes
            if batch and isinstance(recipe, qat.Recipe) and needs_linear_layout(recipe):
                raise ValueError(f"{where}: recipe {recipe.name!r} blocks an operand (NVFP4) or uses the Hadamard "
                                 f"transform, but the kernel axes {batch} of {_from.einsum_str!r} are batch axes "
                                 f"(in the input and the output); use a per-tensor 8-bit recipe or keep it in "
                                 f"high precision")
            if isinstance(recipe, qat.Recipe):
                check_blocks(recipe, k, m, where, k_name=f"the contraction size K of {_from.einsum_str!r}",
                             m_name=f"the kernel's free size M of {_from.einsum_str!r}")
        _adopt_params(self, _from)
        for name in ("einsum_str", "kernel_shape", "bias_shape", "dtype", "param_dtype", "precision",
                     "promote_dtype", "preferred_element_type"):
            setattr(self, name, getattr(_from, name))
        self._init_quant(recipe, observe_only=observe_only, path=path, rngs=rngs, where=where)

    @classmethod
    def from_einsum(cls, einsum: nnx.Einsum, recipe: qat.Recipe, *, path: str = "", observe_only: bool = False,
                    rngs: nnx.Rngs | None = None) -> "QuantEinsum":
        """A QuantEinsum sharing `einsum`'s kernel and bias `nnx.Param` objects (same arrays, no copy)."""
        if not isinstance(einsum, nnx.Einsum):
            raise TypeError(f"{path or 'from_einsum'}: expected an nnx.Einsum; got {type(einsum).__name__}")
        return cls(einsum.einsum_str, einsum.kernel_shape, einsum.bias_shape, recipe=recipe,
                   observe_only=observe_only, path=path, rngs=rngs, _from=einsum)

    def __call__(self, inputs: jax.Array, einsum_str: str | None = None, out_sharding: Any = None, *,
                 key: jax.Array | None = None) -> jax.Array:
        """As `nnx.Einsum.__call__` (a call-time `einsum_str` takes precedence); `key` overrides the layer's own
        stream (stochastic-rounding recipes only)."""
        _refuse_sharding(out_sharding, self.path or "QuantEinsum")
        spec = einsum_str if einsum_str is not None else self.einsum_str
        if spec is None:
            raise ValueError(f"{self.path or 'QuantEinsum'}: no einsum_str, neither at construction nor in the call")
        spec = spec.replace(" ", "")
        as_einsum = cast(nnx.Einsum, self)  # nnx.Einsum's helpers read only kernel_shape, copied from it
        nnx.Einsum._einsum_str_check(as_einsum, spec)
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, self.kernel[...], bias), dtype=self.dtype)
        e = parse_einsum(spec, inputs, kernel)
        y = self.contract(inputs, kernel, e.dimension_numbers, key=key, precision=self.precision,
                          preferred_element_type=self.preferred_element_type)
        if e.out_perm != tuple(range(y.ndim)):
            y = jnp.transpose(y, e.out_perm)
        if bias is not None:
            y += jnp.reshape(bias, nnx.Einsum._infer_broadcasted_bias_shape(as_einsum, spec, inputs, kernel))
        return y


def _sorted_axes(axes: tuple[int, ...], ndim: int) -> tuple[int, ...]:
    return tuple(sorted(a % ndim for a in axes))  # as nnx.LinearGeneral normalizes its axes


class QuantLinearGeneral(QuantOp):
    """Drop-in for `nnx.LinearGeneral` (contracts the input `axis` with the kernel [*batch, *in_features,
    *out_features]) with input and kernel fake-quantized by a `qat.Recipe`, as the GEMM of
    `jaxlowfp.ops` (K = prod(in_features), M = prod(out_features)). Same Params and initialization as
    `nnx.LinearGeneral` (built by it). A `batch_axis` takes the per-tensor 8-bit recipes only."""

    if TYPE_CHECKING:  # set in __init__ from the nnx.LinearGeneral (adopted Params, then a setattr loop)
        kernel: nnx.Param[jax.Array]
        bias: nnx.Param[jax.Array] | None
        in_features: tuple[int, ...]
        out_features: tuple[int, ...]
        axis: tuple[int, ...]
        batch_axis: Mapping[int, int]
        use_bias: bool
        dtype: Any
        param_dtype: Any
        precision: Any
        promote_dtype: Any
        preferred_element_type: Any

    def __init__(self, in_features: Any, out_features: Any, *, recipe: qat.Recipe, observe_only: bool = False,
                 path: str = "", rngs: nnx.Rngs | None = None, _from: nnx.LinearGeneral | None = None,
                 **linear_kwargs: Any):
        if _from is None:
            if rngs is None:
                raise TypeError("QuantLinearGeneral needs rngs=nnx.Rngs(...) to initialize its parameters")
            _from = nnx.LinearGeneral(in_features, out_features, rngs=rngs, **linear_kwargs)
        where = path or f"QuantLinearGeneral({_from.in_features}, {_from.out_features})"
        if _from.dot_general is not None or _from.dot_general_cls is not None:
            raise ValueError(f"{where}: this nnx.LinearGeneral uses a custom dot_general; QuantLinearGeneral would "
                             f"replace it. Keep the layer out of the rules or quantize it yourself.")
        k, m = int(np.prod(_from.in_features)), int(np.prod(_from.out_features))
        if isinstance(recipe, qat.Recipe):
            if _from.batch_axis and needs_linear_layout(recipe):
                raise ValueError(f"{where}: recipe {recipe.name!r} blocks an operand (NVFP4) or uses the Hadamard "
                                 f"transform, which needs a contraction without batch axes; this layer has "
                                 f"batch_axis={dict(_from.batch_axis)}. Use a per-tensor 8-bit recipe or keep it "
                                 f"in high precision")
            check_blocks(recipe, k, m, where, k_name=f"prod(in_features={_from.in_features})",
                         m_name=f"prod(out_features={_from.out_features})")
        _adopt_params(self, _from)
        for name in ("in_features", "out_features", "axis", "batch_axis", "use_bias", "dtype", "param_dtype",
                     "precision", "promote_dtype", "preferred_element_type"):
            setattr(self, name, getattr(_from, name))
        self._init_quant(recipe, observe_only=observe_only, path=path, rngs=rngs, where=where)

    @classmethod
    def from_linear_general(cls, layer: nnx.LinearGeneral, recipe: qat.Recipe, *, path: str = "",
                            observe_only: bool = False, rngs: nnx.Rngs | None = None) -> "QuantLinearGeneral":
        """A QuantLinearGeneral sharing `layer`'s kernel and bias `nnx.Param` objects (same arrays, no copy)."""
        if not isinstance(layer, nnx.LinearGeneral):
            raise TypeError(f"{path or 'from_linear_general'}: expected an nnx.LinearGeneral; got "
                            f"{type(layer).__name__}")
        return cls(layer.in_features, layer.out_features, recipe=recipe, observe_only=observe_only, path=path,
                   rngs=rngs, _from=layer)

    def __call__(self, inputs: jax.Array, out_sharding: Any = None, *, key: jax.Array | None = None) -> jax.Array:
        """As `nnx.LinearGeneral.__call__`; `key` overrides the layer's own stream (stochastic rounding only)."""
        _refuse_sharding(out_sharding, self.path or "QuantLinearGeneral")
        ndim = inputs.ndim
        n_batch = len(self.batch_axis)
        axis = _sorted_axes(self.axis, ndim)
        batch_axis = _sorted_axes(tuple(self.batch_axis.keys()), ndim)
        expanded_batch_shape = tuple(inputs.shape[a] if a in batch_axis else 1 for a in range(ndim) if a not in axis)
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, self.kernel[...], bias), dtype=self.dtype)
        dn = ((axis, tuple(range(n_batch, n_batch + len(axis)))), (batch_axis, tuple(range(n_batch))))
        y = self.contract(inputs, kernel, dn, key=key, precision=self.precision,
                          preferred_element_type=self.preferred_element_type)
        if bias is not None:
            y += jnp.reshape(bias, (*expanded_batch_shape, *self.out_features))
        return y
