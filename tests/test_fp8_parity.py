"""FP8 delayed scaling against Flax's own `flax.linen.fp8_ops.Fp8DotGeneralOp`, step for step.

The same stream of activations and output gradients (with spikes, drops, +-Inf and NaN) goes through
``nn.Dense(dot_general_cls=Fp8DotGeneralOp)`` and through ``nn.Dense(dot_general_cls=quant_dot_general_cls(
qat.fp8_delayed(convention="flax")))``: outputs, gradients, scales and all three amax histories (inputs, kernel,
output gradients) are bit-identical at every step. The one documented difference is the non-finite policy: where an
input or gradient element is +-Inf, Flax clips it to +-fp8_max * scale (a finite value) and we pass it through, so
exactly the output rows / gradient rows and columns that element touches differ (finite there in Flax, non-finite
here); everything else, and every history, stays identical. Flax's amax reduction (`jnp.max`) keeps a NaN for
these small tensors on XLA:CPU (it can drop one above ~4096 elements); ours always does.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax.linen import fp8_ops

from jaxlowfp import qlinen as jlinen
from jaxlowfp import qat, scaling

pytestmark = pytest.mark.filterwarnings("ignore:The Fp8DotGeneralOp is deprecated:DeprecationWarning")

L = 16  # history length: the non-finite amaxes leave the window within the run, so the frozen scales thaw
B, K, M = 8, 32, 16
STEPS = 64
LR = np.float32(0.05)
OWG = fp8_ops.OVERWRITE_WITH_GRADIENT

# step -> what happens to the activation x or the output gradient g
X_SCALE = {5: 1e3, 6: 1e3, 30: 1e-3, 50: 300.0}
G_SCALE = {12: 1e4, 13: 1e-4, 55: 1e-2}
X_POISON = {20: np.inf, 36: np.nan}  # one element of x, at (2, 5)
G_POISON = {27: -np.inf, 44: np.nan}  # one element of g, at (1, 3)
XI, GI = (2, 5), (1, 3)


def stream(t: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + t)
    x = (rng.standard_normal((B, K)) * X_SCALE.get(t, 1.0)).astype(np.float32)
    g = (rng.standard_normal((B, M)) * 1e-2 * G_SCALE.get(t, 1.0)).astype(np.float32)
    if t in X_POISON:
        x[XI] = X_POISON[t]
    if t in G_POISON:
        g[GI] = G_POISON[t]
    return x, g


def flax_layout(h: scaling.AmaxHistory) -> np.ndarray:
    """Our ring buffer (amax k in slot k % L) in Flax's order: slot 0 the newest, then oldest to newest-but-one
    (``jnp.roll(h, -1).at[0].set(a)`` each step); unwritten slots 0."""
    hist, c = np.asarray(h.history), int(h.count)
    n = hist.shape[0]
    out = np.zeros(n, np.float32)
    for k in range(min(c, n)):  # the k-th newest amax, recorded as number c - 1 - k
        out[0 if k == 0 else n - k] = hist[(c - 1 - k) % n]
    return out


def bits(a) -> np.ndarray:
    a = np.asarray(a, np.float32)
    return np.where(np.isnan(a), np.uint32(0x7FC00000), a.view(np.uint32))  # any NaN equals any NaN


def assert_identical(ours, theirs, what: str, differ: np.ndarray | None = None, nan: bool = False):
    """Bit-identical outside `differ`; inside it ours is non-finite, theirs finite (Inf clipped by Flax) or, with
    `nan`, NaN in both."""
    o, f = np.asarray(ours), np.asarray(theirs)
    assert o.shape == f.shape and o.dtype == f.dtype, (what, o.shape, f.shape, o.dtype, f.dtype)
    same = np.ones(o.shape, bool) if differ is None else ~differ
    bad = (bits(o) != bits(f)) & same
    assert not bad.any(), f"{what}: {bad.sum()} elements differ, e.g. ours {o[bad][:4]} flax {f[bad][:4]}"
    if differ is not None:
        assert not np.isfinite(o[differ]).any(), f"{what}: expected non-finite where the Inf/NaN reaches"
        assert (np.isnan(f[differ]).all() if nan else np.isfinite(f[differ]).all()), what


def dense(cls) -> nn.Dense:
    return nn.Dense(M, dot_general_cls=cls)


@pytest.fixture(scope="module")
def run():
    """Both models over the stream; per step, everything there is to compare."""
    flax_model = dense(functools.partial(fp8_ops.Fp8DotGeneralOp, amax_history_length=L))  # "deprecated", shipped
    fv = flax_model.init(jax.random.key(0), jnp.zeros((B, K)))
    recipe = qat.fp8_delayed(history_len=L, convention="flax")
    our_model = dense(jlinen.quant_dot_general_cls(recipe))
    ov = our_model.init(jax.random.key(0), jnp.zeros((B, K)))
    params = fv["params"]
    owg = fv[OWG]
    amax = ov[jlinen.AMAX_COLLECTION]
    our_params = params

    @jax.jit
    def flax_step(params, owg, x, g):
        y, vjp = jax.vjp(lambda p, o, a: flax_model.apply({"params": p, OWG: o}, a), params, owg, x)
        dp, new_owg, dx = vjp(g)
        return y, dp, dx, new_owg

    @jax.jit
    def our_step(params, amax, x, g):
        def f(p, pend, a):
            v = {"params": p, jlinen.AMAX_COLLECTION: scaling.with_pending_amaxes(amax, pend),
                 jlinen.PHASE_COLLECTION: ov[jlinen.PHASE_COLLECTION]}
            y, upd = our_model.apply(v, a, mutable=[jlinen.AMAX_COLLECTION, jlinen.STATS_COLLECTION])
            return y, upd

        y, vjp, upd = jax.vjp(f, params, scaling.pending_amaxes(amax), x, has_aux=True)
        dp, reported, dx = vjp(g)
        return y, dp, dx, scaling.with_pending_amaxes(upd[jlinen.AMAX_COLLECTION], reported), \
            upd[jlinen.STATS_COLLECTION]

    steps = []
    for t in range(STEPS):
        x, g = stream(t)
        fy, fdp, fdx, owg = flax_step(params, owg, x, g)
        oy, odp, odx, amax, stats = our_step(our_params, amax, x, g)
        steps.append(dict(t=t, fy=fy, fdp=fdp, fdx=fdx, owg=owg, oy=oy, odp=odp, odx=odx, amax=amax, stats=stats))
        if t not in X_POISON and t not in G_POISON:  # a non-finite step updates no weights (on either side)
            params = jax.tree.map(lambda p, d: p - LR * d, params, fdp)
            our_params = jax.tree.map(lambda p, d: p - LR * d, our_params, odp)
    return recipe, steps


def _ours_state(s) -> qat.RecipeState:
    return s["amax"]["QuantDotGeneral_0"]["recipe_state"]


def test_outputs_and_gradients_bit_identical(run):
    _, steps = run
    for s in steps:
        t = s["t"]
        y_rows = w_rows = dx_rows = w_cols = None
        nan = t in (36, 44)
        if t in X_POISON:  # the element of x reaches its output row and its kernel-gradient row
            y_rows = np.zeros((B, M), bool)
            y_rows[XI[0]] = True
            w_rows = np.zeros((K, M), bool)
            w_rows[XI[1]] = True
        if t in G_POISON:  # the element of g reaches its dx row and its kernel-gradient column
            dx_rows = np.zeros((B, K), bool)
            dx_rows[GI[0]] = True
            w_cols = np.zeros((K, M), bool)
            w_cols[:, GI[1]] = True
        assert_identical(s["oy"], s["fy"], f"step {t} output", y_rows, nan)
        assert_identical(s["odx"], s["fdx"], f"step {t} input gradient", dx_rows, nan)
        assert_identical(s["odp"]["kernel"], s["fdp"]["kernel"], f"step {t} kernel gradient",
                         w_rows if w_rows is not None else w_cols, nan)
        assert_identical(s["odp"]["bias"], s["fdp"]["bias"], f"step {t} bias gradient")  # high precision: equal
    # The stream did what it says: the Inf steps really differ, and the spikes really saturated or froze scales.
    assert np.isfinite(np.asarray(steps[20]["fy"])).all() and not np.isfinite(np.asarray(steps[20]["oy"])).all()


def test_histories_and_scales_bit_identical(run):
    recipe, steps = run
    frozen = 0
    for s in steps:
        t, owg, st = s["t"], s["owg"]["Fp8DotGeneralOp_0"], _ours_state(s)
        assert_identical(flax_layout(st.activation), owg["input_amax_history"], f"step {t} input history")
        assert_identical(flax_layout(st.weight), owg["kernel_amax_history"], f"step {t} kernel history")
        # The output gradient's amax is still pending (recorded by the next forward pass): record it to compare.
        grad = scaling.record_pending(recipe.grad.scaling, st.grad, st.grad_pending)
        assert_identical(flax_layout(grad), owg["output_grad_amax_history"], f"step {t} output-gradient history")
        stats = s["stats"]["QuantDotGeneral_0"]["stats"]
        assert_identical(stats.activation.scale.reshape(1), owg["input_scale"], f"step {t} input scale")
        assert_identical(stats.weight.scale.reshape(1), owg["kernel_scale"], f"step {t} kernel scale")
        assert_identical(recipe.grad.scaling.scale(grad.estimate).reshape(1), owg["output_grad_scale"],
                         f"step {t} output-gradient scale")
        frozen += int(not np.isfinite(np.max(np.asarray(owg["input_amax_history"]))))
    # Flax's initial scale 1 at step 0, and a stretch of steps whose window held a non-finite amax (scale frozen).
    assert float(steps[0]["owg"]["Fp8DotGeneralOp_0"]["input_scale"][0]) == 1.0
    assert frozen == 2 * L
    assert int(_ours_state(steps[-1]).activation.nonfinite) == 2


def test_default_convention_differs_exactly_where_documented(run):
    """Our default convention on the same first steps: the first step uses the current amax (Flax: scale 1) and
    the scale is one rounding ``est / fp8_max`` (Flax: ``1 / (fp8_max / est)``)."""
    recipe, steps = run
    st = _ours_state(steps[0])
    default = qat.fp8_delayed(history_len=L).activation.scaling
    x0, _ = stream(0)
    a0 = np.float32(np.max(np.abs(x0)))
    assert float(default.scale(default.amax_estimate(default.init(), a0))) == a0 / np.float32(448.0)
    assert float(recipe.activation.scaling.scale(recipe.activation.scaling.amax_estimate(
        recipe.activation.scaling.init(), a0))) == 1.0
    est = np.float32(np.asarray(st.activation.history)[0])
    one_rounding = est / np.float32(448.0)
    two_roundings = np.float32(1.0) / (np.float32(448.0) / est)
    assert float(default.scale(est)) == one_rounding
    assert float(recipe.activation.scaling.scale(est)) == two_roundings


# ------------------------------------------------------------------------------------------ Transformer Engine


class TEDelayedScaling:
    """Transformer Engine JAX's ``DelayedScaleQuantizer`` and ``compute_scale_from_amax`` (transformer_engine/jax/
    quantize/quantizer.py), transcribed in numpy float32: TE is not installable without CUDA. Its ``scale`` is
    the quantization multiplier; the dequant multiplier is ``scale_inv = 1 / scale``."""

    def __init__(self, q_dtype, history_len: int, margin: int, algo: str):
        self.q_dtype, self.margin, self.algo = q_dtype, margin, algo
        self.scale = np.float32(1.0)
        self.amax_history = np.zeros(history_len, np.float32)

    def quantize(self, x: np.ndarray) -> tuple[np.ndarray, np.float32]:
        fp8_max = np.float32(ml_dtypes.finfo(self.q_dtype).max)
        with np.errstate(invalid="ignore", over="ignore"):
            q = np.clip(x.astype(np.float32) * self.scale, -fp8_max, fp8_max).astype(self.q_dtype)
        scale_inv = np.float32(1.0) / self.scale
        used = self.scale
        self.update(np.float32(np.max(np.abs(x))) if not np.isnan(x).any() else np.float32(np.nan))
        return q.astype(np.float32) * scale_inv, used

    def update(self, new_amax: np.float32) -> None:
        h = self.amax_history.copy()
        h[0] = new_amax
        amax = np.max(h) if self.algo == "max" else h[0]  # np.max propagates NaN
        fp8_max = np.float32(ml_dtypes.finfo(self.q_dtype).max)
        with np.errstate(divide="ignore", invalid="ignore"):
            sf = (fp8_max / amax) / np.float32(2**self.margin)
        sf = sf if amax > 0 else self.scale
        self.scale = np.float32(sf if np.isfinite(amax) else self.scale)
        self.amax_history = np.roll(h, -1)
        self.amax_history[0] = 0.0


@pytest.mark.parametrize("algorithm, te_algo, margin", [("max_window", "max", 0), ("most_recent", "most_recent", 2)])
@pytest.mark.parametrize("fmt, q_dtype", [("e4m3", ml_dtypes.float8_e4m3fn), ("e5m2", ml_dtypes.float8_e5m2)])
def test_te_convention_matches_transformer_engine_update_rule(algorithm, te_algo, margin, fmt, q_dtype):
    """convention="te": the fake-quantized values and TE's quantization scale, step by step, over a stream with
    spikes, a zero tensor, an Inf and a NaN (the NaN is the one element that stays NaN in TE as in ours; an Inf is
    clipped by TE and passed through by us, so that element is left out)."""
    te = TEDelayedScaling(q_dtype, history_len=8, margin=margin, algo=te_algo)
    fmax = float(ml_dtypes.finfo(q_dtype).max)
    spec = qat.QuantSpec(format=fmt, clip="format", scaling=scaling.DelayedScaling(
        algorithm=algorithm, history_len=8, target_max=fmax, margin=margin, convention="te"))
    fq = jax.jit(lambda x, st: qat.fake_quant(x, st, spec))
    state = spec.init()
    for t in range(30):
        rng = np.random.default_rng(t)
        x = (rng.standard_normal(300) * {3: 1e4, 4: 1e-5, 9: 0.0, 17: 50.0}.get(t, 1.0)).astype(np.float32)
        if t == 11:
            x[7] = np.inf
        if t == 20:
            x[8] = np.nan
        want, sf = te.quantize(x)
        y, state, stats = fq(x, state)
        keep = np.isfinite(x)
        np.testing.assert_array_equal(bits(np.asarray(y)[keep]), bits(want[keep]), err_msg=f"step {t}")
        assert np.float32(spec.scaling.multiplier(stats.amax_estimate)) == sf, t
        assert np.float32(stats.scale) == np.float32(1.0) / sf, t
        assert not np.isfinite(np.asarray(y)[~keep]).any()


def test_te_multiplies_and_flax_divides():
    """The two conventions share every scale and history, and differ in one rounding: TE quantizes ``x * sf``,
    Flax ``x / (1 / sf)``. Values where that rounding crosses an E4M3 tie tell them apart (numpy references)."""
    est = np.float32(2.5234003)
    sf = np.float32(448.0) / est
    s = np.float32(1.0) / sf
    # x within a few ulps of the E4M3 ties in [1, 2) divided by sf: the two products can land on either side
    base = (np.float32(1) + (2 * np.arange(8, dtype=np.float32) + 1) / np.float32(16)) / sf
    xs = (base[:, None] + np.arange(-4, 5, dtype=np.float32) * np.spacing(base)[:, None]).astype(np.float32).ravel()
    te = (np.clip(xs * sf, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s)
    fx = (np.clip(xs / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * s)
    assert (te != fx).any()  # the references themselves differ on some of these x
    for conv, want in (("te", te), ("flax", fx)):
        spec = qat.QuantSpec(format="e4m3", clip="format", scaling=scaling.DelayedScaling(
            history_len=1, target_max=448.0, convention=conv))
        state = spec.scaling.update(spec.init(), est)  # the window now holds est
        y, _, _ = qat.fake_quant(jnp.asarray(xs), state, spec)
        np.testing.assert_array_equal(np.asarray(y), want, err_msg=conv)


def _dot_precisions(fn, *args) -> set[str]:
    """The precisions of every dot_general in the jaxpr of `fn` (sub-jaxprs included); None counts as DEFAULT."""
    from jax.extend import core

    found = set()

    def walk(j):
        for e in j.eqns:
            if e.primitive.name == "dot_general":
                p = e.params["precision"]
                p = p[0] if isinstance(p, tuple) else p
                found.add("DEFAULT" if p is None else p.name)
            for v in e.params.values():
                for sub in v if isinstance(v, (list, tuple)) else [v]:
                    if isinstance(sub, (core.ClosedJaxpr, core.Jaxpr)):
                        walk(sub.jaxpr if isinstance(sub, core.ClosedJaxpr) else sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_flax_convention_runs_the_backward_gemms_at_highest_as_flax_does():
    """Fp8DotGeneralOp's forward GEMM runs at DEFAULT and its backward GEMMs at HIGHEST. On CPU the two agree for
    float32; on GPUs DEFAULT may mean TF32, so convention="flax" uses the same precisions (checked on the jaxprs)."""
    x, g = jnp.ones((4, 8)), jnp.ones((4, 3))
    fm = nn.Dense(3, dot_general_cls=fp8_ops.Fp8DotGeneralOp)
    fv = fm.init(jax.random.key(0), x)

    def flax_grads(p, o, a, c):
        return jax.vjp(lambda p, o, a: fm.apply({"params": p, OWG: o}, a), p, o, a)[1](c)

    def ours(conv):
        om = nn.Dense(3, dot_general_cls=jlinen.quant_dot_general_cls(qat.fp8_delayed(convention=conv)))
        ov = om.init(jax.random.key(0), x)
        return _dot_precisions(lambda p, a, c: jax.vjp(lambda p, a: om.apply({**ov, "params": p}, a), p, a)[1](c),
                               ov["params"], x, g)

    theirs = _dot_precisions(flax_grads, fv["params"], fv[OWG], x, g)
    assert theirs == {"DEFAULT", "HIGHEST"}
    assert ours("flax") == theirs
    assert ours("te") == {"DEFAULT"}  # TE's GEMMs are its own; "te" leaves the caller's precision
