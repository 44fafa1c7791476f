"""jaxlowfp.ptq: GPTQ against RTN and a textbook float64 oracle, SmoothQuant / AWQ folds are exact, the exported
compressed-tensors checkpoint matches that convention and reloads bit-identically, reports and errors."""
import json

import en_dtypes
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxlowfp import ptq
from jaxlowfp.ptq import calibrate, checkpoint
from jaxlowfp import Format as TensorFormat
from jaxlowfp.models.llama import PRESETS, Llama

FORMATS = [TensorFormat(kind="nvfp4", rule=r) for r in ("static_6", "static_4", "abs_max", "mae", "mse")] + [
    TensorFormat(kind="nvfp4", rule="mse", block_shape=(16, 16)), TensorFormat(kind="mxfp4"),
    TensorFormat(kind="hif8")]
IDS = [f.name for f in FORMATS]
LAYERS = r"blocks/\d+/(attn|mlp)/\w+_proj"


@pytest.fixture(scope="module")
def layer():
    """A fixture layer: kernel [64, 48] and correlated inputs X [512, 64] with a few outlier channels."""
    rng = np.random.default_rng(0)
    kernel = rng.standard_normal((64, 48)).astype(np.float32) * 0.1
    x = rng.standard_normal((512, 64)) @ rng.standard_normal((64, 64)) * 0.3
    x[:, :4] *= 8.0
    x = x.astype(np.float32)
    return jnp.asarray(kernel), x, jnp.asarray(2.0 * x.T @ x / len(x))


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_gptq_reconstruction_below_rtn(layer, fmt):
    kernel, x, h = layer
    err = lambda q: float(np.linalg.norm(x @ np.asarray(kernel) - x @ np.asarray(q)))  # noqa: E731
    rtn = err(ptq.rtn_weight(kernel, fmt).kernel)
    for cfg in (ptq.GPTQ(), ptq.GPTQ(act_order=True)):  # one compilation: the order is data
        g = ptq.gptq_weight(kernel, h, fmt, cfg)
        assert err(g.kernel) < 0.8 * rtn, (cfg, err(g.kernel), rtn)
        if g.packed is not None:  # the packed codes and scales are exactly the weights the model computes with
            np.testing.assert_array_equal(np.asarray(g.packed.dequantize(jnp.float32).T), np.asarray(g.kernel))


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_gptq_without_correlation_is_rtn_bit_for_bit(layer, fmt):
    """H = I: nothing feeds back, so the fixed-scale column quantizer must reproduce nvfp4.quantize / mx /
    qat.scaled_round (each verified against its own oracle) bit for bit, scales and 4/6 choices included."""
    kernel, _, _ = layer
    rtn = ptq.rtn_weight(kernel, fmt)
    g = ptq.gptq_weight(kernel, jnp.eye(64, dtype=jnp.float32), fmt, ptq.GPTQ(act_order=True))
    np.testing.assert_array_equal(np.asarray(g.kernel), np.asarray(rtn.kernel))
    if fmt.kind == "nvfp4":
        np.testing.assert_array_equal(np.asarray(g.packed.codes), np.asarray(rtn.packed.codes))
        np.testing.assert_array_equal(np.asarray(g.packed.scales.astype(jnp.float32)),
                                      np.asarray(rtn.packed.scales.astype(jnp.float32)))


def _textbook_gptq(w: np.ndarray, h: np.ndarray, quant, damp: float = 0.01) -> np.ndarray:
    """GPTQ as in Frantar et al. (Algorithm 1, one column at a time, no lazy batches) in float64 numpy."""
    w = w.astype(np.float64).copy()
    h = h.astype(np.float64) + damp * np.mean(np.diag(h)) * np.eye(len(h))
    u = np.linalg.cholesky(np.linalg.inv(h)).T
    q = np.zeros_like(w)
    for j in range(w.shape[1]):
        q[:, j] = quant(w[:, j])
        e = (w[:, j] - q[:, j]) / u[j, j]
        w[:, j + 1:] -= np.outer(e, u[j, j + 1:])
    return q


def test_gptq_matches_textbook_oracle_hif8(layer):
    """The error feedback against an independent float64 GPTQ whose quantizer is the en_dtypes HiF8 cast
    (per-tensor scale amax / 15, clip at 15, as the HiF8 scheme)."""
    kernel, x, h = layer
    wt = np.asarray(kernel).T
    scale = np.float32(np.max(np.abs(wt)) / np.float32(15.0))

    def quant(col):
        y = np.clip((col.astype(np.float32) * (np.float32(1) / scale)), -15, 15)
        return y.astype(en_dtypes.hifloat8).astype(np.float32) * scale

    ref = _textbook_gptq(wt, np.asarray(h), quant)
    got = np.asarray(ptq.gptq_weight(kernel, h, TensorFormat(kind="hif8")).kernel).T
    same = np.mean(got == ref.astype(np.float32))
    assert same > 0.97, same  # float32 vs float64 feedback can flip a rare rounding tie
    e_ref = np.linalg.norm(x @ (wt - ref).T)
    e_got = np.linalg.norm(x @ (wt - got).T)
    assert abs(e_got - e_ref) < 0.02 * e_ref


# ---------------------------------------------------------------------------------------------------------------
# whole models


def _model() -> Llama:
    return Llama(PRESETS["tiny"], rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def tokens():
    return jnp.asarray(np.random.default_rng(1).integers(0, 256, (4, 32)), jnp.int32)


@pytest.mark.parametrize("method", [ptq.SmoothQuant(alpha=0.5), ptq.AWQ(grid=4)], ids=["smoothquant", "awq"])
def test_smoothing_without_quantization_keeps_outputs(tokens, method):
    model = _model()
    for block in model.blocks:  # outlier channels, as real models have, so that the scales are not all 1
        for norm in (block.attn_norm, block.mlp_norm):
            norm.scale.set_value(norm.scale[...].at[:3].multiply(30.0))
    ref = model(tokens)
    layers = [p for p in calibrate.linear_modules(model) if p != "lm_head"]
    stats = ptq.collect(model, layers, [tokens], samples_per_batch=64, progress=False)
    pairs, skipped = model.smoothing_folds()  # the model family says which op precedes which projections
    folds = [ptq.Fold(prev=prev, layers=layers) for prev, layers in pairs]
    assert len(folds) == 3 * PRESETS["tiny"].n_layers  # qkv, gate/up, down; o_proj skipped (grouped-query)
    assert [p for p, _ in skipped] == [f"blocks/{i}/attn/o_proj" for i in range(PRESETS["tiny"].n_layers)]
    before = np.asarray(model.blocks[0].mlp_norm.scale[...])
    ptq.smooth_model(model, method, folds, {p: ptq.scheme("nvfp4-mse") for p in layers}, stats)
    assert not np.allclose(np.asarray(model.blocks[0].mlp_norm.scale[...]), before)  # the outliers did move
    # float32 rounding only (scales up to ~30 change the rounding; quantization would move logits by ~1e-1)
    np.testing.assert_allclose(np.asarray(model(tokens)), np.asarray(ref), rtol=1e-4, atol=2e-4)


def test_v_to_o_fold_without_grouped_query(tokens):
    cfg = PRESETS["tiny"]
    import dataclasses

    model = Llama(dataclasses.replace(cfg, n_kv_heads=cfg.n_heads), rngs=nnx.Rngs(0))
    pairs, skipped = model.smoothing_folds()
    folds = [ptq.Fold(prev=prev, layers=layers) for prev, layers in pairs]
    assert not skipped and ptq.Fold(prev="blocks/0/attn/v_proj", layers=("blocks/0/attn/o_proj",)) in folds
    ref = model(tokens)
    layers = [p for p in calibrate.linear_modules(model) if p != "lm_head"]
    stats = ptq.collect(model, layers, [tokens], progress=False)
    ptq.smooth_model(model, ptq.SmoothQuant(), folds, {p: ptq.scheme("hif8") for p in layers}, stats)
    np.testing.assert_allclose(np.asarray(model(tokens)), np.asarray(ref), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("method", ptq.METHODS)
def test_methods_quantize_the_model(tokens, method):
    """Every method quantizes every matched layer onto the format's grid and moves the logits a little."""
    model = _model()
    ref = model(tokens)
    res = ptq.quantize_model(model, [ptq.Rule(path=r"blocks/(1|2)/mlp/\w+_proj", scheme=ptq.scheme("nvfp4-mse"))],
                       method=method, calibration=tokens, progress=False)
    assert {p for p, _ in res.report.quantized} == {f"blocks/{i}/mlp/{n}_proj" for i in (1, 2)
                                                    for n in ("gate", "up", "down")}
    assert len(res.report.unmatched) == 4 * 7 + 1 - 6 and res.report.unused_rules == ()
    lin = model.blocks[1].mlp.down_proj
    arr, _ = res.packed["blocks/1/mlp/down_proj"]
    np.testing.assert_array_equal(np.asarray(arr.dequantize(jnp.float32).T), np.asarray(lin.kernel[...]))
    assert isinstance(lin.dot_general, ptq.ActQuant)
    assert set(res.act_amax) == {p for p, _ in res.report.quantized}
    if method in ("smoothquant", "awq"):
        assert {f.prev for f in res.folds} == {"blocks/1/mlp_norm", "blocks/1/mlp/up_proj", "blocks/2/mlp_norm",
                                               "blocks/2/mlp/up_proj"}
    out = np.asarray(model(tokens))
    rel = np.linalg.norm(out - np.asarray(ref)) / np.linalg.norm(np.asarray(ref))
    assert 1e-4 < rel < 0.5, rel


def _unpack_compressed_tensors(packed: np.ndarray) -> np.ndarray:
    """compressed-tensors' unpack_fp4_from_uint8: low nibble first, bit 3 the sign, bits 0-2 index the
    magnitudes (0, .5, 1, 1.5, 2, 3, 4, 6)."""
    table = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
    nib = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    return table[nib & 7] * np.where(nib & 8, -1.0, 1.0).astype(np.float32)


@pytest.mark.parametrize("weights_only,block", [(False, (1, 16)), (True, (16, 16))], ids=["w4a4", "w4a16-16x16"])
def test_export_follows_compressed_tensors_and_reloads_bit_identically(tmp_path, tokens, weights_only, block):
    model = _model()
    sch = ptq.scheme("nvfp4-mse", weights_only=weights_only, weight_block=block)
    res = ptq.quantize_model(model, [ptq.Rule(path=r"blocks/[12]/mlp/\w+_proj", scheme=sch)], method="gptq",
                       calibration=tokens, progress=False)
    ptq.export(model, res, tmp_path, dtype="float32")  # high precision kept exact (the default: PTQResult.dtype)
    tensors = checkpoint.read_safetensors(tmp_path / checkpoint.WEIGHTS_FILE)
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "nvfp4-pack-quantized"
    assert cfg["config_groups"]["group_0"]["weights"]["group_size"] == 16
    assert (cfg["config_groups"]["group_0"]["input_activations"] is None) == weights_only
    assert "lm_head" in cfg["ignore"] and "model.layers.1.self_attn.q_proj" in cfg["ignore"]  # Linears in float32
    assert len(cfg["config_groups"]["group_0"]["targets"]) == 6
    m = "model.layers.2.mlp.gate_proj"  # a Llama is written with its Hugging Face names
    packed, scale = tensors[f"{m}.weight_packed"], tensors[f"{m}.weight_scale"]
    gs = tensors[f"{m}.weight_global_scale"]
    assert packed.dtype == np.uint8 and scale.dtype == ml_dtypes.float8_e4m3fn and gs.dtype == np.float32
    assert packed.shape == (192, 32) and scale.shape == (192, 4) and gs.shape == (1,)
    assert (f"{m}.input_global_scale" in tensors) != weights_only
    # the convention's dequantization, w = fp4 * weight_scale / weight_global_scale, against our kernel
    w = _unpack_compressed_tensors(packed) * np.repeat(scale.astype(np.float32), 16, axis=1) / gs[0]
    np.testing.assert_allclose(w, np.asarray(model.blocks[2].mlp.gate_proj.kernel[...]).T, rtol=1e-6, atol=0)
    assert tensors["model.layers.0.input_layernorm.weight"].dtype == np.float32

    fresh = _model()
    schemes = ptq.load(fresh, tmp_path)
    assert schemes == res.schemes
    np.testing.assert_array_equal(np.asarray(fresh(tokens)), np.asarray(model(tokens)))


def test_report_kept_unmatched_and_unused_rules(tokens):
    model = _model()
    rules = [ptq.Rule(path=r"blocks/0/.*", scheme=None), ptq.Rule(path=r"blocks/\d+/mlp/.*", scheme=ptq.scheme("hif8")),
             ptq.Rule(path=r"nothing/here", scheme=ptq.scheme("mxfp4"))]
    res = ptq.quantize_model(model, rules, method="rtn", progress=False)
    rep = res.report
    assert {p for p, _ in rep.kept} == {f"blocks/0/{x}" for x in ("attn/q_proj", "attn/k_proj", "attn/v_proj",
                                                                  "attn/o_proj", "mlp/gate_proj", "mlp/up_proj",
                                                                  "mlp/down_proj")}
    assert rep.unused_rules == ("nothing/here",)
    assert "blocks/1/attn/q_proj" in rep.unmatched and ("blocks/1/mlp/up_proj", "hif8") in rep.quantized
    assert "unused rules (decided no module): 'nothing/here'" in str(rep)
    assert res.act_amax == {}  # RTN without calibration


def test_bad_options(tokens):
    model = _model()
    rule = [ptq.Rule(path=LAYERS, scheme=ptq.scheme("nvfp4-mse"))]
    with pytest.raises(ValueError, match="unknown PTQ method 'gptqq'"):
        ptq.quantize_model(model, rule, method="gptqq", calibration=tokens)
    with pytest.raises(ValueError, match="scheme='nvfp4-mxe' is not supported"):
        ptq.scheme("nvfp4-mxe")
    with pytest.raises(ValueError, match="rule='sixes' is not supported"):
        TensorFormat(kind="nvfp4", rule="sixes")
    with pytest.raises(ValueError, match=r"integer token array \[n_sequences, seq_len\]"):
        ptq.quantize_model(model, rule, method="gptq", calibration=np.zeros((4, 32), np.float32))
    with pytest.raises(ValueError, match=r"integer token array \[n_sequences, seq_len\]"):
        ptq.quantize_model(model, rule, method="gptq", calibration=np.zeros(32, np.int32))
    with pytest.raises(ValueError, match="needs calibration data"):
        ptq.quantize_model(model, rule, method="awq")
    with pytest.raises(ValueError, match="no nnx.Linear layer matches a rule"):
        ptq.quantize_model(model, [ptq.Rule(path="encoder/.*", scheme=ptq.scheme("hif8"))])
    with pytest.raises(ValueError, match="in_features to be a multiple of 32"):
        ptq.quantize_model(nnx.Sequential(nnx.Linear(48, 32, rngs=nnx.Rngs(0))),
                           [ptq.Rule(path=".*", scheme=ptq.scheme("mxfp4"))])
    with pytest.raises(TypeError, match="must be a jaxlowfp.rules.Rule"):
        ptq.quantize_model(model, ["blocks/.*"])
    # nothing was changed by the failed calls
    assert all(not isinstance(lin.dot_general, ptq.ActQuant) for lin in calibrate.linear_modules(model).values())


def test_cli_arguments():
    from train import ptq_cli

    args = ptq_cli.parse_args(["--methods", "rtn,gptq", "--formats", "nvfp4-mse,hif8", "--mc-items", "0"])
    assert args.methods == ["rtn", "gptq"] and args.formats == ["nvfp4-mse", "hif8"] and args.mc_items == 0
    assert args.calib_seqs == ptq_cli.SMALL["calib_seqs"]
    assert ptq_cli.parse_args(["--full"]).max_tokens == ptq_cli.FULL["max_tokens"]
    for bad in (["--methods", "gptqq"], ["--formats", "nvfp5"], ["--alpha", "2"]):
        with pytest.raises(SystemExit):
            ptq_cli.parse_args(bad)
    rows = [{"method": "rtn", "format": "nvfp4-static_6", "mean": 30.0},
            {"method": "rtn", "format": "nvfp4-mse", "mean": 25.0}]
    (line,) = ptq_cli.verdicts(rows, hp=20.0)
    assert "4/6 beat static_6 with 1 of 1 rules" in line and "+50 % of the gap" in line


def test_cli_variants_start_from_the_high_precision_weights(tokens):
    """Every method x format variant of the experiment starts from the same high-precision parameters: quantizing
    one restored copy must not leak into the next (nnx.merge without copy shares the Variables)."""
    from train import ptq_cli

    graphdef, state = nnx.split(_model())
    first = ptq_cli._restore(graphdef, state)
    hp = np.asarray(first.blocks[1].mlp.up_proj.kernel[...])
    ptq.quantize_model(first, [ptq.Rule(path=LAYERS, scheme=ptq.scheme("nvfp4-mse"))], progress=False)
    assert not np.array_equal(np.asarray(first.blocks[1].mlp.up_proj.kernel[...]), hp)
    np.testing.assert_array_equal(np.asarray(ptq_cli._restore(graphdef, state).blocks[1].mlp.up_proj.kernel[...]), hp)
