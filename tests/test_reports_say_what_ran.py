"""Reports say what ran (issue 45, item 6): a PTQ op is labelled by what it did (its activations quantized at run
time, or never), and the Qwix provider warns about a contraction that reads a submodule's kernel directly where a
quantizing rule matches that submodule but not the module running the contraction (it stays in high precision)."""
import warnings

import pytest
import qwix
from flax import nnx

from jaxlowfp import execution, ptq, qat, qwix_provider
from tests.test_execution import DirectRead, _x  # canvit-nnx's direct kernel read, and its input


def test_ptq_ops_are_labelled_by_what_they_did():
    model = DirectRead(nnx.Rngs(0))
    ptq.quantize_model(model, [ptq.Rule(path=".*", scheme=ptq.scheme("nvfp4-mse"))], activation_scale="token")
    before = {op.path: op.configured for op in execution.quantized_ops(model)}
    assert all("activation quantization never ran" in c for c in before.values()), before
    model(_x())
    after = {op.path: op for op in execution.quantized_ops(model)}
    assert after["mlp"].executed and not after["qkv"].executed
    assert after["mlp"].configured == "PTQ nvfp4-mse: weights quantized, activations quantized at run time " \
                                      "(token scale)"
    assert after["qkv"].configured.endswith("activation quantization never ran")


def _qwix(rules):
    provider = qwix_provider.RecipeProvider(rules)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = qwix.quantize_model(DirectRead(nnx.Rngs(0)), provider, _x())
        model(_x())
    return provider, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_qwix_direct_kernel_read_under_a_child_rule_is_flagged():
    """A rule for ``qkv`` never applies to ``x @ self.qkv.kernel`` in the parent (Qwix matches the op by the module
    that runs it): warned about, and listed by ``direct_reads``; the called ``mlp`` is quantized as before."""
    provider, warned = _qwix([qwix_provider.RecipeRule(module_path="qkv|mlp", recipe=qat.hif8_w8a8())])
    assert provider.executed() == (("mlp", "dot_general0", "hif8_w8a8"),)
    assert provider.direct_reads() == (("", "dot_general0", "qkv"),)
    hits = [w for w in warned if "directly" in w]
    assert len(hits) == 1 and "qkv/kernel" in hits[0] and "HIGH PRECISION" in hits[0] and "'qkv|mlp'" in hits[0]


@pytest.mark.parametrize("rules", [
    [qwix_provider.RecipeRule(module_path=".*", recipe=qat.hif8_w8a8())],  # the parent matched: quantized
    [qwix_provider.RecipeRule(module_path="", recipe=None),  # excluded on purpose
     qwix_provider.RecipeRule(module_path="qkv|mlp", recipe=qat.hif8_w8a8())],
    [qwix_provider.RecipeRule(module_path="mlp", recipe=qat.hif8_w8a8())],  # no rule for qkv
])
def test_qwix_no_flag_where_nothing_is_lost(rules):
    provider, warned = _qwix(rules)
    assert provider.direct_reads() == () and not [w for w in warned if "directly" in w]
