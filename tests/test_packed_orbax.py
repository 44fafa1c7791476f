"""`ptq.save_packed` / `ptq.restore_packed`: every packed format comes back from orbax in a fresh process.

For each format the tiny Llama (one block, as tests/test_ptq_pack.py) is PTQ'd, packed and saved here; one child
process (`_CHILD`, nothing of this process's state) restores every checkpoint from its plan alone. The judges:
  - every leaf of the restored state (codes, block scales, global scales, the rest of the model) equals the original's
    bit for bit (compared as bytes), and its packed layers have the original's formats and backends;
  - the restored model's log-probs match those the original computed here with the same jitted function on the
    same machine (within float32 rounding: two processes, the same program);
and the refusals (another config, a plan that does not match the state, a directory without a plan, a model that
is not packed) change nothing.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("orbax.checkpoint")

from jaxlowfp import ptq  # noqa: E402
from jaxlowfp.models.llama import Llama, preset  # noqa: E402
from jaxlowfp.ptq.packed_checkpoint import PLAN_FILE, plan_of  # noqa: E402
from jaxlowfp.ptq.packing import packed_layers  # noqa: E402

# the packed layers: the MLP's two input projections (one shape: pack compiles its checks once per shape and format,
# the cost of this test); the attention and down projections stay float, so the tree mixes both
PACKED = r"blocks/0/mlp/(gate|up)_proj"
LOGITS = ("nvfp4-mse", "mxfp4", "hif8")  # the forward compared on these (one compile per format and process)
TOKENS = np.random.default_rng(0).integers(0, 256, (2, 16)).astype(np.int32)
# (scheme, quantize_model keywords): every packed format, with the PTQ activation quantizer kept by the packed
# layer (per-token scales) on some, weights only on one
FORMATS = {
    "nvfp4": ("nvfp4", {}),
    "nvfp4-mse": ("nvfp4-mse", {"activation_scale": "token"}),
    "if4": ("if4-mse", {}),
    "mxfp4": ("mxfp4", {"activation_scale": "token"}),
    "mxfp8": ("mxfp8", {}),
    "fp8": ("fp8", {"weights_only": True}),
    "hif8": ("hif8", {"activation_scale": "token"}),
}


@jax.jit
def _logprobs(graph, state, tokens):
    return jax.nn.log_softmax(nnx.merge(graph, state)(tokens), axis=-1)


def _leaves(model):
    """{leaf path: (dtype, bytes)} of the model's state."""
    out = {}
    for path, v in nnx.to_flat_state(nnx.state(model)):
        for sub, leaf in jax.tree_util.tree_flatten_with_path(v)[0]:
            a = np.asarray(leaf)
            out["/".join(map(str, path)) + jax.tree_util.keystr(sub)] = (str(a.dtype), a.tobytes().hex())
    return out


def _packed(name):
    scheme, kw = FORMATS[name]
    kw = dict(kw)
    wo = kw.pop("weights_only", False)
    model = Llama(preset("tiny", n_layers=1), rngs=nnx.Rngs(0))
    res = ptq.quantize_model(model, [ptq.Rule(path=PACKED, scheme=ptq.scheme(scheme, weights_only=wo))],
                             progress=False, **kw)
    ptq.pack_model(model, res)
    return model, res


_CHILD = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from flax import nnx
    from jaxlowfp import ptq
    from jaxlowfp.ptq.packing import packed_layers
    sys.path.insert(0, sys.argv[2])
    from test_packed_orbax import _leaves, _logprobs
    root = sys.argv[1]
    from jaxlowfp.ptq.packed_checkpoint import plan_of
    out = {}
    names, logits = json.load(open(f"{root}/names.json"))
    for name in names:
        model = ptq.restore_packed(f"{root}/{name}")
        layers = {p: [l.kernel.get_value().format.kind, l.plan().backend, l.act_quant is not None]
                  for p, l in packed_layers(model).items()}
        out[name] = {"leaves": _leaves(model), "layers": layers, "plan": plan_of(model)}
        if name in logits:
            lp = np.asarray(_logprobs(*nnx.split(model), np.load(f"{root}/tokens.npy")))
            out[name]["max_dlogp"] = float(np.max(np.abs(lp - np.load(f"{root}/{name}.npy"))))
    json.dump(out, open(f"{root}/child.json", "w"))
""")


def test_every_packed_format_comes_back_from_orbax_in_a_fresh_process(tmp_path):
    want = {}
    for name in FORMATS:
        model, _ = _packed(name)
        ptq.save_packed(model, tmp_path / name)
        if name in LOGITS:
            np.save(tmp_path / f"{name}.npy", np.asarray(_logprobs(*nnx.split(model), TOKENS)))
        layers = {p: [lay.kernel.get_value().format.kind, lay.plan().backend, lay.act_quant is not None]
                  for p, lay in packed_layers(model).items()}
        want[name] = (_leaves(model), layers, json.loads(json.dumps(plan_of(model))))
    np.save(tmp_path / "tokens.npy", TOKENS)
    (tmp_path / "names.json").write_text(json.dumps([list(FORMATS), list(LOGITS)]))
    tests_dir = str(__import__("pathlib").Path(__file__).parent)
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), tests_dir], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads((tmp_path / "child.json").read_text())
    for name in FORMATS:
        leaves, layers, plan = want[name]
        kind = FORMATS[name][0].split("-")[0]
        assert len(layers) == 2 and {v[0] for v in layers.values()} == {kind}, name
        assert got[name]["layers"] == layers, name
        assert got[name]["leaves"].keys() == leaves.keys(), name
        bad = [p for p in leaves if tuple(got[name]["leaves"][p]) != leaves[p]]
        assert not bad, (name, bad[:4])
        assert got[name]["plan"] == plan, name  # formats, backends, activation quantizers: the layers' statics
        if name in LOGITS:
            assert got[name]["max_dlogp"] <= 1e-6, (name, got[name]["max_dlogp"])
    # the per-token activation quantizer came back where it was
    assert all(v[2] for v in want["hif8"][1].values()) and not any(v[2] for v in want["fp8"][1].values())


def test_refusals(tmp_path):
    model, res = _packed("hif8")
    d = ptq.save_packed(model, tmp_path / "ok")
    with pytest.raises(ValueError, match="not an empty directory"):
        ptq.save_packed(model, d)
    # another config given to restore into
    other = nnx.eval_shape(lambda: Llama(preset("tiny", n_layers=2), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="n_layers"):
        ptq.restore_packed(d, other)
    # a plan that no longer matches the saved state (a layer's shape edited)
    plan = json.loads((d / PLAN_FILE).read_text())
    w = plan["layers"][0]["weight"]
    w["n"], w["array"]["codes"]["shape"][0] = w["n"] * 2, w["array"]["codes"]["shape"][0] * 2
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "state").symlink_to(d / "state")
    (bad / PLAN_FILE).write_text(json.dumps(plan))
    with pytest.raises(ValueError, match="does not match the saved state"):
        ptq.restore_packed(bad)
    fresh = nnx.eval_shape(lambda: Llama(preset("tiny", n_layers=1), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="does not match the saved state"):
        ptq.restore_packed(bad, fresh)
    assert not packed_layers(fresh)  # the refusal changed nothing
    with pytest.raises(ValueError, match="not a save_packed checkpoint"):
        ptq.restore_packed(tmp_path)
    # a fake-quant model (not packed) and one packed only in part
    fq = Llama(preset("tiny", n_layers=1), rngs=nnx.Rngs(0))
    r = ptq.quantize_model(fq, [ptq.Rule(path=PACKED, scheme=ptq.scheme("hif8"))], progress=False)
    with pytest.raises(ValueError, match="no packed layer"):
        ptq.save_packed(fq, tmp_path / "fq")
    ptq.pack_model(fq, r, paths=["blocks/0/mlp/up_proj"])
    with pytest.raises(ValueError, match="fake-quantized, not packed"):
        ptq.save_packed(fq, tmp_path / "part")
    assert not (tmp_path / "fq").exists() and not (tmp_path / "part").exists()
    with pytest.raises(ValueError, match="jaxlowfp.models"):
        ptq.save_packed(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), tmp_path / "lin")
    # the good checkpoint restores into a given abstract float model of its config, in place
    into = nnx.eval_shape(lambda: Llama(preset("tiny", n_layers=1), rngs=nnx.Rngs(0)))
    assert ptq.restore_packed(d, into) is into and len(packed_layers(into)) == 2
    assert jnp.array_equal(_logprobs(*nnx.split(into), TOKENS), _logprobs(*nnx.split(model), TOKENS))


_MOE_CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    from flax import nnx
    from jaxlowfp import ptq
    sys.path.insert(0, sys.argv[2])
    from test_packed_orbax import _leaves, _logprobs
    root = sys.argv[1]
    model = ptq.restore_packed(f"{root}/moe")
    lp = np.asarray(_logprobs(*nnx.split(model), np.load(f"{root}/tokens.npy")))
    json.dump({"leaves": _leaves(model), "max_dlogp": float(np.max(np.abs(lp - np.load(f"{root}/moe.npy"))))},
              open(f"{root}/child.json", "w"))
""")


def test_packed_experts_come_back_from_orbax_in_a_fresh_process(tmp_path):
    # a mixture-of-experts decoder: experts packed (PackedExperts) with their per-token activation quantizer
    # (RaggedActQuant at quant_<name>), attention projections packed (PackedLinear), router float
    from jaxlowfp.models.moe import MoEConfig, MoEDecoder
    from jaxlowfp.ptq.experts import RaggedActQuant
    from jaxlowfp.ptq.packing import PackedExperts

    cfg = MoEConfig(vocab=256, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=32,
                    n_experts=4, n_experts_per_tok=2, d_expert=64)
    model = MoEDecoder(cfg, rngs=nnx.Rngs(0))
    res = ptq.quantize_model(model, [ptq.Rule(path=r".*router", scheme=None),
                                     ptq.Rule(path=r".*(_proj|experts/.*)", scheme=ptq.scheme("nvfp4-mse"))],
                             progress=False, activation_scale="token")
    ptq.pack_model(model, res)
    experts = model.blocks[0].mlp.experts
    assert isinstance(experts.gate_proj, PackedExperts) and isinstance(experts.quant_gate_proj, RaggedActQuant)
    plan = plan_of(model)
    assert sorted(e["type"] for e in plan["layers"]).count("experts") == 3
    ptq.save_packed(model, tmp_path / "moe")
    np.save(tmp_path / "moe.npy", np.asarray(_logprobs(*nnx.split(model), TOKENS)))
    np.save(tmp_path / "tokens.npy", TOKENS)
    tests_dir = str(__import__("pathlib").Path(__file__).parent)
    proc = subprocess.run([sys.executable, "-c", _MOE_CHILD, str(tmp_path), tests_dir], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads((tmp_path / "child.json").read_text())
    leaves = _leaves(model)
    assert got["leaves"].keys() == leaves.keys()
    assert any("gate_proj" in p and "codes" in p for p in leaves)  # the experts' codes are leaves of the state
    bad = [p for p in leaves if tuple(got["leaves"][p]) != leaves[p]]
    assert not bad, bad[:4]
    assert got["max_dlogp"] <= 1e-6, got["max_dlogp"]
    # an expert weight left fake-quantized is refused before anything is written
    fq = MoEDecoder(cfg, rngs=nnx.Rngs(0))
    r = ptq.quantize_model(fq, [ptq.Rule(path=r".*router", scheme=None),
                                ptq.Rule(path=r".*(_proj|experts/.*)", scheme=ptq.scheme("nvfp4-mse"))],
                           progress=False)
    ptq.pack_model(fq, r, paths=[p for p in r.schemes])
    with pytest.raises(ValueError, match="fake-quantized, not packed"):
        ptq.save_packed(fq, tmp_path / "part")
    assert not (tmp_path / "part").exists()
