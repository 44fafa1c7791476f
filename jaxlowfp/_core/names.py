"""The format and rule names themselves (pure data, no imports): the leaf copy that the block math and the kernels
validate against. The public face, with the names built from these, is :mod:`jaxlowfp.registry`."""

NVFP4_KERNEL_RULES = ("static_6", "static_4", "abs_max", "mae", "mse")  # the rules the Pallas kernels implement
NVFP4_RULES = NVFP4_KERNEL_RULES + ("search",)  # every accepted rule; "search": the per-block E4M3 scale search
NVFP4_FOUR_OVER_SIX = ("abs_max", "mae", "mse")
NVFP4_BLOCK_SHAPES = ((1, 16), (16, 16))
ROUNDINGS = ("nearest", "stochastic", "stochastic_unbiased", "ms_eden")
IF_FORMATS = ("if4", "if6_e2m3", "if6_e3m2", "if3")
IF_RULES = ("abs_max", "mae", "mse")
MX_FORMATS = ("e2m1", "e4m3", "e5m2")
MX_RULES = ("floor", "ceil")
