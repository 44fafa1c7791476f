"""What `jaxlowfp.ptq.quantize` and the exporters refuse before they change or write anything: non-finite values
(in any parameter, in the calibration inputs of a layer, in any tensor written) and all-zero quantized kernels.

Why refuse rather than pass through: a NaN or Inf weight makes every block scale it touches (and, through a
fused group's shared amax, every member's global scale) NaN; an all-zero kernel has amax 0, so its NVFP4 global
scale ``S_enc = 6 * 448 / amax`` is not defined (and any stand-in, e.g. 1.0, would be written as if meaningful).
Every message names the parameter or layer and says what was found there.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from flax import nnx

__all__ = ["describe_nonfinite", "check_finite_tensor", "check_model_weights", "check_calibration_inputs",
           "check_packed_nvfp4"]


def describe_nonfinite(values: np.ndarray) -> str | None:
    """None if every value is finite, else e.g. ``"2 NaN and 1 Inf of 4096 values (first at index (3, 17))"``."""
    v = np.asarray(values)
    if not np.issubdtype(v.dtype, np.floating) and v.dtype.kind != "V":
        return None
    v = v.astype(np.float32) if v.dtype.kind == "V" or v.dtype.itemsize < 4 else v
    bad = ~np.isfinite(v)
    if not bad.any():
        return None
    n_nan, n_inf = int(np.isnan(v).sum()), int(np.isinf(v).sum())
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    return f"{n_nan} NaN and {n_inf} Inf of {v.size} values (first at index {first})"


def check_finite_tensor(values: Any, where: str, action: str = "refusing to export") -> None:
    """ValueError naming `where` if `values` holds a NaN or an Inf."""
    found = describe_nonfinite(_host(values))
    if found is not None:
        raise ValueError(f"{where}: {found}; {action}")


def _host(values: Any) -> np.ndarray:
    """A host copy that leaves no cached copy on a sharded / device array (`jaxlowfp.ptq.stream.fetch`)."""
    from jaxlowfp.ptq.stream import fetch

    return fetch(values)


def _natural(path: str) -> tuple:
    """Sort key that orders ``blocks/2`` before ``blocks/10``."""
    return tuple((0, int(t)) if t.isdigit() else (1, t) for t in re.split(r"(\d+)", path))


def check_model_weights(model: nnx.Module, targets: Iterable[str], caller: str = "jaxlowfp.ptq.quantize") -> None:
    """Refuse a model whose parameters hold NaN / Inf (all of them: a non-finite norm or embedding poisons the
    calibration and is written by every export), or whose quantized layers (`targets`) have an all-zero kernel.
    Nothing is changed."""
    params = {"/".join(map(str, p)): v for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)}
    bad = []
    for path in sorted(params, key=_natural):
        found = describe_nonfinite(_host(params[path][...]))
        if found is not None:
            bad.append(f"{path}: {found}")
    if bad:
        raise ValueError(f"{caller}: the model has non-finite parameters, which would become NaN scales and weights "
                         f"(and, through a fused group's shared scale, poison its other members): "
                         + "; ".join(bad[:4]) + (f"; and {len(bad) - 4} more" if len(bad) > 4 else "")
                         + ". Nothing was changed")
    zero = [p for p in targets if f"{p}/kernel" in params and not np.any(_host(params[f"{p}/kernel"][...]))]
    if zero:
        raise ValueError(f"{caller}: the kernels of {', '.join(sorted(zero, key=_natural)[:4])} are all zero; a "
                         f"zero tensor has no scale to quantize it with (its NVFP4 global scale 6 * 448 / amax "
                         f"would be undefined). Keep it in high precision with a Rule(path=..., scheme=None) before "
                         f"the quantizing rule, or remove the layer. Nothing was changed")


def check_calibration_inputs(stats: Mapping[str, Any], paths: Iterable[str],
                             caller: str = "jaxlowfp.ptq.quantize") -> None:
    """Refuse layers whose calibration inputs held NaN / Inf (their ``amax`` statistic is not finite). The
    weights were checked finite first, so the earliest such layer is where the non-finite values enter: the
    message lists the layers in model order, the first one first."""
    def finite(st: Any) -> bool:
        h = getattr(st, "hessian", None)
        return bool(np.isfinite(np.asarray(st.amax)).all() and np.isfinite(np.asarray(st.abs_sum)).all()
                    and (h is None or np.isfinite(np.asarray(h)).all()))

    bad = sorted((p for p in paths if p in stats and not finite(stats[p])), key=_natural)
    if bad:
        raise ValueError(f"{caller}: the calibration inputs of {', '.join(bad[:6])}"
                         f"{f' (and {len(bad) - 6} more)' if len(bad) > 6 else ''} hold NaN or Inf (or overflow "
                         f"float32 in the Hessian sum x x^T); the first of them in the model, {bad[0]}, is where they "
                         f"enter (the weights are finite: check the calibration data, or activations growing past "
                         f"float32 before that layer)")


def check_packed_nvfp4(where: str, arr: Any, s_enc: Any) -> None:
    """A packed NVFP4 weight an export may write: finite block scales, a finite positive global (encode) scale,
    and not all zero (an all-zero tensor's global scale means nothing)."""
    check_finite_tensor(_host(arr.scales).astype(np.float32), f"{where}: the NVFP4 block scales")
    s = float(s_enc)
    if not (np.isfinite(s) and s > 0):
        raise ValueError(f"{where}: weight_global_scale is {s}; it must be finite and > 0; refusing to export")
    if not np.any(_host(arr.codes) & 0x77):  # every E2M1 magnitude code 0: the weight is all (+-)zero
        raise ValueError(f"{where}: the quantized weight is all zero, so its global scale ({s}) means nothing; "
                         f"refusing to export (keep the layer in high precision: a Rule with scheme=None)")
