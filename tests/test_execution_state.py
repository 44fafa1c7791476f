"""The execution record is state of each op (issue 42, item 5): nothing process-specific in the graphdef, so two
identically built quantized models share one jit trace; each model's own call, and only it, marks its ops."""
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import compiled
from flax import nnx

from jaxlowfp import execution, ptq, qat, qnnx, training
from jaxlowfp.qat import gemm


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(32, 64, rngs=rngs)
        self.down = nnx.Linear(64, 32, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def _quantized(how):
    """An MLP quantized by QAT (hif8) or PTQ (NVFP4 weights and per-token activations); (model, report)."""
    model = MLP(nnx.Rngs(0))
    if how == "qat":
        return model, qnnx.quantize_model(model, [qnnx.Rule(path=".*", recipe=qat.hif8_w8a8())])
    res = ptq.quantize_model(model, [ptq.Rule(path=".*", scheme=ptq.scheme("nvfp4-mse"))], activation_scale="token")
    return model, res.report


def _x():
    return jnp.asarray(np.random.default_rng(0).standard_normal((4, 32)), jnp.float32)


@pytest.mark.parametrize("how", ["qat", "ptq"])
def test_two_identical_models_share_one_nnx_jit_trace(how):
    (a, _), (b, report_b), (c, report_c) = (_quantized(how) for _ in range(3))
    assert nnx.graphdef(a) == nnx.graphdef(b) and hash(nnx.graphdef(a)) == hash(nnx.graphdef(b))
    traces = []

    @nnx.jit
    def forward(model, x):
        traces.append(1)
        return model(x)

    forward(a, _x())
    assert {op.path for op in execution.quantized_ops(a) if op.executed} == {"up", "down"}
    assert set(report_b.not_executed()) == {"up", "down"}  # a's call is not b's
    with pytest.raises(RuntimeError, match="no quantized op of the model has executed yet"):
        execution.check_executed(b, strict=True)
    forward(b, _x())
    assert len(traces) == 1  # b ran a's trace
    assert set(report_b.executed()) == {"up", "down"} and report_b.not_executed() == ()
    assert execution.check_executed(b, strict=True) == ()
    for op in execution.quantized_ops(b):
        assert op.executed and op.backend == gemm.plan(_recipe(b, op.path)).backend
    assert report_c.executed() == ()  # never called: not executed, whatever ran the same trace
    with pytest.raises(RuntimeError, match=r"no quantized op of the model has executed yet"):
        execution.check_executed(c, strict=True)


@pytest.mark.parametrize("how", ["qat", "ptq", "packed"])
def test_a_quantized_models_second_nnx_jit_call_compiles_nothing(how, caplog):
    """A quantized op writes its record (a QAT op its amax history) in the forward, so ``nnx.jit`` hands back the
    model's whole state committed to its device; `quantize_model` and `pack_model` leave the state committed, so the
    first call lowers with the shardings of every later one and XLA compiles the program once (it compiled it again
    at the second call: a SmolLM2 forward with Four Over Six on every projection, 57 s at -O0 beside a training run)."""
    import logging

    if how == "packed":
        model = MLP(nnx.Rngs(0))
        res = ptq.quantize_model(model, [ptq.Rule(path=".*", scheme=ptq.scheme("nvfp4-mse"))],
                                 activation_scale="token")
        ptq.pack_model(model, res)
    else:
        model, _ = _quantized(how)
    assert all(x.committed for x in jax.tree.leaves(nnx.state(model)) if isinstance(x, jax.Array))
    forward = nnx.jit(lambda m, x: m(x))
    with caplog.at_level(logging.DEBUG), jax.log_compiles(True):
        for _ in range(3):
            jax.block_until_ready(forward(model, _x()))
    assert len(runs := compiled(caplog, "jit(<lambda>)")) == 1, runs


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_loaded_model_is_committed_where_it_is(family):
    """`models.load` hands back committed arrays, so a jitted forward of the loaded model is the program the same
    model runs after its state comes back from a jitted call (an evaluation, a step): one compile, not two."""
    from pathlib import Path

    from jaxlowfp.models import load

    model, _ = load(Path(__file__).parent / "fixtures" / "moe" / family)
    leaves = [x for x in jax.tree.leaves(nnx.state(model)) if isinstance(x, jax.Array)]
    assert leaves and all(x.committed for x in leaves)
    assert {d for x in leaves for d in x.devices()} == {jax.devices()[0]}


def test_calibration_compiles_one_step_for_uncommitted_and_committed_inputs(caplog):
    """`ptq.calibrate.collect` commits the model and each batch together: a batch made by `jnp.asarray` and one
    already on the device (as a block's output is, in sequential PTQ) run one compiled step."""
    import logging

    from jaxlowfp.ptq import calibrate

    model = MLP(nnx.Rngs(0))
    batches = [_x(), jax.device_put(_x() + 1.0, jax.devices()[0])]
    assert [b.committed for b in batches] == [False, True]
    with caplog.at_level(logging.DEBUG), jax.log_compiles(True):
        stats = calibrate.collect(model, ["up", "down"], batches, hessian=True)
    assert stats["up"].tokens == 8
    assert len(runs := compiled(caplog, "jit(_step)")) == 1, runs


def _recipe(model, path):
    mod = getattr(model, path)
    return mod.recipe if isinstance(mod, qnnx.QuantOp) else mod.dot_general.recipe


@pytest.mark.parametrize("how", ["qat", "ptq"])
def test_jax_jit_over_split_state_traces_once_and_returns_the_records(how):
    """Plain ``jax.jit`` with the graphdef static: one trace for both models; the records come back in the
    returned state, and only the model whose state is updated with it says executed."""
    (a, report_a), (b, report_b) = _quantized(how), _quantized(how)
    traces = []

    @functools.partial(jax.jit, static_argnums=0)
    def forward(graphdef, state, x):
        traces.append(1)
        model = nnx.merge(graphdef, state)
        return model(x), nnx.state(model)

    (ga, sa), (gb, sb) = nnx.split(a), nnx.split(b)
    assert ga == gb
    ya, new_a = forward(ga, sa, _x())
    yb, new_b = forward(gb, sb, _x())
    assert len(traces) == 1
    assert set(report_a.not_executed()) == {"up", "down"}  # the new state is not written back yet
    nnx.update(a, new_a)
    assert set(report_a.executed()) == {"up", "down"} and report_b.executed() == ()
    nnx.update(b, execution.records(nnx.merge(gb, new_b)))  # the records alone suffice
    assert set(report_b.executed()) == {"up", "down"}
    np.testing.assert_array_equal(np.asarray(ya), np.asarray(yb))  # one program, the same weights and input


def test_graphdef_holds_no_op_key():
    """Nothing in a quantized op's static attributes is process-unique: the record is a Variable (state)."""
    model, _ = _quantized("ptq")
    hook = model.up.dot_general
    assert isinstance(hook, ptq.ActQuant) and isinstance(hook.record, execution.ExecutionRecord)
    assert not hasattr(hook, "op_key") and not hasattr(_quantized("qat")[0].up, "op_key")
    state = nnx.state(model, execution.ExecutionRecord)
    assert sorted("/".join(map(str, p)) for p, _ in nnx.to_flat_state(state)) == [
        "down/dot_general/record", "up/dot_general/record"]


class DirectRead(nnx.Module):
    def __init__(self, rngs):
        self.qkv = nnx.Linear(32, 96, rngs=rngs)
        self.mlp = nnx.Linear(32, 32, rngs=rngs)

    def __call__(self, x):
        return self.mlp(x) + (x @ self.qkv.kernel[...])[..., :32]


def test_jitted_training_step_names_the_unused_layer_at_trace_time():
    """`make_step` under ``jax.jit``: the records come in traced; the check still tells the op this trace ran
    (mlp) from the one it did not (qkv), and the returned state records mlp only."""
    model = DirectRead(nnx.Rngs(0))
    qnnx.quantize_model(model, [qnnx.Rule(path=".*", recipe=qat.hif8_w8a8())])
    graphdef, state = training.init(model, optax.sgd(1e-3))
    step = jax.jit(training.make_step(graphdef, optax.sgd(1e-3), lambda m, b: jnp.mean(m(b) ** 2)))
    with pytest.warns(RuntimeWarning, match=r"\(qkv \(hif8_w8a8\)\): the model ran"):
        state, _ = step(state, jnp.ones((2, 8, 32), jnp.float32))
    trained = nnx.merge(graphdef, state.params, state.qstate, state.rest)
    assert {op.path: op.executed for op in execution.quantized_ops(trained)} == {"qkv": False, "mlp": True}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(state, jnp.ones((2, 8, 32), jnp.float32))  # cached: no new trace, no new warning


def test_shared_programs_need_no_key():
    """Identical quantized blocks: one graphdef for all (their ops differ in the static `path` name only), and the
    records a program returns land in the block whose state it ran on."""
    from jaxlowfp.models.llama import PRESETS, Llama

    model = Llama(PRESETS["tiny"], rngs=nnx.Rngs(0))
    qnnx.quantize_model(model, [qnnx.Rule(path=r"blocks/\d+/mlp/.*", recipe=qat.hif8_w8a8())])
    blocks = list(model.blocks)
    programs = execution.SharedPrograms(blocks)
    assert len(blocks) > 1 and all(g is programs.split[0][0] for g, _ in programs.split)
    g, s = programs.split[1]
    recs = jax.jit(lambda s, x: execution.records(_run(nnx.merge(g, s), x)))(
        s, jnp.ones((1, 4, PRESETS["tiny"].d_model), jnp.float32))
    programs.record(1, recs)
    ran = {op.path for op in execution.quantized_ops(model) if op.executed}
    assert ran == {f"blocks/1/mlp/{p}" for p in ("gate_proj", "up_proj", "down_proj")}


def _run(block, x):
    from jaxlowfp.models.llama import _ptq_block

    _ptq_block(block, x)
    return block


@pytest.mark.parametrize("scale", ["token", "static"])
def test_block_by_block_scoring_compiles_each_block_program_once(caplog, scale):
    """`evaluation.score_requests` runs identical quantized blocks through one program: compiled once per padded
    length, not once more for the first block (whose input, the embedding of host tokens, was uncommitted while
    every later block's was committed, so XLA compiled the same block program twice). With static activation scales
    each block is calibrated to its own amaxes, which are state (`ptq.layers.Calibration`), not part of the
    graphdef: still one program (it was one per block)."""
    import logging

    from jaxlowfp.evaluation import Request, score_requests
    from jaxlowfp.models.llama import PRESETS, Llama

    model = Llama(PRESETS["tiny"], rngs=nnx.Rngs(0))
    calib = np.random.default_rng(2).integers(0, 256, (4, 16)) if scale == "static" else None
    res = ptq.quantize_model(model, [ptq.Rule(path=r"blocks/\d+/mlp/\w+_proj", scheme=ptq.scheme("fp8"))],
                             calibration=calib, activation_scale=scale)
    if scale == "static":  # the blocks' calibrated amaxes differ: a key of the graphdef would split them
        amaxes = {round(res.act_amax[f"blocks/{i}/mlp/down_proj"], 6) for i in range(len(model.blocks))}
        assert len(amaxes) == len(model.blocks), res.act_amax
        assert model.blocks[1].mlp.down_proj.dot_general.amax == pytest.approx(res.act_amax["blocks/1/mlp/down_proj"])
    requests = [Request(tuple(range(1, 12)), n_pred=10)]
    with caplog.at_level(logging.DEBUG), jax.log_compiles(True):
        score_requests(model, requests, batch_size=2)
    assert len(runs := compiled(caplog, "jit(_block)")) == 1, runs
