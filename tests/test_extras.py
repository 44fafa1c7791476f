"""Without the `jaxlowfp[models]` extra, the model and the evaluation still import, and what needs the extra (the
checkpoint loaders, progress bars) raises an ImportError that names the extra to install."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# one fresh interpreter in which the extra's packages cannot be imported (None in sys.modules blocks an import)
_CODE = """
import sys
for m in ('tokenizers', 'gguf', 'tqdm', 'tqdm.auto'):
    sys.modules[m] = None
from jaxlowfp import evaluation
from jaxlowfp.models import Llama, load, preset
print('model and evaluation import')

def message(fn):
    try:
        fn()
    except ImportError as e:
        return str(e)
    return 'no error'

import importlib
from jaxlowfp._core.progress import progress_bar
print('hf:', message(lambda: importlib.import_module('jaxlowfp.models.hf_loader')))
print('gguf:', message(lambda: importlib.import_module('jaxlowfp.models.gguf_loader')))
print('load:', message(lambda: load('smollm2-135m')))
print('progress:', message(lambda: progress_bar([1], enabled=True, desc='x')))
print('no progress:', progress_bar([1], enabled=False, desc='x'))
"""


def test_without_the_models_extra():
    out = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines()[1:])
    assert out.stdout.startswith("model and evaluation import")
    for key, package in (("hf", "tokenizers"), ("gguf", "gguf"), ("load", "gguf"),
                         ("progress", "tqdm.auto")):
        assert f"needs the optional package {package!r}" in lines[key], (key, lines[key])
        assert "pip install 'jaxlowfp[models]'" in lines[key], (key, lines[key])
    assert lines["no progress"] == "[1]"
