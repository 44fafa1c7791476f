"""One-shot GPU check (``make gpu-check``): kernels against their jnp twins on the device, throughput, QAT step.

  (a) Every Pallas kernel configuration (HiF8 fused fake-quant; NVFP4 quantize and fake-quantize for every rule,
      1x16 and 16x16 blocks; float32 and bfloat16; every backend the kernels offer) against its jnp twin
      (``jaxlowfp.qat.scaled_round``; ``jaxlowfp.nvfp4.quantize / fake_quantize(impl="xla")``), bit for bit (a NaN
      equals any NaN), on ragged shapes, for inputs: log-normal magnitudes, the same scaled by 1e-4 and by 1e4, and
      one holding NaN, +-Inf, zeros, -0.0, subnormals, the smallest normals and values near FLT_MAX (NVFP4: with
      the tensor amax, which is then NaN, and with a finite supplied ``global_amax``). HiF8's amax and counters
      are checked against numpy.
  (b) GB/s and fraction of a device copy (a jitted ``-x``: one read, one write) for the HiF8 kernel and NVFP4
      ``static_6`` and 4/6 ``mse`` (quantize and fake-quantize, 1x16), per backend and for the jnp twin, and the
      4/6 overhead over ``static_6`` (bench/gpu_kernels.py's timer and table, default block configuration).
  (c) The HiF8 W8A8 QAT train step (Pallas and jnp quantizers) against the high-precision step, bfloat16 compute,
      on the demo model.
  (d) The configurations that passed (a) go to ``jaxlowfp/verified_kernels.json`` (merged with the entries of
      other devices and JAX versions; a configuration that fails here loses its entry for this device and JAX).
  (e) Everything goes to the ``## GPU check`` section of bench/RESULTS.md.
  (f) Packed NVFP4 GEMMs (``jaxlowfp.backends``) for Llama-8B-sized projections: the real block-scaled GEMM
      (cuDNN, sm_100+) on Four Over Six codes and the dequant backend against fake-quant (within float32 summation
      order) and the bf16 GEMM, with times (``packed_gemm_check``). Exit 1 when a packed product leaves the bound.

Refuses to run without a GPU that runs the kernels (exit 2). Exit 1 when a kernel differs from its twin.
Runs with the GPU machine's own python3 against the source tree (jax >= 0.11, no installs)::

    PYTHONPATH=. python3 scripts/gpu_check.py            # make gpu-check
    PYTHONPATH=. python3 scripts/gpu_check.py --interpret  # the (a)-(c) logic on CPU: Pallas interpret mode,
                                                           # tiny shapes; writes nothing
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import re
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxlowfp import QArray, dispatch, nvfp4, qat  # noqa: E402

SECTION = "GPU check"
VERIFIED = ROOT / "jaxlowfp" / "verified_kernels.json"
SCHEMA = 1
HIF8_CLIP = 15.0
TRAIN_PRESET = "base"  # jaxlowfp.models.llama preset for (c)

warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*", category=DeprecationWarning)


# ---- the configurations ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One kernel configuration checked in (a).

    Attributes:
      kernel: name in ``jaxlowfp.dispatch.KERNELS``.
      backend: "triton" or "mosaic" (``backend=`` of the kernel, passed only where the kernel takes it).
      dtype: "float32" or "bfloat16".
      rule, block_shape: NVFP4 only (None for HiF8).
    """

    kernel: str
    backend: str
    dtype: str
    rule: str | None = None
    block_shape: tuple[int, int] | None = None

    def __post_init__(self):
        if self.kernel not in dispatch.KERNELS:
            raise ValueError(f"kernel={self.kernel!r}; known kernels: {sorted(dispatch.KERNELS)}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16'; got {self.dtype!r}")
        if (self.rule is None) != (self.block_shape is None) or (self.rule is None) != self.kernel.startswith("hif8"):
            raise ValueError(f"rule and block_shape are given for NVFP4 kernels only; got {self}")

    @property
    def label(self) -> str:
        bs = "x".join(map(str, self.block_shape)) if self.block_shape else "-"
        return f"{self.kernel} [{self.backend}] {self.rule or '-'} {bs} {self.dtype}"


def all_cases(backends: tuple[str, ...] = dispatch.PALLAS_BACKENDS) -> list[Case]:
    """Every kernel x rule x block shape x dtype, for each of `backends` the kernel has (``dispatch.KERNELS``)."""
    unknown = set(dispatch.KERNELS) - {"hif8.scaled_fake_quant", "nvfp4.quantize", "nvfp4.fake_quantize"}
    if unknown:
        raise RuntimeError(f"scripts/gpu_check.py does not know how to call {sorted(unknown)} "
                           "(jaxlowfp.dispatch.KERNELS): add it here")
    out = []
    for dtype in ("float32", "bfloat16"):
        for kernel in ("hif8.scaled_fake_quant", "nvfp4.quantize", "nvfp4.fake_quantize"):
            for b in (b for b in backends if b in dispatch.KERNELS[kernel]):
                if kernel.startswith("hif8"):
                    out.append(Case(kernel=kernel, backend=b, dtype=dtype))
                else:
                    out += [Case(kernel=kernel, backend=b, dtype=dtype, rule=r, block_shape=tuple(bs))
                            for r in nvfp4.KERNEL_RULES for bs in nvfp4.BLOCK_SHAPES]
    return out


def case_shape(case: Case, small: bool) -> tuple[int, int]:
    """Ragged against the kernels' default tiles (16 x 512 for NVFP4, 8192 elements for HiF8): a partial last
    tile in K, and in rows where the block shape allows it. `small`: for interpret mode (one tile)."""
    if small:
        return (32, 48) if case.block_shape == (16, 16) else (19, 48)
    return (1008, 1040) if case.block_shape == (16, 16) else (1001, 1040)


# ---- inputs ------------------------------------------------------------------------------------------------------


def input_sets(shape: tuple[int, int], seed: int = 0) -> dict[str, np.ndarray]:
    """float32 host arrays (cast to the case's dtype on the device): see the module docstring."""
    rng = np.random.default_rng(seed)
    base = (rng.standard_normal(shape) * np.exp(rng.standard_normal(shape))).astype(np.float32)
    base[0] = 0.0  # an all-zero row
    base[1, :5] = [-0.0, 300.0, -1e-3, 7.5, 0.0]
    special = base.copy()
    flat = special.reshape(-1)
    picks = {
        np.nan: 3, np.inf: 2, -np.inf: 2,
        1e-39: 3, -2e-40: 3, 1.4e-45: 1, 1.2e-38: 2, -1.18e-38: 2,  # subnormals and the smallest normals
        2.5e38: 1, -3.0e38: 1,  # near FLT_MAX (bfloat16's max is 3.39e38)
    }
    positions = rng.choice(np.arange(32, flat.size), size=sum(picks.values()), replace=False)
    i = 0
    for value, count in picks.items():
        flat[positions[i:i + count]] = value
        i += count
    flat[16:32] = 0.0  # a zero block
    return {"lognormal": base, "x1e-4": base * np.float32(1e-4), "x1e4": base * np.float32(1e4), "specials": special}


def hif8_scale(x: np.ndarray) -> np.float32:
    """A delayed-scaling-like decode scale: the 99.5th percentile of the finite |x| over the clip (some saturate)."""
    a = np.abs(x[np.isfinite(x)])
    return np.float32(max(float(np.percentile(a, 99.5)), 1e-30) / HIF8_CLIP)


# ---- (a) exactness -----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExactResult:
    case: Case
    shape: tuple[int, int]
    mismatches: dict[str, int]  # input set -> differing elements (-1: the kernel raised)
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and not any(self.mismatches.values())


def count_mismatches(want: Any, got: Any) -> int:
    from gpu_kernels import count_mismatches as bits_differ  # bench/gpu_kernels.py: bit compare, NaN == NaN

    return bits_differ(want, got)


def _kernel_call(case: Case, interpret: bool) -> Callable:
    entry = dispatch.kernel(case.kernel, case.backend)
    if case.rule is None:
        return lambda x, scale: entry(x, scale, HIF8_CLIP, interpret=interpret)
    return lambda x, ga: entry(x, rule=case.rule, block_shape=case.block_shape, global_amax=ga, interpret=interpret)


def _twin_call(case: Case) -> Callable:
    if case.rule is None:
        return jax.jit(lambda x, scale: qat.scaled_round(x, scale, HIF8_CLIP, "hif8"))
    fn = nvfp4.quantize if case.kernel == "nvfp4.quantize" else nvfp4.fake_quantize
    return lambda x, ga: fn(x, rule=case.rule, block_shape=case.block_shape, global_amax=ga, impl="xla")


def _leaves(out: Any) -> list:
    if isinstance(out, QArray):
        return [out.codes, out.scales, out.global_scale]
    return jax.tree.leaves(out)


def hif8_oracle(x: np.ndarray, y_twin: np.ndarray, *, flush_subnormals: bool = False) -> tuple[np.float32, int, int]:
    """numpy: (amax, NaN if any NaN; #non-finite; #{x != 0 and y == 0}) of the kernel's extra outputs.

    `flush_subnormals`: model a backend that treats float32 subnormal inputs as zero (XLA:CPU, so interpret mode).
    """
    xf = np.asarray(x, np.float32)
    if flush_subnormals:
        xf = np.where(np.abs(xf) < np.finfo(np.float32).tiny, np.float32(0), xf)
    amax = np.float32(np.nan) if np.isnan(xf).any() else np.float32(np.max(np.abs(xf)))
    under = int(np.sum((xf != 0) & (np.asarray(y_twin, np.float32) == 0)))
    return amax, int(np.sum(~np.isfinite(xf))), under


def check_case(case: Case, sets: dict[str, np.ndarray], *, interpret: bool) -> dict[str, int]:
    """Input set -> mismatching elements of `case`'s kernel against its twin on the default device."""
    kernel, twin = _kernel_call(case, interpret), _twin_call(case)
    out = {}
    for name, host in sets.items():
        x = jnp.asarray(host).astype(jnp.dtype(case.dtype))
        xh = np.asarray(x.astype(jnp.float32))  # the values the device sees
        if case.rule is None:
            scale = jnp.float32(hif8_scale(xh))
            y, sat = twin(x, scale)
            got = kernel(x, scale)
            # On a GPU, numpy's answer. On a CPU (interpret mode) XLA flushes subnormal inputs to zero in some
            # compares and not in others (the Triton interpreter's `x != 0` always, the Mosaic interpreter's for
            # float32 but not bfloat16): either answer is accepted there.
            flushes = (False, True) if jax.default_backend() == "cpu" else (False,)
            extra = min(
                count_mismatches([np.asarray(o[0]), np.int32(o[1]), np.int32(o[2])],
                                 [got.amax, got.nonfinite_count, got.underflow_count])
                for o in (hif8_oracle(xh, np.asarray(y.astype(jnp.float32)), flush_subnormals=f) for f in flushes))
            out[name] = count_mismatches([y, sat], [got.y, got.saturated_count]) + extra
            continue
        amaxes = {name: None}
        if not np.isfinite(xh).all():  # the tensor amax is NaN here: also a finite supplied one
            amaxes[f"{name}, global_amax"] = jnp.float32(np.max(np.abs(xh[np.isfinite(xh)])))
        for label, ga in amaxes.items():
            out[label] = count_mismatches(_leaves(twin(x, ga)), _leaves(kernel(x, ga)))
    return out


def check_exact(cases: list[Case], *, interpret: bool = False, small: bool = False, threads: int = 1,
                log: Callable[[str], None] = print) -> list[ExactResult]:
    """(a) for `cases`, in order; a kernel that raises is a failed case with its error, not a crash.

    `threads` > 1 checks several cases at once, so their compilations (Triton, ptxas: seconds each) overlap.
    """
    def one(case: Case) -> ExactResult:
        shape = case_shape(case, small)
        try:
            res = ExactResult(case=case, shape=shape, mismatches=check_case(case, input_sets(shape),
                                                                             interpret=interpret))
        except Exception as e:  # noqa: BLE001 - recorded with the configuration
            res = ExactResult(case=case, shape=shape, mismatches={}, error=f"{type(e).__name__}: {str(e)[:300]}")
        log(f"  {case.label} {shape[0]}x{shape[1]}: " + ("exact" if res.passed else res.error or str(res.mismatches)))
        return res

    if threads <= 1:
        return [one(c) for c in cases]
    with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(one, cases))


def exact_table(results: list[ExactResult]) -> str:
    from _results import markdown_table

    rows = []
    for r in results:
        c = r.case
        detail = r.error or ("exact" if r.passed else
                             ", ".join(f"{k}: {v}" for k, v in r.mismatches.items() if v))
        rows.append([c.kernel, c.backend, c.rule or "-", "x".join(map(str, c.block_shape)) if c.block_shape else "-",
                     c.dtype, f"{r.shape[0]}x{r.shape[1]}", "pass" if r.passed else "FAIL", detail])
    return markdown_table(["kernel", "backend", "rule", "block", "dtype", "shape", "result", "mismatches"], rows)


# ---- (b) throughput ----------------------------------------------------------------------------------------------


def _hif8_with_stats(x, scale):
    """The jnp twin of everything the HiF8 kernel returns: qat.scaled_round, amax and the counters."""
    y, sat = qat.scaled_round(x, scale, HIF8_CLIP, "hif8")
    xf = x.astype(jnp.float32)
    return (y, jnp.max(jnp.abs(xf)), sat, jnp.sum(~jnp.isfinite(xf), dtype=jnp.int32),
            jnp.sum((x != 0) & (y == 0), dtype=jnp.int32))


def throughput_cases(backend: str) -> list:
    """bench/gpu_kernels.py ``Case``s for (b): HiF8 and NVFP4 static_6 / mse (quantize and fake-quantize, 1x16),
    the `backend` kernel at its default configuration against the twin forced to the jnp code (``impl="xla"``),
    compared bit for bit (no near-tie allowance)."""
    import gpu_kernels as bench

    scale = jnp.float32(0.25)
    hif8 = dispatch.kernel("hif8.scaled_fake_quant", backend)
    cases = [bench.Case(
        name=f"HiF8 scaled fake-quant (+amax, counts) [{backend}]", kernel="hif8.scaled_fake_quant",
        xla=lambda x: _hif8_with_stats(x, scale),
        pallas=lambda x, c, interpret: tuple(hif8(x, scale, HIF8_CLIP, interpret=interpret, **c)),
        configs=({},), bytes_moved=lambda x: 2 * x.size * x.dtype.itemsize,
        compare=lambda want, got: (count_mismatches(want, got), 0),
    )]
    amax = jnp.float32(40.0)  # a supplied global amax: the kernel alone, no XLA amax pass
    for kernel, twin, label in (("nvfp4.quantize", nvfp4.quantize, "quantize"),
                                ("nvfp4.fake_quantize", nvfp4.fake_quantize, "fake-quant")):
        entry, fake = dispatch.kernel(kernel, backend), kernel == "nvfp4.fake_quantize"
        for rule in ("static_6", "mse"):
            cases.append(bench.Case(
                name=f"NVFP4 {label} {rule} 1x16 [{backend}]", kernel=kernel,
                xla=lambda x, twin=twin, rule=rule: twin(x, rule=rule, global_amax=amax, impl="xla"),
                pallas=lambda x, c, interpret, entry=entry, rule=rule: entry(
                    x, rule=rule, global_amax=amax, interpret=interpret, **c),
                configs=({},),
                bytes_moved=(lambda x: 2 * x.size * x.dtype.itemsize) if fake else (
                    lambda x: x.size * x.dtype.itemsize + x.size // 2 + x.size // 16),
                compare=lambda want, got: (count_mismatches(_leaves(want), _leaves(got)), 0),
            ))
    return cases


def throughput(shape: tuple[int, int], dtype: Any, backends: tuple[str, ...], *, interpret: bool = False,
               iters: int = 20, reps: int = 5) -> tuple[list[str], list[list], list[str]]:
    """(header, rows, notes) of bench/gpu_kernels.py's ``run`` over :func:`throughput_cases` for each backend."""
    import gpu_kernels as bench

    rows, notes = [], []
    for b in backends:
        r, n = bench.run([shape], [dtype], throughput_cases(b), interpret=interpret, iters=iters, reps=reps)
        rows += r
        notes += n
    return bench.HEADER, rows, notes


# ---- (c) QAT train step ------------------------------------------------------------------------------------------


def gemm_variants(device: Any) -> tuple[dict[str, qat.Recipe], dict[str, str]]:
    """The QAT steps of the GEMM backends (`Recipe(gemm=...)`): FP8 delayed scaling and NVFP4 4/6 W4A4, each on the
    dequant backend and on its low-precision GEMM where `device` runs it: ({variant: recipe}, {variant: why not})."""
    from jaxlowfp import backends

    out, skipped = {}, {}
    for label, recipe, gemm in (("fp8_delayed", qat.fp8_delayed(), "fp8"),
                                ("NVFP4 4/6 W4A4", qat.nvfp4_w4a4("mse"), "scaled_matmul")):
        out[f"{label} (dequant)"] = recipe
        real = dataclasses.replace(recipe, gemm=gemm)
        try:
            qat.gemm.plan(real, device=device)
        except backends.BackendUnavailableError as e:
            skipped[f"{label} ({gemm})"] = str(e)
            continue
        out[f"{label} ({gemm})"] = real
    return out, skipped


def build_train_steps(preset: str, *, batch: int, seq: int, backends: tuple[str, ...] = (),
                      overrides: dict | None = None, recipes: dict[str, qat.Recipe] | None = None,
                      ) -> tuple[dict[str, tuple[Callable, Any]], jax.Array]:
    """({variant: (jitted step, state)}, token batch): the high-precision step and the HiF8 W8A8 QAT step with the
    jnp quantizers and with the Pallas kernel of each of `backends`, plus one QAT step per entry of `recipes`,
    bfloat16 compute, for the `jaxlowfp.models.llama` preset (with ModelConfig `overrides`)."""
    import optax
    from flax import nnx

    from jaxlowfp.qnnx import paper_rules, quantize_model
    from train.loop import init_state, make_train_step  # the public step builder (one import to move)
    from jaxlowfp.models.llama import Llama, loss_fn
    from jaxlowfp.models.llama import preset as model_preset

    cfg = model_preset(preset, **{"dtype": "bfloat16", "max_seq_len": max(seq, 8), **(overrides or {})})
    schedule = optax.constant_schedule(1e-4)
    tx = optax.adamw(schedule)
    variants = {"hp": None, "qat (jnp)": {"impl": "xla"}}
    variants.update({f"qat (pallas, {b})": {"impl": "pallas", "pallas_backend": b} for b in backends})
    variants.update(recipes or {})
    steps = {}
    for name, how in variants.items():
        model = Llama(cfg, rngs=nnx.Rngs(0))
        if how is not None:
            if isinstance(how, qat.Recipe):
                recipe = how
            else:
                r = qat.hif8_w8a8()
                recipe = dataclasses.replace(r, weight=dataclasses.replace(r.weight, **how),
                                             activation=dataclasses.replace(r.activation, **how))
            quantize_model(model, paper_rules(cfg.n_layers, keep_first=1, keep_last=1, recipe=recipe))
        graphdef, state = init_state(model, tx)
        steps[name] = (jax.jit(make_train_step(graphdef, tx, loss_fn=loss_fn, schedule=schedule)), state)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab, (batch, seq + 1)), jnp.int32)
    return steps, tokens


FP8_GEMM_CALL = "__cublas$lt$matmul$f8"  # XLA's custom call for cuBLASLt's FP8 GEMM
BLOCK_SCALED_CALL = "__cudnn$blockScaledDot"  # cuDNN's block-scaled GEMM
_DEF = re.compile(r"^\s*(?:ROOT )?(%[\w.\-]+) = ([a-z0-9]+)\[", re.M)
_DOT = re.compile(r"\bdot\((%[\w.\-]+), (%[\w.\-]+)\)")


def f8_dots(hlo: str) -> int:
    """Dots in an optimized HLO text that read both operands as float8 (on a GPU: XLA's Triton GEMM on FP8 tensor
    cores, the other way XLA runs an FP8 GEMM besides the cuBLASLt call). Names are scoped per computation."""
    n = 0
    for comp in re.split(r"\n(?=\S)", hlo):  # a computation starts at column 0
        types = dict(_DEF.findall(comp))
        n += sum(all(types.get(o, "").startswith("f8") for o in ops) for ops in _DOT.findall(comp))
    return n


def train_step_times(preset: str, *, batch: int, seq: int, reps: int, backends: tuple[str, ...] = (),
                     overrides: dict | None = None, recipes: dict[str, qat.Recipe] | None = None,
                     info: dict | None = None) -> dict[str, float]:
    """Median ms per step of each :func:`build_train_steps` variant, the variants interleaved (load hits all).
    `info`, if given, receives per variant the first step's loss and the low-precision GEMM calls in its optimized
    HLO (cuBLASLt FP8, cuDNN block-scaled)."""
    steps, tokens = build_train_steps(preset, batch=batch, seq=seq, backends=backends, overrides=overrides,
                                      recipes=recipes)
    for name, (fn, state) in list(steps.items()):  # compile (ahead of time, once) and warm up
        compiled = fn.lower(state, tokens).compile()
        steps[name] = (compiled, state)
        _, metrics = compiled(state, tokens)
        if info is not None:
            hlo = compiled.as_text()
            info[name] = {"loss": float(metrics["loss"]), "fp8 GEMMs": hlo.count(FP8_GEMM_CALL),
                          "f8 dots": f8_dots(hlo), "block-scaled GEMMs": hlo.count(BLOCK_SCALED_CALL)}
        jax.block_until_ready(compiled(state, tokens))
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(reps):
        for name, (fn, state) in steps.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(state, tokens))
            times[name].append(time.perf_counter() - t)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


# ---- (d) the verified table --------------------------------------------------------------------------------------

_KEY_FIELDS = ("kernel", "backend", "device_kind", "compute_capability", "rule", "block_shape", "dtype", "jax")


# ---- (f) packed GEMMs: the real NVFP4 GEMM with Four Over Six codes against bf16 and fake-quant -------------------

# Llama-3-8B's projections (d_model 4096, 8 KV heads of 128, d_ff 14336) as (name, K, N), and the tokens M
LLAMA8B_PROJECTIONS = (("q_proj / o_proj", 4096, 4096), ("k_proj / v_proj", 4096, 1024),
                       ("gate_proj / up_proj", 4096, 14336), ("down_proj", 14336, 4096))
PACKED_TOKENS = 2048
SMALL_PROJECTIONS = (("small", 64, 32),)


def _median_ms(fn: Callable, *args, reps: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


PACKED_FORMATS = (("nvfp4-mse", "scaled_matmul", "NVFP4 4/6 W4A4"), ("fp8", "fp8", "FP8 E4M3 W8A8"))
NATIVE_CALLS = {"scaled_matmul": "__cudnn$blockScaledDot", "fp8": "__cublas$lt$matmul$f8"}


def packed_gemm_check(projections: tuple = LLAMA8B_PROJECTIONS, *, tokens: int = PACKED_TOKENS, reps: int = 10,
                      device: Any = None, formats: tuple = PACKED_FORMATS) -> list[dict]:
    """Per format and projection: packed weights and activations quantized by jaxlowfp in the program (NVFP4 4/6
    ``mse``; FP8 E4M3 per tensor), through the format's low-precision backend (`scaled_matmul`: cuDNN's block-scaled
    GEMM, sm_100+; `fp8`: cuBLASLt's FP8 GEMM, sm_89+; a row saying why not where the device lacks it) and the
    `dequant` backend, against the fake-quant product (``fake_quantize(x) @ dequantize(W)``, float32) and the plain
    bfloat16 GEMM: median ms each, whether each packed product is within float32 summation order of the fake-quant
    one (``|y - ref| <= (K + 4) eps (|x̂| @ |ŵ|)``, tests/test_packed.py's bound) with the largest ratio to that
    bound, and whether the backend's custom call is in the optimized HLO. The bf16 GEMM's error against fake-quant
    is reported for scale."""
    from jaxlowfp import backends, packed

    eps = float(np.finfo(np.float32).eps)
    dn = (((1,), (0,)), ((), ()))
    out = []
    for fmt, real, label in formats:
        for name, k, n in projections:
            kx, kw = jax.random.split(jax.random.key(k + n))
            x = jax.random.normal(kx, (tokens, k), jnp.float32).astype(jnp.bfloat16)
            w = jax.random.normal(kw, (k, n), jnp.float32) * np.float32(1 / np.sqrt(k))
            pw = packed.pack(w, fmt)
            xq = packed.fake_quantize(x.astype(jnp.float32), fmt)
            wq = pw.dequantize(jnp.float32)
            dot = jax.jit(lambda a, b: jnp.dot(a, b, precision="highest"))
            ref = dot(xq, wq)
            bound = (k + 4) * eps * dot(jnp.abs(xq), jnp.abs(wq))
            fake = jax.jit(lambda a, b, fmt=fmt: jnp.dot(packed.fake_quantize(a.astype(jnp.float32), fmt), b,
                                                         precision="highest"))  # what the fake-quant model runs
            row: dict[str, Any] = {"format": label, "projection": f"{name} {k}x{n}", "M": tokens, "real": real,
                                   "fake-quant ms": _median_ms(fake, x, wq, reps=reps)}
            w_bf16 = w.astype(jnp.bfloat16)
            bf16 = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
            row["bf16 ms"] = _median_ms(bf16, x, w_bf16, reps=reps)
            row["bf16 max |err| / bound"] = float(jnp.max(jnp.abs(bf16(x, w_bf16) - ref) / bound))
            for b in (real, "dequant"):
                key = "real" if b == real else "dequant"
                try:
                    plan = backends.plan(pw, fmt, b, device=device)
                except backends.BackendUnavailableError as e:
                    row[f"{key} ms"], row[f"{key} exact"] = None, f"not run: {e}"
                    continue
                f = jax.jit(lambda a, p, b=b, fmt=fmt: backends.packed_dot_general(
                    a.astype(jnp.float32), p, dn, gemm=b, activation=fmt, device=device))
                with jax.default_matmul_precision("highest"):  # dequant's float32 dot in float32, not TF32
                    compiled = f.lower(x, pw).compile()
                    y = compiled(x, pw)
                    row[f"{key} ms"] = _median_ms(compiled, x, pw, reps=reps)
                tiny = np.float32(np.finfo(np.float32).tiny)
                ratio = float(jnp.max(jnp.abs(y - ref) / jnp.maximum(bound, tiny)))
                row[f"{key} exact"] = ratio <= 1.0
                row[f"{key} max |err| / bound"] = ratio
                row[f"{key} native"] = plan.native
                hlo = compiled.as_text()
                row[f"{key} calls"] = hlo.count(NATIVE_CALLS[real]) if b == real else 0
                row[f"{key} f8 dots"] = f8_dots(hlo)
            out.append(row)
    return out


def packed_gemm_table(rows: list[dict]) -> str:
    from _results import markdown_table

    def ms(v):
        return "-" if v is None else f"{v:.3f}"

    def exact(r, key):
        v = r[f"{key} exact"]
        return v if isinstance(v, str) else f"{v} ({r[f'{key} max |err| / bound']:.2f})"

    body = [[r["format"], r["projection"], r["M"], ms(r["bf16 ms"]), ms(r["fake-quant ms"]),
             f"{r['real']}: " + ms(r["real ms"]) + (" (native)" if r.get("real native") else ""),
             f"{r.get('real calls', '-')} / {r.get('real f8 dots', '-')}", ms(r["dequant ms"]), exact(r, "real"),
             exact(r, "dequant"),
             f"{r['bf16 max |err| / bound']:.0f}"] for r in rows]
    return markdown_table(["format", "projection", "M", "bf16 GEMM ms", "fake-quant ms", "low-precision backend ms",
                           "its GEMM calls / float8 dots in HLO", "dequant ms", "backend within bound (max ratio)",
                           "dequant within bound", "bf16 err / bound"], body)


def _key(entry: dict) -> tuple:
    return tuple(tuple(v) if isinstance(v, list) else v for v in (entry.get(f) for f in _KEY_FIELDS))


def verified_entry(case: Case, device_kind: str, compute_capability: str, jax_version: str, date: str) -> dict:
    e = {"kernel": case.kernel, "backend": case.backend, "device_kind": device_kind,
         "compute_capability": compute_capability}
    if case.rule is not None:
        e.update(rule=case.rule, block_shape=list(case.block_shape))
    e.update(dtype=case.dtype, jax=jax_version, date=date)
    return e


def merge_verified(path: Path, results: list[ExactResult], *, device_kind: str, compute_capability: str,
                   jax_version: str, date: str) -> dict:
    """Write `path` with the configurations of `results` that passed, merged with its other entries.

    Entries are keyed by (kernel, backend, device, compute capability, rule, block shape, dtype, jax version): a
    passing configuration replaces its entry (new date), a failing one removes it, other keys are kept.
    """
    data = json.loads(path.read_text()) if path.exists() else {"schema": SCHEMA, "entries": []}
    if data.get("schema") != SCHEMA or not isinstance(data.get("entries"), list):
        raise ValueError(f"{path}: expected {{'schema': {SCHEMA}, 'entries': [...]}}; got schema "
                         f"{data.get('schema')!r}")
    entries = {_key(e): e for e in data["entries"]}
    for r in results:
        e = verified_entry(r.case, device_kind, compute_capability, jax_version, date)
        if r.passed:
            entries[_key(e)] = e
        else:
            entries.pop(_key(e), None)
    out = {"schema": SCHEMA, "entries": sorted(entries.values(), key=lambda e: tuple(map(str, _key(e))))}
    path.write_text(json.dumps(out, indent=1) + "\n")
    return out


# ---- driver ------------------------------------------------------------------------------------------------------


def gpu_or_reason() -> tuple[Any, str]:
    dev = jax.devices()[0]
    ok, reason = dispatch.pallas_capability("hif8.scaled_fake_quant", dev)
    return (dev if ok else None), reason


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interpret", action="store_true",
                    help="no GPU needed: Pallas interpret mode, tiny shapes, 'tiny' model; writes nothing")
    ap.add_argument("--only", default="", help="comma-separated substrings: check only matching configurations")
    ap.add_argument("--backends", nargs="+", choices=dispatch.PALLAS_BACKENDS, default=None,
                    help="Pallas backends to check (default: every backend the GPU and this JAX run; with "
                         "--interpret: triton)")
    ap.add_argument("--threads", type=int, default=4,
                    help="(a): configurations checked at once, so compilations overlap (1: one after another)")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--skip-packed", action="store_true")
    ap.add_argument("--packed-formats", nargs="+", choices=[f for f, _, _ in PACKED_FORMATS], default=None,
                    help="(f): the packed formats to check (default all)")
    ap.add_argument("--no-write", action="store_true", help="leave verified_kernels.json and RESULTS.md alone")
    ap.add_argument("--verified-path", type=Path, default=VERIFIED, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    dev = jax.devices()[0]
    if not args.interpret:
        dev, reason = gpu_or_reason()
        if dev is None:
            print(f"scripts/gpu_check.py needs a GPU that runs the Pallas kernels; {reason}. Nothing was run or "
                  "written (for the logic alone on this machine: --interpret).", file=sys.stderr)
            return 2
    write = not (args.no_write or args.interpret)
    t_start = time.perf_counter()
    timing: dict[str, float] = {}
    backends = tuple(args.backends or (("triton",) if args.interpret else dispatch.PALLAS_BACKENDS))
    cases, skipped = [], {}
    for c in all_cases(backends):
        ok, why = (True, "") if args.interpret else dispatch.pallas_capability(c.kernel, dev, pallas_backend=c.backend)
        if ok:
            cases.append(c)
        else:
            skipped.setdefault((c.kernel, c.backend), why)
    runnable = tuple(b for b in backends if any(c.backend == b for c in cases))
    if args.only:
        keys = [k.strip() for k in args.only.split(",") if k.strip()]
        cases = [c for c in cases if any(k in c.label for k in keys)]
    print(f"(a) {len(cases)} kernel configurations against their twins on {dev.device_kind}", flush=True)
    t = time.perf_counter()
    results = check_exact(cases, interpret=args.interpret, small=args.interpret,
                          threads=1 if args.interpret else args.threads, log=lambda s: print(s, flush=True))
    timing["(a) exactness"] = time.perf_counter() - t
    failed = [r for r in results if not r.passed]
    parts = [f"**(a) Kernels against their jnp twins, bit for bit** ({len(results) - len(failed)} of {len(results)} "
             "configurations exact; inputs: log-normal, x1e-4, x1e4, and NaN/+-Inf/zeros/-0.0/subnormals/"
             "smallest normals/near FLT_MAX, for NVFP4 with the tensor amax and with a finite `global_amax`):\n\n"
             + exact_table(results)
             + "".join(f"\n\nNot run: {k} ({b}): {why}" for (k, b), why in skipped.items())]
    if not args.skip_throughput:
        print("(b) throughput", flush=True)
        t = time.perf_counter()
        shape, iters, reps = ((16, 512), 1, 1) if args.interpret else ((8192, 8192), 20, 5)
        header, rows, notes = throughput(shape, jnp.bfloat16, runnable, interpret=args.interpret, iters=iters,
                                         reps=reps)
        timing["(b) throughput"] = time.perf_counter() - t
        from _results import markdown_table

        parts.append(
            f"**(b) Throughput**, {shape[0]}x{shape[1]} bfloat16, default block configuration, a supplied NVFP4 "
            f"`global_amax` (the kernel alone, no amax pass). Median of {reps} x {iters} queued calls; \"/ copy\" "
            "divides by a jitted `-x` of the same input (one read, one write); bytes are what each must read and "
            "write. Goals: HiF8 and `static_6` >= 0.80 of copy, `mse` <= 1.15x `static_6`.\n\n"
            + markdown_table(header, rows) + ("\n\n" + "\n".join(f"- {n}" for n in notes) if notes else ""))
    if not args.skip_train:
        print("(c) QAT train step", flush=True)
        t = time.perf_counter()
        preset, batch, seq, reps = ("tiny", 2, 16, 1) if args.interpret else (TRAIN_PRESET, 16, 512, 10)
        recipes, gemm_skipped = gemm_variants(dev)
        info: dict[str, dict] = {}
        ms = train_step_times(preset, batch=batch, seq=seq, reps=reps, backends=() if args.interpret else runnable,
                              recipes=recipes, info=info)
        timing["(c) train step"] = time.perf_counter() - t
        hp = ms["hp"]
        from _results import markdown_table

        parts.append(
            f"**(c) Train step**, `jaxlowfp.models.llama` preset \"{preset}\", bfloat16 compute, "
            f"batch {batch} x {seq}, HiF8 "
            "W8A8 QAT (delayed scaling, MLP projections of the middle blocks as `paper_rules` selects them) "
            "against high precision, and the same layers under FP8 delayed scaling and NVFP4 4/6 W4A4 with the "
            "forward product on each GEMM backend (`Recipe(gemm=...)`; the backward is the same). \"first loss\" "
            "is the first step's; the GEMM columns count cuBLASLt FP8 / cuDNN block-scaled custom calls in the "
            f"optimized HLO; median of {reps} interleaved steps:\n\n"
            + markdown_table(["variant", "ms / step", "vs HP", "first loss", "cuBLASLt FP8 calls",
                              "float8 dots (Triton)", "block-scaled calls"],
                             [[k, f"{v:.2f}", f"{v / hp:.2f}x", f"{info[k]['loss']:.6f}", info[k]["fp8 GEMMs"],
                               info[k]["f8 dots"], info[k]["block-scaled GEMMs"]] for k, v in ms.items()])
            + "".join(f"\n\nNot run: {k}: {why}" for k, why in gemm_skipped.items()))
    packed_failed = []
    if not args.skip_packed:
        print("(f) packed GEMMs", flush=True)
        t = time.perf_counter()
        proj, tokens, reps = ((SMALL_PROJECTIONS, 16, 1) if args.interpret else (LLAMA8B_PROJECTIONS, PACKED_TOKENS,
                                                                                  10))
        fmts = tuple(f for f in PACKED_FORMATS if args.packed_formats is None or f[0] in args.packed_formats)
        rows = packed_gemm_check(proj, tokens=tokens, reps=reps, device=dev, formats=fmts)
        timing["(f) packed GEMMs"] = time.perf_counter() - t
        packed_failed = [f"{r['format']} {r['projection']}" for r in rows
                         if r["dequant exact"] is False or r["real exact"] is False]
        parts.append(
            f"**(f) Packed GEMMs** (jaxlowfp.backends), Llama-8B projections, M = {tokens} bfloat16 tokens: "
            "W4A4 NVFP4 with Four Over Six (mse) codes and W8A8 FP8 E4M3 (per-tensor scales), activations quantized "
            "by jaxlowfp in the program, through the format's low-precision backend (`scaled_matmul`: cuDNN's "
            "block-scaled GEMM on sm_100+; `fp8`: cuBLASLt's FP8 GEMM on sm_89+) and `dequant`, against the "
            "fake-quant product (float32, precision highest) and the bf16 GEMM. \"within bound\": every output "
            "within float32 summation order of fake-quant, (K + 4) eps (|x̂| @ |ŵ|); the ratio is the largest "
            "|err| / bound. \"GEMM calls\" counts the backend's custom call (`__cudnn$blockScaledDot`, "
            f"`__cublas$lt$matmul$f8`) in the optimized HLO. Median of {reps} calls.\n\n" + packed_gemm_table(rows))
    total = time.perf_counter() - t_start
    print("\n\n".join(parts))
    print("phases: " + ", ".join(f"{k} {v:.0f} s" for k, v in timing.items()) + f"; total {total:.0f} s")
    if write:
        from _results import write_section

        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
        cc = str(getattr(dev, "compute_capability", "?"))
        merged = merge_verified(args.verified_path, results, device_kind=dev.device_kind, compute_capability=cc,
                                jax_version=jax.__version__, date=date)
        head = (f"`PYTHONPATH=. python3 scripts/gpu_check.py` (`make gpu-check`) on {dev.device_kind} (compute "
                f"capability {cc}), jax {jax.__version__}, {date}; {total:.0f} s ("
                + ", ".join(f"{k} {v:.0f} s" for k, v in timing.items()) + "). "
                f"**(d)** {len(results) - len(failed)} configurations recorded as verified in "
                f"`jaxlowfp/verified_kernels.json` ({len(merged['entries'])} entries in all).")
        write_section(SECTION, head + "\n\n" + "\n\n".join(parts))
    if packed_failed:
        print(f"\npacked GEMMs outside the float32 bound of fake-quant: {packed_failed}", file=sys.stderr)
        return 1
    if failed:
        print(f"\n{len(failed)} configuration(s) differ from their twins or failed:\n"
              + "\n".join(f"- {r.case.label}: {r.error or r.mismatches}" for r in failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
