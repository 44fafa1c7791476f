"""The README is the front door: its first screen (what jaxlowfp is, install, the two commands), its size, its two
quickstarts (the files in examples/, run here exactly as printed), its links (each resolves) and its figures (each
one appears in the docs page or bench/RESULTS.md that the same paragraph or table row links to, so the two cannot
drift). Also the library snippet of docs/models.md (moved there from the README): it runs as a user would run it, in a
fresh interpreter outside the checkout, so it can import nothing but the installed library."""
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
EXAMPLES = ROOT / "examples"
# each quickstart file, and the first line of its README block
QUICKSTARTS = {"quickstart_qat.py": "# One HiF8 W8A8 QAT step", "quickstart_smollm2.py": "# SmolLM2-135M -> NVFP4"}


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def _snippet() -> str:
    found = [b for b in _python_blocks(ROOT / "docs" / "models.md") if b.startswith("# pip install 'jaxlowfp[models]'")]
    assert len(found) == 1, "the load / evaluate / quantize snippet of docs/models.md is missing"
    return found[0]


@pytest.mark.slow
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


# -- the first screen ----------------------------------------------------------------------------------------------

def test_the_first_screen_says_what_it_is_how_to_install_and_the_two_commands():
    text = README.read_text()
    assert len(text.encode()) < 12 * 1024, f"README.md is {len(text.encode())} bytes; the bar is 12 KB"
    first = "\n".join(text.splitlines()[:25])
    for needed in ("make demo", "make test", "**jaxlowfp** is", "pip install", "make setup"):
        assert needed in first, f"{needed!r} is not on the README's first screen"
    assert "make test" in (ROOT / ".ci" / "run").read_text()  # CI runs the command the README names


# -- the quickstarts: the README's blocks are the example files, and they run -------------------------------------

def _readme_block(first_line: str) -> str:
    found = [b for b in _python_blocks(README) if b.startswith(first_line)]
    assert len(found) == 1, f"the README has {len(found)} blocks starting with {first_line!r}"
    return found[0]


@pytest.mark.parametrize("name", sorted(QUICKSTARTS))
def test_the_readme_quickstart_is_the_example_file(name):
    assert _readme_block(QUICKSTARTS[name]) == (EXAMPLES / name).read_text(), \
        f"README.md's quickstart and examples/{name} differ: change both"


def _run(name: str, replace: tuple[str, str] | None = None) -> dict:
    """Runs examples/<name> in this process (as ``python examples/<name>`` would: a fresh ``__main__`` namespace),
    returns the namespace it leaves. ``replace``: (text of the file, what the test runs instead), once."""
    path = EXAMPLES / name
    code = path.read_text()
    if replace:
        assert code.count(replace[0]) == 1, replace[0]
        code = code.replace(*replace)
    ns = {"__name__": "__main__", "__file__": str(path)}
    exec(compile(code, str(path), "exec"), ns)
    return ns


def test_the_qat_quickstart_runs(capsys):
    import numpy as np
    ns = _run("quickstart_qat.py")
    layers, loss, saturated = capsys.readouterr().out.strip().rsplit(" ", 2)
    assert layers == "(('layers/0', 'hif8_w8a8'), ('layers/2', 'hif8_w8a8'))"
    assert math.isfinite(float(loss)) and float(loss) > 0 and 0.0 <= float(saturated) <= 1.0
    metrics, state = ns["metrics"], ns["state"]
    assert not bool(metrics["observe_only"]) and bool(metrics["finite"])  # a quantized step, not a warmup one
    assert int(state.step) == 3
    # the amax histories recorded the three steps: max-window state, non-zero amaxes
    amaxes = [np.asarray(x) for x in __import__("jax").tree.leaves(state.qstate)
              if np.asarray(x).dtype == np.float32 and np.asarray(x).ndim == 1 and np.asarray(x).shape[0] == 64]
    assert amaxes and all((a > 0).sum() == 3 for a in amaxes), [(a > 0).sum() for a in amaxes]


def test_the_smollm2_quickstart_runs(smollm2, monkeypatch, capsys, tmp_path):
    """The second quickstart on the worker's SmolLM2 (conftest: a fresh copy of the model loaded once per worker, in
    place of the file's own ``load("smollm2-135m")``), writing its export under tmp_path; its rule on the projections
    of two blocks instead of all 30 (the export, the packed reload and generation are the same code; the whole model
    costs minutes of the suite's 2 cores, mostly compiling the packed decode)."""
    from flax import nnx

    import jaxlowfp.models
    from jaxlowfp.packed import PackedParam

    def load(name, **kw):
        assert name == "smollm2-135m" and not kw, (name, kw)
        return smollm2

    out = tmp_path / "export"
    monkeypatch.setattr(jaxlowfp.models, "load", load)
    monkeypatch.setattr(tempfile, "mkdtemp", lambda: (out.mkdir(), str(out))[1])
    ns = _run("quickstart_smollm2.py", replace=(r'path=r"blocks/\d+/(attn|mlp)/', r'path=r"blocks/(1|2)/(attn|mlp)/'))
    report, generated = capsys.readouterr().out.strip().splitlines()[-2:]
    assert report.startswith(f"exported to {out}: ") and "bits per parameter" in report, report
    assert "Paris" in generated, generated  # ' Paris.\n\nThe population of the'
    kernels = [p for p, _ in nnx.to_flat_state(nnx.state(ns["packed"], PackedParam))]
    assert len(kernels) == 2 * 7, kernels  # every projection of the two blocks holds its codes packed


# -- links and figures ----------------------------------------------------------------------------------------------

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
# a figure: a number standing alone (not the 4 of nvfp4, the 8 of W8A8 or the 90 of sm_90a)
_FIGURE = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)*(?:e[-+]?\d+)?(?![\w])")


def _local_links(text: str) -> list[str]:
    return [t.split("#")[0] for _, t in _LINK.findall(text) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_every_readme_link_resolves():
    text = README.read_text()
    links = _local_links(text)
    assert links, "the README links to no docs page"
    missing = sorted({t for t in links if not (ROOT / t).is_file()})
    assert not missing, f"README links to missing files: {missing}"
    # the docs pages it links to are pages of the site (mkdocs.yml's nav), not only files in docs/
    nav = (ROOT / "mkdocs.yml").read_text()
    off_nav = sorted({t for t in links if t.startswith("docs/") and f": {t[len('docs/'):]}" not in nav})
    assert not off_nav, f"README links to docs files that are not in mkdocs.yml's nav: {off_nav}"


def _figure_blocks() -> list[tuple[str, str, str]]:
    """(section heading, block, the section's text) for every paragraph and table row outside code blocks."""
    out = []
    for section in re.split(r"^(?=## )", _FENCE.sub("", README.read_text()), flags=re.M):
        heading = section.splitlines()[0] if section.strip() else ""
        body = section.split("\n", 1)[1] if "\n" in section else ""
        for para in re.split(r"\n\s*\n", body):
            rows = para.splitlines() if para.lstrip().startswith("|") else [para]
            out += [(heading, row, body) for row in rows if row.strip()]
    return out


def test_every_figure_of_the_readme_is_in_the_page_it_links_to():
    """Each number the README states in prose or a table appears in a local file (a docs page, bench/RESULTS.md)
    that its paragraph or table row links to, or, with no link there, that its section links to."""
    bad = []
    for heading, block, section in _figure_blocks():
        text = _LINK.sub(lambda m: m.group(1), block)  # link texts count, link targets are not figures
        text = re.sub(r"https?://\S+", "", text)
        figures = set(_FIGURE.findall(text))
        if not figures:
            continue
        sources = _local_links(block) or _local_links(section)
        if not sources:
            bad.append(f"{heading}: {sorted(figures)} in a block whose section links to no page: {block[:80]!r}")
            continue
        pages = "\n".join((ROOT / s).read_text() for s in sources if (ROOT / s).is_file())
        absent = sorted(f for f in figures if f not in pages)
        if absent:
            bad.append(f"{heading}: {absent} not in {sources}: {block[:100]!r}")
    assert not bad, "README figures without a source page:\n" + "\n".join(bad)


def test_the_figure_check_can_fail(tmp_path, monkeypatch):
    """The check above on a README that states a figure its linked page does not hold."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "p.md").write_text("the error is 0.00756\n")
    (tmp_path / "README.md").write_text("# x\n\n## S\n\nthe error is 0.00757 ([p](docs/p.md)).\n")
    monkeypatch.setattr(sys.modules[__name__], "README", tmp_path / "README.md")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError, match=r"\['0.00757'\] not in \['docs/p.md'\]"):
        test_every_figure_of_the_readme_is_in_the_page_it_links_to()
    (tmp_path / "README.md").write_text("# x\n\n## S\n\nthe error is 0.00756 ([p](docs/p.md)).\n")
    test_every_figure_of_the_readme_is_in_the_page_it_links_to()


# -- the tensor API block: its codes decode, by ml_dtypes' own float4 / float8 tables, to what dequantize gives ----

def test_the_tensor_api_block_runs_and_its_codes_decode_independently(capsys):
    import ml_dtypes
    import numpy as np
    ns: dict = {"__name__": "__main__"}
    exec(compile(_readme_block("# One format, one quantized array"), "README.md", "exec"), ns)
    q, x_hat = ns["q"], ns["x_hat"]
    assert capsys.readouterr().out.split() == ["Format('nvfp4-mse')", "(4,", "32)", "float8_e4m3fn", "float32"]
    codes = np.asarray(q.codes)
    nib = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(4, 64)  # element 2j in the low nibble
    elems = nib.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    scales = np.asarray(q.scales).view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    ref = (elems * np.repeat(scales, 16, axis=-1)) * np.float32(q.global_scale)
    np.testing.assert_array_equal(np.asarray(x_hat), ref)
    assert np.abs(ref - np.asarray(ns["x"])).max() < 0.2 * np.abs(np.asarray(ns["x"])).max()  # a real quantization
