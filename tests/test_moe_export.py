"""Export of PTQ'd mixtures of experts (issue 29 item 4): compressed-tensors NVFP4 in the per-expert layout,
checked against what transformers + compressed-tensors read (tests/fixtures/moe/ct_consumer.npz, written by
scripts/moe_ct_consumer.py from the exports tests/fixtures/moe/{qwen3_moe,mixtral}_nvfp4), and the refusals."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlowfp import ptq
from jaxlowfp.models import load
from jaxlowfp.ptq import checkpoint
from moe_export_common import FAMILIES, FIX, TOKENS, quantized

CT = np.load(FIX / "ct_consumer.npz")
EXPERT = {"qwen3_moe": ("mlp", "gate_proj", "up_proj"), "mixtral": ("block_sparse_moe", "w1", "w3")}


@pytest.fixture(scope="module", params=FAMILIES)
def exported(request, tmp_path_factory):
    fam = request.param
    model, res, tok = quantized(fam)
    out = tmp_path_factory.mktemp(fam)
    rep = checkpoint.export(model, res, out, tokenizer=tok, dtype="float32")
    return fam, model, res, rep, checkpoint.read_safetensors(out / checkpoint.WEIGHTS_FILE), out


def _dtype(a):
    return {"float8_e4m3fn": "float8_e4m3fn"}.get(str(a.dtype), str(a.dtype))


def test_tensor_names_dtypes_shapes_are_what_the_consumer_read(exported):
    fam, _, _, _, tensors, _ = exported
    want = {n: (d, s) for n, d, s in zip(CT[f"{fam}_ct_names"], CT[f"{fam}_ct_dtypes"], CT[f"{fam}_ct_shapes"])}
    got = {n: (_dtype(a), str(tuple(a.shape))) for n, a in tensors.items()}
    assert got == want
    mlp, g, _ = EXPERT[fam]
    assert f"model.layers.1.{mlp}.experts.3.{g}.weight_packed" in got and f"model.layers.0.{mlp}.gate.weight" in got


def test_packed_codes_and_scales_are_the_committed_export(exported):
    """The same PTQ run rebuilds the integers the consumer read (E2M1 codes, E4M3 scale bytes) bit for bit."""
    fam, _, _, _, tensors, _ = exported
    committed = checkpoint.read_safetensors(FIX / f"{fam}_nvfp4" / checkpoint.WEIGHTS_FILE)
    for n, a in tensors.items():
        if n.endswith(("weight_packed", "weight_scale")):
            np.testing.assert_array_equal(a.view(np.uint8), committed[n].view(np.uint8), err_msg=n)


def test_every_expert_decodes_as_compressed_tensors_decodes_it(exported):
    """Our weights vs compressed-tensors' unpack + dequantize in float32: it computes q * (s / g), we (q * s) * (1 / g)
    (`jaxlowfp.ptq.checkpoint`): two float32 roundings on each side, at most 2 ulp apart; its
    NVFP4PackedCompressor.decompress itself (bfloat16) is our weight rounded to bfloat16 (within one bfloat16 ulp:
    it rounds after its own float32 arithmetic)."""
    fam, model, res, _, _, _ = exported
    names = json.loads((FIX / f"{fam}_nvfp4" / checkpoint.META_FILE).read_text())["tensor_names"]
    params = {"/".join(map(str, p)): v for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)}
    checked = 0
    for path, name in names.items():
        per = name if isinstance(name, list) else [name]
        w = np.asarray(params[path][...], np.float32)
        for e, n in enumerate(per):
            key = f"{fam}_w__{n[: -len('.weight')]}"
            if key not in CT:
                continue
            ours = (w[e] if isinstance(name, list) else w).T
            np.testing.assert_array_max_ulp(CT[key], ours, maxulp=2)
            bf = CT[f"{fam}_bf16__{n[: -len('.weight')]}"]
            np.testing.assert_allclose(bf, ours, rtol=2.0 ** -8, atol=0)
            checked += 1
    assert checked == sum(1 for k in CT.files if k.startswith(f"{fam}_w__")) and checked > 16


def test_log_probs_match_transformers_on_compressed_tensors_weights(exported):
    """transformers' float32 model on compressed-tensors' decoded weights (the fixture) vs our fake-quantized model.
    Tolerance 2e-5 on log-probs (measured: 1.9e-6 for both families), float32
    rounding of two different programs (summation order of the matmuls and the
    softmax, over 2 layers of width 32) and the 1-ulp decoding difference of about a quarter of the weights; routing
    is the same (no top-k tie within those margins on this sequence, else the error would be O(1))."""
    fam, model, _, _, _, _ = exported
    ours = jax.nn.log_softmax(jax.jit(lambda m, x: m(x))(model, jnp.asarray(TOKENS))[0], -1)
    np.testing.assert_allclose(np.asarray(ours), CT[f"{fam}_logprobs"], atol=2e-5, rtol=0)


def test_transformers_own_load_drops_the_expert_global_scale():
    """Recorded consumer gap (transformers 5.24.0): its fused-expert decompression never passes weight_global_scale,
    so the experts it loads are S_enc times ours; dense layers load right."""
    for fam in FAMILIES:
        mlp, g, _ = EXPERT[fam]
        committed = checkpoint.read_safetensors(FIX / f"{fam}_nvfp4" / checkpoint.WEIGHTS_FILE)
        s = float(committed[f"model.layers.0.{mlp}.experts.0.{g}.weight_global_scale"][0])
        ratio = CT[f"{fam}_hf_ratio"]
        np.testing.assert_allclose(ratio[ratio != 0], s, rtol=2.0 ** -7)


def test_gate_and_up_share_one_global_scale_per_expert(exported):
    fam, _, _, _, tensors, _ = exported
    mlp, g, u = EXPERT[fam]
    scales = []
    for e in range(4):
        a = tensors[f"model.layers.0.{mlp}.experts.{e}.{g}.weight_global_scale"]
        b = tensors[f"model.layers.0.{mlp}.experts.{e}.{u}.weight_global_scale"]
        np.testing.assert_array_equal(a, b)
        scales.append(float(a[0]))
    assert len(set(scales)) > 1  # per expert, not one for the layer


def test_an_expert_no_token_reaches_exports_finite_scales(tmp_path):
    """W4A4 experts, calibrated on one repeated token: the experts no token reaches fall back (warned), and every
    weight_global_scale / input_global_scale written is finite and > 0; gate and up share the input scale."""
    model, _ = load(FIX / "qwen3_moe")
    rules = [ptq.Rule(path=r"blocks/\d+/mlp/experts/.*", scheme=ptq.scheme("nvfp4-mse"))]
    with pytest.warns(RuntimeWarning, match=r"experts \[.*\] saw fewer than 1 calibration token"):
        res = ptq.quantize_model(model, rules, method="rtn", calibration=np.full((2, 8), 7, np.int32),
                                 activation_scale="token")  # the calibration amax is exported whatever the scaling
    assert any(r.fallback for r in res.experts.values())
    checkpoint.export(model, res, tmp_path)
    t = checkpoint.read_safetensors(tmp_path / checkpoint.WEIGHTS_FILE)
    gs = {n: float(v[0]) for n, v in t.items() if n.endswith("global_scale")}
    assert len([n for n in gs if ".experts." in n and n.endswith("input_global_scale")]) == 2 * 8 * 3
    assert all(np.isfinite(v) and v > 0 for v in gs.values())
    for e in range(8):
        p = f"model.layers.0.mlp.experts.{e}."
        assert gs[p + "gate_proj.input_global_scale"] == gs[p + "up_proj.input_global_scale"]
    targets = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["config_groups"]
    assert any("model.layers.1.mlp.experts.7.down_proj" in g["targets"] for g in targets.values())


def test_kept_experts_are_ignored_and_written_per_expert(exported):
    fam, _, _, _, tensors, out = exported
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    mlp = EXPERT[fam][0]
    assert f"model.layers.0.{mlp}.gate" in ignore
    if fam == "mixtral":  # down_proj (w2) has 24 inputs: kept in high precision
        assert "model.layers.0.block_sparse_moe.experts.2.w2" in ignore
        assert tensors["model.layers.0.block_sparse_moe.experts.2.w2.weight"].shape == (32, 24)


def test_gguf_expert_tensors_read_back_by_gguf_to_our_weights(exported, tmp_path):
    """GGUF: every ``blk.N.ffn_{gate,up,down}_exps.weight`` [E, out, in] and ``ffn_gate_inp`` as `gguf`'s own reader
    and dequantizer (gguf.quants) read them equals our (quantized) weights; the per-expert global scales have no
    GGUF NVFP4 encoding (one ``.scale`` per tensor), so the experts are F32, with a note saying so."""
    import gguf

    fam, model, res, _, _, _ = exported
    rep = ptq.export_gguf(model, res, tmp_path / "m.gguf", tokenizer_json=FIX / fam / "tokenizer.json")
    assert any("ffn_gate_exps" in n and "written as F32" in n for n in rep.notes)
    params = {"/".join(map(str, p)): v for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)}
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    got = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
           for t in reader.tensors}
    n_exps = 0
    for i in range(2):
        for ours, theirs in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            w = np.swapaxes(np.asarray(params[f"blocks/{i}/mlp/experts/{ours}"][...], np.float32), -1, -2)
            # kept (Mixtral's down_proj): F32, the evaluated dtype (PTQResult.dtype), exactly
            np.testing.assert_array_equal(got[f"blk.{i}.ffn_{theirs}_exps.weight"], w)
            n_exps += 1
        router = np.asarray(params[f"blocks/{i}/mlp/router/kernel"][...], np.float32).T
        np.testing.assert_array_equal(got[f"blk.{i}.ffn_gate_inp.weight"], router)  # F32: the evaluated dtype
    assert n_exps == 6
    assert rep.types["blk.0.ffn_gate_exps.weight"] == "F32"  # (d_model 32: dense rows are not whole 64-blocks either)


def test_gguf_refuses_w4a4_experts(tmp_path):
    model, _ = load(FIX / "qwen3_moe")
    res = ptq.quantize_model(model, [ptq.Rule(path=r"blocks/\d+/mlp/experts/.*", scheme=ptq.scheme("nvfp4-mse"))],
                             method="rtn", calibration=np.full((2, 8), 7, np.int32), activation_scale="token")
    with pytest.raises(ValueError, match="quantize their inputs"):
        ptq.export_gguf(model, res, tmp_path / "m.gguf", tokenizer_json=FIX / "qwen3_moe" / "tokenizer.json")


def test_load_rebuilds_the_exported_moe(exported):
    """`ptq.checkpoint.load` of a MoE export into a fresh model gives the same log-probs (same program: bitwise)."""
    fam, model, _, _, _, out = exported
    fresh, _ = load(FIX / fam)
    schemes = checkpoint.load(fresh, out)
    assert any("/experts/" in p for p in schemes)
    run = jax.jit(lambda m, x: m(x))
    x = jnp.asarray(TOKENS)
    np.testing.assert_array_equal(np.asarray(run(fresh, x)), np.asarray(run(model, x)))


def test_gguf_mxfp4_experts_are_mxfp4_tensors_gguf_reads_back(tmp_path):
    """MXFP4 has no global scale, so MXFP4 experts need none of NVFP4's per-expert scales: each
    ``ffn_{gate,up}_exps`` is one type-39 tensor [E, out, in] (llama.cpp's MXFP4 MoE layout), which gguf's
    dequantizer reads back to our quantized weights bit for bit (Qwen3-MoE's down_proj, 16 inputs, is not whole
    32-value blocks and is kept)."""
    import gguf

    model, _ = load(FIX / "qwen3_moe")
    res = ptq.quantize_model(model, [ptq.Rule(path=r"blocks/\d+/mlp/experts/(gate|up)_proj",
                                              scheme=ptq.scheme("mxfp4", weights_only=True))],
                             calibration=np.asarray(TOKENS), progress=False)
    rep = ptq.export_gguf(model, res, tmp_path / "m.gguf", tokenizer_json=FIX / "qwen3_moe" / "tokenizer.json")
    params = {"/".join(map(str, p)): v for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)}
    checked = 0
    for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors:
        if "_exps" in t.name and "down" not in t.name:
            assert t.tensor_type == gguf.GGMLQuantizationType.MXFP4 and rep.types[t.name] == "MXFP4"
            got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
            i, which = t.name.split(".")[1], t.name.split("_")[1]
            ours = np.asarray(params[f"blocks/{i}/mlp/experts/{which}_proj"][...], np.float32)
            np.testing.assert_array_equal(got, np.swapaxes(ours, -1, -2), err_msg=t.name)
            checked += 1
    assert checked == 4
    back, _ = load(tmp_path / "m.gguf")  # our loader: the quantized experts, F32 (evaluated dtype) elsewhere
    tokens = jnp.asarray(TOKENS)
    fwd = jax.jit(lambda m, x: m(x))  # one program per model structure (eagerly: ~200 one-op compilations)
    assert float(jnp.max(jnp.abs(fwd(back, tokens) - fwd(model, tokens)))) < 1e-2
