"""Transactional quantize (issue 45): a refusal partway through `ptq.quantize_model` (sequential GPTQ refusing
block 1 after block 0 was quantized, dense and mixture of experts; a one-pass method) puts every state leaf back
bit for bit and removes the quantizer hooks it had attached."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from jaxlowfp import ptq
from jaxlowfp.models import load
from jaxlowfp.models.llama import PRESETS, Llama

import moe_export_common as moe

CFG = dataclasses.replace(PRESETS["tiny"], n_layers=2)
TOKENS = np.random.default_rng(7).integers(0, 256, (4, 16)).astype(np.int32)


def _leaves(model):
    return [(p, np.asarray(v.get_value())) for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)]


def _hooks(model):
    """Every module's public non-Variable, non-Module attributes (the quantizer hooks), by identity."""
    out = {}
    for p, m in nnx.iter_graph(model):
        if isinstance(m, nnx.Module):
            for k, a in vars(m).items():
                if not k.startswith("_") and not isinstance(a, (nnx.Variable, nnx.Module)):
                    out[("/".join(map(str, p)), k)] = id(a)
    return out


def _assert_unchanged(model, leaves, hooks):
    now = _leaves(model)
    assert [p for p, _ in now] == [p for p, _ in leaves]
    for (p, a), (_, b) in zip(now, leaves):
        assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)), p
    assert _hooks(model) == hooks


def _overflow_after_block0(model, down_proj):
    """Block 0's MLP output overflows float32, so block 1's calibration inputs are Inf (the weights stay finite)."""
    down_proj.set_value(np.full(down_proj.shape, 1e38, np.float32))


@pytest.mark.parametrize("method", ["gptq", "smoothquant", "rtn"])
def test_dense_refusal_in_block_1_restores_everything(method):
    model = Llama(CFG, rngs=nnx.Rngs(0))
    kept = model.blocks[0].mlp.down_proj.kernel[...]
    _overflow_after_block0(model, model.blocks[0].mlp.down_proj.kernel)
    leaves, hooks = _leaves(model), _hooks(model)
    rules = [ptq.Rule(path=r"blocks/\d+/(attn|mlp)/\w+_proj", scheme=ptq.scheme("nvfp4-mse"))]
    with pytest.raises(ValueError, match=r"calibration inputs of blocks/1/"):
        ptq.quantize_model(model, rules, method=method, calibration=TOKENS, progress=False)
    _assert_unchanged(model, leaves, hooks)
    # and the model still quantizes once the cause is gone
    model.blocks[0].mlp.down_proj.kernel.set_value(kept)
    ptq.quantize_model(model, rules, method=method, calibration=TOKENS, progress=False)


def test_moe_sequential_refusal_restores_block_0_experts():
    model, _ = load(moe.FIX / "qwen3_moe")
    down = model.blocks[0].mlp.experts.down_proj if hasattr(model.blocks[0].mlp, "experts") else None
    assert down is not None
    _overflow_after_block0(model, down)
    leaves, hooks = _leaves(model), _hooks(model)
    calib = np.random.default_rng(0).integers(0, 280, (4, 16)).astype(np.int32)
    with pytest.raises(ValueError):
        ptq.quantize_model(model, moe.rules("qwen3_moe"), method="gptq", calibration=calib, progress=False)
    _assert_unchanged(model, leaves, hooks)
    assert jax.tree.leaves(nnx.state(model))  # the model is whole
