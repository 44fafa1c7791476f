"""PTQ of ``nnx.LinearGeneral`` and ``nnx.Einsum`` layers (jaxlowfp.ptq.layers): each weight is quantized as the GEMM
matrix [K, N] (contracted axes first, flattened) and each input as [rows, K], so a model written with general
layers is quantized exactly as the same model written with ``nnx.Linear`` layers. The twin here is built by hand
(numpy reshapes and transposes of the kernels), not by the library's layout code."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlowfp import nvfp4, ptq

B, T = 2, 8


class General(nnx.Module):
    """x [b, t, 4, 8] -> LinearGeneral (contract 4 x 8, out 2 x 16) -> tanh -> Einsum over (g, f) -> [b, t, 48].
    The Einsum's kernel puts its free axis first ("hgf"), so its GEMM matrix needs a transpose."""

    def __init__(self, rngs):
        self.lg = nnx.LinearGeneral((4, 8), (2, 16), axis=(-2, -1), rngs=rngs)
        self.ein = nnx.Einsum("btgf,hgf->bth", (48, 2, 16), rngs=rngs)

    def __call__(self, x):
        return self.ein(jnp.tanh(self.lg(x)))


class Twin(nnx.Module):
    """The same function with nnx.Linear layers: kernels reshaped by hand."""

    def __init__(self, gen: General, rngs):
        self.lg = nnx.Linear(32, 32, rngs=rngs)
        self.ein = nnx.Linear(32, 48, use_bias=False, rngs=rngs)
        self.lg.kernel.set_value(np.asarray(gen.lg.kernel[...]).reshape(32, 32))
        self.lg.bias.set_value(np.asarray(gen.lg.bias[...]).reshape(32))
        self.ein.kernel.set_value(np.transpose(np.asarray(gen.ein.kernel[...]), (1, 2, 0)).reshape(32, 48))

    def __call__(self, x):
        return self.ein(jnp.tanh(self.lg(x.reshape(B, T, 32))))


def _models():
    gen = General(nnx.Rngs(0))
    return gen, Twin(gen, nnx.Rngs(1))


def _calibration():
    rng = np.random.default_rng(0)
    return [jnp.asarray(rng.standard_normal((B, T, 4, 8)), jnp.float32) for _ in range(2)]


RULES = [ptq.Rule(path="lg|ein", scheme=ptq.scheme("nvfp4-mse"))]


def _gen_kernels(gen):
    return {"lg": np.asarray(gen.lg.kernel[...]).reshape(32, 32),
            "ein": np.transpose(np.asarray(gen.ein.kernel[...]), (1, 2, 0)).reshape(32, 48)}


def test_calibration_records_the_inputs_as_gemm_rows():
    """The Hessian and amaxes of each general layer are those of its Linear twin's input: the same values (the
    lg input is the batch itself: equal amaxes; the Hessians are matmuls in two programs: float32 rounding)."""
    gen, twin = _models()
    batches = _calibration()
    g = ptq.collect(gen, ["lg", "ein"], batches, forward=lambda m, b: m(b), hessian=True)
    t = ptq.collect(twin, ["lg", "ein"], batches, forward=lambda m, b: m(b), hessian=True)
    for p in ("lg", "ein"):
        assert g[p].tokens == t[p].tokens == 2 * B * T
        np.testing.assert_allclose(g[p].hessian, t[p].hessian, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(g[p].amax, t[p].amax, rtol=1e-6)
    np.testing.assert_array_equal(g["lg"].amax, t["lg"].amax)


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_general_layers_quantize_as_their_linear_twin(method):
    """RTN and GPTQ (W4A4 NVFP4, 4/6 mse) give each general layer's GEMM matrix exactly the twin's quantized kernel
    (the same quantizer on the same [K, N] values; GPTQ from the same statistics), and the quantized models compute
    the same function (float32 rounding of two programs, then NVFP4 activation codes: within a few quantization
    steps on a handful of elements, so the mean error is tiny)."""
    gen, twin = _models()
    batches = _calibration()
    kw = {}
    if method == "gptq":
        stats = ptq.collect(twin, ["lg", "ein"], batches, forward=lambda m, b: m(b), hessian=True)
        kw = dict(stats=stats)
    r_gen = ptq.quantize_model(gen, RULES, method=method, **kw)
    r_twin = ptq.quantize_model(twin, RULES, method=method, **kw)
    assert sorted(p for p, _ in r_gen.report.quantized) == ["ein", "lg"] and r_gen.report.quantized_fraction == 1.0
    got = _gen_kernels(gen)
    for p in ("lg", "ein"):
        np.testing.assert_array_equal(got[p], np.asarray(getattr(twin, p).kernel[...]), err_msg=p)
        np.testing.assert_array_equal(np.asarray(r_gen.packed[p][0].codes), np.asarray(r_twin.packed[p][0].codes))
    assert isinstance(gen.lg.dot_general, ptq.ActQuant) and isinstance(gen.ein.einsum_op, ptq.EinsumActQuant)
    x = batches[0]
    y_gen, y_twin = np.asarray(gen(x)), np.asarray(twin(x))
    assert y_gen.shape == y_twin.shape == (B, T, 48)
    err = np.abs(y_gen - y_twin)
    assert err.mean() < 1e-4 * np.abs(y_twin).mean() + 1e-6 and (err > 1e-5).mean() < 0.05, (err.mean(), err.max())


def test_einsum_activations_are_blocked_along_the_contraction():
    """An Einsum whose contracted input axis is not last ("bkt,kn->btn") fake-quantizes its input with NVFP4 blocks
    along k: equal to quantizing the transposed input [b, t, k] by hand, unlike blocks along the input's last axis
    (t), which a missing transpose would give."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((B, 32, 16)) * np.exp(rng.standard_normal((B, 1, 16))), jnp.float32)
    w = jnp.asarray(rng.standard_normal((32, 48)), jnp.float32)
    fmt = ptq.scheme("nvfp4-mse").activation
    got = ptq.EinsumActQuant(fmt)("bkt,kn->btn", x, w)
    xq = np.asarray(nvfp4.fake_quantize(jnp.asarray(np.transpose(np.asarray(x), (0, 2, 1))), rule="mse"))
    want = jnp.einsum("bkt,kn->btn", jnp.asarray(np.transpose(xq, (0, 2, 1))), w)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    wrong = jnp.einsum("bkt,kn->btn", nvfp4.fake_quantize(x, rule="mse"), w)  # blocks along t
    assert not np.allclose(np.asarray(got), np.asarray(wrong), rtol=1e-3)


def test_unsupported_general_layers_are_clear_errors():
    rngs = nnx.Rngs(0)

    class Experts(nnx.Module):
        def __init__(self):
            self.moe = nnx.Einsum("ebk,ekn->ebn", (4, 32, 16), rngs=rngs)  # e: an expert (batch) axis

    with pytest.raises(ValueError, match=r"moe: the einsum 'ebk,ekn->ebn' has batch axes"):
        ptq.quantize_model(Experts(), ptq.Rule(path="moe", scheme=ptq.scheme("hif8")))

    class LateSpec(nnx.Module):
        def __init__(self):
            self.ein = nnx.Einsum("bk,kn->bn", (32, 16), rngs=rngs)
            self.ein.einsum_str = None  # the equation then comes with each call (Flax allows either)

    with pytest.raises(ValueError, match=r"ein: this nnx.Einsum takes its equation at call time"):
        ptq.quantize_model(LateSpec(), ptq.Rule(path="ein", scheme=ptq.scheme("hif8")))

    class Odd(nnx.Module):
        def __init__(self):
            self.lg = nnx.LinearGeneral((3, 5), 16, axis=(-2, -1), rngs=rngs)

    with pytest.raises(ValueError, match=r"lg: .*in_features to be a multiple of 16; got 15"):
        ptq.quantize_model(Odd(), ptq.Rule(path="lg", scheme=ptq.scheme("nvfp4-mse")))

    gen, _ = _models()
    with pytest.raises(ValueError, match=r"'smoothquant' folds per-channel scales into nnx.Linear layers; "
                                         r"ein \(Einsum\)"):
        ptq.quantize_model(gen, RULES, method="smoothquant", calibration=_calibration(), forward=lambda m, b: m(b))
    result = ptq.quantize_model(gen, RULES)
    with pytest.raises(ValueError, match=r"export \(compressed-tensors\) stores nnx.Linear weights.*"
                                         r"lg \(LinearGeneral\)"):
        ptq.export(gen, result, "/nonexistent/never-written", tensor_names={})
    # the error above left the model usable and quantized
    assert jnp.isfinite(gen(_calibration()[0])).all()
