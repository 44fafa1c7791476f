"""GPTQ NVFP4 4/6 of a model on a mesh (4 simulated CPU devices, conftest): the calibration activations of every
block have their rows over the data axes, the statistics' sums over rows (``X^T X``, amax) are reduced on the
devices by XLA's collectives (an all-reduce in the compiled step; only the reduced values reach the host), and the
codes and scales equal one device's, but for a few codes counted here.

Why any code may differ: the sharded Hessian adds its rows' outer products in another order (per-device partial
sums, then the all-reduce), and the sharded forward passes (tensor-parallel attention and MLP) give block k+1 inputs
a float32 ulp or so away; every Hessian entry moves by ~1e-7 relative. GPTQ's column loop turns a few of those
into another rounding where a value lies that close to the midpoint between two E2M1 codes (a near tie, not an
exact one). Measured: 5 of 73728 codes (one layer, ``blocks/1/attn/v_proj``), no block or global scale. (On a wider
model many more differ under sequential calibration, because block 0's few differing codes give block 1 other
inputs; with one-pass statistics only a few hundred in 2M do: bench/RESULTS.md, *PTQ on a mesh*.)"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlowfp import ptq, sharding
from jaxlowfp.models import Llama, ModelConfig
from jaxlowfp.ptq import calibrate, gptq, sequential

CFG = ModelConfig(vocab=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=32)
RULES = [ptq.Rule(path=r"blocks/\d+/(attn|mlp)/\w+_proj", scheme=ptq.scheme("nvfp4-mse", weights_only=True))]


def test_gptq_on_a_mesh_calibrates_rows_per_device_and_gives_one_device_codes(monkeypatch):
    mesh = sharding.make_mesh("fsdp=2,tensor=2")
    ref = Llama(CFG, rngs=nnx.Rngs(0))
    model = sharding.shard_model(Llama(CFG, rngs=nnx.Rngs(0)), mesh, sharding.llama_rules())
    tokens = np.random.default_rng(0).integers(0, 96, (8, 16)).astype(np.int32)
    seen: list = []
    collect = calibrate.collect

    def spy(block, rel, xs, **kw):
        if not seen and len(jax.tree.leaves(nnx.state(block))[0].sharding.device_set) > 1:
            g, s = nnx.split(block)
            hlo = calibrate._step.lower(g, s, xs[0], tuple(rel), kw["forward"], kw["hessian"], 0).compile().as_text()
            seen.append((xs[0].sharding.spec, "all-reduce" in hlo))
        return collect(block, rel, xs, **kw)

    monkeypatch.setattr(sequential.calibrate, "collect", spy)
    one = ptq.quantize_model(ref, RULES, method=ptq.GPTQ(), calibration=jnp.asarray(tokens))
    loops: list = []
    row_mesh = gptq._row_mesh

    def spy_rows(kernel, out):
        got = row_mesh(kernel, out)
        loops.append(None if got is None else (got[0].size, got[1]))
        return got

    monkeypatch.setattr(gptq, "_row_mesh", spy_rows)
    got = ptq.quantize_model(model, RULES, method=ptq.GPTQ(), calibration=sharding.put_batch(tokens, mesh))
    assert got.pipeline == "sequential"
    assert len(loops) == 14 and all(lp == (4, ("fsdp", "tensor")) for lp in loops), loops  # column loop row-sharded
    assert seen == [(sharding.P(("data", "fsdp")), True)]  # rows over the data axes; the sums are all-reduced
    assert sorted(one.packed) == sorted(got.packed) and len(one.packed) == 14
    differ, total = {}, 0
    for p, (arr, s_enc) in one.packed.items():
        a, b = np.asarray(arr.codes), np.asarray(got.packed[p][0].codes)
        n = int(((a & 15) != (b & 15)).sum() + ((a >> 4) != (b >> 4)).sum())
        total += 2 * a.size
        if n:
            differ[p] = n
        np.testing.assert_array_equal(np.asarray(arr.scales).view(np.uint8),
                                      np.asarray(got.packed[p][0].scales).view(np.uint8), err_msg=p)
        assert float(s_enc) == float(got.packed[p][1]), p
    assert total == 73728
    assert sum(differ.values()) <= 16, differ  # measured: {"blocks/1/attn/v_proj": 5}
    assert all(p.startswith("blocks/1/") for p in differ), differ  # block 0 sees the same embedded rows
    kernel = model.blocks[0].mlp.up_proj.kernel.get_value()
    assert kernel.sharding.spec == sharding.P("fsdp", "tensor")  # quantized in place, still sharded
