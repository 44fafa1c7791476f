"""Property-based tests (hypothesis, issue 45 item 8) over the public quantize / dequantize / fake_quantize calls,
the pack / export / load calls (`packed.pack`, the GGUF block bytes, `ptq.export` -> `models.load_export`) and
the safetensors reader: random shapes, dtypes, magnitudes from 2^-100 to 2^100, zeros, NaN and Inf at random
positions. Either the result equals an independent oracle (the numpy references of test_nvfp4.py and test_mx.py,
written from docs/formats/nvfp4.md with ml_dtypes casts; en_dtypes' HiF8; gguf-py's dequantizer; the safetensors
package's writer; the in-memory fake-quant model for a reloaded export), or
the error is a clear one naming what was wrong. Example counts are bounded (``settings(max_examples=...)``, the
shapes drawn from a few so that the jitted quantizers compile a few times only): the file takes about 40 s of CPU."""
import functools
import os
import struct
import tempfile

import en_dtypes
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jaxlowfp import hif8, mx, nvfp4
from jaxlowfp.models import CheckpointError
from jaxlowfp.models.quantized import read_safetensors

import test_mx as mx_ref
import test_nvfp4 as nv_ref

F32 = np.float32
SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
# every example count below, summed: the number of cases one run tries (bench/RESULTS.md)
EXAMPLES = {"nvfp4": 40, "nvfp4_nonfinite": 12, "mx": 30, "hif8": 40, "bad_shapes": 15, "safetensors": 30,
            "safetensors_damaged": 30, "pack": 20, "gguf_bytes": 8, "export_load": 4}


@st.composite
def scaled(draw, shape, *, nonfinite=False, min_exp=-100):
    """float32 values of `shape`: a hypothesis array in [-1e4, 1e4] (zeros and subnormals included) times 2^k,
    k in [min_exp, 100] (tiny and huge tensors); with `nonfinite`, a NaN, +Inf or -Inf at a drawn position."""
    x = draw(hnp.arrays(F32, shape, elements=st.floats(-1e4, 1e4, width=32)))
    x = (x * F32(2.0) ** draw(st.integers(min_exp, 100))).astype(F32)
    if nonfinite:
        flat = x.reshape(-1)
        flat[draw(st.integers(0, flat.size - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    return x


@functools.lru_cache(maxsize=None)
def _jitted(fn, **kw):
    """One compiled program per quantizer and keyword set (quantize, its dequantize and fake_quantize together):
    the examples of a test reuse a few programs."""
    mod = {"nvfp4": nvfp4, "mx": mx}[fn]
    return jax.jit(lambda v: (q := mod.quantize(v, **kw), mod.dequantize(q), mod.fake_quantize(v, **kw)))


@settings(max_examples=EXAMPLES["nvfp4"], **SETTINGS)
@given(data=st.data(), case=st.sampled_from([((2, 32), (1, 16)), ((16, 32), (16, 16))]),
       rule=st.sampled_from(["static_6", "mse"]))
def test_nvfp4_quantize_matches_the_reference(data, case, rule):
    """Codes, E4M3 block scales and the global scale equal the reference's bit for bit; dequantize equals the
    reference's decode, and fake_quantize equals it too (the documented identity), under jit. The MSE rule's
    magnitudes stay above 2^-50: below, see test_nvfp4_four_over_six_choice_at_tiny_magnitudes."""
    shape, block = case
    x = data.draw(scaled(shape, min_exp=-50 if rule == "mse" else -100))
    q, deq, fq = _jitted("nvfp4", rule=rule, block_shape=block)(x)
    with np.errstate(over="ignore"):  # the reference's block errors overflow where the specification's do
        nv_ref.check_against_ref(q, x, rule, block)
        codes, scales, s_dec, _ = nv_ref.ref_quantize(x, rule, block)
    want = nv_ref.ref_dequantize(codes, scales, s_dec, x.shape, block[0])
    assert nv_ref.same_bits(deq, want).all()
    assert nv_ref.same_bits(fq, want).all()


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("rule", ["mse", "mae", "abs_max"])
def test_nvfp4_four_over_six_choice_at_tiny_magnitudes(rule, jit):
    """Found by the property test: XLA:CPU flushes float32 subnormals to zero, so the squared block errors of a
    tensor with amax below ~2^-57 were 0 for both the 6 and the 4 scale and the tie picked 6, where IEEE float32
    (the reference) picks the exact 4. The errors are now measured on values times an exact power of two
    (``error_scale``), so the choice equals IEEE's; the same block pattern at 2^0 is the control. (At 2^-80 the
    reference's own squares underflow to 0 and it picks 6; there the scaled choice is the exact one, 4.)"""
    for k in (0, -57, -60, -64):
        x = (np.concatenate([[3.0], np.ones(31)]).reshape(2, 16) * 2.0**k).astype(F32)
        q = (jax.jit(functools.partial(nvfp4.quantize, rule=rule)) if jit else
             functools.partial(nvfp4.quantize, rule=rule))(x)
        nv_ref.check_against_ref(q, x, rule, (1, 16))
        if rule != "abs_max":  # the all-ones block maps exactly to 4 (error 0) and not to 6
            assert bool(np.asarray(nvfp4.selected_map4(x, rule=rule))[1, 0]), k


@settings(max_examples=EXAMPLES["nvfp4_nonfinite"], **SETTINGS)
@given(data=st.data(), rule=st.sampled_from(["static_6", "mse"]))
def test_nvfp4_nonfinite_anywhere_poisons_visibly(data, rule):
    """A NaN or Inf anywhere makes the tensor amax non-finite: every scale and every fake-quantized value is NaN
    (never a finite, silently wrong tensor)."""
    x = data.draw(scaled((2, 32), nonfinite=True))
    q, deq, fq = _jitted("nvfp4", rule=rule, block_shape=(1, 16))(x)
    assert np.isnan(np.asarray(q.global_scale)) and np.isnan(np.asarray(q.scales).astype(F32)).all()
    assert np.isnan(np.asarray(deq)).all() and np.isnan(np.asarray(fq)).all()


@settings(max_examples=EXAMPLES["mx"], **SETTINGS)
@given(data=st.data(), fmt=st.sampled_from(["e2m1", "e4m3"]), rule=st.sampled_from(["floor", "ceil"]),
       nonfinite=st.booleans())
def test_mx_matches_the_reference(data, fmt, rule, nonfinite):
    """MX codes, E8M0 scales and dequantized values equal the reference's, NaN / Inf included (only the block
    holding one is poisoned: MX has no tensor scale)."""
    x = data.draw(scaled((2, 64), nonfinite=nonfinite))
    q, deq, fq = _jitted("mx", format=fmt, rule=rule)(x)
    codes, scale_bytes, want = mx_ref.ref_quantize(x, fmt, rule)
    np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8), scale_bytes)
    ok = ~np.isnan(want.reshape(2, 2, 32)).all(-1)  # a poisoned block's element codes are undefined (scale NaN)
    per = 16 if fmt == "e2m1" else 32  # code bytes per block
    got_codes = np.asarray(q.codes).reshape(2, 2, per)
    np.testing.assert_array_equal(got_codes[ok], codes.reshape(2, 2, per)[ok])
    assert mx_ref.same_bits(deq, want).all() and mx_ref.same_bits(fq, want).all()
    assert (~ok).sum() == int(nonfinite)  # the one block holding the bad value, and only it


@settings(max_examples=EXAMPLES["hif8"], **SETTINGS)
@given(x=hnp.arrays(F32, (64,), elements=st.floats(width=32, allow_nan=True, allow_infinity=True)),
       k=st.integers(-60, 60))
def test_hif8_round_matches_en_dtypes(x, k):
    """hif8.round and encode on any float32 values (NaN, +-Inf, subnormals, 2^+-60 magnitudes) equal en_dtypes'
    golden HiF8 cast bit for bit (every NaN equal to every NaN)."""
    with np.errstate(over="ignore", invalid="ignore"):
        x = (x * F32(2.0) ** k).astype(F32)
        want_codes = x.astype(en_dtypes.hifloat8).view(np.uint8)
        want = want_codes.view(en_dtypes.hifloat8).astype(F32)
    got = np.asarray(hif8.round(x))
    a, b = got.view(np.uint32), want.view(np.uint32)
    assert ((a == b) | (np.isnan(got) & np.isnan(want))).all()
    np.testing.assert_array_equal(np.asarray(hif8.encode(x)), want_codes)


@settings(max_examples=EXAMPLES["bad_shapes"], **SETTINGS)
@given(rows=st.integers(1, 3), cols=st.integers(1, 70).filter(lambda n: n % 16), mxf=st.booleans())
def test_block_quantizers_refuse_ragged_last_axes(rows, cols, mxf):
    """A last axis that is not a multiple of the block (16 for NVFP4, 32 for MX) is a ValueError that says so,
    never a silently padded or truncated tensor."""
    x = np.ones((rows, cols), F32)
    if mxf:
        if cols % 32 == 0:
            return
        with pytest.raises(ValueError, match=r"32"):
            mx.quantize(x, format="e2m1")
    else:
        with pytest.raises(ValueError, match=r"last axis.*multiple of 16"):
            nvfp4.quantize(x)


DTYPES = {"F32": np.float32, "F16": np.float16, "I32": np.int32, "U8": np.uint8, "I64": np.int64}


@st.composite
def tensors(draw):
    names = draw(st.lists(st.text("abcdefgh._0123456789", min_size=1, max_size=10), min_size=1, max_size=4,
                          unique=True))
    out = {}
    for name in names:
        dt = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        if np.issubdtype(dt, np.floating):
            el = st.floats(-1e3, 1e3, width=16 if dt == np.float16 else 32)
        else:
            info = np.iinfo(dt)
            el = st.integers(int(max(info.min, -2**31)), int(min(info.max, 2**31 - 1)))
        out[name] = draw(hnp.arrays(dt, shape, elements=el))
    return out


def _write(tmp: str, ts: dict) -> str:
    from safetensors.numpy import save_file

    path = os.path.join(tmp, "model.safetensors")
    save_file(ts, path)
    return path


@settings(max_examples=EXAMPLES["safetensors"], **SETTINGS)
@given(ts=tensors())
def test_safetensors_round_trip(ts):
    """Whatever the safetensors package writes (names, dtypes, shapes with zero-sized axes, scalars) the validated
    reader reads back: same names, dtypes, shapes and bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        got = read_safetensors(_write(tmp, ts))
    assert sorted(got) == sorted(ts)
    for name, want in ts.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        np.testing.assert_array_equal(got[name], want, err_msg=name)


@settings(max_examples=EXAMPLES["safetensors_damaged"], **SETTINGS)
@given(ts=tensors(), where=st.floats(0, 1, exclude_max=True), extra=st.integers(-64, 64).filter(bool),
       header=st.booleans())
def test_safetensors_damaged_is_a_named_error(ts, where, extra, header):
    """A file cut at any byte, or with bytes appended (``extra`` > 0), or whose header length field is off by
    ``extra``, is a CheckpointError naming the file: never a tensor read from the wrong bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(tmp, ts)
        raw = open(path, "rb").read()
        if header:
            (n,) = struct.unpack("<Q", raw[:8])
            raw = struct.pack("<Q", max(n + extra, 0)) + raw[8:]
        elif extra > 0:
            raw = raw + b"\0" * extra
        else:
            raw = raw[: int(where * len(raw))]
        with open(path, "wb") as f:
            f.write(raw)
        with pytest.raises(CheckpointError, match=r"model\.safetensors"):
            read_safetensors(path)


# ---- pack / GGUF bytes / export -> load (issue 45 item 8: the public pack, export and load calls)

PACK_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _pack_oracle(wt: np.ndarray, fmt: str):
    """(codes as uint8 or None, W'^T values) of the float32 matrix `wt` [N, K] from the numpy references:
    NVFP4 (test_nvfp4, ml_dtypes E4M3), MX (test_mx), FP8 (ml_dtypes E4M3) and HiF8 (en_dtypes) with the current
    scale ``s = amax / target`` (1 for an all-zero matrix), ``q = cast(clip(x * (1 / s), +-target))``."""
    if fmt.startswith("nvfp4"):
        rule = "mse" if fmt == "nvfp4-mse" else "static_6"
        codes, scales, s_dec, _ = nv_ref.ref_quantize(wt, rule, (1, 16))
        return codes, nv_ref.ref_dequantize(codes, scales, s_dec, wt.shape, 1)
    if fmt.startswith("mx"):
        codes, _, want = mx_ref.ref_quantize(wt, "e2m1" if fmt == "mxfp4" else "e4m3", "floor")
        return codes, want
    target = F32(448.0 if fmt == "fp8" else 15.0)
    amax = np.max(np.abs(wt))
    s = F32(1.0) if amax == 0 else amax / target
    cast = ml_dtypes.float8_e4m3fn if fmt == "fp8" else en_dtypes.hifloat8
    q = np.clip(wt * (F32(1.0) / s), -target, target).astype(cast)
    return q.view(np.uint8), q.astype(F32) * s


@settings(max_examples=EXAMPLES["pack"], **SETTINGS)
@given(data=st.data(), fmt=st.sampled_from(["nvfp4", "nvfp4-mse", "mxfp4", "mxfp8", "fp8", "hif8"]),
       dtype=st.sampled_from(sorted(PACK_DTYPES)), shape=st.sampled_from([(32, 3), (64, 1)]), nonfinite=st.booleans())
def test_pack_matches_the_reference_or_poisons(data, fmt, dtype, shape, nonfinite):
    """`packed.pack(w, fmt)` of a GEMM matrix W' [K, N] in float32 / bfloat16 / float16, magnitudes 2^-100 ..
    2^100 (float16 overflows to Inf there), zeros, a NaN / Inf at a drawn position: finite weights give the
    reference's codes and its decoded values bit for bit (``PackedWeight.dequantize``, transposed back); a
    non-finite one never gives a finite tensor: every value is NaN (a tensor scale) or its block's are (MX)."""
    from jaxlowfp import packed

    w = data.draw(scaled(shape, nonfinite=nonfinite, min_exp=-50 if fmt == "nvfp4-mse" else -100))
    with np.errstate(over="ignore"):
        w = w.astype(PACK_DTYPES[dtype])
    p = packed.pack(w, fmt)
    got = np.asarray(p.dequantize())  # W' [K, N]
    assert got.shape == shape and p.shape == shape
    wt = np.ascontiguousarray(w.astype(F32).T)
    if not np.isfinite(wt).all() and not fmt.startswith("mx"):
        assert np.isnan(got).all(), fmt
        return
    with np.errstate(over="ignore", invalid="ignore"):
        codes, want = _pack_oracle(wt, fmt)
    assert nv_ref.same_bits(got.T, want).all(), fmt
    ok = ~np.isnan(want.reshape(shape[1], -1, 32)).all(-1)  # MX: a poisoned block's codes are undefined
    per = codes.shape[-1] * 32 // shape[0]  # code bytes per 32 values
    np.testing.assert_array_equal(np.asarray(p.array.codes).view(np.uint8).reshape(shape[1], -1, per)[ok],
                                  codes.reshape(shape[1], -1, per)[ok])


@settings(max_examples=EXAMPLES["gguf_bytes"], **SETTINGS)
@given(data=st.data(), fmt=st.sampled_from(["nvfp4", "nvfp4-mse", "mxfp4"]), n=st.sampled_from([1, 3]))
def test_gguf_block_bytes_decode_as_gguf_reads_them(data, fmt, n):
    """The GGUF rows `ptq.export_gguf` writes (`nvfp4_bytes`, `mxfp4_bytes`) of a packed weight of any magnitude
    (zeros included) decode with gguf-py's own dequantizer (llama.cpp's reference, not ours) to the packed weight's
    values: NVFP4 times the tensor's ``.scale`` (S_dec), MXFP4 as is."""
    import gguf

    from jaxlowfp import packed
    from jaxlowfp.ptq.gguf_export import mxfp4_bytes, nvfp4_bytes

    w = data.draw(scaled((64, n), min_exp=-50))
    p = packed.pack(w, fmt)
    want = np.asarray(p.dequantize_t())  # [N, K]
    if fmt == "mxfp4":
        raw, qtype, s_dec = mxfp4_bytes(want), gguf.GGMLQuantizationType.MXFP4, F32(1.0)
    else:
        raw = nvfp4_bytes(np.asarray(p.array.codes), np.asarray(p.array.scales))
        qtype, s_dec = gguf.GGMLQuantizationType.NVFP4, F32(np.asarray(p.array.global_scale))
    got = gguf.quants.dequantize(raw, qtype).reshape(want.shape).astype(F32) * s_dec
    np.testing.assert_array_equal(got, want)  # -0 == +0: gguf-py decodes the E2M1 code 0x8 (-0) as +0


@functools.lru_cache(maxsize=1)
def _lp_program():
    from flax import nnx

    return jax.jit(lambda g, s, t: jax.nn.log_softmax(nnx.merge(g, s)(t), -1))


@settings(max_examples=EXAMPLES["export_load"], **SETTINGS)
@given(scheme=st.sampled_from(["nvfp4-mse", "fp8"]), layer=st.sampled_from(["gate_proj", "up_proj", "down_proj"]),
       k=st.integers(-60, 60), zero_row=st.integers(0, 63), bad=st.sampled_from([None, None, np.nan, np.inf]),
       where=st.integers(0, 64 * 64 - 1))
def test_export_then_load_is_the_quantized_model_or_a_clear_error(tmp_path_factory, scheme, layer, k, zero_row,
                                                                    bad, where):
    """`ptq.quantize_model` (RTN) -> `ptq.export` -> `models.load_export` of a tiny Llama one of whose MLP kernels
    is scaled by 2^k (2^-60 .. 2^60), has a zero row, and maybe a NaN / Inf at a drawn position: a finite model
    reloads as the in-memory quantized (fake-quant) model, every parameter and the log-probs bit for bit (one
    jitted program for both); a non-finite weight is a ValueError naming the layer, and no export is left."""
    import dataclasses

    from flax import nnx

    from jaxlowfp import models, ptq
    from jaxlowfp.models.llama import PRESETS, Llama

    model = Llama(dataclasses.replace(PRESETS["tiny"], n_layers=1), rngs=nnx.Rngs(0))
    kernel = model.blocks[0].mlp.__getattribute__(layer).kernel
    w = np.asarray(kernel[...]) * F32(2.0) ** k
    w[zero_row % w.shape[0]] = 0.0
    if bad is not None:
        w.reshape(-1)[where % w.size] = bad
    kernel.set_value(jnp.asarray(w))
    out = tmp_path_factory.mktemp("export") / "out"
    rules = [ptq.Rule(path=r"blocks/\d+/mlp/\w+_proj", scheme=ptq.scheme(scheme, weights_only=True))]
    if bad is not None:
        with pytest.raises(ValueError, match=rf"blocks/0/mlp/{layer}"):
            res = ptq.quantize_model(model, rules, method="rtn", progress=False)
            ptq.export(model, res, out)
        assert not out.exists()
        return
    res = ptq.quantize_model(model, rules, method="rtn", progress=False)
    ptq.export(model, res, out)
    back, _ = models.load_export(out, tokenizer=None)
    mine, theirs = (dict(nnx.to_flat_state(nnx.state(m, nnx.Param))) for m in (model, back))
    assert sorted(mine) == sorted(theirs)
    for name in mine:
        np.testing.assert_array_equal(np.asarray(theirs[name][...]), np.asarray(mine[name][...]), err_msg=str(name))
    tokens = jnp.asarray(np.arange(24, dtype=np.int32).reshape(2, 12) * 7 % 256)
    np.testing.assert_array_equal(_lp_program()(*nnx.split(back), tokens), _lp_program()(*nnx.split(model), tokens))
