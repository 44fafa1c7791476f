"""Every docstring example of the library runs and prints what it says (the examples are documentation)."""
import doctest
import importlib
import pathlib
import pkgutil

import pytest

import jaxlowfp

# (jaxlowfp.nnx and jaxlowfp.linen: deprecated aliases that only warn and re-export)
MODULES = sorted(m.name for m in pkgutil.walk_packages(jaxlowfp.__path__, "jaxlowfp.")
                 if m.name not in ("jaxlowfp.nnx", "jaxlowfp.linen"))
# the public modules a newcomer reads first: each shows at least one worked example
MUST_HAVE_EXAMPLES = ("jaxlowfp", "jaxlowfp.hif8", "jaxlowfp.formats", "jaxlowfp.nvfp4", "jaxlowfp.mx",
                      "jaxlowfp.scaling", "jaxlowfp.qat", "jaxlowfp.dispatch", "jaxlowfp.hadamard", "jaxlowfp.qnnx",
                      "jaxlowfp.training", "jaxlowfp.rules", "jaxlowfp.ptq")


@pytest.mark.parametrize("name", ["jaxlowfp", *MODULES])
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{name}: {result.failed} docstring example(s) failed (see the output above)"
    if name in MUST_HAVE_EXAMPLES:
        assert result.attempted > 0, f"{name} has no docstring example"


DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
PAGES_WITH_EXAMPLES = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if ">>> " in p.read_text())


@pytest.mark.parametrize("page", PAGES_WITH_EXAMPLES)
def test_docs_page_examples_run(page):
    """The doctest examples of the docs site's pages (the README's content moved there) run and print what they say."""
    result = doctest.testfile(str(DOCS / page), module_relative=False,
                              optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0, f"docs/{page}: {result}"
