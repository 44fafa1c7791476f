"""A packed W4A4 / W8A8 model's run-time activation quantizer is compiled once per shape, not once per projection
(issue 44, `jaxlowfp.backends.shared_quantizer`).

On a one-device CPU process the quantizer runs as one shared program (``jax.pure_callback``), so the caller's
program holds a callback where it held a copy of the quantizer. XLA:CPU keeps each copy's machine code resident:
SmolLM2-135M W4A4 held ~870 MiB of compiled code after its forward compiled, more than five times its packed weights
(bench/packed_memory.py). Judges: the values (the inline quantizer's, within float32 rounding: two XLA programs),
the gradient and vmap (the inline function's), and the compiled program's size (deterministic for one XLA).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlowfp import backends, ptq
from jaxlowfp.models.llama import Llama, preset

CFG = preset("tiny", d_model=64, d_ff=128, n_layers=2, vocab=128)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 16)), jnp.int32)


def _packed(scheme, **kw):
    model = Llama(CFG, rngs=nnx.Rngs(0))
    res = ptq.quantize_model(model, [ptq.Rule(path=r".*_proj", scheme=ptq.scheme(scheme))], progress=False, **kw)
    ptq.pack_model(model, res)
    return model


def _compiled(model):
    graph, state = nnx.split(model)
    f = jax.jit(lambda s, t: nnx.merge(graph, s)(t))
    c = f.lower(state, TOKENS).compile()
    return c.as_text(), np.asarray(c(state, TOKENS))


@pytest.mark.parametrize("scheme,kw,ratio", [
    ("nvfp4-mse", {}, 0.6),  # per-token activation scales (PackedLinear's act_quant)
    ("nvfp4-mse", {"activation_scale": "tensor"}, 0.6),  # backends' fake_quantize
    ("hif8", {}, 0.7),  # a smaller quantizer (0.60 here)
])
def test_packed_forward_shares_one_quantizer_program(monkeypatch, scheme, kw, ratio):
    model = _packed(scheme, **kw)
    monkeypatch.setattr(backends, "SHARED_QUANTIZER", False)
    inline_hlo, inline = _compiled(model)
    monkeypatch.setattr(backends, "SHARED_QUANTIZER", True)
    assert backends._share_quantizer()  # on any CPU (auto: a one-device process; this suite has several)
    shared_hlo, shared = _compiled(model)
    assert "callback" in shared_hlo and "callback" not in inline_hlo
    # 14 projections, 8 distinct inputs: 8 quantizers compiled in; then none
    assert len(shared_hlo) < ratio * len(inline_hlo), (len(shared_hlo), len(inline_hlo))
    np.testing.assert_allclose(shared, inline, rtol=0, atol=2e-5)


def test_shared_quantizer_gradient_and_vmap_are_the_inline_functions(monkeypatch):
    monkeypatch.setattr(backends, "SHARED_QUANTIZER", True)
    from jaxlowfp.packed import as_format, fake_quantize

    fn = backends._fake_quantizer(as_format("nvfp4-mse"))
    assert backends._fake_quantizer(as_format("nvfp4-mse")) is fn  # one function object: one shared program
    x = jax.random.normal(jax.random.key(0), (3, 4, 32), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (3, 4, 32), jnp.float32)

    def loss(f):
        return lambda x: jnp.sum(jnp.sin(f(x)) * w)

    shared = jax.jit(jax.value_and_grad(loss(lambda x: backends.shared_quantizer(fn, x))))(x)
    inline = jax.jit(jax.value_and_grad(loss(fn)))(x)
    np.testing.assert_allclose(shared[0], inline[0], rtol=1e-6)
    assert float(jnp.max(jnp.abs(inline[1]))) > 0.1  # a gradient that a zero cotangent would not match
    np.testing.assert_allclose(shared[1], inline[1], rtol=0, atol=1e-6)
    # vmap: each slice quantized on its own (one tensor amax per slice), as the inline function under vmap
    v_shared = jax.jit(jax.vmap(lambda x: backends.shared_quantizer(fn, x)))(x)
    np.testing.assert_allclose(v_shared, jax.vmap(lambda x: fake_quantize(x, "nvfp4-mse"))(x), rtol=0, atol=1e-6)
