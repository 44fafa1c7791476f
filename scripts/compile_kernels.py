"""Compile every Pallas kernel configuration for real GPU targets on a host without a GPU (deviceless AOT).

For each target (A100 sm_80, H100 sm_90a, B200 sm_100a) a subprocess builds a compile-only CUDA device from XLA's
own target description (``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=<text
GpuTargetConfigProto>, topology="1x1x1")``; the descriptions are the ``*.txtpb`` files embedded in the
jax-cuda12-pjrt plugin), lowers each kernel under a mesh of that device and calls ``.compile()``: Triton's GPU
passes, LLVM's NVPTX backend and ptxas run for real. One subprocess per target, because XLA caches compiled
kernels by their hash, not by target.

What is recorded per kernel, and where it comes from:
  - registers, spill stores/loads, stack frame, static shared memory: ``ptxas -v``. XLA runs ptxas from
    ``xla_gpu_cuda_data_dir``; each compile points that at a throw-away directory whose ``bin/ptxas`` runs the
    real ptxas (nvidia-cuda-nvcc-cu12) with XLA's own arguments plus ``-v`` and keeps its report.
  - the launch (grid, threads, dynamic shared memory, which Triton sizes itself): XLA's thunk sequence, dumped by
    ``xla_dump_to``.
A spill, a compile error or more shared memory than the target allows per block makes the run fail (exit 1),
naming the kernel, configuration and target. The table goes to the ``## {SECTION}`` section of bench/RESULTS.md.

    .venv/bin/python scripts/compile_kernels.py                # all targets, 2 processes, writes RESULTS.md
    .venv/bin/python scripts/compile_kernels.py --no-write --targets "sm_80 (A100)"

Needs jax-cuda12-plugin and jax-cuda12-pjrt at jaxlib's version and nvidia-cuda-nvcc-cu12 (ptxas): ``make setup``
puts them into ``.venv/gpu-compile``, a directory only this script adds to its path (``JAXLOWFP_GPU_COMPILE_DIR``
overrides it); ``pip install -e ".[gpu-compile]"`` into the environment works too. Works with jax 0.12.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib
import importlib.metadata
import json
import mmap
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
SECTION = "Deviceless GPU compilation (registers, spills, shared memory)"
# The CUDA plugin and ptxas live in a directory of their own (scripts/bootstrap.sh installs them there with
# `pip install --target`), seen only by this script and its subprocesses: installed into the environment itself,
# the plugin would print a "cuDNN not found" traceback at every jax start on a machine without a GPU.
GPU_COMPILE_DIR = Path(os.environ.get("JAXLOWFP_GPU_COMPILE_DIR", Path(sys.prefix) / "gpu-compile"))
if GPU_COMPILE_DIR.is_dir() and str(GPU_COMPILE_DIR) not in sys.path:
    sys.path.append(str(GPU_COMPILE_DIR))
INSTALL_HINT = (f"make setup (scripts/bootstrap.sh installs jax-cuda12-plugin and jax-cuda12-pjrt matching jaxlib, "
                f"and nvidia-cuda-nvcc-cu12, into {GPU_COMPILE_DIR} with pip install --no-deps --target), or "
                f'pip install -e ".[gpu-compile]" into the environment')

# target label -> device_description_str of XLA's embedded GpuTargetConfigProto
TARGETS: dict[str, str] = {
    "sm_80 (A100)": "NVIDIA A100-SXM4-80GB",
    "sm_90 (H100)": "NVIDIA H100 80GB HBM3",
    "sm_100 (B200)": "NVIDIA B200",
}
EXTRA_TARGETS: dict[str, str] = {"sm_90 (H200)": "NVIDIA H200 141GB HBM3e"}  # same sm_90a code as the H100
DEFAULT_JOBS = 2

# Shapes (rows, K): one per configuration, ragged so the masked load/store paths are compiled. 4095 rows leave a
# partial last row tile; 16x16 blocks need rows % 16 == 0, so there K = 5136 (not a multiple of the 512-column
# tile) leaves a partial last column tile instead (also for 1x16 and the flattened HiF8 kernel).
RAGGED_1X16 = (4095, 5136)
RAGGED_16X16 = (4080, 5136)
_TRITON_KERNEL_NAME = re.compile(r'name = \\?"([A-Za-z_][\w.]*)\\?", num_stages')


class CompileCheckError(RuntimeError):
    """A kernel failed to compile, spilled registers or needs too much shared memory."""


# ---- the toolchain -----------------------------------------------------------------------------------------------


def check_toolchain() -> Path:
    """Path of the real ptxas; raises CompileCheckError saying how to install what is missing."""
    import jaxlib

    missing = []
    try:
        plugin_version = importlib.metadata.version("jax-cuda12-plugin")
        importlib.metadata.version("jax-cuda12-pjrt")
    except importlib.metadata.PackageNotFoundError as e:
        missing.append(f"{e.name} is not installed")
        plugin_version = None
    ptxas = None
    try:
        nvcc = importlib.import_module("nvidia.cuda_nvcc")
        for p in list(getattr(nvcc, "__path__", [])) + [Path(str(getattr(nvcc, "__file__", "") or "")).parent]:
            if (Path(p) / "bin" / "ptxas").exists():
                ptxas = Path(p) / "bin" / "ptxas"
                break
    except ImportError:
        pass
    if ptxas is None:
        missing.append("ptxas (nvidia-cuda-nvcc-cu12) is not installed")
    if missing:
        raise CompileCheckError(
            "deviceless GPU compilation needs the gpu-compile extra: " + "; ".join(missing)
            + f". Install: {INSTALL_HINT}"
        )
    if plugin_version != jaxlib.__version__:
        raise CompileCheckError(
            f"jax-cuda12-plugin {plugin_version} does not match jaxlib {jaxlib.__version__} (jax disables a "
            f"mismatched plugin). Reinstall: {INSTALL_HINT}"
        )
    return ptxas


def _plugin_library() -> Path:
    spec = importlib.util.find_spec("jax_plugins.xla_cuda12")
    if spec is None or not spec.submodule_search_locations:
        raise CompileCheckError(f"jax-cuda12-pjrt (jax_plugins.xla_cuda12) is not installed. Install: {INSTALL_HINT}")
    lib = Path(list(spec.submodule_search_locations)[0]) / "xla_cuda_plugin.so"
    if not lib.exists():
        raise CompileCheckError(f"{lib} is missing; reinstall jax-cuda12-pjrt: {INSTALL_HINT}")
    return lib


def target_config(device: str) -> str:
    """XLA's GpuTargetConfigProto (text) for `device`, read from the text protos embedded in the PJRT plugin.

    These are the files XLA itself ships (xla/backends/gpu/target_config/*.txtpb); JAX has no Python API for them.
    """
    lib = _plugin_library()
    key = f'device_description_str: "{device}"'.encode()
    with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        for m in re.finditer(rb"gpu_device_info \{\n", data):
            start = data.rfind(b"\x00", 0, m.start()) + 1
            end = data.find(b"\x00", m.start())
            text = data[start:end]
            if key in text:
                return text.decode()
    raise CompileCheckError(f"no embedded GPU target description for {device!r} in {lib} (XLA renamed it?)")


# ---- configurations ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """One kernel configuration to compile.

    Attributes:
      kernel: name in ``jaxlowfp.dispatch.KERNELS``.
      dtype: input dtype name ("float32" or "bfloat16").
      shape: input shape (rows, K).
      rule, block_shape: NVFP4 only (None for HiF8).
      backend: a Pallas backend of the kernel in ``jaxlowfp.dispatch.KERNELS`` ("triton", "mosaic").
    """

    kernel: str
    dtype: str
    shape: tuple[int, int]
    rule: str | None = None
    block_shape: tuple[int, int] | None = None
    backend: str = "triton"

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16'; got {self.dtype!r}")
        if self.backend not in ("triton", "mosaic"):
            raise ValueError(f"backend must be 'triton' or 'mosaic'; got {self.backend!r}")
        if (self.rule is None) != (self.kernel in HIF8_KERNELS):
            raise ValueError(f"rule and block_shape are given for the NVFP4 kernels only; got {self}")
        if (self.rule is None) != (self.block_shape is None):
            raise ValueError("rule and block_shape go together (NVFP4) or are both None (HiF8)")

    @property
    def label(self) -> str:
        parts = [self.kernel]
        if self.rule is not None:
            parts += [self.rule, "x".join(map(str, self.block_shape))]
        parts += [self.dtype, "x".join(map(str, self.shape))]
        if self.backend != "triton":
            parts.append(self.backend)
        return " ".join(parts)


HIF8_KERNELS = ("hif8.scaled_fake_quant",)  # called as (x, scale, clip)
NVFP4_KERNELS = ("nvfp4.quantize", "nvfp4.fake_quantize")  # called as (x, rule=, block_shape=)


def all_configs(backends: tuple[str, ...] = ("triton",)) -> list[Config]:
    """Every kernel x rule x block shape x dtype, once each, at a ragged shape, for each of `backends` the kernel
    has in ``jaxlowfp.dispatch.KERNELS``."""
    from jaxlowfp import dispatch, nvfp4

    unknown = set(dispatch.KERNELS) - set(HIF8_KERNELS + NVFP4_KERNELS)
    if unknown:
        raise CompileCheckError(f"scripts/compile_kernels.py does not know how to call {sorted(unknown)} "
                                "(jaxlowfp.dispatch.KERNELS): add it here")
    out = []
    for dtype in ("float32", "bfloat16"):
        for kernel in sorted(dispatch.KERNELS, key=lambda k: (k not in HIF8_KERNELS, k != "nvfp4.quantize")):
            for backend in (b for b in backends if b in dispatch.KERNELS[kernel]):
                if kernel in HIF8_KERNELS:
                    out.append(Config(kernel=kernel, dtype=dtype, shape=RAGGED_1X16, backend=backend))
                    continue
                for rule in nvfp4.KERNEL_RULES:
                    for bs in nvfp4.BLOCK_SHAPES:
                        shape = RAGGED_16X16 if bs[0] > 1 else RAGGED_1X16
                        out.append(Config(kernel=kernel, dtype=dtype, shape=shape, rule=rule, block_shape=tuple(bs),
                                          backend=backend))
    return out


def min_compute_capability(config: Config) -> int:
    """The kernel's minimum, e.g. 80 (``jaxlowfp.dispatch.KERNELS``)."""
    from jaxlowfp import dispatch

    return dispatch.KERNELS[config.kernel][config.backend].requires.min_compute_capability


def build(config: Config) -> tuple[Callable, tuple]:
    """(function, abstract arguments) that compile `config`'s kernel: its Pallas entry point (found through
    ``jaxlowfp.dispatch.kernel``), compiled, not interpreted."""
    import jax
    import jax.numpy as jnp

    from jaxlowfp import dispatch

    entry = dispatch.kernel(config.kernel, config.backend)
    x = jax.ShapeDtypeStruct(config.shape, jnp.dtype(config.dtype))
    if config.rule is None:
        fn = lambda x, s: entry(x, s, 15.0, interpret=False)  # noqa: E731
        return fn, (x, jax.ShapeDtypeStruct((), jnp.float32))
    fn = lambda x: entry(x, rule=config.rule, block_shape=config.block_shape, interpret=False)  # noqa: E731
    return fn, (x,)


# ---- reading what ptxas and XLA report ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class PtxasInfo:
    """``ptxas -v`` for one entry function."""

    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    static_smem: int


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(text: str) -> dict[str, PtxasInfo]:
    """Entry function -> its ``ptxas -v`` numbers (a function without a "Function properties" line has none)."""
    out: dict[str, PtxasInfo] = {}
    for block in re.split(r"(?=ptxas info\s*: Compiling entry function)", text):
        m = _ENTRY.search(block)
        if not m:
            continue
        used = _USED.search(block)
        if used is None:
            raise CompileCheckError(f"ptxas -v printed no register count for {m.group(1)}:\n{block}")
        frame = _FRAME.search(block)
        smem = _SMEM.search(block[used.start():].split("\n", 1)[0])
        st, ss, sl = (int(g) for g in frame.groups()) if frame else (0, 0, 0)
        out[m.group(1)] = PtxasInfo(arch=m.group(2), registers=int(used.group(1)), spill_stores=ss, spill_loads=sl,
                                    stack_frame=st, static_smem=int(smem.group(1)) if smem else 0)
    return out


_LAUNCH = re.compile(
    r"(\S+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\]\s+shared_memory: (\d+) bytes")


def parse_launches(text: str) -> dict[str, tuple[tuple[int, int, int], int, int]]:
    """Kernel name -> (grid, threads per block, dynamic shared memory bytes) from XLA's thunk_sequence dump."""
    out = {}
    for m in _LAUNCH.finditer(text):
        g = tuple(int(v) for v in m.group(2, 3, 4))
        t = int(m.group(5)) * int(m.group(6)) * int(m.group(7))
        out[m.group(1)] = (g, t, int(m.group(8)))
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelStats:
    """What one compiled configuration uses on one target."""

    target: str
    config: Config
    name: str  # the Triton kernel's entry function
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    smem: int  # static (ptxas) + dynamic (Triton, at launch) shared memory per block, bytes
    smem_limit: int
    threads: int
    grid: tuple[int, int, int]
    other_spills: tuple[str, ...]  # XLA fusions of the same program that spilled
    seconds: float

    def problems(self) -> list[str]:
        where = f"{self.config.label} on {self.target} ({self.arch})"
        out = []
        if self.spill_stores or self.spill_loads:
            out.append(f"{self.name} ({where}) spills registers: {self.spill_stores} bytes stored, "
                       f"{self.spill_loads} bytes loaded ({self.registers} registers)")
        if self.smem > self.smem_limit:
            out.append(f"{self.name} ({where}) needs {self.smem} bytes of shared memory per block; the target allows "
                       f"{self.smem_limit}")
        out += [f"{o} ({where}, an XLA fusion around the kernel) spills registers" for o in self.other_spills]
        return out


_WRAPPER = """#!/bin/sh
# ptxas as XLA calls it, plus -v; the report goes to {log}, warnings and errors still to XLA
for a in "$@"; do
  case "$a" in
    -arch=*|--gpu-name*)
      out="{log}/ptxas.$$"
      {real} "$@" -v 2>"$out"; rc=$?
      grep -v -e '^ptxas info' -e 'bytes stack frame' "$out" >&2
      exit $rc;;
  esac
done
exec {real} "$@"
"""


def _cuda_dir(work: Path, real_ptxas: Path) -> Path:
    """A CUDA data directory for XLA whose ptxas is the logging wrapper (libdevice from the real one)."""
    (work / "bin").mkdir(parents=True)
    (work / "log").mkdir()
    for sub in ("nvvm", "include"):
        if (real_ptxas.parents[1] / sub).exists():
            (work / sub).symlink_to(real_ptxas.parents[1] / sub)
    wrapper = work / "bin" / "ptxas"
    wrapper.write_text(_WRAPPER.format(log=shlex.quote(str(work / "log")), real=shlex.quote(str(real_ptxas))))
    wrapper.chmod(0o755)
    return work


def _capability(config_text: str) -> int:
    """e.g. 90 for the target description's ``cuda_compute_capability { major: 9 }`` (minor 0 is left out)."""
    m = re.search(r"cuda_compute_capability \{\s*major: (\d+)(?:\s*minor: (\d+))?", config_text)
    if m is None:
        raise CompileCheckError("the target description has no cuda_compute_capability")
    return 10 * int(m.group(1)) + int(m.group(2) or 0)


def _smem_limit(config_text: str) -> int:
    m = re.search(r"shared_memory_per_block_optin: (\d+)", config_text) or re.search(
        r"shared_memory_per_block: (\d+)", config_text)
    if m is None:
        raise CompileCheckError("the target description has no shared_memory_per_block(_optin)")
    return int(m.group(1))


def compile_target(target: str, configs: list[Config], *, log: Callable[[str], None] = print) -> tuple[
        list[KernelStats], list[str]]:
    """Compile `configs` for `target` in this process: (stats, errors). Must run in a fresh process per target."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*", category=DeprecationWarning)
    jax.config.update("jax_enable_compilation_cache", False)
    real_ptxas = check_toolchain()
    device = {**TARGETS, **EXTRA_TARGETS}[target]
    text = target_config(device)
    smem_limit = _smem_limit(text)
    topo = topologies.get_topology_desc(platform="cuda", target_config=text, topology="1x1x1")
    mesh = topologies.make_mesh(topo, (1,), ("x",))
    replicated = NamedSharding(mesh, PartitionSpec())
    set_mesh = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh
    stats, errors = [], []
    with tempfile.TemporaryDirectory(prefix="compile_kernels_") as tmp:
        for i, config in enumerate(configs):
            where = f"{config.label} for {target}"
            if _capability(text) < min_compute_capability(config):
                log(f"  {where}: skipped (needs compute capability {min_compute_capability(config) / 10:.1f})")
                continue
            work = _cuda_dir(Path(tmp) / str(i), real_ptxas)
            t0 = time.perf_counter()
            try:
                fn, args = build(config)
                args = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated) for a in args)
                with set_mesh(mesh):
                    lowered = jax.jit(fn, in_shardings=(replicated,) * len(args)).lower(*args)
                    lowered.compile(compiler_options={
                        "xla_gpu_cuda_data_dir": str(work), "xla_dump_to": str(work / "dump")})
            except Exception as e:  # noqa: BLE001 - reported with the kernel, configuration and target
                errors.append(f"{where}: compile error: {type(e).__name__}: {str(e).strip()[:2000]}")
                log(f"  FAILED {where}: {type(e).__name__}")
                continue
            seconds = time.perf_counter() - t0
            try:
                stats.append(_stats(target, config, lowered.as_text(), work, smem_limit, seconds))
            except CompileCheckError as e:
                errors.append(f"{where}: {e}")
                continue
            s = stats[-1]
            log(f"  {where}: {s.registers} registers, {s.spill_stores + s.spill_loads} spill bytes, "
                f"{s.smem} B smem, {seconds:.1f} s")
            errors += s.problems()
    return stats, errors


def _stats(target: str, config: Config, lowered_text: str, work: Path, smem_limit: int,
           seconds: float) -> KernelStats:
    names = set(_TRITON_KERNEL_NAME.findall(lowered_text))
    if config.backend != "triton":  # Mosaic GPU compiles its kernel itself; only "it compiled" is recorded
        return KernelStats(target=target, config=config, name=config.kernel, arch="?", registers=-1,
                           spill_stores=0, spill_loads=0, stack_frame=0, smem=0, smem_limit=smem_limit, threads=-1,
                           grid=(0, 0, 0), other_spills=(), seconds=seconds)
    if len(names) != 1:
        raise CompileCheckError(f"expected one Pallas-Triton call in the lowered program, found {sorted(names)}")
    ptxas = {}
    for f in sorted((work / "log").glob("ptxas.*")):
        ptxas.update(parse_ptxas(f.read_text()))
    if not ptxas:
        raise CompileCheckError(f"XLA did not run ptxas from {work}/bin (it may have switched to libnvptxcompiler); "
                                "no register report")
    launches = {}
    for f in (work / "dump").glob("*.thunk_sequence.txt"):
        launches.update(parse_launches(f.read_text()))
    name = next(iter(names)) if names else None
    if name not in ptxas:
        raise CompileCheckError(f"ptxas reported no entry function {name!r}; it compiled {sorted(ptxas)}")
    if name not in launches:
        raise CompileCheckError(f"XLA's thunk sequence has no launch of {name!r}; it has {sorted(launches)}")
    info = ptxas[name]
    grid, threads, dyn_smem = launches[name]
    others = tuple(sorted(k for k, v in ptxas.items() if k != name and (v.spill_stores or v.spill_loads)))
    return KernelStats(
        target=target, config=config, name=name, arch=info.arch, registers=info.registers,
        spill_stores=info.spill_stores, spill_loads=info.spill_loads, stack_frame=info.stack_frame,
        smem=info.static_smem + dyn_smem, smem_limit=smem_limit, threads=threads, grid=grid, other_spills=others,
        seconds=seconds,
    )


# ---- driver: one subprocess per target, a pool of at most `jobs` -------------------------------------------------


def _worker(target: str, out: Path, backends: tuple[str, ...], labels: list[str] | None = None) -> int:
    configs = all_configs(backends)
    if labels is not None:
        unknown = set(labels) - {c.label for c in configs}
        if unknown:
            raise CompileCheckError(f"no configuration labelled {sorted(unknown)} for backends {backends}")
        configs = [c for c in configs if c.label in set(labels)]
    stats, errors = compile_target(target, configs, log=lambda s: print(s, flush=True))
    out.write_text(json.dumps({"stats": [dataclasses.asdict(s) for s in stats], "errors": errors}))
    return 0


def _from_json(d: dict) -> KernelStats:
    c = d.pop("config")
    c["shape"] = tuple(c["shape"])
    c["block_shape"] = tuple(c["block_shape"]) if c["block_shape"] is not None else None
    return KernelStats(config=Config(**c), **{**d, "grid": tuple(d["grid"]), "other_spills": tuple(d["other_spills"])})


def run_targets(targets: list[str], *, backends: tuple[str, ...] = ("triton",), jobs: int = DEFAULT_JOBS,
                timeout: float = 1800.0, log: Callable[[str], None] = print,
                select: dict[str, list[Config]] | None = None,
                ) -> tuple[list[KernelStats], list[str], dict[str, float]]:
    """Compile every configuration of `backends` for each target, one subprocess per target: (stats, errors,
    seconds per target). `select` (target -> configurations) compiles only those for a target it names (the test
    suite's cheaper subset); targets it does not name get every configuration."""
    check_toolchain()
    unknown = [t for t in targets if t not in {**TARGETS, **EXTRA_TARGETS}]
    if unknown:
        raise ValueError(f"unknown targets {unknown}; allowed: {sorted({**TARGETS, **EXTRA_TARGETS})}")
    if not 1 <= jobs <= 2:
        raise ValueError(f"jobs must be 1 or 2 (CI has 2 cores); got {jobs}")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}

    def one(target: str) -> tuple[list[KernelStats], list[str], float]:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            t0 = time.perf_counter()
            try:
                labels = [] if select is None or target not in select else [
                    "--worker-labels", json.dumps([c.label for c in select[target]])]
                proc = subprocess.run([sys.executable, __file__, "--worker", target, "--worker-out", str(out),
                                       "--backends", *backends, *labels],
                                      env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                                      check=False)
            except subprocess.TimeoutExpired:
                return [], [f"{target}: compiling took longer than {timeout:.0f} s"], time.perf_counter() - t0
            seconds = time.perf_counter() - t0
            log(f"{target}: {seconds:.0f} s\n{proc.stdout.rstrip()}")
            if proc.returncode != 0 or not out.exists():
                return [], [f"{target}: the compile worker failed (exit {proc.returncode}):\n"
                            f"{proc.stderr.strip()[-4000:]}"], seconds
            data = json.loads(out.read_text())
            return [_from_json(d) for d in data["stats"]], data["errors"], seconds

    stats, errors, seconds = [], [], {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        for target, (s, e, t) in zip(targets, pool.map(one, targets)):
            stats += s
            errors += e
            seconds[target] = t
    return stats, errors, seconds


def table(stats: list[KernelStats], targets: list[str]) -> str:
    """Markdown: one row per configuration, per target "registers / spill bytes / shared memory"."""
    sys.path.insert(0, str(ROOT / "bench"))
    from _results import markdown_table

    by = {(s.config, s.target): s for s in stats}
    configs = list(dict.fromkeys(s.config for s in stats))
    arch = {t: next((s.arch for s in stats if s.target == t and s.arch != "?"), "?") for t in targets}
    header = ["kernel", "rule", "block", "dtype", "shape", "threads"] + [f"{t} {arch[t]}" for t in targets]
    rows = []
    for c in configs:
        cells = []
        for t in targets:
            s = by.get((c, t))
            cells.append(("-" if c.backend == "mosaic" else "failed") if s is None else
                         "compiled" if s.registers < 0 else
                         f"{s.registers} / {s.spill_stores + s.spill_loads} / {s.smem}")
        threads = max(by[(c, t)].threads for t in targets if (c, t) in by)
        rows.append([c.kernel + ("" if c.backend == "triton" else f" ({c.backend})"), c.rule or "-",
                     "x".join(map(str, c.block_shape)) if c.block_shape else "-", c.dtype,
                     "x".join(map(str, c.shape)), threads, *cells])
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", nargs="+", default=list(TARGETS), metavar="TARGET",
                    help=f"targets to compile for (default: {list(TARGETS)}; also {list(EXTRA_TARGETS)})")
    ap.add_argument("--jobs", type=int, default=DEFAULT_JOBS, help="targets compiled at once (1 or 2)")
    ap.add_argument("--backends", nargs="+", default=["triton"], choices=["triton", "mosaic"],
                    help="Pallas backends to compile (default: triton; Mosaic GPU kernels compile for sm_90+ only, "
                         "and ptxas is not asked about them: the table says 'compiled')")
    ap.add_argument("--no-write", action="store_true", help="print only; do not touch bench/RESULTS.md")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--worker-labels", type=json.loads, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args.worker, args.worker_out, tuple(args.backends), args.worker_labels)
    load = os.getloadavg()[0]
    try:
        stats, errors, seconds = run_targets(args.targets, backends=tuple(args.backends), jobs=args.jobs)
    except CompileCheckError as e:
        print(f"scripts/compile_kernels.py: {e}", file=sys.stderr)
        return 1
    body = table(stats, args.targets)
    print(body)
    if errors:
        print("\nFAILED:\n" + "\n".join(f"- {e}" for e in errors), file=sys.stderr)
    if not args.no_write:
        import jax
        import jaxlib

        ptxas = subprocess.run([str(check_toolchain()), "--version"], capture_output=True, text=True,
                               check=False).stdout
        ptxas_v = re.search(r"release ([\d.]+), V([\d.]+)", ptxas)
        sys.path.insert(0, str(ROOT / "bench"))
        from _results import write_section

        write_section(SECTION, (
            f"`.venv/bin/python scripts/compile_kernels.py` (`make test` runs part of it through "
            f"tests/test_gpu_compile.py: every configuration for sm_80, every kernel for each target) on a CPU-only "
            f"host: jax {jax.__version__}, jax-cuda12-plugin "
            f"{importlib.metadata.version('jax-cuda12-plugin')} (jaxlib {jaxlib.__version__}), ptxas "
            f"{ptxas_v.group(2) if ptxas_v else '?'}. Every configuration is compiled, not only lowered, for each "
            "target from XLA's own target description; Triton and ptxas run for real. Each cell is "
            "**registers per thread / spill bytes (stores + loads) / shared memory per block in bytes** (static "
            "from `ptxas -v` plus the dynamic amount Triton asks for at launch) of the Pallas kernel's entry "
            "function, at the kernel's default block configuration. Shapes are ragged (a partial last tile) so the "
            "masked paths are compiled. A spill, a compile error or shared memory above the target's per-block "
            "limit fails the run. Wall time per target (2 at a time): "
            + ", ".join(f"{t} {s:.0f} s" for t, s in seconds.items())
            + f" (load average {load:.1f} at the start).\n\n" + body
            + (f"\n\n**{len(errors)} problem(s)** (the run fails):\n\n" + "\n".join(f"- {e}" for e in errors)
               if errors else "\n\nNo spills, no compile errors, no shared-memory overflow.")
        ))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
