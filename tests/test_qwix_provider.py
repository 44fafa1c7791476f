"""The Qwix provider (jaxlowfp.qwix_provider): Qwix's own quantize_model intercepts the model's matmuls and our
recipes quantize them. Judges: Qwix's interception and rule lookup (the real package, pinned), and our own
QuantLinear / qlinen path on the same model, which the provider must equal bit for bit."""
import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import qwix
from flax import nnx
from packaging.specifiers import SpecifierSet
from qwix._src import interception, qconfig
from qwix._src.utils import flax_util

from jaxlowfp import qat, qlinen, qnnx, qwix_provider, training
from jaxlowfp.qwix_provider import RecipeProvider, RecipeRule

HIF8 = qat.hif8_w8a8()
NVFP4 = qat.nvfp4_w4a4("mse")


def test_the_private_qwix_api_the_provider_relies_on():
    """An upgrade of Qwix that changes any of these fails here, not silently in a user's model."""
    assert SpecifierSet(qwix_provider.SUPPORTED_QWIX).contains(qwix.__version__)
    sig = inspect.signature(qconfig.QuantizationProvider._get_current_rule_and_op_id)
    assert list(sig.parameters) == ["self", "op_name", "only_rule", "repeated_call"]
    assert list(inspect.signature(qconfig.QuantizationProvider._init_rule).parameters) == ["self", "rule"]
    assert list(inspect.signature(qconfig.QuantizationProvider.__init__).parameters) == ["self", "rules",
                                                                                          "disable_jit"]
    assert "get_intercept_map" in vars(qconfig.QuantizationProvider)
    assert list(inspect.signature(flax_util.find_param).parameters) == ["x", "ptq_array_type"]
    assert callable(flax_util.get_current_module) and callable(flax_util.get_current_module_path)
    for name in ("jax.lax.dot_general", "jax.numpy.einsum"):
        assert interception.has_attribute(name)
    # the jitted jnp contractions the provider intercepts by name, `@`'s among them (array_methods calls
    # tensor_contractions.matmul by module attribute)
    for name in RecipeProvider([]).get_intercept_map():
        assert interception.has_attribute(name), name
    import jax._src.numpy.array_methods as am
    assert "tensor_contractions.matmul" in inspect.getsource(am._operator_matmul)
    fields = {f.name for f in qwix.QuantizationRule.__dataclass_fields__.values()}
    assert {"module_path", "op_names", "weight_qtype", "act_qtype", "tile_size"} <= fields


def test_rules_are_validated():
    with pytest.raises(TypeError, match="jaxlowfp.qat.Recipe"):
        RecipeRule(module_path="up", recipe="hif8")
    with pytest.raises(ValueError, match="weight_qtype"):
        RecipeRule(module_path="up", recipe=HIF8, weight_qtype=jnp.int8)
    with pytest.raises(ValueError, match=r"op_names \['conv_general_dilated'\]"):
        RecipeRule(module_path="up", recipe=HIF8, op_names=("conv_general_dilated",))
    with pytest.raises(ValueError, match="not a valid regular expression"):
        RecipeRule(module_path="up(", recipe=HIF8)
    with pytest.raises(TypeError, match="RecipeRule"):
        RecipeProvider([qwix.QtRule(module_path="up", weight_qtype=jnp.int8)])


class MLP(nnx.Module):
    def __init__(self, rngs, d=32, h=64):
        self.up = nnx.Linear(d, h, rngs=rngs)
        self.down = nnx.Linear(h, d, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


def _loss_fn(m, batch):
    return jnp.mean((m(batch[0]) - batch[1]) ** 2), {}


def _batch(n=8, d=32, seed=0):
    x = jax.random.normal(jax.random.key(seed), (n, d), jnp.float32)
    return x, jnp.sin(x)


def _train(model, steps, recipe_warmup=1, microbatches=1):
    tx = optax.adam(1e-2)
    graphdef, state = training.init(model, tx)
    step = jax.jit(training.make_step(graphdef, tx, _loss_fn, warmup=qat.Warmup(steps=recipe_warmup),
                                      microbatches=microbatches))
    out = []
    for i in range(steps):
        state, m = step(state, _batch(seed=i))
        out.append(float(m["loss"]))
    return state, out


def _histories(state):
    """{layer: RecipeState} of the amax histories, keyed by layer name (provider or QuantLinear path)."""
    out = {}
    for path, v in nnx.to_flat_state(state.qstate):
        out[path[0]] = v.get_value()
    return out


def _quantize_model(model, provider, *inputs):
    """qwix.quantize_model, its first call (which creates the provider's ops) under jit: Qwix makes that call
    eagerly, op by op, which costs seconds of dispatch per quantized model."""
    model = qwix.quantize_model(model, provider, *inputs, skip_nnx_init=True)
    nnx.jit(lambda m, *a: m(*a))(model, *inputs)
    return model


FP8 = qat.fp8_delayed(history_len=16)


def test_provider_equals_quant_linear_bit_for_bit():
    """One model, a recipe per layer: the provider hands an op its rule's recipe and runs it through the same
    QuantOp as QuantLinear, so recipes differ here only by what the op does with its format, not by path.
    up: NVFP4 4/6 (1x16 blocks along the contraction, current scaling); down: FP8 delayed, whose output-gradient
    history goes through the pending slot. HiF8 W8A8 through the provider is judged bit for bit by
    test_first_match_wins_none_keeps_and_op_names_filter (einsum) and test_linen_provider_equals_qlinen, and in a
    trained model by test_foreign_loop.py::test_mamba2_by_interception_equals_module_replacement."""
    x = _batch()[0]
    ours = MLP(nnx.Rngs(0))
    qnnx.quantize_model(ours, [qnnx.Rule(path="up", recipe=NVFP4), qnnx.Rule(path="down", recipe=FP8)])
    provider = RecipeProvider([RecipeRule(module_path="up", recipe=NVFP4), RecipeRule(module_path="down", recipe=FP8)])
    theirs = _quantize_model(MLP(nnx.Rngs(0)), provider, x)
    assert provider.get_unused_rules() == []
    ops = {p: op.recipe.name for p, op in qnnx.iter_quant_ops(theirs)}
    assert ops == {"down/jaxlowfp_dot_general0": "fp8_delayed", "up/jaxlowfp_dot_general0": "nvfp4_w4a4_mse"}
    # quantize_model's call: its histories recorded that call; ours has to see the same input
    nnx.jit(lambda m, x: m(x))(ours, x)
    s_ours, l_ours = _train(ours, 3)
    s_theirs, l_theirs = _train(theirs, 3)
    assert l_ours == l_theirs  # every step's loss, bit for bit (step 0 observe-only, then quantized)
    for a, b in zip(jax.tree.leaves(s_ours.params), jax.tree.leaves(s_theirs.params)):
        np.testing.assert_array_equal(a, b)  # parameters after 3 optimizer steps: same gradients
    h_ours, h_theirs = _histories(s_ours), _histories(s_theirs)
    for name in ("up", "down"):
        for a, b in zip(jax.tree.leaves(h_ours[name]), jax.tree.leaves(h_theirs[name])):
            np.testing.assert_array_equal(a, b)
    # the output-gradient history is fed through the pending slot, as a gradient
    assert int(h_theirs["down"].grad.count) >= 2


def test_first_match_wins_none_keeps_and_op_names_filter():
    class Mixed(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jax.random.normal(rngs.params(), (32, 16)) * 0.1)
            self.lin = nnx.Linear(16, 16, rngs=rngs)
            self.keep = nnx.Linear(16, 16, rngs=rngs)

        def __call__(self, x):
            h = jnp.einsum("btd,df->btf", x, self.w[...])
            return self.keep(self.lin(h))

    x = jax.random.normal(jax.random.key(1), (2, 3, 32))
    rules = [RecipeRule(module_path="keep", recipe=None),
             RecipeRule(module_path=".*", op_names=("einsum",), recipe=HIF8),
             RecipeRule(module_path="lin", op_names=("dot_general",), recipe=NVFP4),
             RecipeRule(module_path="nothing/here", recipe=HIF8)]
    provider = RecipeProvider(rules)
    model = _quantize_model(Mixed(nnx.Rngs(0)), provider, x)
    ops = {p: op.recipe.name for p, op in qnnx.iter_quant_ops(model)}
    assert ops == {"jaxlowfp_einsum0": "hif8_w8a8", "lin/jaxlowfp_dot_general0": "nvfp4_w4a4_mse"}
    assert [r.module_path for r in provider.get_unused_rules()] == ["nothing/here"]
    # the einsum (weight on the right, through the flattened GEMM) equals QuantEinsum on the same kernel
    qe = qnnx.QuantEinsum("btd,df->btf", (32, 16), recipe=HIF8, rngs=nnx.Rngs(5))
    qe.kernel.set_value(model.w[...])
    model.jaxlowfp_einsum0.amax.set_value(HIF8.init())
    got = jnp.einsum("btd,df->btf", x, model.w[...])  # outside the intercepted call: plain
    assert got.shape == (2, 3, 16)
    np.testing.assert_array_equal(qe(x), _intercepted_einsum(model, x))
    stats = qnnx.collect_stats(model)
    assert stats["jaxlowfp_einsum0/activation/amax"] == pytest.approx(float(jnp.max(jnp.abs(x))))
    assert qnnx.set_observe_only(model, True) == 2


def _intercepted_einsum(model, x):
    """The first op of Mixed.__call__, as the provider runs it (a fresh history, as qe has)."""
    h = model.jaxlowfp_einsum0.contract(x, model.w[...], (((2,), (0,)), ((), ())))
    return h


def test_two_activations_under_a_rule_is_an_error():
    class Attn(nnx.Module):
        def __init__(self, rngs):
            self.q = nnx.Linear(16, 16, rngs=rngs)

        def __call__(self, x):
            q = self.q(x)
            return jnp.einsum("bqd,bkd->bqk", q, x)

    with pytest.raises(ValueError, match="two activations"):
        qwix.quantize_model(Attn(nnx.Rngs(0)), RecipeProvider([RecipeRule(module_path="", recipe=HIF8)]),
                            jnp.ones((2, 4, 16)))


class LinenMLP(nn.Module):
    dot_general_cls: object = None

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(64, dot_general_cls=self.dot_general_cls, name="up")(x)
        return nn.Dense(32, dot_general_cls=self.dot_general_cls, name="down")(jax.nn.gelu(h))


@pytest.mark.parametrize("recipe", [HIF8, NVFP4], ids=["hif8_w8a8", "nvfp4_4over6"])
def test_linen_provider_equals_qlinen(recipe):
    x, tgt = _batch()
    provider = RecipeProvider([RecipeRule(module_path="up|down", recipe=recipe)])
    theirs = qwix.quantize_model(LinenMLP(), provider)
    ours = LinenMLP(dot_general_cls=qlinen.quant_dot_general_cls(recipe))
    v_t = theirs.init(jax.random.key(0), x)
    v_o = ours.init(jax.random.key(0), x)
    np.testing.assert_array_equal(v_t["params"]["up"]["kernel"], v_o["params"]["up"]["kernel"])

    def run(model, v):
        def loss(p):
            y, upd = model.apply({**v, "params": p}, x, mutable=[qlinen.AMAX_COLLECTION, qlinen.STATS_COLLECTION])
            return jnp.mean((y - tgt) ** 2), upd
        (l, upd), g = jax.value_and_grad(loss, has_aux=True)(v["params"])
        return l, g, upd

    for v in (v_t, v_o):
        v[qlinen.PHASE_COLLECTION] = jax.tree.map(lambda _: jnp.asarray(False), v[qlinen.PHASE_COLLECTION])
    l_t, g_t, u_t = run(theirs, v_t)
    l_o, g_o, u_o = run(ours, v_o)
    assert float(l_t) == float(l_o)
    for a, b in zip(jax.tree.leaves(g_t), jax.tree.leaves(g_o)):
        np.testing.assert_array_equal(a, b)
    st_t = u_t[qlinen.AMAX_COLLECTION]["up"]["dot_general0"]
    st_o = u_o[qlinen.AMAX_COLLECTION]["up"]["QuantDotGeneral_0"]["recipe_state"]
    for a, b in zip(jax.tree.leaves(st_t), jax.tree.leaves(st_o)):
        np.testing.assert_array_equal(a, b)
    assert "up/dot_general0/activation/amax" in qlinen.collect_stats(u_t)
    assert qlinen.set_observe_only(v_t, True)[qlinen.PHASE_COLLECTION]["up"]["dot_general0"]


def test_the_readme_qwix_snippet_runs(capsys):
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "docs" / "qwix_maxtext.md").read_text()  # moved from README
    found = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if b.startswith("# Qwix: pip install")]
    assert len(found) == 1, "the Qwix snippet of docs/qwix_maxtext.md is missing"
    exec(compile(found[0], "docs/qwix_maxtext.md (Qwix snippet)", "exec"), {})
    ops, loss = capsys.readouterr().out.strip().rsplit("] ", 1)
    assert ops == "['jaxlowfp_einsum0', 'out/jaxlowfp_dot_general0'" and np.isfinite(float(loss))


# -- rule independence: a ViT-style model that reads its qkv kernel directly (`x @ self.qkv.kernel[...]`) --------

class _ViTAttn(nnx.Module):
    def __init__(self, d, rngs):
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.proj = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        q, k, v = jnp.split(x @ self.qkv.kernel[...] + self.qkv.bias[...][None, None], 3, axis=-1)
        a = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k) / 4.0, axis=-1)  # two activations
        return self.proj(jnp.einsum("bqk,bkd->bqd", a, v))


class _ViTMLP(nnx.Module):
    def __init__(self, d, rngs):
        self.fc1 = nnx.Linear(d, 2 * d, rngs=rngs)
        self.w2 = nnx.Param(jax.random.normal(rngs.params(), (2 * d, d)) * 0.1)  # the module's own weight

    def __call__(self, x):
        return jax.nn.gelu(self.fc1(x)) @ self.w2[...]


class _ViT(nnx.Module):
    def __init__(self, rngs, d=16, depth=2):
        self.blocks = nnx.List([nnx.Dict(attn=_ViTAttn(d, rngs), mlp=_ViTMLP(d, rngs)) for _ in range(depth)])

    def __call__(self, x):
        for b in self.blocks:
            x = x + b["attn"](x)
            x = x + b["mlp"](x)
        return x


# every contraction of _ViT: (module path, op id, op name); blocks 0 and 1 have the same shapes
_VIT_OPS = [(f"blocks/{i}/{p}", op, name) for i in range(2) for p, op, name in (
    ("attn", "dot_general0", "dot_general"), ("attn", "einsum0", "einsum"), ("attn", "einsum1", "einsum"),
    ("attn/proj", "dot_general0", "dot_general"), ("mlp/fc1", "dot_general0", "dot_general"),
    ("mlp", "dot_general0", "dot_general"))]


def _expected(rules):
    """The reference: each op's first matching rule (re.fullmatch of the path, op_names), nothing else."""
    import re
    out = set()
    for path, op, name in _VIT_OPS:
        rule = next((r for r in rules if re.fullmatch(r.module_path, path) and (not r.op_names or name in r.op_names)),
                    None)
        if rule is not None and rule.recipe is not None:
            if name == "einsum":
                return "two activations"
            out.add((path, op, rule.recipe.name))
    return tuple(sorted(out))


def test_a_rules_effect_does_not_depend_on_the_other_rules():
    """Issue 32: with Qwix's interception of lax.dot_general alone, `x @ w` reached the provider only when JAX's
    trace cache of jnp.matmul missed, so a rule list's result depended on what ran before (an earlier list, or
    block 0 for block 1). All lists here run in one process, over the same model: each one's executed ops equal
    the first-match reference, for permutations, extensions, and overlapping rules."""
    import itertools
    x = jax.random.normal(jax.random.key(2), (2, 4, 16))
    attn = RecipeRule(module_path=r"blocks/\d+/attn", op_names=("dot_general",), recipe=HIF8)
    fc1 = RecipeRule(module_path=r"blocks/0/mlp/fc1", recipe=NVFP4)
    keep1 = RecipeRule(module_path=r"blocks/1/.*", recipe=None)
    nothing = RecipeRule(module_path=r"head", recipe=HIF8)
    mlp1 = RecipeRule(module_path=r"blocks/1/mlp", recipe=HIF8)  # same shapes as blocks/0/mlp's `@`
    broad = RecipeRule(module_path=r".*", op_names=("dot_general",), recipe=FP8)
    attn_all = RecipeRule(module_path=r"blocks/\d+/attn", recipe=HIF8)  # meets the attention einsums
    lists = [list(p) for p in itertools.permutations([attn, fc1, keep1])]
    lists += [[attn], [mlp1], [keep1, mlp1], [mlp1, keep1], [nothing, attn], [attn, nothing, fc1, broad],
              [keep1, broad], [fc1, attn_all], [RecipeRule(module_path="blocks/0/attn", recipe=None), keep1, attn_all]]
    seen = set()
    for rules in lists:
        want = _expected(rules)
        provider = RecipeProvider(rules)
        if want == "two activations":
            with pytest.raises(ValueError, match="two activations"):
                qwix.quantize_model(_ViT(nnx.Rngs(0)), provider, x)
            continue
        model = qwix.quantize_model(_ViT(nnx.Rngs(0)), provider, x)
        assert provider.executed() == want, [r.module_path for r in rules]
        # the executed ops are the model's QuantOps, and each one observed its activation
        assert sorted(p.rsplit("/jaxlowfp_", 1)[0] for p, _ in qnnx.iter_quant_ops(model)) == [p for p, _, _ in want]
        stats = qnnx.collect_stats(model)
        for path, op, _ in want:
            assert stats[f"{path}/jaxlowfp_{op}/activation/amax"] > 0
        seen.add(want)
    assert len(seen) >= 5  # the lists really differ in what they quantize


class _OwnWeight(nnx.Module):
    """One contraction with the module's own parameter, written in one of the forms the provider intercepts."""

    def __init__(self, form, rngs):
        self.form = form
        self.w = nnx.Param(jax.random.normal(rngs.params(), (32, 16)) * 0.1)

    def __call__(self, x):
        w = self.w[...]
        if self.form == "@":
            return x @ w
        if self.form == "matmul":
            return jnp.matmul(x, w)
        if self.form == "dot":
            return jnp.dot(x, w)
        if self.form == "einsum":
            return jnp.einsum("btd,df->btf", x, w)
        return jax.lax.dot_general(x, w, (((2,), (0,)), ((), ())))


@pytest.mark.parametrize("jit_first_call", [False, True], ids=["eager", "jit"])
def test_x_at_own_weight_is_quantized_like_einsum_and_dot_general(jit_first_call):
    """`x @ self.w[...]` (and jnp.matmul, jnp.dot) crashed with Flax's TraceContextError: the provider created the
    op's state inside jnp.matmul's own jit trace. Now each form is one dot_general op, bit for bit the einsum and
    lax.dot_general forms of the same module."""
    x = jax.random.normal(jax.random.key(3), (2, 3, 32))
    outs = {}
    for form in ("@", "matmul", "dot", "einsum", "dot_general"):
        provider = RecipeProvider([RecipeRule(module_path="", recipe=HIF8)])
        quantize = _quantize_model if jit_first_call else qwix.quantize_model
        model = quantize(_OwnWeight(form, nnx.Rngs(0)), provider, x)
        op = "einsum0" if form == "einsum" else "dot_general0"
        assert provider.executed() == (("", op, "hif8_w8a8"),), form
        outs[form] = nnx.jit(lambda m, x: m(x))(model, x)
        assert outs[form].shape == (2, 3, 16)
    for form, y in outs.items():
        np.testing.assert_array_equal(y, outs["dot_general"], err_msg=form)
    assert not np.array_equal(outs["@"], x @ _OwnWeight("@", nnx.Rngs(0)).w[...])  # quantized, not plain


def test_contractions_inside_other_jitted_functions_are_errors_under_a_quantizing_rule():
    """jnp.inner (jit-compiled by JAX) and a user's jax.jit helper: their traces are cached, so quantizing the
    dot_general inside would depend on what ran first. Under a quantizing rule: an error naming the module, the
    op and the function; under recipe=None: JAX's own op."""
    helper = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (0,)), ((), ()))))

    class Inner(nnx.Module):
        def __init__(self, how, rngs):
            self.how = how
            self.w = nnx.Param(jax.random.normal(rngs.params(), (16, 16)))

        def __call__(self, x):
            return jnp.inner(x, self.w[...]) if self.how == "inner" else helper(x, self.w[...])

    x = jnp.ones((2, 16))
    with pytest.raises(ValueError, match=r"blk:dot_general0: jnp.inner under a quantizing rule"):
        _call_under(Inner("inner", nnx.Rngs(0)), x)
    with pytest.raises(ValueError, match=r"blk:dot_general0: this contraction runs inside .*<lambda>.*jax.jit"):
        _call_under(Inner("helper", nnx.Rngs(0)), x)
    for how in ("inner", "helper"):  # high precision where the rule says so
        model = _call_under(Inner(how, nnx.Rngs(0)), x, recipe=None)
        np.testing.assert_array_equal(model(x), model.blk(x))


def _call_under(blk, x, recipe=HIF8):
    class Wrap(nnx.Module):
        def __init__(self, blk):
            self.blk = blk

        def __call__(self, x):
            return self.blk(x)

    provider = RecipeProvider([RecipeRule(module_path="blk", recipe=recipe)])
    model = qwix.quantize_model(Wrap(blk), provider, x)
    assert provider.executed() == ()
    return model


class _LinenOwnWeight(nn.Module):
    form: str

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(0.1), (32, 16))
        return x @ w if self.form == "@" else jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())))


def test_linen_x_at_own_weight_equals_dot_general():
    x = jax.random.normal(jax.random.key(4), (4, 32))
    outs = {}
    for form in ("@", "dot_general"):
        provider = RecipeProvider([RecipeRule(module_path=".*", recipe=HIF8)])
        model = qwix.quantize_model(_LinenOwnWeight(form), provider)
        v = model.init(jax.random.key(1), x)
        v[qlinen.PHASE_COLLECTION] = jax.tree.map(lambda _: jnp.asarray(False), v[qlinen.PHASE_COLLECTION])
        outs[form] = model.apply(v, x, mutable=[qlinen.AMAX_COLLECTION, qlinen.STATS_COLLECTION])[0]
        assert provider.executed() == (("", "dot_general0", "hif8_w8a8"),)
    np.testing.assert_array_equal(outs["@"], outs["dot_general"])
