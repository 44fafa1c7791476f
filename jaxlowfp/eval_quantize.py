"""How the lm-eval backend (`jaxlowfp.harness`) quantizes the model it evaluates: the recipe names of its
``quantize=`` argument, the evaluated form of a recipe (`eval_recipe`), fake quantization of a whole model
(`fake_quantize_model`) and post-training quantization from a calibration text (`ptq_model`).

Nothing here needs lm-eval: ``python -m train eval`` and the benches quantize with these functions too, then wrap
the model in `jaxlowfp.harness.JaxLowFPLM`.

Activation scaling when evaluating (``act_scale``): ``token`` gives each token its own amax (current scaling), so a
request's score does not depend on the other requests of its batch nor on padding; ``tensor`` keeps the recipe's
per-tensor estimate (the batch's amax); ``static`` is the calibrated per-layer input amax of PTQ (what an export
writes and vLLM applies).
"""
from __future__ import annotations

from jaxlowfp._core.surface import public_dir as _public_dir

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxlowfp import registry

if TYPE_CHECKING:
    import jax

__all__ = ["ACT_SCALES", "PTQ_LAYERS", "QUANTIZE", "eval_recipe", "fake_quantize_model", "ptq_model"]

PTQ_LAYERS = r".*(attn|mlp)/\w+_proj"  # every attention and MLP projection (not the embedding, not lm_head)
QUANTIZE = registry.EVAL_QUANTIZE  # none, hif8, nvfp4, nvfp4-<rule>, if4-<rule>, fp8
ACT_SCALES = ("auto", "token", "static", "tensor")


def eval_recipe(recipe: Any, act_scale: str) -> Any:
    """`recipe` as evaluated: ``act_scale="token"`` gives its activations one amax per token (current scaling), so a
    request's score never depends on the other requests in its batch or on padding; ``"tensor"`` keeps the recipe
    as it is (a fresh model's delayed or current estimate is then the batch's amax). Evaluation computes no
    gradients, so the recipe's gradient quantization is dropped."""

    from jaxlowfp.scaling import CurrentScaling

    if act_scale == "tensor" or recipe.activation is None:
        return recipe
    if act_scale != "token":
        raise ValueError(f"act_scale={act_scale!r} for fake quantization; allowed: token (per token, dynamic) or "
                         f"tensor (the batch's amax); static needs calibration: use ptq=")
    a = recipe.activation
    act = dataclasses.replace(a, scaling=CurrentScaling(target_max=a.scaling.target_max, granularity="token"),
                              target_max=None)
    return dataclasses.replace(recipe, activation=act, grad=None)  # the recipe's gemm= and name kept


def fake_quantize_model(model: Any, quantize: str, *, layers: str = "paper", keep_first: int = 3,
                        keep_last: int = 2, act_scale: str = "token", gemm: str = "dequant") -> Any:
    """Fake-quantize ``model``'s Linear layers in place (`jaxlowfp.qnnx.quantize_model`) with the recipe named
    ``quantize`` (`QUANTIZE`) on ``layers`` (``paper``: the MLPs of blocks keep_first .. n - keep_last - 1,
    `jaxlowfp.qnnx.paper_rules`; ``all``: every attention and MLP projection; else a regex of module paths),
    activations scaled per ``act_scale`` (`eval_recipe`), products on ``gemm`` (`jaxlowfp.qat.gemm`); returns the
    `jaxlowfp.rules.QuantizeReport`. A selection that quantizes nothing is an error, never a silent
    high-precision evaluation."""
    from jaxlowfp import qat
    from jaxlowfp.qnnx import paper_rules, quantize_model as qnnx_quantize
    from jaxlowfp.rules import Rule

    if quantize not in QUANTIZE or quantize == "none":
        raise ValueError(f"quantize={quantize!r}; allowed: {', '.join(QUANTIZE[1:])} (or none for no quantization)")
    recipe = dataclasses.replace(eval_recipe(qat.named_recipe(quantize), act_scale), gemm=gemm)
    qat.gemm.plan(recipe, where=f"quantize={quantize}, gemm={gemm}")  # refused here, before any layer changes
    if layers == "paper":
        rules = paper_rules(model.config.n_layers, keep_first=keep_first, keep_last=keep_last, recipe=recipe)
    else:
        rules = [Rule(path=PTQ_LAYERS if layers == "all" else layers, recipe=recipe)]
    report = qnnx_quantize(model, rules)
    if not report.quantized:
        raise ValueError(f"quantize={quantize!r}, layers={layers!r} selects no Linear layer of the model "
                         f"(unmatched: {list(report.unmatched)[:6]} ...)")
    return report


def ptq_model(model: Any, tokenizer: Any, method: str, *, scheme: str, layers: str, weights_only: bool,
              calibration: str | None, calib_seqs: int, calib_len: int, act_scale: str = "auto",
              mesh: Any = None) -> Any:
    """Post-training quantization of ``model`` in place (`jaxlowfp.ptq.quantize_model`) with ``method`` (``rtn``,
    ``gptq``, ``smoothquant``, ``awq``) to ``scheme`` on the layers matching the regex ``layers``; all but RTN
    calibrate on the UTF-8 text file ``calibration``, tokenized and cut into ``calib_seqs`` x ``calib_len`` tokens.
    Returns the `jaxlowfp.ptq.PTQResult`. With ``mesh`` (the model on it) the calibration rows are split over its
    data axes, as `jaxlowfp.ptq` runs on a mesh."""
    from jaxlowfp import ptq, sharding

    m = ptq.method_from_name(method)
    tokens: np.ndarray | jax.Array | None = None
    if calibration is not None:
        text = Path(calibration).read_text(encoding="utf-8")
        ids = tokenizer.encode(text)
        need = calib_seqs * calib_len
        if len(ids) < need:
            raise ValueError(f"calibration={calibration!r} has {len(ids)} tokens; calib_seqs x calib_len needs {need}")
        tokens = np.asarray(ids[:need], np.int32).reshape(calib_seqs, calib_len)
    elif method != "rtn":
        raise ValueError(f"ptq={method!r} needs calibration=<a UTF-8 text file> (only rtn needs no calibration)")
    rules = [ptq.Rule(path=layers, scheme=ptq.scheme(scheme, weights_only=weights_only))]
    if tokens is not None and mesh is not None:
        tokens = sharding.put_batch(tokens, mesh)
    return ptq.quantize_model(model, rules, method=m, calibration=tokens, activation_scale=act_scale)


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
