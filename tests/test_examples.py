"""The example notebooks run top to bottom (the scripts are run by the tests of the module they show)."""
import pathlib

import nbclient
import nbformat
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, f"no notebooks under {EXAMPLES}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(EXAMPLES)}}
                            ).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "Error" not in text
    if path.name == "quickstart.ipynb":  # the claims the notebook's prose makes
        assert "max_window  steps with clipping: 0/10" in text
        assert "most_recent steps with clipping: 0/10" not in text
