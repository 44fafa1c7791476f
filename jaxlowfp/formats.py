"""Element formats as frozen, hashable descriptors (:class:`ElementFormat`): HiF8, E4M3, E5M2 and E2M1.

A tensor format (elements, block scales, tensor scale, rule) is :class:`jaxlowfp.Format`; its ``element`` names one
of these.

Each descriptor has ``encode(x, *, saturate=False) -> uint8 codes``, ``decode(codes, dtype)`` and
``round(x, *, saturate=False)`` (the nearest representable value, in ``x``'s dtype), plus the range constants
(``max_finite``, ``min_normal``, ``min_subnormal``) and the default clip targets used by the QAT recipes.

The OCP minifloats (E4M3 = ``float8_e4m3fn``, E5M2 = ``float8_e5m2``, E2M1 = ``float4_e2m1fn``) round to nearest,
ties to even, exactly like ``ml_dtypes`` casts; the rounding is explicit integer / threshold math on the float32
bit pattern, so XLA cannot elide an ``f32 -> f8 -> f32`` round trip under ``jit``. Overflow without saturation
follows ``ml_dtypes``: E4M3 gives NaN (it has no Inf), E5M2 gives Inf, E2M1 clamps to +-6 (it has neither).
``saturate=True`` clamps every non-NaN value, Inf included, to +-max_finite (PTX ``cvt.rn.satfinite``). The sign of
zero is kept (``-1e-9 -> -0``), as in ``ml_dtypes``. HiF8 delegates to :mod:`jaxlowfp.hif8`. The math lives in
``jaxlowfp._core.minifloat`` (shared with the Pallas kernels).

>>> import jax.numpy as jnp
>>> from jaxlowfp import formats
>>> formats.E4M3.round(jnp.float32(300.0)).item(), int(formats.get("e2m1").encode(jnp.float32(-5.5)))
(288.0, 15)
"""
from jaxlowfp._core.surface import public_dir as _public_dir
from jaxlowfp._core.deprecation import deprecated_getattr
from jaxlowfp._core.minifloat import (
    E2M1,
    E4M3,
    E5M2,
    FORMATS,
    HIF8,
    ElementFormat,
    MiniFloat,
    get,
)

__all__ = ["ElementFormat", "MiniFloat", "HIF8", "E4M3", "E5M2", "E2M1", "FORMATS", "get"]

# old name (one release): jaxlowfp.Format is the tensor format now; the element descriptors are ElementFormat
__getattr__ = deprecated_getattr(__name__, {"Format": ("jaxlowfp.formats.ElementFormat", lambda: ElementFormat)})


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
