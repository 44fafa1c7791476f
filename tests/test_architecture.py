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
    "jaxlowfp.rules": 1,
    "jaxlowfp.sharding": 1,  # meshes and PartitionSpec rules (jax.sharding only), used by models and the app
    "jaxlowfp.registry": 1,  # the format and rule names (imports only jaxlowfp._core.names: no jax)
    "jaxlowfp.nvfp4": 2,
    "jaxlowfp.if4": 2,  # IF3 / IF4 / IF6 adaptive block formats, beside nvfp4
    "jaxlowfp.mx": 2,
    "jaxlowfp.scaling": 2,
    "jaxlowfp.qat": 3,
    "jaxlowfp.ops": 3,  # the one op layer: every quantized contraction (beside the QAT ops it runs)
    "jaxlowfp.execution": 4,  # which quantized ops of a model ran (reads the record ops writes)
    "jaxlowfp.packed": 3,  # packed low-precision weights (codes + scales) and their nnx.Variable type
    "jaxlowfp.backends": 3,  # execution backends of packed products (scaled_matmul, fp8, dequant)
    "jaxlowfp.packed_layer": 4,  # PackedLinear (an nnx layer holding packed weights), used by models and ptq
    "jaxlowfp.qnnx": 4,
    "jaxlowfp.qlinen": 4,
    "jaxlowfp.qwix_provider": 4,  # the Qwix provider (optional dependency qwix), beside the Flax integration
    "jaxlowfp.owg": 4,  # scale state carried as gradients (_overwrite_with_gradient), used by qlinen
    "jaxlowfp.nnx": 4,  # deprecated alias of jaxlowfp.qnnx
    "jaxlowfp.linen": 4,  # deprecated alias of jaxlowfp.qlinen
    "jaxlowfp.training": 5,
    "jaxlowfp.ptq": 6,  # PTQ, export and load into a given model: imports neither models nor qnnx
    "jaxlowfp.models": 7,  # the model family and its loaders (load_export builds a model for ptq.load)
    "jaxlowfp.evaluation": 7,
    "jaxlowfp.harness": 7,  # the lm-eval backend (jaxlowfp[lm-eval])
    "jaxlowfp.eval_quantize": 7,  # how the backend quantizes the model it evaluates (fake quantization, PTQ)
    "jaxlowfp.eval_record": 7,  # what the backend records about the model it evaluated (results JSON)
    "jaxlowfp.lm_eval_tasks": 7,  # in-memory lm-eval tasks and evaluate()
    "jaxlowfp.lm_eval_cli": 7,  # the jaxlowfp-lm-eval command line
    "jaxlowfp": 8,  # the package's own __init__ (lazy: imports nothing of its own)
    "train": 9,
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


KERNEL_MODULES = sorted(m.name for m in pkgutil.iter_modules([str(ROOT / "pallas_kernels")])
                        if not m.name.startswith("_"))


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
                 or m.startswith(("jaxlowfp.qat", "jaxlowfp.qnnx", "jaxlowfp.training", "jaxlowfp.qlinen"))}
    assert not forbidden, f"importing pallas_kernels.{name} loaded {sorted(forbidden)}"
    assert {m for m in loaded if m.startswith("jaxlowfp.") and not m.startswith("jaxlowfp._core")} == set()


def test_public_all_lists_only_what_exists():
    import importlib

    for name in ("jaxlowfp", "jaxlowfp.hif8", "jaxlowfp.formats", "jaxlowfp.nvfp4", "jaxlowfp.mx", "jaxlowfp.scaling",
                 "jaxlowfp.rules", "jaxlowfp.models", "jaxlowfp.evaluation", "jaxlowfp.ptq",
                 "jaxlowfp.qat", "jaxlowfp.qnnx", "jaxlowfp.qlinen", "jaxlowfp.dispatch", "jaxlowfp.training",
                 "jaxlowfp.hadamard"):
        module = importlib.import_module(name)
        missing = [n for n in module.__all__ if not hasattr(module, n)]
        assert not missing, f"{name}.__all__ names what it does not define: {missing}"
        private = [n for n in module.__all__ if n.startswith("_")]
        assert not private, f"{name}.__all__ lists private names {private}"


def test_the_library_never_imports_the_application():
    bad = [f"{a} imports {b}" for a, targets in GRAPH.items() if not a.startswith("train")
           for b in targets if b == "train" or b.startswith("train.")]
    assert not bad, "\n".join(bad)


# Flax modules that are submodules users reach only through a dotted import (`from flax.training import
# train_state`), never as a bare `from flax import training`, so a jaxlowfp module of that name shadows nothing
_DOTTED_ONLY = {"training"}


def test_no_public_module_is_named_like_a_flax_module():
    import flax

    flax_names = {m.name for m in pkgutil.iter_modules(flax.__path__) if not m.name.startswith("_")}
    ours = {m.name for m in pkgutil.iter_modules([str(ROOT / "jaxlowfp")]) if not m.name.startswith("_")}
    deprecated = {"nnx", "linen"}  # old names, kept one release with a DeprecationWarning
    clash = (ours - deprecated - _DOTTED_ONLY) & flax_names
    assert not clash, f"public jaxlowfp modules named like flax modules: {sorted(clash)}"
    assert {"nnx", "linen"} <= flax_names  # the check looks at the right names


def test_the_deprecated_module_names_warn_and_alias():
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "try:\n    from jaxlowfp import nnx\nexcept DeprecationWarning as e:\n    print('warned', e)\n"
            "warnings.simplefilter('ignore')\nfrom jaxlowfp.nnx.layer import QuantLinear\n"
            "from jaxlowfp import linen, qlinen, qnnx\n"
            "print(QuantLinear is qnnx.QuantLinear, linen.QuantDotGeneral is qlinen.QuantDotGeneral)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "warned jaxlowfp.nnx is renamed jaxlowfp.qnnx" in out.stdout and out.stdout.strip().endswith("True True")


def test_the_distribution_lists_every_package():
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    dirs = {p.parent.relative_to(ROOT).as_posix().replace("/", ".") for pkg in ("jaxlowfp",)
            for p in (ROOT / pkg).rglob("__init__.py")}
    assert dirs | {"jaxlowfp_train", "jaxlowfp_pallas"} == listed
    # the app and the kernels are installed under names no user has
    assert cfg["package-dir"] == {"jaxlowfp_train": "train", "jaxlowfp_pallas": "pallas_kernels"}


def test_library_calls_show_no_progress_bar_unless_asked():
    import importlib
    import inspect

    found = []
    for name in ("jaxlowfp.evaluation", "jaxlowfp.ptq", "jaxlowfp.models", "jaxlowfp.training"):
        module = importlib.import_module(name)
        for attr in getattr(module, "__all__", []):
            fn = getattr(module, attr)
            if inspect.isfunction(fn):
                p = inspect.signature(fn).parameters.get("progress")
                if p is not None:
                    found.append(f"{name}.{attr}")
                    assert p.default is False, f"{name}.{attr}(progress={p.default!r}): library calls default to False"
    assert len(found) >= 4, found  # perplexity, score_choices, score_requests, ptq.quantize_model, ptq.collect
