"""Independent oracles shared by several test files (they use outside codecs, never jaxlowfp)."""
import en_dtypes
import numpy as np


def hif8_fake_quant_f64(a: np.ndarray, amax: float, target_max: float = 15.0) -> np.ndarray:
    """Per-tensor HiF8 fake quant in float64: scale = amax / target_max, clip, en_dtypes TA cast, rescale."""
    scale = np.float32(amax) / np.float32(target_max)
    s = np.clip(a.astype(np.float32) / scale, -target_max, target_max).astype(np.float32)
    return s.astype(en_dtypes.hifloat8).astype(np.float64) * np.float64(scale)
