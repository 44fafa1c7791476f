"""Write the IF4 / IF6 fixtures of ``tests/test_if4.py`` with fouroversix's own PyTorch reference quantizer (CPU).

fouroversix (the Four Over Six authors' library, MIT Han Lab) quantizes to its "adaptive block-scaled" formats
(arXiv 2603.28765) in ``fouroversix/quantize/pytorch/reference.py``: each 16-value block gets the standard NVFP4
scale (block max -> 6, tensor amax -> 6 * 448) and is rounded twice, onto the FP grid and onto a signed integer
grid stretched to the same max, and the grid with the smaller error (MSE, MAE or max abs error in the original,
dequantized domain) is kept; an integer block is flagged by setting the sign bit of its E4M3 scale.

Two versions are recorded, each in its own Python 3.11 venv outside the repository (CPU torch)::

    python3.11 -m venv /work/venvs/fouroversix
    /work/venvs/fouroversix/bin/pip install torch==2.13.0 numpy ninja packaging psutil setuptools wheel transformers
    SKIP_CUDA_BUILD=1 /work/venvs/fouroversix/bin/pip install --no-build-isolation fouroversix==1.0.5
    /work/venvs/fouroversix/bin/python scripts/make_fouroversix_fixtures.py tests/fixtures/fouroversix/pypi-1.0.5.npz

    # the GitHub HEAD (mit-han-lab/fouroversix commit dadfad6901d4, 2026-04-21, setup.py version 1.1.0, not on
    # PyPI): the same venv recipe, then `SKIP_CUDA_BUILD=1 pip install --no-build-isolation --no-deps .` from a
    # checkout of that commit (git archive), and
    /work/venvs/fouroversix-head/bin/python scripts/make_fouroversix_fixtures.py \
        tests/fixtures/fouroversix/head-dadfad6.npz

PyPI 1.0.5 (the newest release) has IF4 only (``DataType.if4``, function ``quantize_to_fp4``); the HEAD also has
IF6 with an E2M3 or E3M2 FP grid against INT6 (``DataType.if6_e2m3`` / ``if6_e3m2``, function ``quantize``). Both were
run with torch 2.13.0+cpu, numpy 2.4.6, transformers 5.24.0 (fouroversix imports it), on x86-64.

What is stored (``np.savez_compressed``): in the PyPI file, per case ``x/<case>`` the input (float32 values, or the
uint16 bit patterns of bf16 cases; the HEAD file reuses these inputs and checks they are the same), and in both, per
(format, rule, case) the reference's packed codes (``codes/...``: IF4 two nibbles a byte, element 2j low; IF6 one
6-bit code a byte), the E4M3 scale bytes with the integer flag in bit 7 (``scales/...``: [rows, K/16] for 1x16
blocks, [rows/16, K/16] for 16x16 tiles) and the tensor amax (``amax/...``); for IF4 with MSE on a few cases also the
reference's own dequantization (``PyTorchQuantizeBackend.dequantize``, which multiplies in float16 before the
float32 global scale; ``deq/...``). ``meta`` is a JSON string with versions, the command line, cases, dtypes and the
fraction of blocks that picked the integer grid. The HEAD run also re-quantizes every IF4 case with the HEAD code
and records whether it equals the PyPI file byte for byte (``checked_against_pypi``).

Cases (numpy ``default_rng``, seeds in ``CASES``): Gaussian float32 and bf16, Laplace, Student-t(3), Gaussian with
1 % x50 outliers, tiny (x 1e-12), huge (x 1e30), all zeros, zero and constant blocks with -0.0 elements, hand-made
rounding ties of both grids, a NaN block and an Inf block quantized with a caller-supplied finite amax, and 16x16
tiles. The script also counts, per rule, how many blocks picked the integer grid.
"""
from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import torch

import fouroversix
from fouroversix.utils import DataType, ScaleRule

HEAD = hasattr(DataType, "if6_e2m3")  # the GitHub HEAD (1.1.0.dev); PyPI 1.0.5 has IF4 only
if HEAD:
    from fouroversix.quantize.pytorch.reference import quantize as ref_quantize
else:
    from fouroversix.quantize.pytorch.reference import quantize_to_fp4 as ref_quantize
from fouroversix.quantize.pytorch.backend import PyTorchQuantizeBackend  # noqa: E402
from fouroversix.quantize.quantized_tensor import QuantizedTensor  # noqa: E402

RULES = ("mse", "mae", "abs_max")
# PyPI 1.0.5 records IF4; the HEAD records IF6 and checks that its IF4 equals 1.0.5's byte for byte (FORMATS_CHECKED)
FORMATS = ("if6_e2m3", "if6_e3m2") if HEAD else ("if4",)
FORMATS_CHECKED = ("if4",) if HEAD else ()
IF4_ONLY_CASES = ("gauss_f32", "laplace_bf16", "outliers_bf16")  # IF6 codes take a byte each: fewer cases
DEQ_CASES = ("gauss_bf16", "ties_f32", "zero_const_blocks_f32", "huge_f32", "tiny_f32")


def _bf16(a: np.ndarray) -> np.ndarray:
    return torch.from_numpy(a.astype(np.float32)).bfloat16().float().numpy()


def _ties() -> np.ndarray:
    """Blocks whose scaled values sit on rounding boundaries: with amax = 2688 the global scale is 1 and a block
    with max 6 * 2^j has the exact scale 2^j, so y = x / 2^j is what the element roundings see."""
    fp_ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.1, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.5, 6.0]
    k = np.arange(8, dtype=np.float32)
    int_ties = list(((k + 0.5) * np.float32(6.0 / 7.0)).astype(np.float32)) + [6.0, 0.0, 3.0, 1.0, 2.0, 4.0, 5.0, 0.3]
    rows = []
    for j in (-2, 0, 3, 6):
        for base in (fp_ties, int_ties):
            b = np.asarray(base, np.float32) * np.float32(2.0**j)
            rows.append(np.where(np.arange(16) % 3 == 1, -b, b))
    x = np.concatenate(rows).reshape(4, -1).astype(np.float32)  # 4 x 128: 8 blocks a row
    x[0, 0] = 2688.0  # the tensor max: global scale exactly 1
    return x


def _cases() -> dict[str, tuple[np.ndarray, str, float | None]]:
    """name -> (values as float32, "float32" | "bfloat16", caller-supplied amax or None)."""
    out: dict[str, tuple[np.ndarray, str, float | None]] = {}
    g = np.random.default_rng(0)
    out["gauss_f32"] = (g.standard_normal((16, 128)).astype(np.float32), "float32", None)
    out["gauss_bf16"] = (_bf16(g.standard_normal((16, 256))), "bfloat16", None)
    out["laplace_bf16"] = (_bf16(g.laplace(size=(16, 256))), "bfloat16", None)
    out["student_t3_bf16"] = (_bf16(g.standard_t(3, size=(16, 256))), "bfloat16", None)
    o = g.standard_normal((16, 256))
    out["outliers_bf16"] = (_bf16(np.where(g.random((16, 256)) < 0.01, 50 * o, o)), "bfloat16", None)
    out["tiny_f32"] = ((g.standard_normal((8, 64)) * 1e-12).astype(np.float32), "float32", None)
    out["huge_f32"] = ((g.standard_normal((8, 64)) * 1e30).astype(np.float32), "float32", None)
    out["zeros_f32"] = (np.zeros((2, 32), np.float32), "float32", None)
    z = g.standard_normal((16, 64)).astype(np.float32)
    z[0, :16] = 0.0
    z[1, 16:32] = -0.0
    z[2, 32:48] = 1.5
    z[3, 48:64] = -3.0
    z[4, :16:2] = -0.0
    z[5, 16:32] *= np.float32(1e-6)  # a block far below the tensor max
    out["zero_const_blocks_f32"] = (z, "float32", None)
    out["ties_f32"] = (_ties(), "float32", None)
    nf = g.standard_normal((16, 64)).astype(np.float32)
    amax = float(np.abs(nf).max())
    nf[2, 5] = np.nan
    nf[7, 40] = np.inf
    nf[9, 20] = -np.inf
    out["nonfinite_given_amax_f32"] = (nf, "float32", amax)
    out["gauss_bf16_2d"] = (_bf16(g.standard_normal((64, 128))), "bfloat16", None)
    return out


def _torch(x: np.ndarray, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(x.copy())
    return t.bfloat16() if dtype == "bfloat16" else t


def _quantize(xt: torch.Tensor, amax: float | None, fmt: str, rule: str, two_d: bool):
    kw = dict(block_scale_2d=two_d, fp4_format=DataType(fmt), scale_rule=ScaleRule(rule),
              use_blackwell_scale_layout=False)
    if not HEAD:
        kw["pack_values"] = True
    x_amax = None if amax is None else torch.tensor(amax, dtype=torch.float32)
    return ref_quantize(xt, x_amax, **kw)


def _dequantize(values, scales2d, amax, fmt: str, rule: str, shape) -> np.ndarray:
    t = QuantizedTensor(values, scales2d, amax, DataType(fmt), tuple(shape), ScaleRule(rule),
                        scale_factors_are_in_blackwell_layout=False)
    return PyTorchQuantizeBackend.dequantize(t, torch.float32).numpy()


def _check_against(pypi: Path, cases) -> str:
    """The HEAD's IF4 against the PyPI 1.0.5 fixture: codes, scale bytes and amax, every case and rule."""
    ref = np.load(pypi)
    bad = []
    for name, (x, dtype, amax) in cases.items():
        rows, k = x.shape
        for rule in RULES:
            values, scales, x_amax = _quantize(_torch(x, dtype), amax, "if4", rule, name.endswith("_2d"))
            sb = scales.reshape(rows, k // 16).view(torch.uint8).numpy()
            sb = sb[::16] if name.endswith("_2d") else sb
            key = f"if4/{rule}/{name}"
            if not (np.array_equal(values.numpy(), ref[f"codes/{key}"]) and np.array_equal(sb, ref[f"scales/{key}"])
                    and np.float32(x_amax).tobytes() == ref[f"amax/{key}"].tobytes()):
                bad.append(key)
    return "identical to PyPI 1.0.5 on every case and rule" if not bad else f"differs from PyPI 1.0.5: {bad}"


def main(out: Path) -> None:
    arrays: dict[str, np.ndarray] = {}
    cases = _cases()
    picked: dict[str, dict[str, float]] = {}
    checked = {}
    for fmt in FORMATS_CHECKED:
        checked[fmt] = _check_against(out.parent / "pypi-1.0.5.npz", cases)
        print(f"{fmt}: {checked[fmt]}")
    for name, (x, dtype, amax) in cases.items():
        stored = x.astype(ml_dtypes.bfloat16).view(np.uint16) if dtype == "bfloat16" else x
        if HEAD:  # the inputs live in the PyPI file (the same generator made both)
            assert np.load(out.parent / "pypi-1.0.5.npz")[f"x/{name}"].tobytes() == stored.tobytes(), name
        else:
            arrays[f"x/{name}"] = stored
        two_d = name.endswith("_2d")
        xt = _torch(x, dtype)
        rows, k = x.shape
        for fmt in FORMATS:
            if fmt != "if4" and name in IF4_ONLY_CASES:
                continue
            for rule in RULES:
                key = f"{fmt}/{rule}/{name}"
                values, scales, x_amax = _quantize(xt, amax, fmt, rule, two_d)
                s2 = scales.reshape(rows, k // 16)
                sb = s2.view(torch.uint8).numpy()
                arrays[f"codes/{key}"] = values.numpy().astype(np.uint8)
                arrays[f"scales/{key}"] = sb[::16] if two_d else sb
                arrays[f"amax/{key}"] = np.asarray(x_amax, np.float32).reshape(())
                if fmt == "if4" and rule == "mse" and name in DEQ_CASES:
                    arrays[f"deq/{key}"] = _dequantize(values, s2, x_amax, fmt, rule, x.shape).astype(np.float32)
                finite = np.isfinite(x).reshape(-1, 16).all(-1) if not two_d else None
                flags = (sb[::16] if two_d else sb) >= 128
                picked.setdefault(f"{fmt}/{rule}", {})[name] = float(flags.mean() if finite is None
                                                                     else flags.reshape(-1)[finite].mean())
    meta = {
        "fouroversix": fouroversix.__version__,
        "source": "GitHub mit-han-lab/fouroversix dadfad6901d473a734fe71e0b082e70ee993e23a" if HEAD
        else "PyPI fouroversix==1.0.5",
        "function": "fouroversix.quantize.pytorch.reference." + ("quantize" if HEAD else "quantize_to_fp4"),
        "torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version(),
        "machine": platform.machine(), "command": " ".join(sys.argv),
        "formats": list(FORMATS), "rules": list(RULES),
        "if4_only_cases": list(IF4_ONLY_CASES) if HEAD else [],
        "cases": {n: {"dtype": d, "shape": list(x.shape), "amax": a, "block": "16x16" if n.endswith("_2d") else "1x16"}
                  for n, (x, d, a) in cases.items()},
        "int_block_fraction": picked,
        "checked_against_pypi": checked,
    }
    arrays["meta"] = np.asarray(json.dumps(meta, indent=1))
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, **arrays)
    print(json.dumps(picked, indent=1))
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB, {len(arrays)} arrays)")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: {sys.argv[0]} OUT.npz")
    main(Path(sys.argv[1]))
