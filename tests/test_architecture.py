"""The floors of the package (docs/architecture.md): imports point down only, no import cycle among the project's
modules, and a kernel module loads neither the QAT layer, Flax NNX integration nor optax."""
import ast
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxlowfp", "pallas_kernels", "train")

# floor of each module prefix (longest prefix wins); an import may only point to the same floor or below
FLOORS = {
    "jaxlowfp._core": 0,
    "pallas_kernels": 1,
    "jaxlowfp.dispatch": 1,
    "jaxlowfp.hif8": 1,
    "jaxlowfp.formats": 1,
    "jaxlowfp.hadamard": 1,
    "jaxlowfp.nvfp4": 2,
    "jaxlowfp.mx": 2,
    "jaxlowfp.scaling": 2,
    "jaxlowfp.qat": 3,
    "jaxlowfp.nnx": 4,
    "jaxlowfp.linen": 4,
    "jaxlowfp.training": 5,
    "jaxlowfp.ptq": 6,
    "jaxlowfp": 7,  # the package's own __init__ (lazy: imports nothing of its own)
    "train": 8,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            out[_module_name(path)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The project module `name` refers to (a module, or the module defining an imported attribute)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    """Project modules `module` imports, at module level or inside functions (a late import is still an edge)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_pkg else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]
        for n in names:
            target = _resolve(n)
            # a submodule importing its own package (or a package its own submodule) is not a cycle of modules
            if target and target != module and not module.startswith(target + "."):
                out.add(target)
    return out


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _floor(module: str) -> int:
    best = max((k for k in FLOORS if module == k or module.startswith(k + ".")), key=len)
    return FLOORS[best]


def test_every_module_has_a_floor():
    for m in MODULES:
        assert any(m == k or m.startswith(k + ".") for k in FLOORS), f"{m} has no floor in FLOORS"


def test_imports_point_down_only():
    bad = [f"{a} (floor {_floor(a)}) imports {b} (floor {_floor(b)})"
           for a, targets in GRAPH.items() for b in targets if _floor(b) > _floor(a)]
    assert not bad, "imports that point up:\n" + "\n".join(sorted(bad))


def test_kernels_import_only_the_leaf_layer():
    bad = [f"{a} imports {b}" for a, targets in GRAPH.items() if a.startswith("pallas_kernels")
           for b in targets if not (b.startswith("jaxlowfp._core") or b.startswith("pallas_kernels"))]
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


KERNEL_MODULES = sorted(m.name for m in pkgutil.iter_modules([str(ROOT / "pallas_kernels")]) if not m.name.startswith("_"))


@pytest.mark.parametrize("name", KERNEL_MODULES)
def test_a_kernel_module_loads_no_upper_floor(name):
    code = ("import importlib, json, sys; importlib.import_module('pallas_kernels.%s'); "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('jaxlowfp', 'optax', 'flax'))))"
            % name)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    forbidden = {m for m in loaded if m.split(".")[0] in ("optax", "flax")
                 or m.startswith(("jaxlowfp.qat", "jaxlowfp.nnx", "jaxlowfp.training", "jaxlowfp.linen"))}
    assert not forbidden, f"importing pallas_kernels.{name} loaded {sorted(forbidden)}"
    assert {m for m in loaded if m.startswith("jaxlowfp.") and not m.startswith("jaxlowfp._core")} == set()


def test_public_all_lists_only_what_exists():
    import importlib

    for name in ("jaxlowfp", "jaxlowfp.hif8", "jaxlowfp.formats", "jaxlowfp.nvfp4", "jaxlowfp.mx", "jaxlowfp.scaling",
                 "jaxlowfp.qat", "jaxlowfp.nnx", "jaxlowfp.linen", "jaxlowfp.dispatch", "jaxlowfp.training",
                 "jaxlowfp.hadamard"):
        module = importlib.import_module(name)
        missing = [n for n in module.__all__ if not hasattr(module, n)]
        assert not missing, f"{name}.__all__ names what it does not define: {missing}"
        private = [n for n in module.__all__ if n.startswith("_")]
        assert not private, f"{name}.__all__ lists private names {private}"
