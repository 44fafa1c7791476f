"""The application's evaluation texts, and its byte-level multiple-choice task scored with a real tokenizer.

Perplexity and choice scoring themselves are the library's (`jaxlowfp.evaluation`, lm-eval's conventions).

Texts (`load_texts`): the held-out (validation) parts of `train.data`'s domains, Shakespeare and the Python
standard library, and English prose: *Alice's Adventures in Wonderland* (Lewis Carroll, 1865; public domain), the
Canterbury-corpus copy ``alice29.txt`` in the source distribution of the PyPI package ``brotli==1.2.1``
(``tests/testdata/alice29.txt``), whose last `train.data.VAL_FRACTION` (from the start of a line) is used.
``scripts/bootstrap.sh`` downloads that archive into ``.venv/share/prose/`` (``pip download``; nothing is built or
installed).

The multiple-choice task is `train.evaluate.build_choice_task` (a held-out context, its true continuation and three
continuations from elsewhere), decoded to text (`choice_items`) and scored by `jaxlowfp.evaluation.score_choices`.
"""
from __future__ import annotations

import sys
import tarfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from flax import nnx

from jaxlowfp.evaluation import ChoiceItem, TextScore, perplexity, score_choices
from .data import DOC_SEP, VAL_FRACTION, DataError, load_domain
from .evaluate import ChoiceTask

__all__ = [
    "PROSE_INSTALL",
    "TEXTS",
    "TextScore",
    "choice_items",
    "load_texts",
    "perplexity",
    "prose_text",
    "score_choices_tokens",
]

TEXTS = ("shakespeare", "python", "prose")
PROSE_PACKAGE = "brotli-1.2.1"
PROSE_MEMBER = f"{PROSE_PACKAGE}/tests/testdata/alice29.txt"
PROSE_INSTALL = 'python -m pip download --no-deps --no-binary :all: "brotli==1.2.1" -d .venv/share/prose'


def prose_text(archive: str | Path | None = None) -> str:
    """*Alice's Adventures in Wonderland* from the brotli 1.2.1 source archive (module docstring)."""
    path = Path(archive) if archive is not None else Path(sys.prefix) / "share" / "prose" / f"{PROSE_PACKAGE}.tar.gz"
    how = f"Get it with `{PROSE_INSTALL}` (scripts/bootstrap.sh does; it downloads, builds nothing)."
    if not path.is_file():
        raise DataError(f"text 'prose' needs {path} (the source archive of the PyPI package brotli==1.2.1). {how}")
    try:
        with tarfile.open(path) as tar:
            data = tar.extractfile(PROSE_MEMBER).read()
    except (tarfile.TarError, KeyError, OSError, AttributeError) as e:
        raise DataError(f"text 'prose': cannot read {PROSE_MEMBER} from {path}: {e}. {how}") from e
    return data.decode("utf-8").replace("\r\n", "\n")


def _docs(val: np.ndarray) -> list[str]:
    """Validation bytes of a `train.data.Domain` (documents ended by DOC_SEP) as texts."""
    parts = bytes(val).split(bytes([DOC_SEP]))
    return [p.decode("utf-8", errors="replace") for p in parts if p.strip()]


def load_texts(names: Sequence[str] = TEXTS, *, prose_archive: str | Path | None = None) -> dict[str, list[str]]:
    """Held-out documents of each text: ``{"shakespeare": [...], "python": [...], "prose": [...]}``."""
    out = {}
    for name in names:
        if name in ("shakespeare", "python"):
            out[name] = _docs(load_domain(name).val)
        elif name == "prose":
            text = prose_text(prose_archive)  # held out: the last VAL_FRACTION, from the start of its first line
            cut = len(text) - max(1, int(len(text) * VAL_FRACTION))
            out[name] = [text[text.rfind("\n", 0, cut) + 1:]]
        else:
            raise ValueError(f"unknown text {name!r}; allowed: {', '.join(map(repr, TEXTS))}")
    return out


def choice_items(task: ChoiceTask) -> list[ChoiceItem]:
    """The byte-level `ChoiceTask` decoded to text items (contexts and continuations as UTF-8)."""
    def text(b: np.ndarray) -> str:
        return bytes(b.astype(np.uint8)).decode("utf-8", errors="replace")

    return [ChoiceItem(text(task.context[i]), tuple(text(task.choices[i, j, : task.lengths[i, j]])
                                                    for j in range(task.choices.shape[1])), int(task.label[i]))
            for i in range(len(task.label))]


def score_choices_tokens(model: nnx.Module, tokenizer: Any, task: ChoiceTask, *, max_length: int = 512,
                         batch_size: int = 16, progress: bool = True) -> dict[str, float]:
    """`train.evaluate.score_choices` with the real tokenizer (`jaxlowfp.evaluation.score_choices`)."""
    return score_choices(model, tokenizer, choice_items(task), max_length=max_length, batch_size=batch_size,
                         progress=progress)
