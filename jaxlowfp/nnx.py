"""Deprecated name of `jaxlowfp.qnnx` (it shadowed ``flax.nnx`` in user code); removed in the next release.

``from jaxlowfp import nnx`` and ``jaxlowfp.nnx.layer`` / ``.rules`` / ``.telemetry`` still import, with a
DeprecationWarning, and give the very objects of `jaxlowfp.qnnx`.
"""
import sys
import warnings

from jaxlowfp import qnnx as _qnnx
from jaxlowfp.qnnx import *  # noqa: F401,F403
from jaxlowfp.qnnx import __all__  # noqa: F401
from jaxlowfp.qnnx import layer, rules, telemetry
from jaxlowfp.qnnx.rules import quantize  # noqa: F401  (the old name, in this old module)

warnings.warn("jaxlowfp.nnx is renamed jaxlowfp.qnnx (it shadowed flax.nnx); import jaxlowfp.qnnx instead",
              DeprecationWarning, stacklevel=2)
for _name, _mod in (("layer", layer), ("rules", rules), ("telemetry", telemetry)):
    sys.modules[f"{__name__}.{_name}"] = _mod
del _name, _mod, _qnnx
