"""What the lm-eval backend (`jaxlowfp.harness`) records about the model it evaluates, in lm-eval's results JSON
(``config.quantization``): the layers a selection quantized (`layers_record`), what an in-process model's quantized
ops say they are (`given_model_record`) and, read from the model after the run, what it held and ran
(`executed_record`): its quantized op modules, how many executed and on which GEMM backend, and its packed weights
(`packed_record`). Every record is flat and JSON-serializable. Nothing here needs lm-eval."""
from __future__ import annotations

from jaxlowfp._core.surface import public_dir as _public_dir

import collections
from typing import Any

__all__ = ["executed_record", "given_model_record", "layers_record", "op_kind", "packed_record"]


def layers_record(selection: Any, paths: Any, **extra: Any) -> dict[str, Any]:
    """The ``layers`` entry of the quantization record: the selection asked for, how many layers and which."""
    paths = sorted(paths)
    out = {"pattern": selection, "quantized": len(paths), "paths": paths}
    if selection == "paper":
        out.update(extra)
    return out


def op_kind(op: Any) -> tuple[str, str, str]:
    """(scheme, activation scale, configured GEMM backend) of one quantized op (`jaxlowfp.execution.op_modules`):
    its recipe's name, where its activations get their amax (a PTQ quantizer's ``activation_scale``, a recipe's
    scaling granularity, ``delayed (<algorithm>)``, or none for weights only) and its recipe's ``gemm``."""
    recipe = op.recipe
    scheme = str(getattr(recipe, "name", None) or type(recipe).__name__)
    gemm = str(getattr(recipe, "gemm", "dequant"))
    if hasattr(op, "activation_scale"):  # a PTQ activation quantizer
        return scheme, str(op.activation_scale), gemm
    if getattr(recipe, "activation", None) is None:
        return scheme, "none (weights only)", gemm
    sc = recipe.activation.scaling
    return scheme, str(getattr(sc, "granularity", None) or f"delayed ({getattr(sc, 'algorithm', '?')})"), gemm


def given_model_record(model: Any) -> dict[str, Any]:
    """The quantization record of an in-process ``model=`` (quantized, or not, by its caller): what its quantized
    ops say they are (`jaxlowfp.execution.quantized_ops`): recipe names, activation scales and GEMM backends; kind
    ``given`` with them, ``none`` without. (A weights-only quantization that left no op behind is invisible here.)"""
    from jaxlowfp.execution import op_modules

    ops = op_modules(model)
    if not ops:
        return {}
    kinds = [op_kind(op) for _, op in ops]
    return {"kind": ["given"], "scheme": ", ".join(sorted({k[0] for k in kinds})),
            "activation_scale": ", ".join(sorted({k[1] for k in kinds})),
            "gemm": ", ".join(sorted({k[2] for k in kinds})), "layers": layers_record(None, [p for p, _ in ops])}


def executed_record(model: Any) -> dict[str, Any]:
    """What the model holds and ran, read from it (not from the arguments): the quantized op modules present
    (`jaxlowfp.execution.op_modules`), how many, how many have executed (their execution record is set), and per
    op ``"<scheme> | <activation scale> | <GEMM backend>"``, the backend being the one its last forward ran on
    (``not run`` for an op that never executed); ``by_kind`` counts the ops per such string, ``packed`` lists the
    packed weights (`packed_record`), and ``jaxlowfp`` is the library version. Flat and JSON-serializable:
    `JaxLowFPLM.get_model_info` puts it in the results JSON as ``config.quantization.executed``, after lm-eval's
    run."""
    import jaxlowfp
    from jaxlowfp.execution import op_modules, quantized_ops

    per_op: dict[str, str] = {}
    ran = 0
    for (path, op), q in zip(op_modules(model), quantized_ops(model)):  # the same ops, in the same order
        scheme, scale, _ = op_kind(op)
        ran += bool(q.executed)
        key = path if path not in per_op else f"{path}#{sum(k.split('#')[0] == path for k in per_op) + 1}"
        per_op[key] = f"{scheme} | {scale} | {(q.backend or '?') if q.executed else 'not run'}"
    by_kind = dict(collections.Counter(per_op.values()))
    return {"ops": len(per_op), "ran": ran, "by_kind": by_kind, "per_op": per_op, "packed": packed_record(model),
            "jaxlowfp": jaxlowfp.__version__}


def _packed_activation(layer: Any) -> str:
    """Where a `PackedLinear`'s activations are quantized: its PTQ quantizer's scale, its own format (one tensor
    scale), a foreign checkpoint's quantizer, or not at all."""
    if layer.act_quant is not None:
        return str(layer.act_quant.activation_scale)
    if layer.activation is not None:
        return f"tensor ({layer.activation.name})"
    return "checkpoint's" if layer.act_fn is not None else "none (weights only)"


def packed_record(model: Any) -> dict[str, Any]:
    """The packed weights a model holds (`jaxlowfp.ptq.packing.report_of`; they are parameters, not ops, so
    ``ops`` does not count them): how many, and per weight ``"<weight format> | <activation scale> | <backend>"``,
    the backend being the one its layer plans on this device (``(native)``: the native GEMV), and their counts."""
    from jaxlowfp.ptq.packing import packed_layers, report_of

    layers = packed_layers(model)
    per: dict[str, str] = {}
    for path, fmt, backend, native in report_of(model).layers:
        act = _packed_activation(layers[path]) if path in layers else "as its layer's op"
        per[path] = f"{fmt} | {act} | {backend}{' (native)' if native else ''}"
    return {"weights": len(per), "by_kind": dict(collections.Counter(per.values())), "per_weight": per}


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
