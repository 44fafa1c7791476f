"""jaxlowfp.sharding and sharded streaming loading on simulated CPU devices (conftest: 4 in this process; 8 in a
subprocess): the Llama rule presets, clear errors for a bad mesh or rule set, and `jaxlowfp.models.load(...,
mesh=...)` of tiny safetensors (single file, sharded index) and GGUF (F32, Q8_0, Q4_1 blocks split across shards,
q/k rows permuted) checkpoints equal to the unsharded load bit for bit, each device holding only its shard, every
read a shard's slice, and the sharded model's logits those of the numpy oracle (tests/test_models_oracle.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from test_models_gguf import write_gguf
from test_models_hf import CFG, write_hf
from test_models_oracle import forward, random_weights, read_gguf
from jaxlowfp import sharding
from jaxlowfp.models import Llama, gguf_loader, hf_loader, load, preset
from jaxlowfp.sharding import P, ShardingError, ShardRule
from conftest import child_xla_flags

T = gguf.GGMLQuantizationType
ROOT = Path(__file__).resolve().parents[1]


def abstract_tiny(**kw) -> Llama:
    return nnx.eval_shape(lambda: Llama(preset("tiny", **kw), rngs=nnx.Rngs(0)))


def shapes_of(model) -> dict:
    return {p: v.get_value().shape for p, v in sharding.variable_paths(model).items()}


def test_make_mesh_has_every_axis():
    mesh = sharding.make_mesh("fsdp=2,tensor=2")
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 2, "expert": 1}
    assert dict(sharding.make_mesh({"tensor": 4}).shape)["tensor"] == 4
    assert dict(sharding.make_mesh().shape)["data"] == 4
    with pytest.raises(ValueError, match=r"mesh axis 'model=2' .* axes from data, fsdp, tensor, expert"):
        sharding.make_mesh("model=2")
    with pytest.raises(ValueError, match=r"needs data\*fsdp\*tensor\*expert = 8 devices; 4 are available"):
        sharding.make_mesh("fsdp=8")


def test_llama_rules_give_maxtext_layout():
    mesh = sharding.make_mesh("fsdp=2,tensor=2")
    specs = sharding.partition_specs(shapes_of(abstract_tiny()), sharding.llama_rules(), mesh)
    assert specs["blocks/0/attn/q_proj/kernel"] == P("fsdp", "tensor")  # [d_model, heads]: column parallel
    assert specs["blocks/3/mlp/down_proj/kernel"] == P("tensor", "fsdp")  # [d_ff, d_model]: row parallel
    assert specs["embed/embedding"] == P("tensor", "fsdp")
    assert specs["lm_head/kernel"] == P("fsdp", "tensor")
    assert specs["blocks/0/attn_norm/scale"] == P()
    fsdp = sharding.partition_specs(shapes_of(abstract_tiny()), sharding.fsdp_rules(), mesh)
    tp = sharding.partition_specs(shapes_of(abstract_tiny(tie_embeddings=True, qkv_bias=True)),
                          sharding.tensor_parallel_rules(), mesh)
    assert (fsdp["blocks/1/mlp/up_proj/kernel"], fsdp["blocks/1/attn/o_proj/kernel"]) == (P("fsdp", None),
                                                                                           P(None, "fsdp"))
    assert (tp["blocks/1/mlp/up_proj/kernel"], tp["blocks/1/attn/q_proj/bias"]) == (P(None, "tensor"), P())


def test_expert_rules_hook():
    mesh = sharding.make_mesh("expert=2,tensor=2")
    shapes = {"blocks/0/moe/up_proj": (8, 64, 96), "blocks/0/moe/down_proj": (8, 96, 64), "blocks/0/router": (64, 8)}
    rules = (sharding.expert_rules(r"blocks/\d+/moe/up_proj"),
             sharding.expert_rules(r"blocks/\d+/moe/down_proj", row_parallel=True), ShardRule(path=".*"))
    specs = sharding.partition_specs(shapes, rules, mesh)
    assert specs == {"blocks/0/moe/up_proj": P("expert", "fsdp", "tensor"),
                     "blocks/0/moe/down_proj": P("expert", "tensor", "fsdp"), "blocks/0/router": P()}


@pytest.mark.parametrize("mesh,rules,match", [
    ("fsdp=4", (ShardRule(path="blocks/0/attn/q_proj/kernel", spec=("model", None)), ShardRule(path=".*")),
     r"ShardRule\(path='blocks/0/attn/q_proj/kernel'\) names mesh axis 'model', which the mesh does not have "
     r"\(axes: data, fsdp, tensor, expert\)"),
    ("tensor=4", sharding.llama_rules(),
     r"parameter blocks/0/mlp/(gate|up|down)_proj/kernel has shape \((64, 90|90, 64)\): mesh axis 'tensor' \(size 4\)"
     r" of ShardRule.* does not divide its dimension [01] \(90\)"),
    ("fsdp=4", (sharding.expert_rules(r"blocks/\d+/moe/\w+"), *sharding.llama_rules()),
     r"ShardRule\(path='blocks/\\\\d\+/moe/\\\\w\+'\) matches no parameter of the model"),
    ("fsdp=4", sharding.llama_rules()[:3], r"no sharding rule matches parameter blocks/0/attn_norm/scale"),
    ("fsdp=4", (ShardRule(path="embed/embedding", spec=("fsdp", None, None)), ShardRule(path=".*")),
     r"parameter embed/embedding has shape \(256, 64\), but ShardRule\(path='embed/embedding'\) gives 3 dim"),
])
def test_bad_mesh_or_rules_are_clear_errors(mesh, rules, match):
    shapes = shapes_of(abstract_tiny(d_ff=90))
    with pytest.raises(ShardingError, match=match):
        sharding.partition_specs(shapes, rules, sharding.make_mesh(mesh))


def test_shard_rule_validation():
    with pytest.raises(ValueError, match="uses mesh axis 'fsdp' for two dimensions"):
        ShardRule(path="x", spec=("fsdp", "fsdp"))
    with pytest.raises(ValueError, match="not a valid regular expression"):
        ShardRule(path="(", spec=())
    with pytest.raises(TypeError, match="every spec entry must be an axis name"):
        ShardRule(path="x", spec=(3,))


# ---------------------------------------------------------------------------------------------------------------
# sharded streaming loading


def _write(tmp_path, kind: str) -> Path:
    if kind.startswith("gguf"):
        path = tmp_path / "m.gguf"
        qtype = {"gguf-f32": T.F32, "gguf-q8_0": T.Q8_0, "gguf-q4_1": T.Q4_1}[kind]
        write_gguf(path, random_weights(CFG, seed=5), qtype=qtype)
        return path
    write_hf(tmp_path, random_weights(CFG, seed=5), shards=2 if kind == "hf-index" else 1,
             index=kind == "hf-index")
    return tmp_path


def _variables(model) -> dict:
    return {p: v.get_value() for p, v in sharding.variable_paths(model).items()}


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({4: np.uint32, 2: np.uint16}[a.dtype.itemsize])


def _shard_bytes(x: jax.Array) -> int:
    """Bytes of one device's shard of `x` by its PartitionSpec."""
    parts = np.prod([x.sharding.mesh.shape[a] for e in x.sharding.spec if e is not None
                     for a in (e if isinstance(e, tuple) else (e,))])
    return x.nbytes // int(parts)


@pytest.fixture
def reads(monkeypatch):
    """Every slice any loader reads, as (tensor, index, tensor shape)."""
    seen = []

    def spy(build):
        def wrapped(config, fetch, source, **kw):
            def fetch_spy(spec):
                t = fetch(spec)

                def read(index, t=t):
                    seen.append((t.where, index, t.shape))
                    return t.read(index)
                return type(t)(t.shape, t.where, read)
            return build(config, fetch_spy, source, **kw)
        return wrapped

    for module in (hf_loader, gguf_loader):
        monkeypatch.setattr(module, "build_model", spy(module.build_model))
    return seen


@pytest.mark.parametrize("kind,mesh", [
    ("hf-index", "fsdp=4"),
    ("hf-single", "fsdp=2,tensor=2"),
    ("gguf-f32", "tensor=4"),
    ("gguf-q8_0", "fsdp=4"),  # 16 of a row's 64 values per shard: half of a 32-value block
    ("gguf-q4_1", "fsdp=2,tensor=2"),
])
def test_sharded_load_equals_unsharded_bit_for_bit(tmp_path, reads, kind, mesh):
    path = _write(tmp_path, kind)
    ref, _ = load(path)
    reads.clear()
    m = sharding.make_mesh(mesh)
    model, tok = load(path, mesh=m)
    got, want = _variables(model), _variables(ref)
    assert set(got) == set(want)
    specs = sharding.partition_specs({p: x.shape for p, x in got.items()}, sharding.llama_rules(), m)
    total = 0
    for p in want:
        np.testing.assert_array_equal(_bits(got[p]), _bits(want[p]), err_msg=p)
        x = got[p]
        assert x.sharding.mesh is m and x.sharding.spec == specs[p]
        assert {s.data.nbytes for s in x.addressable_shards} == {_shard_bytes(x)}  # each device: its shard only
        total += _shard_bytes(x)
    assert set(sharding.device_bytes(model).values()) == {total}
    unsharded = sum(x.nbytes for x in want.values())
    assert total < unsharded / 3  # most bytes are in the kernels and the embedding, split 4 ways
    # every read was a shard's slice: no sharded kernel was read whole (GGUF q/k reads cover whole heads)
    for where, index, shape in reads:
        if "norm" not in where:
            assert np.prod([s.stop - s.start for s in index]) < np.prod(shape), where


def test_sharded_bfloat16_and_custom_rules(tmp_path):
    path = _write(tmp_path, "gguf-q8_0")
    ref, _ = load(path, param_dtype="bfloat16")
    rules = (ShardRule(path=r"blocks/\d+/mlp/.*", spec=(None, "fsdp")), ShardRule(path=".*"))
    model, _ = load(path, param_dtype="bfloat16", mesh=sharding.make_mesh("fsdp=4"), rules=rules)
    for p, want in _variables(ref).items():
        got = _variables(model)[p]
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=p)
        assert got.sharding.spec == (P(None, "fsdp") if "/mlp/" in p else P())


def test_sharded_model_logits_match_the_numpy_oracle(tmp_path):
    path = _write(tmp_path, "gguf-q4_1")
    model, _ = load(path, mesh=sharding.make_mesh("fsdp=2,tensor=2"))
    ids = np.random.default_rng(4).integers(0, CFG["vocab"], 20)
    ours = np.asarray(jax.jit(lambda m, x: m(x))(model, jnp.asarray(ids[None], jnp.int32)))[0]
    w, ocfg, layout = read_gguf(path)
    np.testing.assert_allclose(ours, forward(w, ocfg, ids, layout), rtol=1e-4, atol=1e-4)


def test_load_errors_name_the_mesh_problem(tmp_path):
    cfg = CFG | {"vocab": 274}  # 274 = 2 x 137: a vocabulary 4 devices cannot split
    path = tmp_path / "v.gguf"
    write_gguf(path, random_weights(cfg), cfg)
    with pytest.raises(ShardingError, match=r"parameter (embed/embedding|lm_head/kernel) has shape "
                                            r"\((274, 64|64, 274)\): mesh axis 'tensor' \(size 4\) of ShardRule"):
        load(path, mesh=sharding.make_mesh("tensor=4"))
    model, _ = load(path, mesh=sharding.make_mesh("fsdp=2,tensor=2"))  # 2 divides it
    assert model.embed.embedding.get_value().sharding.spec == P("tensor", "fsdp")
    with pytest.raises(ValueError, match="rules= places parameters on a mesh; pass mesh= too"):
        load(path, rules=sharding.llama_rules())


_EIGHT = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from jaxlowfp import sharding
    from jaxlowfp.models import load
    path = sys.argv[1]
    ref, _ = load(path)
    want = {p: np.asarray(v.get_value()) for p, v in sharding.variable_paths(ref).items()}
    out = {"devices": jax.device_count(), "unsharded": sum(a.nbytes for a in want.values())}
    for n in (2, 4, 8):
        devices = jax.devices()[:n]
        for spec in (f"fsdp={n}", f"fsdp={n // 2},tensor=2"):
            model, _ = load(path, mesh=sharding.make_mesh(spec, devices))
            same = all(np.array_equal(np.asarray(v.get_value()).view(np.uint32), want[p].view(np.uint32))
                       for p, v in sharding.variable_paths(model).items())
            per = sharding.device_bytes(model)
            out[spec] = {"same": same, "max_bytes": max(per.values()), "n": len(per)}
    print(json.dumps(out))
""")


def test_eight_devices_per_device_bytes_fall_with_the_device_count(tmp_path):
    """A subprocess with 8 CPU devices (jax_num_cpu_devices): fsdp over 2, 4, 8 devices, and fsdp x tensor."""
    path = _write(tmp_path, "gguf-q8_0")
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_FLAGS")} | {
        "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": child_xla_flags()}
    proc = subprocess.run([sys.executable, "-c", _EIGHT, str(path)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 8
    unsharded = out.pop("unsharded")
    out.pop("devices")
    assert all(r["same"] for r in out.values()), out
    assert [out[f"fsdp={n}"]["n"] for n in (2, 4, 8)] == [2, 4, 8]
    fsdp = [out[f"fsdp={n}"]["max_bytes"] for n in (2, 4, 8)]
    assert unsharded > fsdp[0] > fsdp[1] > fsdp[2]
    # the replicated norms are ~1 % of the tiny model: per-device bytes fall nearly as 1/n
    for n, b in zip((2, 4, 8), fsdp):
        assert unsharded / n <= b < 1.05 * unsharded / n, (n, b, unsharded)
    for n in (2, 4, 8):  # fsdp x tensor over the same devices holds as little as fsdp alone
        assert out[f"fsdp={n // 2},tensor=2"]["max_bytes"] <= fsdp[(2, 4, 8).index(n)] * 1.05
