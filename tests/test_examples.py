"""The example notebooks run top to bottom (the scripts are run by the tests of the module they show; the README's
quickstarts by tests/test_readme.py).

The notebooks of one pytest worker share one kernel process: each starts with ``%reset -f`` (an empty namespace, as
in a fresh kernel: a notebook that used a name it does not define fails) but finds JAX, Flax and jaxlowfp already
imported and their compiled programs cached, which a fresh kernel per notebook paid for again each time."""
import os
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
def tiny_checkpoint(tmp_path_factory):
    """A tiny Llama checkpoint (random weights; 22 blocks: the notebooks quantize ``blocks/1\\d`` and keep 10 + 10, a
    byte-level BPE tokenizer) for the notebooks that show SmolLM2-135M: they read ``JAXLOWFP_EXAMPLE_MODEL``
    (default "smollm2-135m"). Loading SmolLM2 and running GPTQ and lm-eval on it made the notebooks minutes of the
    suite; the library's results on SmolLM2 are the tests' of those modules."""
    from test_models_hf import CFG, write_hf
    from test_models_oracle import random_weights

    cfg = CFG | {"n_layers": 22}
    path = tmp_path_factory.mktemp("tiny_llama")
    write_hf(path, random_weights(cfg, seed=3), cfg, shards=1, config={"max_position_embeddings": 256})
    return path


@pytest.fixture(scope="module")
def kernel(tiny_checkpoint):
    """One python3 kernel for this worker's notebooks, started in examples/ (as each notebook's own directory),
    with ``JAXLOWFP_EXAMPLE_MODEL`` the tiny checkpoint."""
    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(EXAMPLES), env=os.environ | {"JAXLOWFP_EXAMPLE_MODEL": str(tiny_checkpoint)})
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
