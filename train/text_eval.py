"""The application's evaluation texts, and its byte-level multiple-choice task scored with a real tokenizer.

Both are scored through lm-eval (EleutherAI's lm-evaluation-harness) with the library's backend
(`jaxlowfp.harness`): each text is an in-memory ``loglikelihood_rolling`` task named ``jaxlowfp_text_<name>``, the
choice task a ``multiple_choice`` task named ``jaxlowfp_choice_<name>``; lm-eval builds the requests and computes
word / byte perplexity and acc / acc_norm, the backend scores them (`jaxlowfp.evaluation.score_requests`).

Texts (`load_texts`): the held-out (validation) parts of `train.data`'s domains, Shakespeare and the Python
standard library, and English prose: *Alice's Adventures in Wonderland* (Lewis Carroll, 1865; public domain), the
Canterbury-corpus copy ``alice29.txt`` in the source distribution of the PyPI package ``brotli==1.2.1``
(``tests/testdata/alice29.txt``), whose last `train.data.VAL_FRACTION` (from the start of a line) is used.
``scripts/bootstrap.sh`` downloads that archive into ``.venv/share/prose/`` (``pip download``; nothing is built or
installed).

The multiple-choice task is `train.evaluate.build_choice_task` (a held-out context, its true continuation and three
continuations from elsewhere), decoded to text (`choice_items`); its choices are continuations as they are (lm-eval's
``target_delimiter`` is empty), and lm-eval's ``acc_norm`` divides by their length in characters.
"""
from __future__ import annotations

import sys
import tarfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from flax import nnx

from jaxlowfp.evaluation import ChoiceItem, TextScore
from .data import DOC_SEP, VAL_FRACTION, DataError, load_domain
from .evaluate import ChoiceTask

__all__ = [
    "CHOICE_TASK",
    "PROSE_INSTALL",
    "TEXTS",
    "TextScore",
    "choice_items",
    "lm_eval_note",
    "load_texts",
    "perplexity",
    "prose_text",
    "score_choices_tokens",
    "text_task",
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


CHOICE_TASK = "jaxlowfp_choice_shakespeare"


def text_task(name: str) -> str:
    """The lm-eval task name of a text: ``jaxlowfp_text_<name>``."""
    return f"jaxlowfp_text_{name}"


def lm_eval_note(tasks: Sequence[str]) -> str:
    """The report line that says what scored: lm-eval's version, the backend and the task names."""
    from jaxlowfp.harness import LM_EVAL_VERSION

    return (f"scored through lm-eval {LM_EVAL_VERSION} (backend jaxlowfp.harness, registered as `jaxlowfp`), "
            f"tasks: {', '.join(tasks)}")


def _backend(model: nnx.Module, tokenizer: Any, **kw: Any) -> Any:
    from jaxlowfp.harness import JaxLowFPLM

    return JaxLowFPLM(model=model, tokenizer=tokenizer, **kw)


def perplexity(model: nnx.Module, tokenizer: Any, docs: Sequence[str], *, name: str = "text",
               max_tokens: int | None = None, max_length: int = 512, stride: int | None = None,
               batch_size: int = 8, progress: bool = False) -> TextScore:
    """Rolling-window perplexity of ``docs`` through lm-eval (task ``jaxlowfp_text_<name>``): the arguments and the
    result of `jaxlowfp.evaluation.perplexity`, with lm-eval's word and byte counts and the backend's token count."""
    from jaxlowfp.harness import evaluate, rolling_task

    task = text_task(name)
    lm = _backend(model, tokenizer, batch_size=batch_size, max_length=max_length, stride=stride, progress=progress)
    res = evaluate(lm, [rolling_task(task, list(docs), tokenizer=tokenizer, max_tokens=max_tokens)])
    samples = res["samples"][task]
    ll = sum(float(s["word_perplexity"][0]) for s in samples)
    words = sum(int(s["word_perplexity"][1]) for s in samples)
    nbytes = sum(int(s["byte_perplexity"][1]) for s in samples)
    call = next(c for c in lm.calls if c["kind"] == "loglikelihood_rolling")
    seconds = call["seconds"]
    return TextScore(name, len(samples), int(call["scored"]), words, nbytes, ll, seconds,
                     call["tokens"] / seconds if seconds > 0 else float("nan"))


def score_choices_tokens(model: nnx.Module, tokenizer: Any, task: ChoiceTask, *, max_length: int = 512,
                         batch_size: int = 16, progress: bool = True) -> dict[str, float]:
    """The byte-level `ChoiceTask` with the real tokenizer, through lm-eval (task `CHOICE_TASK`): ``acc``,
    ``acc_norm``, ``items``, ``seconds`` and ``tokens_per_s`` (model inputs per second of scoring)."""
    from jaxlowfp.harness import choice_task, evaluate

    lm = _backend(model, tokenizer, batch_size=batch_size, max_length=max_length, progress=progress)
    r = evaluate(lm, [choice_task(CHOICE_TASK, choice_items(task))])["results"][CHOICE_TASK]
    call = next(c for c in lm.calls if c["kind"] == "loglikelihood")
    seconds = call["seconds"]
    return {"acc": float(r["acc,none"]), "acc_norm": float(r["acc_norm,none"]), "items": float(len(task.label)),
            "seconds": seconds, "tokens_per_s": call["tokens"] / seconds if seconds > 0 else float("nan")}
