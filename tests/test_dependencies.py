"""pyproject.toml's core dependencies are exactly what the library imports (issue 27 item 5), every distribution the
library imports is declared somewhere (core or an extra), and the Qwix provider's version check is the pin."""
import ast
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _names(reqs):
    return {Requirement(r).name.lower().replace("_", "-") for r in reqs}


def _imported_distributions(package: str) -> dict[str, set[str]]:
    """distribution name -> the modules of `package` that import it (any import statement, late ones included)."""
    dists = md.packages_distributions()  # top-level import name -> distributions that provide it
    out: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops = [node.module.split(".")[0]]
            else:
                continue
            for top in tops:
                if top in sys.stdlib_module_names or top in ("jaxlowfp", "pallas_kernels", "__future__"):
                    continue
                for d in dists.get(top, [top]):
                    out.setdefault(d.lower().replace("_", "-"), set()).add(str(path.relative_to(ROOT)))
    return out


def test_every_core_dependency_is_imported_by_the_library():
    imported = _imported_distributions("jaxlowfp")
    unused = sorted(_names(PROJECT["dependencies"]) - set(imported))
    assert not unused, f"core dependencies the library never imports (move them to an extra): {unused}"


def test_every_distribution_the_library_imports_is_declared():
    declared = _names(PROJECT["dependencies"])
    for reqs in PROJECT["optional-dependencies"].values():
        declared |= {n for n in _names(reqs) if n != "jaxlowfp"}
    imported = _imported_distributions("jaxlowfp") | _imported_distributions("pallas_kernels")
    imported.pop("jaxlib", None)  # jax's own runtime, installed with it
    missing = {d: sorted(m) for d, m in imported.items() if d not in declared}
    assert not missing, f"imported but declared nowhere in pyproject.toml: {missing}"


def test_test_only_packages_are_not_core():
    core = _names(PROJECT["dependencies"])
    assert not core & {"chex", "orbax-checkpoint", "pytest"}
    assert "orbax-checkpoint" in _names(PROJECT["optional-dependencies"]["train"])  # train/checkpoint.py


def test_jax_and_flax_are_capped_and_the_installed_versions_satisfy_the_pins():
    pins = {Requirement(r).name: Requirement(r).specifier for r in PROJECT["dependencies"]}
    for name in ("jax", "flax"):
        assert any(s.operator == "<" for s in pins[name]), f"{name} is not capped: {pins[name]}"
    for name, spec in pins.items():
        assert spec.contains(md.version(name), prereleases=True), (name, md.version(name), str(spec))


def test_the_qwix_version_check_is_the_pin():
    from jaxlowfp import qwix_provider  # the test extra installs qwix: a missing one fails, never skips
    (pin,) = [Requirement(r) for r in PROJECT["optional-dependencies"]["qwix"] if r.startswith("qwix")]
    assert SpecifierSet(qwix_provider.SUPPORTED_QWIX) == pin.specifier
    src = (ROOT / "jaxlowfp" / "qwix_provider.py").read_text()
    assert re.search(r"SpecifierSet\(SUPPORTED_QWIX\)\.contains\(qwix\.__version__\)", src)  # the import-time check
    spec = SpecifierSet(qwix_provider.SUPPORTED_QWIX)
    assert spec.contains("0.1.8") and spec.contains("0.1.8.post1")  # what pip installs for the pin
    assert not spec.contains("0.1.9") and not spec.contains("0.1.7") and not spec.contains("0.1.9rc1")
