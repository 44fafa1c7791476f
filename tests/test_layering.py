"""Layering of the library (issue 42 item 6), read statically from the source with ``ast``:

- no library module over `MAX_LINES` lines, except the ones listed in `LONG_MODULES` with the reason;
- `jaxlowfp.ptq` imports neither `jaxlowfp.models` nor `jaxlowfp.qnnx` (function-level imports included): loading an
  export builds a model in `jaxlowfp.models` (`jaxlowfp.models.load_export`), shared rules live in `jaxlowfp.rules`;
- no module uses a private name (``_name``) of another project module, by ``from m import _name`` or as ``m._name``
  of an imported module, except the ones listed in `PRIVATE_USES` with the reason.

Both exception lists are a ratchet: an entry that no longer applies fails too, so the lists only shrink.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("jaxlowfp", "pallas_kernels")  # the installed packages (the application, train/, is not a library)
MAX_LINES = 600

# module path -> why it is still longer than MAX_LINES
LONG_MODULES: dict[str, str] = {}  # none left

# (module path, "imported module:private name") -> why it is still there (none left)
PRIVATE_USES: dict[tuple[str, str], str] = {}


def _files() -> list[Path]:
    return sorted(p for pkg in LIBRARY for p in (ROOT / pkg).rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _module(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _base(node: ast.ImportFrom, path: Path, root: Path) -> str:
    """The absolute module a ``from ... import`` reads from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    anchor = _module(path, root).split(".")
    if path.name != "__init__.py":
        anchor = anchor[:-1]
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def _imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Every project module or name `path` imports, as dotted names (``from a import b`` gives ``a.b``), at module
    level or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = _base(node, path, root)
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def _is_module(dotted: str, root: Path) -> bool:
    where = root.joinpath(*dotted.split("."))
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_uses(path: Path, root: Path = ROOT) -> set[str]:
    """``"module:name"`` for each private name of another project module that `path` uses."""
    tree = ast.parse(path.read_text(), str(path))
    own = _module(path, root)
    uses, bound = set(), {}  # bound: local name -> the project module it is
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in LIBRARY:
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = _base(node, path, root)
            if base.split(".")[0] not in LIBRARY:
                continue
            for a in node.names:
                # a private module is the package's own implementation floor (jaxlowfp._core): imported on purpose
                if _private(a.name) and base != own and not _is_module(f"{base}.{a.name}", root):
                    uses.add(f"{base}:{a.name}")
                bound[a.asname or a.name] = f"{base}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in bound:
                target = ".".join([bound[value.id], *reversed(chain)])
                if target != own:
                    uses.add(f"{target}:{node.attr}")
    return uses


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_library_module_is_longer_than_the_limit():
    long = {_rel(p): _lines(p) for p in _files() if _lines(p) > MAX_LINES}
    unlisted = {p: n for p, n in long.items() if p not in LONG_MODULES}
    assert not unlisted, f"modules over {MAX_LINES} lines (split them by what they hold): {unlisted}"
    stale = sorted(set(LONG_MODULES) - set(long))
    assert not stale, f"LONG_MODULES lists modules that are {MAX_LINES} lines or shorter now: remove {stale}"


def test_ptq_imports_neither_models_nor_qnnx():
    bad = []
    for path in sorted((ROOT / "jaxlowfp" / "ptq").rglob("*.py")):
        for name in _imported_modules(path):
            if any(name == m or name.startswith(m + ".") for m in ("jaxlowfp.models", "jaxlowfp.qnnx")):
                bad.append(f"{_rel(path)} imports {name}")
    assert not bad, "\n".join(bad)


def test_no_module_uses_a_private_name_of_another():
    found = {(_rel(p), use) for p in _files() for use in _private_uses(p)}
    unlisted = sorted(found - set(PRIVATE_USES))
    assert not unlisted, ("private names used across modules (give the helper a public name in the lower module, "
                          "or move it down into jaxlowfp/_core):\n" + "\n".join(f"{p}: {u}" for p, u in unlisted))
    stale = sorted(set(PRIVATE_USES) - found)
    assert not stale, f"PRIVATE_USES lists uses that are gone: remove {stale}"


@pytest.mark.parametrize("source, expected", [
    ("from jaxlowfp.ops import _group_ids\n", {"jaxlowfp.ops:_group_ids"}),
    ("from jaxlowfp import ops\nops._group_ids(1, 2)\n", {"jaxlowfp.ops:_group_ids"}),
    ("import jaxlowfp.models.hf_loader as hf\nhf._json(1)\n", {"jaxlowfp.models.hf_loader:_json"}),
    ("from . import formats\nformats._Legacy\n", {"jaxlowfp.ptq.formats:_Legacy"}),
    ("def f():\n    from jaxlowfp.ptq import formats\n    return formats._Legacy\n", {"jaxlowfp.ptq.formats:_Legacy"}),
    ("from jaxlowfp._core.surface import public_dir as _public_dir\n", set()),  # a public name, aliased
    ("import numpy as np\nnp._private\n", set()),  # not a project module
    ("def f():\n    from jaxlowfp.packed import _scale\n", {"jaxlowfp.packed:_scale"}),  # function-level too
    ("from jaxlowfp import _core\n", set()),  # a private module: the implementation floor, imported on purpose
])
def test_the_private_name_check_finds_what_it_should(tmp_path, source, expected):
    """The checker itself, on small sources placed as jaxlowfp/ptq/probe.py (a checker that finds nothing would
    pass the repository check)."""
    path = tmp_path / "jaxlowfp" / "ptq" / "probe.py"
    path.parent.mkdir(parents=True)
    path.write_text(source)
    (tmp_path / "jaxlowfp" / "_core").mkdir()
    (tmp_path / "jaxlowfp" / "_core" / "__init__.py").write_text("")
    assert _private_uses(path, tmp_path) == expected


def test_the_ptq_import_check_sees_function_level_and_relative_imports(tmp_path):
    path = tmp_path / "jaxlowfp" / "ptq" / "probe.py"
    path.parent.mkdir(parents=True)
    path.write_text("def f():\n    from ..models import llama\n    from jaxlowfp import qnnx\n")
    assert {"jaxlowfp.models.llama", "jaxlowfp.qnnx"} <= _imported_modules(path, tmp_path)
