"""The example notebooks run top to bottom (the scripts are run by the tests of the module they show; the README's
quickstarts by tests/test_readme.py).

The notebooks of one pytest worker share one kernel process: each starts with ``%reset -f`` (an empty namespace, as
in a fresh kernel: a notebook that used a name it does not define fails) but finds JAX, Flax and jaxlowfp already
imported and their compiled programs cached, which a fresh kernel per notebook paid for again each time."""
import pathlib

import nbclient
import nbformat
import pytest
from jupyter_client.manager import KernelManager

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, f"no notebooks under {EXAMPLES}"


@pytest.fixture(scope="module")
def kernel():
    """One python3 kernel for this worker's notebooks, started in examples/ (as each notebook's own directory)."""
    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(EXAMPLES))
    yield km
    km.shutdown_kernel(now=True)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, kernel):
    nb = nbformat.read(path, as_version=4)
    reset = nbformat.v4.new_code_cell("%reset -f\nimport matplotlib.pyplot as _plt\n_plt.close('all')\ndel _plt")
    nb.cells.insert(0, reset)  # the namespace of a fresh kernel
    nbclient.NotebookClient(nb, km=kernel, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(EXAMPLES)}}).execute()
    assert nb.cells[0] is reset and not reset.outputs, reset.outputs
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "Error" not in text
    if path.name == "quickstart.ipynb":  # the claims the notebook's prose makes
        assert "max_window  steps with clipping: 0/10" in text
        assert "most_recent steps with clipping: 0/10" not in text
