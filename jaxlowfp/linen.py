"""Deprecated name of `jaxlowfp.qlinen` (it shadowed ``flax.linen`` in user code); removed in the next release."""
import warnings

from jaxlowfp.qlinen import *  # noqa: F401,F403
from jaxlowfp.qlinen import __all__  # noqa: F401

warnings.warn("jaxlowfp.linen is renamed jaxlowfp.qlinen (it shadowed flax.linen); import jaxlowfp.qlinen instead",
              DeprecationWarning, stacklevel=2)
