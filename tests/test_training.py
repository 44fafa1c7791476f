"""`jaxlowfp.training`: the state from `init` can be donated to a jitted step; what microbatches record on a
quantized step whose amax history is still empty (the documented exception to "k microbatches = one big batch")."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from conftest import compiled
from flax import nnx

from jaxlowfp import qat, qnnx, training
from jaxlowfp.scaling import AmaxHistory


class Net(nnx.Module):
    def __init__(self, rngs):
        self.up_proj = nnx.Linear(16, 32, rngs=rngs)
        self.down_proj = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(nnx.relu(self.up_proj(x)))


def _loss(m, batch):
    return jnp.mean((m(batch) - batch) ** 2), {}


def _model():
    model = Net(nnx.Rngs(0))
    qnnx.quantize_model(model, [qnnx.Rule(path=".*", recipe=qat.hif8_w8a8())])
    return model


def _histories(qstate):
    return [h for h in jax.tree.leaves(qstate, is_leaf=lambda x: isinstance(x, AmaxHistory))
            if isinstance(h, AmaxHistory)]


def test_the_initial_state_can_be_donated():
    tx = optax.adam(1e-3)  # adam's state holds a count and two moments per parameter
    graphdef, state = training.init(_model(), tx)
    pointers = [p for x in jax.tree.leaves(state) for p in
                (s.data.unsafe_buffer_pointer() for s in x.addressable_shards)]
    assert len(pointers) == len(set(pointers)), "two leaves of the initial state share a buffer"
    step = jax.jit(training.make_step(graphdef, tx, _loss, warmup=qat.Warmup(steps=1)), donate_argnums=0)
    batch = jnp.asarray(np.random.default_rng(0).standard_normal((8, 16)), jnp.float32)
    old = jax.tree.leaves(state.params)[0]
    for _ in range(3):
        state, metrics = step(state, batch)
        assert bool(metrics["finite"])
    assert int(state.step) == 3 and old.is_deleted()  # donated: updated in place, not copied


def test_a_jitted_step_compiles_once(caplog):
    """`init` commits every leaf where the params are: its step counters and the optimizer's count were
    uncommitted, the step's outputs are committed, so the second call compiled the same program again (a tiny MoE's
    Four Over Six QAT step: 5.9 s more at -O0)."""
    import logging

    tx = optax.adam(1e-3)
    graphdef, state = training.init(_model(), tx)
    assert all(x.committed for x in jax.tree.leaves(state))
    step = jax.jit(training.make_step(graphdef, tx, _loss))
    batch = jnp.asarray(np.random.default_rng(0).standard_normal((8, 16)), jnp.float32)
    with caplog.at_level(logging.DEBUG), jax.log_compiles(True):
        for _ in range(3):
            state, _ = step(state, batch)
        jax.block_until_ready(state)
    assert len(runs := compiled(caplog, "jit(step_fn)")) == 1, runs


def test_an_empty_history_step_scales_each_microbatch_by_its_own_amax():
    """No warmup, so step 1 quantizes with an empty history: each microbatch's estimate is its own current amax.
    The merged record of the first layer (fed by the batch itself) is exactly the big batch's amax; the quantized
    outputs of that step differ from the big batch's (other scales); from step 2 on that layer quantizes with the
    same recorded estimate in both runs."""
    rng = np.random.default_rng(1)
    small, large = rng.uniform(-1, 1, (4, 16)), rng.uniform(-1, 1, (4, 16)) * 9.0
    batch = jnp.asarray(np.concatenate([small, large]), jnp.float32)  # microbatch amaxes about 1 and about 9
    tx = optax.sgd(0.0)  # no update: the same weights in both runs, so only the scales differ
    graphdef, state = training.init(_model(), tx)
    runs = {}
    for k in (1, 2):
        step = jax.jit(training.make_step(graphdef, tx, _loss, microbatches=k))
        runs[k] = step(state, batch)
    (big, big_metrics), (micro, micro_metrics) = runs[1], runs[2]
    # up_proj's histories (its weight and its input, the batch itself): max over microbatches = the big batch's,
    # bit for bit (a max of the same float32 values)
    amax = float(np.max(np.abs(np.asarray(batch))))
    h_big, h_micro = _histories(big.qstate["up_proj"]), _histories(micro.qstate["up_proj"])
    assert amax in {float(h.history[0]) for h in h_micro}
    for a, b in zip(h_big, h_micro):
        np.testing.assert_array_equal(np.asarray(b.history), np.asarray(a.history))
        assert int(a.count) == int(b.count) == 1
    # but on this step the microbatch of amax ~1 was quantized with its own scale: the losses differ
    assert float(big_metrics["loss"]) != float(micro_metrics["loss"])
