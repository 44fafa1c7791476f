"""The README's library snippet (load, generate, evaluate, quantize a real checkpoint) runs as a user would run it:
in a fresh interpreter outside the checkout, so it can import nothing but the installed library."""
import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    found = [b for b in blocks if b.startswith("# pip install 'jaxlowfp[models]'")]
    assert len(found) == 1, "the README's load / evaluate / quantize snippet is missing"
    return found[0]


def test_the_library_snippet_imports_only_jaxlowfp(tmp_path):
    code = _snippet()
    imports = re.findall(r"^(?:from|import) (\w+)", code, re.M)
    assert set(imports) <= {"jax", "jaxlowfp"}, imports
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; assert 'train' not in sys.modules\n"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3 and "Paris" in lines[0], out.stdout
    ppl, acc = map(float, lines[1].split())
    assert 1.0 < ppl < 50.0 and acc == 1.0  # a repeated sentence is easy; Paris beats a banana
    assert 1.0 < float(lines[2]) < 2 * ppl  # fake quantization of the middle MLPs costs little
