"""jaxlowfp.scaling: estimates against hand-computed sequences, delay semantics, merge, state I/O, validation."""
import dataclasses
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlowfp import scaling
from jaxlowfp.scaling import AmaxHistory, CurrentScaling, DelayedScaling

NAN, INF = float("nan"), float("inf")

# One stream with a spike (8), a decay, a NaN and an Inf step, and more recorded steps than the window (L = 3),
# so the ring buffer wraps twice. ema_decay 0.5 keeps every EMA exact in binary.
STREAM = [2.0, 8.0, 1.0, NAN, 4.0, INF, 3.0, 1.0, 1.0, 1.0, 5.0]
# Estimate used at each step, worked out by hand (recorded so far: 2 | 2 8 | 2 8 1 | (NaN skipped) | 2 8 1 4 | ...)
HAND = {
    "most_recent": [2, 2, 8, 1, 1, 4, 4, 3, 1, 1, 1],
    "max_window": [2, 2, 8, 8, 8, 8, 8, 4, 4, 3, 1],  # the spike 8 leaves the 3-step window at step 7
    "max": [2, 2, 8, 8, 8, 8, 8, 8, 8, 8, 8],  # never forgets it
    "ema": [2, 2, 5, 3, 3, 3.5, 3.5, 3.25, 2.125, 1.5625, 1.28125],
}


def _run(s, stream):
    st, est = s.init(), []
    for a in stream:
        est.append(float(s.amax_estimate(st, jnp.float32(a))))
        st = s.update(st, jnp.float32(a))
    return est, st


@pytest.mark.parametrize("algorithm", list(HAND))
def test_estimates_match_hand_computed_sequence(algorithm):
    s = DelayedScaling(algorithm=algorithm, history_len=3, target_max=15.0, ema_decay=0.5)
    est, st = _run(s, STREAM)
    assert est == HAND[algorithm]
    # Recorded (finite) amaxes: 2 8 1 4 3 1 1 1 5 -> 9 of them; slots k % 3 hold the last three: 1 1 5.
    np.testing.assert_array_equal(np.asarray(st.history), [1.0, 1.0, 5.0])
    assert int(st.count) == 9 and int(st.nonfinite) == 2 and int(st.version) == scaling.SCHEMA_VERSION
    assert float(st.peak) == 8.0
    assert float(st.estimate) == HAND[algorithm][-1]  # the estimate used by the last step
    assert float(st.ema) == 0.5 * 1.28125 + 0.5 * 5.0


def test_ema_matches_float64_reference_with_default_decay():
    rng = np.random.default_rng(0)
    stream = rng.uniform(0.5, 4.0, 40).astype(np.float32)
    s = DelayedScaling(algorithm="ema", target_max=15.0)  # ema_decay 0.9
    est, _ = _run(s, stream)
    ref, e = [float(stream[0])], float(stream[0])
    for a in stream[1:]:
        ref.append(e)
        e = 0.9 * e + 0.1 * float(a)
    np.testing.assert_allclose(est, ref, rtol=2e-6)


def test_empty_history_falls_back_to_current_amax_with_margin():
    s = DelayedScaling(algorithm="max_window", target_max=15.0, margin=2.0)
    st = s.init()
    assert float(s.amax_estimate(st, jnp.float32(3.0))) == 12.0
    st = s.update(st, jnp.float32(3.0))
    assert float(st.estimate) == 12.0
    assert float(s.amax_estimate(st, jnp.float32(100.0))) == 12.0  # from the history now, times 2^2
    # A NaN first step: nothing recorded, the fallback is NaN, and the guarded scale is 1.
    st = s.update(s.init(), jnp.float32(NAN))
    assert int(st.count) == 0 and int(st.nonfinite) == 1
    assert float(s.amax_estimate(st, jnp.float32(5.0))) == 20.0
    assert float(s.scale(s.amax_estimate(s.init(), jnp.float32(NAN)))) == 1.0


@pytest.mark.parametrize("algorithm", scaling.ALGORITHMS)
def test_one_step_delay(algorithm):
    """The estimate at step t does not depend on a_t once something was recorded, and a_t is used at t + 1."""
    s = DelayedScaling(algorithm=algorithm, history_len=4, target_max=15.0)
    st = s.update(s.init(), jnp.float32(2.0))
    e_small = s.amax_estimate(st, jnp.float32(0.5))
    e_big = s.amax_estimate(st, jnp.float32(1000.0))
    assert float(e_small) == float(e_big) == 2.0
    st = s.update(st, jnp.float32(1000.0))
    assert float(s.amax_estimate(st, jnp.float32(0.0))) > 2.0


def test_scale_is_ieee_division_under_jit_and_vmap():
    rng = np.random.default_rng(1)
    est = (rng.random(4096) * 1000 + 1e-3).astype(np.float32)
    s = DelayedScaling(target_max=15.0)
    ref = est / np.float32(15.0)  # numpy float32 division is correctly rounded
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(s.scale))(est)), ref)
    np.testing.assert_array_equal(np.asarray(jax.vmap(jax.vmap(s.scale))(est.reshape(64, 64))), ref.reshape(64, 64))
    for e in est[:16]:
        assert np.float32(jax.jit(s.scale)(e)) == e / np.float32(15.0)
    # Guard: 0, NaN, Inf give 1; no gradient flows through the scale.
    np.testing.assert_array_equal(np.asarray(s.scale(jnp.array([0.0, NAN, INF, -INF], jnp.float32))), 1.0)
    assert float(jax.grad(lambda e: s.scale(e))(jnp.float32(3.0))) == 0.0


def test_current_scaling_uses_current_amax_and_counts_nonfinite():
    s = CurrentScaling(target_max=15.0)
    st = s.init()
    est, st = _run(s, [3.0, INF, 30.0])
    assert est == [3.0, INF, 30.0]
    assert int(st.count) == 2 and int(st.nonfinite) == 1 and float(st.history[0]) == 30.0
    assert float(s.scale(jnp.float32(30.0))) == 2.0


def _states(s, amaxes, base=None):
    base = s.init() if base is None else base
    return [s.update(base, jnp.float32(a)) for a in amaxes]


def test_merge_is_slotwise_max_and_idempotent():
    s = DelayedScaling(algorithm="max_window", history_len=3, target_max=15.0, ema_decay=0.5)
    _, base = _run(s, [2.0, 8.0, 1.0, 4.0])  # slots [4, 8, 1], count 4; next write goes to slot 1
    micro = _states(s, [3.0, 6.0, 5.0], base)
    m = scaling.merge(micro)
    np.testing.assert_array_equal(np.asarray(m.history), [4.0, 6.0, 1.0])
    assert int(m.count) == 5 and float(m.peak) == 8.0
    # One step over the whole batch records max(3, 6, 5) = 6: the same state, EMA included.
    one = s.update(base, jnp.float32(6.0))
    chex.assert_trees_all_equal(m, one)
    # List, tuple and stacked pytree give the same; merging copies of one state changes nothing.
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *micro)
    chex.assert_trees_all_equal(scaling.merge(tuple(micro)), m, scaling.merge(stacked), jax.jit(scaling.merge)(micro))
    chex.assert_trees_all_equal(scaling.merge([one, one]), one)


def test_merge_masks_slots_a_nonfinite_replica_did_not_write():
    s = DelayedScaling(algorithm="max_window", history_len=3, target_max=15.0)
    _, base = _run(s, [9.0, 1.0, 1.0])  # slots [9, 1, 1], count 3: slot 0 (the 9) is overwritten next
    m = scaling.merge(_states(s, [2.0, NAN], base))
    # Replica 2 skipped the step, so its slot 0 still holds the 9 from 3 steps ago: outside the window.
    np.testing.assert_array_equal(np.asarray(m.history), [2.0, 1.0, 1.0])
    assert int(m.count) == 4 and int(m.nonfinite) == 1
    assert float(s.amax_estimate(m, jnp.float32(0.0))) == 2.0
    # If every replica skipped it, nothing changes but the counter.
    m = scaling.merge(_states(s, [NAN, INF], base))
    np.testing.assert_array_equal(np.asarray(m.history), [9.0, 1.0, 1.0])
    assert int(m.count) == 3 and int(m.nonfinite) == 1


def test_merge_nested_pytree_and_merge_across():
    s = DelayedScaling(history_len=4, target_max=15.0)
    c = CurrentScaling(target_max=15.0)
    trees = [{"a": s.update(s.init(), jnp.float32(a)), "b": c.update(c.init(), jnp.float32(-a + 10)), "none": None}
             for a in (1.0, 7.0, 3.0)]
    m = scaling.merge(trees)
    assert m["none"] is None
    assert float(m["a"].history[0]) == 7.0 and float(m["b"].history[0]) == 9.0
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
    across = jax.vmap(lambda t: scaling.merge_across(t, "r"), axis_name="r")(stacked)
    chex.assert_trees_all_equal(jax.tree.map(lambda x: x[1], across), m)
    with pytest.raises(ValueError, match="different pytree structure"):
        scaling.merge([trees[0], {"a": trees[0]["a"]}])
    with pytest.raises(ValueError, match="at least one"):
        scaling.merge([])


def test_scan_over_microbatches_with_merge_equals_one_big_batch():
    """lax.scan over steps, vmap over microbatches inside, merge after: the history is the big batch's."""
    s = DelayedScaling(algorithm="max_window", history_len=4, target_max=15.0)
    rng = np.random.default_rng(2)
    amax = rng.uniform(0.5, 5.0, (6, 3)).astype(np.float32)  # 6 steps x 3 microbatches

    def step(st, a_micro):
        micro = jax.vmap(lambda a: s.update(st, a))(a_micro)
        return scaling.merge(micro), None

    merged, _ = jax.lax.scan(step, s.init(), jnp.asarray(amax))
    _, big = _run(s, amax.max(axis=1))
    chex.assert_trees_all_close(merged, big)


@pytest.mark.parametrize("algorithm", scaling.ALGORITHMS)
def test_no_retrace_when_state_values_change(algorithm):
    s = DelayedScaling(algorithm=algorithm, history_len=8, target_max=15.0)
    chex.clear_trace_counter()  # the counter is keyed by the function's code, shared by the parametrized cases

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(st, a):
        return s.update(st, a), s.scale(s.amax_estimate(st, a))

    st = s.init()
    for a in (1.0, NAN, 3.0, 2.0):
        st, _ = step(st, jnp.float32(a))
    # An equal configuration hashes equal, so a jitted function taking it as static does not retrace either.
    assert hash(s) == hash(DelayedScaling(algorithm=algorithm, history_len=8, target_max=15))


def test_orbax_round_trip(tmp_path):
    import orbax.checkpoint as ocp

    s = DelayedScaling(algorithm="max_window", history_len=5, target_max=15.0)
    _, st = _run(s, [1.5, NAN, 3.25, 0.0, 7.0, 2.0, 1.0])
    tree = {"layer0": st, "layer1": CurrentScaling(target_max=224.0).update(CurrentScaling(target_max=224.0).init(),
                                                                            jnp.float32(5.0))}
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "state", tree)
        ckpt.wait_until_finished()
        restored = ckpt.restore(tmp_path / "state", jax.tree.map(ocp.utils.to_shape_dtype_struct, tree))
    assert isinstance(restored["layer0"], AmaxHistory)
    chex.assert_trees_all_equal(restored, tree)
    chex.assert_trees_all_equal_dtypes(restored, tree)
    scaling.check_version(restored)


def test_check_version_rejects_other_schema():
    st = DelayedScaling(target_max=15.0).init()._replace(version=jnp.int32(99))
    with pytest.raises(ValueError, match="schema version"):
        scaling.check_version({"x": st})


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(algorithm="hysteresis", target_max=15.0), ValueError, "algorithm"),
        (dict(history_len=0, target_max=15.0), ValueError, "history_len"),
        (dict(history_len=2.5, target_max=15.0), TypeError, "history_len"),
        (dict(history_len=True, target_max=15.0), TypeError, "history_len"),
        (dict(target_max=0.0), ValueError, "target_max"),
        (dict(target_max=-1.0), ValueError, "target_max"),
        (dict(target_max=math.inf), ValueError, "target_max"),
        (dict(target_max=math.nan), ValueError, "target_max"),
        (dict(target_max="15"), TypeError, "target_max"),
        (dict(target_max=15.0, margin=-1.0), ValueError, "margin"),
        (dict(target_max=15.0, margin=math.inf), ValueError, "margin"),
        (dict(target_max=15.0, ema_decay=1.0), ValueError, "ema_decay"),
        (dict(target_max=15.0, ema_decay=0.0), ValueError, "ema_decay"),
        (dict(target_max=15.0, ema_decay=-0.5), ValueError, "ema_decay"),
        (dict(target_max=15.0, convention="transformer_engine"), ValueError, "convention"),
        (dict(target_max=15.0, convention="te", algorithm="ema"), ValueError, "most_recent"),
        (dict(target_max=15.0, convention="flax", margin=0.5), ValueError, "integer margin"),
    ],
)
def test_bad_configuration_raises_at_construction(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        DelayedScaling(**kwargs)


# Conventions "te" / "flax": window over the whole buffer (empty slots 0), scale 1 until something finite and > 0
# is in the window, scale = 1 / (448 / est), non-finite amaxes recorded and freezing the estimate.
TE_STREAM = [0.0, 2.0, INF, 3.0, 1.0, 0.5, NAN, 4.0]
TE_HAND = {  # estimate used at each step (0 = none yet: scale 1), L = 2, margin 0 and 1
    ("max_window", 0): [0, 0, 2, 2, 2, 3, 1, 1],  # Inf in the window at steps 3, 4; NaN at 7: frozen
    ("most_recent", 0): [0, 0, 2, 2, 3, 1, 0.5, 0.5],
    ("max_window", 1): [0, 0, 4, 4, 4, 6, 2, 2],
}


@pytest.mark.parametrize("algorithm, margin", list(TE_HAND))
@pytest.mark.parametrize("convention", ["te", "flax"])
def test_te_convention_estimates_scales_and_recording(algorithm, margin, convention):
    s = DelayedScaling(algorithm=algorithm, history_len=2, target_max=448.0, margin=margin, convention=convention)
    est, st = _run(s, TE_STREAM)
    assert est == TE_HAND[(algorithm, margin)]
    for e in est:
        want = np.float32(1.0) if e == 0 else np.float32(1.0) / (np.float32(448.0) / np.float32(e))
        assert float(s.scale(jnp.float32(e))) == want
        assert float(s.multiplier(jnp.float32(e))) == (1.0 if e == 0 else np.float32(448.0) / np.float32(e))
    assert int(st.count) == len(TE_STREAM) and int(st.nonfinite) == 2  # recorded and counted
    assert np.isnan(np.asarray(st.history)).sum() == 1  # the NaN is in the buffer
    assert float(st.peak) == 4.0  # peak and ema see finite amaxes only
    default = DelayedScaling(algorithm=algorithm, history_len=2, target_max=448.0, margin=margin)
    assert int(_run(default, TE_STREAM)[1].count) == len(TE_STREAM) - 2  # the default skips them


def test_pending_amax_record_and_merge():
    s = DelayedScaling(history_len=4, target_max=57344.0)
    st = s.update(s.init(), jnp.float32(2.0))
    P = scaling.PendingAmax
    chex.assert_trees_all_equal(scaling.record_pending(s, st, P.none()), st)  # nothing reported: unchanged
    chex.assert_trees_all_equal(scaling.record_pending(s, st, P(jnp.float32(1), jnp.float32(5.0))),
                                s.update(st, jnp.float32(5.0)))
    one = lambda seen, amax: P(jnp.float32(seen), jnp.float32(amax))  # noqa: E731
    m = scaling.merge([one(1, 2.0), one(0, 99.0), one(1, 5.0)])  # an unseen replica's value does not count
    assert float(m.seen) == 1 and float(m.amax) == 5.0
    assert np.isnan(float(scaling.merge([one(1, 2.0), one(1, NAN)]).amax))
    assert float(scaling.merge([one(0, 0.0), one(0, 0.0)]).seen) == 0
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), one(1, 2.0), one(0, 99.0), one(1, NAN))
    across = jax.vmap(lambda p: scaling.merge_across(p, "r"), axis_name="r")(stacked)
    assert np.isnan(np.asarray(across.amax)).all() and (np.asarray(across.seen) == 1).all()


def test_pending_amaxes_select_and_replace():
    from jaxlowfp import qat

    tree = {"a": qat.fp8_delayed(history_len=4).init(), "b": qat.hif8_w8a8().init(), "c": jnp.ones(3)}
    pend = scaling.pending_amaxes(tree)
    assert jax.tree.leaves(pend) == jax.tree.leaves(tree["a"].grad_pending)  # only the PendingAmax leaves
    new = scaling.with_pending_amaxes(tree, [scaling.PendingAmax(jnp.float32(1), jnp.float32(3.0))])
    assert float(new["a"].grad_pending.amax) == 3.0
    chex.assert_trees_all_equal(new["b"], tree["b"])
    with pytest.raises(ValueError, match="holds 1 PendingAmax, `pendings` 0"):
        scaling.with_pending_amaxes(tree, [])


def test_misuse_raises_clearly():
    with pytest.raises(TypeError):
        DelayedScaling(15.0)  # keyword-only
    with pytest.raises(ValueError, match="target_max"):
        CurrentScaling(target_max=0.0)
    s = DelayedScaling(history_len=4, target_max=15.0)
    with pytest.raises(ValueError, match="history_len=4"):
        s.amax_estimate(DelayedScaling(history_len=8, target_max=15.0).init(), jnp.float32(1.0))
    with pytest.raises(ValueError, match="scalar"):
        s.update(s.init(), jnp.ones(3))
    with pytest.raises(TypeError, match="floating"):
        s.update(s.init(), jnp.int32(3))
    with pytest.raises(TypeError, match="AmaxHistory"):
        s.update({"history": None}, jnp.float32(1.0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.history_len = 3


def test_docs_example_is_current():
    """docs/scaling.md's worked example: run its snippet and compare with the output printed in the doc."""
    import contextlib
    import io
    import pathlib
    import re

    doc = (pathlib.Path(__file__).parent.parent / "docs" / "scaling.md").read_text()
    code = re.search(r"<!-- snippet -->\s*```python\n(.*?)```", doc, re.S).group(1)
    expected = re.search(r"<!-- output -->\s*```text\n(.*?)```", doc, re.S).group(1)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, "docs/scaling.md", "exec"), {"__name__": "docs_scaling"})
    assert buf.getvalue().strip() == expected.strip()


def test_static_scaling_with_its_amax_in_the_state_quantizes_as_the_fixed_amax():
    """``StaticScaling(amax=None)``: the calibrated amax is the state's estimate (``calibrated(a)``), so specs of
    layers calibrated apart are equal; quantizing with it equals quantizing with ``StaticScaling(amax=a)`` (the
    same scale; two XLA programs, so within float32 rounding: a moved code would differ by a quantization step)."""
    from jaxlowfp import qat
    from jaxlowfp.scaling import StaticScaling

    a = 2.7
    fixed = qat.QuantSpec(format="nvfp4", scaling=StaticScaling(amax=a, target_max=6.0))
    carried = qat.QuantSpec(format="nvfp4", scaling=StaticScaling(amax=None, target_max=6.0))
    assert carried == qat.QuantSpec(format="nvfp4", scaling=StaticScaling(amax=None, target_max=6.0))
    state = carried.scaling.calibrated(a)
    assert float(state.estimate) == float(np.float32(a))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 64)) * 2, jnp.float32)  # some beyond a: clipped
    f = jax.jit(lambda x, s: qat.fake_quant(x, s, carried)[0])
    want = np.asarray(jax.jit(lambda x: qat.fake_quant(x, fixed.init(), fixed)[0])(x))
    np.testing.assert_allclose(np.asarray(f(x, state)), want, rtol=1e-6, atol=0)
    other = np.asarray(f(x, carried.scaling.calibrated(a / 2)))  # the state, not the spec, sets the scale
    assert np.max(np.abs(other - want)) > 0.1
    new = carried.scaling.update(state, jnp.float32(9.0))  # the amax seen is telemetry; the estimate stays
    assert float(new.estimate) == float(state.estimate) and float(new.history[0]) == 9.0
    with pytest.raises(ValueError, match="calibrated\\(\\) is for amax=None"):
        fixed.scaling.calibrated(a)
    with pytest.raises(ValueError, match="amax"):
        carried.scaling.calibrated(-1.0)
