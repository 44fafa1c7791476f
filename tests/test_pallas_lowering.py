"""Every Pallas kernel cross-lowers to a Triton call for sm_90 and sm_100 from this CPU; dispatch rules.

Lowering needs no GPU and no data (``jax.ShapeDtypeStruct`` inputs at realistic sizes): the Pallas -> Triton
lowering is told the target through an AbstractDevice (docs/kernels.md section 2). It catches unsupported
primitives, non-power-of-two blocks and per-architecture limits; it does not run ptxas.
"""
from __future__ import annotations

import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlowfp import dispatch
from jaxlowfp.dispatch import INTERPRET_ENV, PallasUnavailableError
from jaxlowfp_pallas import _common
from jaxlowfp_pallas import hif8 as phif8
from jaxlowfp_pallas import nvfp4 as pnvfp4

SHAPES = [  # realistic sizes, both dtypes; 5120 columns and 4095 rows leave ragged last blocks
    ((8192, 8192), jnp.float32),
    ((4096, 5120), jnp.bfloat16),
    ((4095, 5120), jnp.float32),
]
# The H200 is lowered for in test_lowers_for_ampere_and_h200 only: the same sm_90 and SM count as the H100, so the
# same lowering.
TARGETS = ["sm_90 (H100)", "sm_100 (B200)"]
_SCALAR = jax.ShapeDtypeStruct((), jnp.float32)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _hif8(shape, dtype, **_):
    fn = lambda x, s: phif8.scaled_fake_quant(x, s, 15.0, interpret=False)  # noqa: E731
    n = shape[0] * shape[1]
    return fn, (jax.ShapeDtypeStruct(shape, dtype), _SCALAR), _cdiv(n, phif8.DEFAULT_BLOCK)


def _nvfp4(entry):
    def case(shape, dtype, rule="mse", block_shape=(1, 16)):
        fn = lambda x: entry(x, rule=rule, block_shape=block_shape, interpret=False)  # noqa: E731
        bm, bn = pnvfp4.DEFAULT_TILE
        return fn, (jax.ShapeDtypeStruct(shape, dtype),), _cdiv(shape[0], bm) * _cdiv(shape[1], bn)

    return case


KERNELS = {
    "hif8.scaled_fake_quant": _hif8,
    "nvfp4.quantize": _nvfp4(pnvfp4.quantize),
    "nvfp4.fake_quantize": _nvfp4(pnvfp4.fake_quantize),
}


def _lower(kernel, shape, dtype, target, **options):
    fn, args, grid = KERNELS[kernel](shape, dtype, **options)
    try:
        text = _common.lower_for_gpu(fn, *args, target=target)
    except Exception as e:  # noqa: BLE001 - re-raised with the kernel and target named
        pytest.fail(
            f"{kernel} {options or ''} failed to lower for {target} at {shape} {jnp.dtype(dtype).name}: "
            f"{type(e).__name__}: {e}"
        )
    return text, grid


def _check_one_triton_call(text: str, grid: int, what: str):
    calls = text.count(_common.TRITON_CALL)
    assert calls == 1, f"{what}: expected 1 Triton call, found {calls}"
    dims = [int(re.search(rf"grid_{a} = (\d+)", text).group(1)) for a in "xyz"]
    assert dims[0] * dims[1] * dims[2] == grid, f"{what}: Triton grid {dims}, expected {grid} programs"


def test_every_registered_kernel_has_a_lowering_case():
    assert set(KERNELS) == set(dispatch.KERNELS), "add a lowering case for each kernel in jaxlowfp.dispatch.KERNELS"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape,dtype", SHAPES, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else None)
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_lowers_to_one_triton_call(kernel, shape, dtype, target):
    text, grid = _lower(kernel, shape, dtype, target)
    _check_one_triton_call(text, grid, f"{kernel} for {target} at {shape}")


@pytest.mark.parametrize("target", ["sm_90 (H100)", "sm_100 (B200)"])
@pytest.mark.parametrize("block_shape", [(1, 16), (16, 16)], ids=["1x16", "16x16"])
@pytest.mark.parametrize("rule", ["static_6", "static_4", "abs_max", "mae", "mse"])
@pytest.mark.parametrize("kernel", ["nvfp4.quantize", "nvfp4.fake_quantize"])
def test_nvfp4_every_rule_lowers(kernel, rule, block_shape, target):
    text, grid = _lower(kernel, (4096, 5120), jnp.bfloat16, target, rule=rule, block_shape=block_shape)
    _check_one_triton_call(text, grid, f"{kernel} rule={rule} block_shape={block_shape} for {target}")


@pytest.mark.parametrize("target", ["sm_80 (A100)", "sm_90 (H200)"])
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_lowers_for_ampere_and_h200(kernel, target):
    """No fp8 cast inside any kernel (scale bytes are bit math), so sm_80 lowers too, as dispatch claims; and the
    H200 target."""
    text, grid = _lower(kernel, (4096, 5120), jnp.bfloat16, target)
    _check_one_triton_call(text, grid, f"{kernel} for {target}")


def test_unknown_target_is_an_error():
    with pytest.raises(ValueError, match="target='sm_75'.*allowed"):
        _common.lower_for_gpu(lambda x: x, _SCALAR, target="sm_75")


# ---- dispatch --------------------------------------------------------------------------------------------------


def test_resolve_impl_on_cpu(monkeypatch):
    monkeypatch.delenv(INTERPRET_ENV, raising=False)
    k = "hif8.scaled_fake_quant"
    assert dispatch.resolve_impl("xla", kernel=k) == "xla"
    assert dispatch.resolve_impl("auto", kernel=k) == "xla"  # no GPU here: auto never picks interpret mode
    assert dispatch.resolve_impl("pallas", kernel=k, interpret=True) == "pallas"
    with pytest.raises(PallasUnavailableError, match=r"impl='pallas'.*hif8\.scaled_fake_quant.*'cpu'.*interpret"):
        dispatch.resolve_impl("pallas", kernel=k)
    monkeypatch.setenv(INTERPRET_ENV, "1")
    assert dispatch.resolve_impl("pallas", kernel=k) == "pallas"
    assert dispatch.resolve_interpret(None, kernel=k) is True
    assert dispatch.resolve_impl("auto", kernel=k) == "xla"


def test_resolve_impl_bad_arguments():
    with pytest.raises(ValueError, match=r"impl='triton'.*allowed: 'auto', 'xla', 'pallas'"):
        dispatch.resolve_impl("triton", kernel="hif8.scaled_fake_quant")
    with pytest.raises(ValueError, match=r"kernel='nope'.*known kernels"):
        dispatch.resolve_impl("xla", kernel="nope")
    with pytest.raises(TypeError, match="interpret must be"):
        dispatch.resolve_impl("pallas", kernel="hif8.scaled_fake_quant", interpret=1)


class _FakeGpu:
    platform = "gpu"

    def __init__(self, kind, cc):
        self.device_kind, self.compute_capability = kind, cc


@pytest.mark.parametrize(
    "kind,cc,ok,match",
    [
        ("NVIDIA H100 80GB HBM3", "9.0", True, "compute capability 9.0"),
        ("NVIDIA B200", "10.0", True, "compute capability 10.0"),
        ("Tesla V100-SXM2-16GB", "7.0", False, r"needs >= 8\.0"),
        ("AMD Instinct MI300X", "gfx942", False, "NVIDIA only"),
    ],
)
def test_capability_reasons(kind, cc, ok, match):
    got_ok, reason = dispatch.pallas_capability("hif8.scaled_fake_quant", _FakeGpu(kind, cc))
    assert got_ok is ok and re.search(match, reason), reason
    cpu_ok, cpu_reason = dispatch.pallas_capability("hif8.scaled_fake_quant", jax.devices("cpu")[0])
    assert not cpu_ok and "'cpu'" in cpu_reason


def test_kernel_requirements_validated():
    with pytest.raises(ValueError, match="min_compute_capability"):
        dispatch.KernelRequirements(min_compute_capability=8.9, why="x")


# ---- bench/gpu_kernels.py: importable, refuses to fake numbers, its exactness check runs in interpret mode -------


def _bench_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "gpu_kernels.py"
    spec = importlib.util.spec_from_file_location("bench_gpu_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_bench_check_exact_in_interpret_mode():
    bench = _bench_module()
    x = bench.make_input((24, 320), jnp.bfloat16)
    cases = bench.all_cases(quick=True)
    assert {c.kernel for c in cases} == set(dispatch.KERNELS)
    # one case per kernel (interpret-mode compiles are slow): HiF8, NVFP4 quantize with 4/6 mse, fused static_6
    picked = [c for c in cases if c.name.startswith("HiF8") or c.name in (
        "NVFP4 quantize mse 1x16", "NVFP4 fake-quant static_6 1x16")]
    assert {c.kernel for c in picked} == set(dispatch.KERNELS)
    for case in picked:
        cfg = dict(case.configs[0])
        if "block_size" in cfg:
            cfg["block_size"] = 2048  # a few grid steps, not one per GPU-sized block
        assert case.bytes_moved(x) > 0
        mismatches, ties = bench.check_exact(case, x, cfg, interpret=True)
        assert (mismatches, ties) == (0, 0), f"{case.name}: {mismatches} mismatches, {ties} near-ties"
    y = np.asarray(jnp.arange(6, dtype=jnp.float32))
    assert bench.count_mismatches([y], [y]) == 0 and bench.count_mismatches([y], [y + 1]) == 6


def test_bench_run_table_logic_in_interpret_mode():
    """The sweep/selection/table code path, on the HiF8 case with two configurations (timings are meaningless)."""
    bench = _bench_module()
    case = bench.hif8_case(quick=True)
    case = bench.dataclasses.replace(case, configs=(dict(block_size=4096), dict(block_size=2048)))
    rows, notes = bench.run([(16, 512)], [jnp.bfloat16], [case], interpret=True, iters=1, reps=1)
    assert len(rows) == 1 and len(rows[0]) == len(bench.HEADER) and not notes, (rows, notes)
    assert rows[0][-2:] == ["0", "0"] and rows[0][-3].startswith("block_size=")


def test_bench_refuses_without_gpu(capsys):
    bench = _bench_module()
    results = bench.Path(bench.__file__).with_name("RESULTS.md")
    before = results.read_text() if results.exists() else None
    assert bench.main([]) == 2
    assert "needs a GPU" in capsys.readouterr().err
    assert (results.read_text() if results.exists() else None) == before
