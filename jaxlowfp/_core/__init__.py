"""The leaf floor of jaxlowfp: element-format and block math, constants, array types and argument checks.

Everything here is pure ``jax``/``numpy``: no optax, no Flax, no policy (no ``impl=`` choice, no jit wrappers of
the public API). Both the public modules (``jaxlowfp.hif8``, ``formats``, ``nvfp4``, ``mx``, ``scaling``, ``qat``)
and the Pallas kernels (``pallas_kernels``) import from here, and nothing here imports either of them, so a kernel
and its jnp twin share one copy of the math without an import cycle (docs/architecture.md).

Modules: ``bits`` (float32 bit helpers, exact division), ``checks`` (argument validation), ``reduce`` (NaN-aware
amax), ``hif8`` (the HiF8 codec), ``minifloat`` (format descriptors: HiF8, E4M3, E5M2, E2M1), ``nvfp4_blocks`` (the
per-block NVFP4 / Four Over Six math), ``qarray`` (``QArray``, the one quantized array), ``format``
(``Format``), ``scaled`` (per-tensor scaled rounding and the
saturation bound), ``pytree`` (frozen dataclass pytrees), ``capability`` (which kernel runs where).
"""
