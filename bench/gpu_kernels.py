"""GPU benchmark of the Pallas kernels against their jnp twins (XLA under jit), with an on-device exactness check.

For each kernel, size and input dtype: the XLA twin's time, the Pallas kernel's time for each block configuration
of a small sweep (the best is kept), the bytes each must move (read x, write the outputs), GB/s, and the fraction
of the device's copy bandwidth (a jitted ``-x`` of the same input: one read and one write). Before timing, every
configuration's outputs are compared bit for bit with the twin on the device (mse/mae: decisions may differ at
near-ties, which are counted). Writes the ``## GPU kernels`` section of bench/RESULTS.md.

Goals (issue 7): each kernel at >= 80 % of copy bandwidth; the 4/6 kernel within 15 % of static_6's time.

    .venv/bin/python bench/gpu_kernels.py                 # needs an NVIDIA GPU (sm_80+); exits 2 without one
    .venv/bin/python bench/gpu_kernels.py --quick         # one size, fewer configurations
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import machine, markdown_table, write_section  # noqa: E402

from jaxlowfp import QArray, dispatch, nvfp4, qat  # noqa: E402
from pallas_kernels import hif8 as phif8  # noqa: E402
from pallas_kernels import nvfp4 as pnvfp4  # noqa: E402

SECTION = "GPU kernels"


# ---- the kernels under test ------------------------------------------------------------------------------------


def _hif8_twin(x, scale, clip: float = 15.0):
    """What XLA computes for the same outputs: jaxlowfp.qat.scaled_round plus the amax and the counters qat takes.

    Returns (y, saturated, amax, nonfinite, underflow); the comparison uses y and the saturated count (the amax of
    XLA:CPU's max may drop a NaN; tests/test_pallas_hif8.py checks the kernel's amax and counters against numpy).
    """
    y, sat = qat.scaled_round(x, scale, clip, "hif8")
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    return y, sat, amax, jnp.sum(~jnp.isfinite(x), dtype=jnp.int32), jnp.sum((x != 0) & (y == 0), dtype=jnp.int32)


def _hif8_compare(want, got) -> tuple[int, int]:
    y, sat, amax, nonfinite, under = want
    return count_mismatches([y, sat, nonfinite, under],
                            [got.y, got.saturated_count, got.nonfinite_count, got.underflow_count]), 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One kernel to benchmark.

    Attributes:
      name: row label.
      kernel: name in jaxlowfp.dispatch.KERNELS.
      xla: the jnp twin, ``xla(x) -> outputs`` (jitted here).
      pallas: ``pallas(x, config, interpret) -> outputs`` (same structure as `xla`).
      configs: block configurations to sweep (dicts of keyword arguments for `pallas`).
      bytes_moved: ``bytes_moved(x) -> int``: bytes read plus written by one call.
      compare: ``compare(xla_out, pallas_out) -> (mismatches, near_ties)``; exact kernels report 0 near-ties.
    """

    name: str
    kernel: str
    xla: Callable[[jax.Array], Any]
    pallas: Callable[..., Any]
    configs: tuple[dict, ...]
    bytes_moved: Callable[[jax.Array], int]
    compare: Callable[[Any, Any], tuple[int, int]]


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def count_mismatches(want: Any, got: Any) -> int:
    """Elements whose bits differ across a pytree of arrays (a NaN equals any NaN)."""
    bad = 0
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        w, g = np.asarray(w), np.asarray(g)
        if w.shape != g.shape or w.dtype != g.dtype:
            return max(w.size, g.size)
        diff = _bits(w.reshape(-1)) != _bits(g.reshape(-1))
        if np.issubdtype(w.dtype, np.floating) or w.dtype.kind == "V":
            wf, gf = w.astype(np.float32).reshape(-1), g.astype(np.float32).reshape(-1)
            diff &= ~(np.isnan(wf) & np.isnan(gf))
        bad += int(diff.sum())
    return bad


def hif8_case(quick: bool) -> Case:
    scale = jnp.float32(0.25)
    blocks = (4096, 8192) if quick else (2048, 4096, 8192, 16384, 32768)
    warps = (4, 8) if quick else (4, 8, 16)
    return Case(
        name="HiF8 scaled fake-quant (+amax, counts)",
        kernel=phif8.KERNEL,
        xla=lambda x: _hif8_twin(x, scale, 15.0),
        pallas=lambda x, cfg, interpret: phif8.scaled_fake_quant(x, scale, 15.0, interpret=interpret, **cfg),
        configs=tuple(dict(block_size=b, num_warps=w) for b in blocks for w in warps),
        bytes_moved=lambda x: 2 * x.size * x.dtype.itemsize,
        compare=_hif8_compare,
    )


def _nvfp4_leaves(out) -> list:
    if isinstance(out, QArray):
        return [out.codes, out.scales, out.global_scale]
    return [out]


def _nvfp4_compare(rule: str):
    """Exact rules: every differing element is a mismatch. mse/mae: blocks whose scale byte differs are counted as
    near-tie decisions (the 4-vs-6 error sums may round differently), the rest must match."""

    def compare(want, got) -> tuple[int, int]:
        want, got = _nvfp4_leaves(want), _nvfp4_leaves(got)
        if rule not in ("mse", "mae") or len(want) == 1:
            return count_mismatches(want, got), 0
        ties = count_mismatches([want[1]], [got[1]])
        return count_mismatches([want[0], want[2]], [got[0], got[2]]) if ties == 0 else 0, ties

    return compare


def nvfp4_cases(quick: bool) -> list[Case]:
    tiles = ((16, 512), (8, 1024)) if quick else ((8, 256), (16, 256), (16, 512), (32, 512), (8, 1024), (16, 1024))
    warps = (4,) if quick else (4, 8)
    configs = tuple(dict(tile_shape=t, num_warps=w) for t in tiles for w in warps)
    amax = jnp.float32(40.0)  # a delayed / supplied amax: the kernel alone, no extra XLA reduction pass
    cases = []
    for entry, twin, label in ((pnvfp4.quantize, nvfp4.quantize, "quantize"),
                               (pnvfp4.fake_quantize, nvfp4.fake_quantize, "fake-quant")):
        for rule in (("static_6", "mse") if quick else ("static_6", "static_4", "abs_max", "mae", "mse")):
            fake = entry is pnvfp4.fake_quantize
            cases.append(Case(
                name=f"NVFP4 {label} {rule} 1x16",
                kernel=pnvfp4.KERNEL_FAKE_QUANTIZE if fake else pnvfp4.KERNEL_QUANTIZE,
                xla=lambda x, twin=twin, rule=rule: twin(x, rule=rule, global_amax=amax, impl="xla"),
                pallas=lambda x, cfg, interpret, entry=entry, rule=rule: entry(
                    x, rule=rule, global_amax=amax, interpret=interpret, **cfg),
                configs=configs,
                bytes_moved=(lambda x: 2 * x.size * x.dtype.itemsize) if fake else (
                    lambda x: x.size * x.dtype.itemsize + x.size // 2 + x.size // 16),
                compare=_nvfp4_compare(rule),
            ))
    return cases


def all_cases(quick: bool) -> list[Case]:
    return [hif8_case(quick), *nvfp4_cases(quick)]


# ---- measurement -----------------------------------------------------------------------------------------------


def check_exact(case: Case, x: jax.Array, config: dict | None = None, *, interpret: bool = False) -> tuple[int, int]:
    """(mismatches, near-ties) of the Pallas kernel against its jnp twin on `x` (interpret mode works on CPU)."""
    config = case.configs[0] if config is None else config
    want = jax.jit(case.xla)(x)
    got = case.pallas(x, config, interpret)
    return case.compare(want, got)


def time_gpu(fn: Callable, x: jax.Array, *, iters: int = 20, reps: int = 5) -> float:
    """Median seconds per call; `iters` calls are queued back to back so launch overhead is hidden."""
    jax.block_until_ready(fn(x))
    per_call = []
    for _ in range(reps):
        t = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(x)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - t) / iters)
    return statistics.median(per_call)


def make_input(shape: tuple[int, int], dtype, seed: int = 0) -> jax.Array:
    """Log-normal-magnitude data with both signs, a few outliers and one all-zero row (on the device)."""
    key = jax.random.key(seed)
    k1, k2 = jax.random.split(key)
    x = jax.random.normal(k1, shape, jnp.float32) * jnp.exp(jax.random.normal(k2, shape, jnp.float32))
    x = x.at[0].set(0.0).at[1, :3].set(jnp.array([300.0, -1e-3, 7.5], jnp.float32))
    return x.astype(dtype)


def gpu_or_reason() -> tuple[jax.Device | None, str]:
    dev = jax.devices()[0]
    ok, reason = dispatch.pallas_capability(phif8.KERNEL, dev)
    return (dev if ok else None), reason


def run(sizes: list[tuple[int, int]], dtypes: list, cases: list[Case], *, interpret: bool = False,
        iters: int = 20, reps: int = 5) -> tuple[list[list], list[str]]:
    """The table rows and notes for `cases` at every size and dtype (``interpret=True`` only for testing the
    logic on a CPU: its timings mean nothing)."""
    copy = jax.jit(jnp.negative)
    timer = functools.partial(time_gpu, iters=iters, reps=reps)
    rows, notes = [], []
    best_time: dict[tuple, float] = {}
    for shape in sizes:
        for dtype in dtypes:
            x = make_input(shape, dtype)
            t_copy = timer(copy, x)
            bw_copy = 2 * x.size * x.dtype.itemsize / t_copy
            for case in cases:
                nbytes = case.bytes_moved(x)
                t_xla = timer(jax.jit(case.xla), x)
                best = None
                for cfg in case.configs:
                    try:
                        mism, ties = check_exact(case, x, cfg, interpret=interpret)
                        t = timer(lambda a, cfg=cfg: case.pallas(a, cfg, interpret), x)
                    except Exception as e:  # noqa: BLE001 - a configuration that fails to compile is skipped
                        notes.append(f"{case.name} {shape} {jnp.dtype(dtype).name} {cfg}: {type(e).__name__}: {e}")
                        continue
                    if mism:
                        notes.append(f"{case.name} {shape} {jnp.dtype(dtype).name} {cfg}: {mism} mismatches")
                    if best is None or (mism > 0, t) < (best[2] > 0, best[0]):  # exact first, then fastest
                        best = (t, cfg, mism, ties)
                if best is None:
                    rows.append([case.name, f"{shape[0]}x{shape[1]}", jnp.dtype(dtype).name, "all configs failed"])
                    continue
                t, cfg, mism, ties = best
                best_time[(case.name, shape, jnp.dtype(dtype).name)] = t
                cfg_s = ", ".join(f"{k}={v}" for k, v in cfg.items())
                rows.append([
                    case.name, f"{shape[0]}x{shape[1]}", jnp.dtype(dtype).name,
                    f"{t_xla * 1e3:.3f}", f"{nbytes / t_xla / 1e9:.0f}", f"{nbytes / t_xla / bw_copy:.2f}",
                    f"{t * 1e3:.3f}", f"{nbytes / t / 1e9:.0f}", f"{nbytes / t / bw_copy:.2f}", f"{t_xla / t:.2f}",
                    cfg_s, str(mism), str(ties),
                ])
                print(" | ".join(rows[-1]), flush=True)
    for (name, shape, dt), t in best_time.items():  # the paper's claim: 4/6 costs < 15 % over plain NVFP4
        base = best_time.get((name.replace(" mse ", " static_6 "), shape, dt))
        if " mse " in name and base:
            notes.append(f"4/6 overhead, {name} vs static_6, {shape[0]}x{shape[1]} {dt}: {100 * (t / base - 1):+.1f} % "
                         f"(goal < 15 %)")
    return rows, notes


HEADER = [
    "kernel", "shape", "dtype", "XLA ms", "XLA GB/s", "XLA / copy", "Pallas ms", "Pallas GB/s", "Pallas / copy",
    "speed-up", "best config", "mismatches", "near-ties",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one size and a smaller configuration sweep")
    ap.add_argument("--no-write", action="store_true", help="print only; do not touch bench/RESULTS.md")
    args = ap.parse_args(argv)
    dev, reason = gpu_or_reason()
    if dev is None:
        print(f"bench/gpu_kernels.py needs a GPU that runs the Pallas kernels; {reason}. No numbers written.",
              file=sys.stderr)
        return 2
    sizes = [(4096, 4096)] if args.quick else [(4096, 4096), (4096, 5120), (8192, 8192), (16384, 8192)]
    dtypes = [jnp.bfloat16] if args.quick else [jnp.bfloat16, jnp.float32]
    rows, notes = run(sizes, dtypes, all_cases(args.quick))
    body = (
        f"`.venv/bin/python bench/gpu_kernels.py{' --quick' if args.quick else ''}` on {machine()}. "
        "Times are medians per call (20 calls queued, 5 repeats). GB/s counts the bytes a kernel must read and "
        "write; \"/ copy\" divides by a jitted `-x` of the same input. \"mismatches\" are output elements whose bits "
        "differ from the jnp twin on this device for the best configuration.\n\n"
        + markdown_table(HEADER, rows)
        + ("\n\nNotes:\n" + "\n".join(f"- {n}" for n in notes) if notes else "")
    )
    if not args.no_write:
        write_section(SECTION, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
