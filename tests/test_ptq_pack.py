"""`jaxlowfp.ptq.pack_model`: a PTQ'd model whose quantized layers hold packed arrays (no float kernel) computes the
fake-quant model's log-probs; orbax saves and restores it bit for bit.

The judge is the fake-quant model itself (``ptq.quantize``: float kernels holding the dequantized weights, the
activations fake-quantized by its `ActQuant`), whose quantizers `tests/test_ptq.py` and friends check against
ml_dtypes, en_dtypes, compressed-tensors and llm-compressor fixtures. The packed model computes the same quantized
values with another arithmetic (the global scales factored out of the GEMM, another fusion of the dot), so
log-probs agree within float32 rounding (measured: <= 2e-6 on the tiny Llama; bench/packed_memory.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jaxlowfp
from jaxlowfp import packed, ptq
from jaxlowfp.models.llama import Llama, preset
from jaxlowfp.ptq.packing import requantized, packed_layers

TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 24)), jnp.int32)
RULES = [ptq.Rule(path=r".*_proj", scheme=None)]


def _model():
    return Llama(preset("tiny", n_layers=1), rngs=nnx.Rngs(0))  # one block: the same layers, a quarter the compile


def _ptq(name, **kw):
    model = _model()
    res = ptq.quantize_model(model, [ptq.Rule(path=r".*_proj", scheme=ptq.scheme(name))], progress=False, **kw)
    return model, res


@jax.jit
def _logprobs(graph, state, tokens):
    return jax.nn.log_softmax(nnx.merge(graph, state)(tokens), axis=-1)


def _lp(model):
    graph, state = nnx.split(model)
    return _logprobs(graph, state, TOKENS)


@nnx.jit
def _run(model, x):
    """The model's forward as one program per model structure (eagerly, a fake-quant and a packed MLP cost a few
    hundred one-op compilations)."""
    return model(x)


class _MLP(nnx.Module):
    def __init__(self, rngs):
        self.up_proj = nnx.Linear(64, 128, rngs=rngs)
        self.down_proj = nnx.Linear(128, 64, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(nnx.relu(self.up_proj(x)))


@pytest.fixture(scope="module")
def w4a4():
    """(fake-quant log-probs, packed model, pack report) for NVFP4 4/6 (mse) W4A4 on the scaled_matmul backend, whose
    activation operand carries one tensor scale (activation_scale="tensor")."""
    model, res = _ptq("nvfp4-mse", activation_scale="tensor")
    fake = _lp(model)
    report = ptq.pack_model(model, res, gemm="scaled_matmul")
    return fake, model, report


def test_packed_model_holds_packed_arrays_not_float_kernels(w4a4):
    _, model, report = w4a4
    layers = packed_layers(model)
    assert len(layers) == 7 and set(layers) == {p for p, *_ in report.layers}
    params = nnx.state(model, nnx.Param)
    kernels = ["/".join(map(str, k[:-1])) for k, _ in nnx.to_flat_state(params) if k[-1] == "kernel"]
    assert kernels == ["lm_head"]  # the float kernels of the quantized layers are gone
    arrays = jax.tree.leaves(nnx.state(model, packed.PackedParam))
    assert {str(a.dtype) for a in arrays} == {"uint8", "float8_e4m3fn", "float32"}
    assert report.float_bytes == 4 * report.params
    assert 4.5 <= report.bits_per_param < 4.52  # 4 + 8/16 bits, plus two float32 scalars per layer
    assert report.packed_bytes == sum(a.nbytes for a in arrays)
    assert all(b == "scaled_matmul" and not native for _, _, b, native in report.layers)  # CPU: emulated


def test_packed_model_gives_the_fake_quant_log_probs(w4a4):
    fake, model, _ = w4a4
    lp = _lp(model)
    assert float(jnp.max(jnp.abs(lp - fake))) < 1e-4


def test_orbax_restores_the_packed_model_bit_for_bit(w4a4, tmp_path):
    _, model, _ = w4a4
    graph, state = nnx.split(model)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "packed", state)
    ckpt.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    restored = ckpt.restore(tmp_path / "packed", abstract)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8))
    np.testing.assert_array_equal(_logprobs(graph, restored, TOKENS), _logprobs(graph, state, TOKENS))
    disk = sum(f.stat().st_size for f in (tmp_path / "packed").rglob("*") if f.is_file())
    assert disk < 2 * sum(a.nbytes for a in jax.tree.leaves(state))


@pytest.mark.parametrize("name,kw", [("hif8", {}), ("nvfp4-static_6", {"arithmetic": "compressed-tensors"}),
                                     ("mxfp4", {}), ("fp8", {}), ("mxfp8", {})])
def test_other_formats_and_conventions(name, kw):
    model = _MLP(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (4, 64), jnp.float32)
    res = ptq.quantize_model(model, [ptq.Rule(path=r".*_proj", scheme=ptq.scheme(name))], progress=False, **kw)
    fake = _run(model, x)
    report = ptq.pack_model(model, res)  # auto: dequant on CPU
    assert {b for _, _, b, _ in report.layers} == {"dequant"} and len(packed_layers(model)) == 2
    np.testing.assert_allclose(_run(model, x), fake, rtol=1e-5, atol=1e-5)
    bits = {"hif8": 8.0, "fp8": 8.0, "mxfp4": 4.25, "mxfp8": 8.25}.get(name, 4.5)
    assert report.bits_per_param == pytest.approx(bits, abs=0.01)


@pytest.mark.parametrize("fmt", ["mxfp4", "if4-mse", "hif8", "fp8", "mxfp8"])
def test_requantizing_a_ptq_kernel_is_lossless(fmt):
    """The formats whose PTQ result keeps no codes: their packed arrays are found again from the dequantized
    kernel (the float32 scale searched among its neighbours) and decode to it bit for bit."""
    w = jax.random.normal(jax.random.key(0), (64, 32), jnp.float32) * 0.02
    tf = jaxlowfp.Format.parse(fmt)
    kernel = ptq.rtn_weight(w, tf).kernel
    p = requantized(kernel, packed.as_format(tf), "layer")
    np.testing.assert_array_equal(p.dequantize(), kernel)
    with pytest.raises(ValueError, match="bit for bit"):
        requantized(kernel.at[3, 5].multiply(1.01), packed.as_format(tf), "blocks/0/mlp/up_proj")


def test_per_token_activations_run_the_op_layer_quantizer():
    """The default per-token activation scales: the packed layer quantizes its input with the PTQ layer's own
    quantizer (the one op layer's), then the weights-only product; the log-probs are the fake-quant model's (the same
    quantized values; equal to float32 rounding of the dot). scaled_matmul runs them with each token's global scale
    outside the GEMM (`backends.scaled_matmul_rows`); other formats with per-token scales are refused there."""
    model, res = _ptq("nvfp4-mse")
    assert res.activation_scale == "token"
    fake = _lp(model)
    report = ptq.pack_model(model, res)
    assert {b for _, _, b, _ in report.layers} == {"dequant"}
    np.testing.assert_allclose(np.asarray(_lp(model)), np.asarray(fake), rtol=0, atol=2e-5)
    model2, res2 = _ptq("nvfp4-mse")
    report2 = ptq.pack_model(model2, res2, gemm="scaled_matmul")
    assert {b for _, _, b, _ in report2.layers} == {"scaled_matmul"}
    assert all(layer.rows_gemm for layer in packed_layers(model2).values())
    np.testing.assert_allclose(np.asarray(_lp(model2)), np.asarray(fake), rtol=0, atol=2e-5)
    model3, res3 = _ptq("if4-mse")
    with pytest.raises(ValueError, match="IF4's INT blocks have no hardware GEMM"):
        ptq.pack_model(model3, res3, gemm="scaled_matmul")


def test_pack_refuses_bad_input_and_leaves_the_model_unchanged():
    model = _MLP(nnx.Rngs(0))
    res = ptq.quantize_model(model, [ptq.Rule(path=r".*_proj", scheme=ptq.scheme("hif8"))], progress=False)
    with pytest.raises(ValueError, match="HiF8 has no hardware GEMM"):
        ptq.pack_model(model, res, gemm="scaled_matmul")
    assert packed_layers(model) == {}
    with pytest.raises(ValueError, match="were not quantized"):
        ptq.pack_model(model, res, paths=["lm_head"])
    k = model.up_proj.kernel
    before = k[...]
    k.set_value(before.at[3, 5].multiply(1.01))  # off the HiF8 grid: no scale reproduces it
    with pytest.raises(ValueError, match="up_proj: no hif8 arrays"):
        ptq.pack_model(model, res)
    assert packed_layers(model) == {}
    k.set_value(before)
    ptq.pack_model(model, res, paths=["up_proj"])
    with pytest.raises(ValueError, match="already packed"):
        ptq.pack_model(model, res, paths=["up_proj"])
    with pytest.raises(TypeError, match="PTQResult"):
        ptq.pack_model(model, {})


def test_pack_for_a_device_without_the_backend_is_refused_before_any_change():
    """`pack(device=)` plans every layer for that device first: NVFP4 on scaled_matmul needs sm_100 (cuDNN's
    block-scaled GEMM), so an H100 (a stand-in device object, as tests/test_packed.py's) is refused by name and the
    model keeps its float kernels; a B200 is accepted (the report says native), and on this CPU the same layers
    run (jax's emulation of scaled_matmul)."""
    import types

    from jaxlowfp import backends

    def gpu(kind, cc):
        return types.SimpleNamespace(platform="gpu", device_kind=kind, compute_capability=cc)

    model = _MLP(nnx.Rngs(0))
    res = ptq.quantize_model(model, [ptq.Rule(path=r".*_proj", scheme=ptq.scheme("nvfp4-mse"))],
                             activation_scale="tensor", progress=False)
    with pytest.raises(backends.BackendUnavailableError,
                       match=r"_proj: gemm=.scaled_matmul.: .*compute capability >= 10.0.*H100"):
        ptq.pack_model(model, res, gemm="scaled_matmul", device=gpu("NVIDIA H100 80GB HBM3", "9.0"))
    assert packed_layers(model) == {} and isinstance(model.up_proj.kernel, nnx.Param)
    rep = ptq.pack_model(model, res, gemm="scaled_matmul", device=gpu("NVIDIA B200", "10.0"))
    assert {r[2:] for r in rep.layers} == {("scaled_matmul", True)}
    assert np.isfinite(np.asarray(_run(model, jnp.ones((2, 64), jnp.float32)))).all()
