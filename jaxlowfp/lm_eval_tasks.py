"""lm-eval tasks for the jaxlowfp backend (`jaxlowfp.harness.JaxLowFPLM`) and one call that runs them.

- `rolling_task`: an in-memory rolling-perplexity task in the layout of lm-eval's ``wikitext`` (word and byte
  perplexity, bits per byte) over documents given as strings;
- `choice_task`: an in-memory multiple-choice task over `jaxlowfp.evaluation.ChoiceItem` s (``acc``, ``acc_norm``);
- `evaluate`: ``lm_eval.simple_evaluate`` of a backend on task names, local task YAMLs or these config dicts.

Needs the ``jaxlowfp[lm-eval]`` extra (``lm-eval`` and ``datasets``, no PyTorch).
"""
from __future__ import annotations

from jaxlowfp._core.surface import public_dir as _public_dir

import logging
from pathlib import Path
from typing import Any, Sequence

try:
    import lm_eval
    from lm_eval.api.model import LM
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("jaxlowfp.lm_eval_tasks needs lm-eval (EleutherAI's lm-evaluation-harness, no PyTorch): "
                      "pip install 'jaxlowfp[lm-eval]'") from e

from jaxlowfp._core.checks import positive_int
from jaxlowfp.evaluation import budget_docs

__all__ = ["choice_task", "evaluate", "rolling_task"]


def _in_memory(rows: list[dict]) -> Any:
    def dataset(**_: Any) -> Any:  # lm-eval calls it with the run's metadata, not needed here
        import datasets

        return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})

    return dataset


def rolling_task(name: str, docs: Sequence[str], *, tokenizer: Any = None, max_tokens: int | None = None
                 ) -> dict[str, Any]:
    """An lm-eval task (a config dict for ``simple_evaluate``) scoring the rolling perplexity of ``docs``, in the
    layout of lm-eval's ``wikitext`` task: word and byte perplexity, bits per byte. The documents stay in memory.
    With ``max_tokens`` (and the ``tokenizer``), only that many tokens of the documents are kept
    (`jaxlowfp.evaluation.budget_docs`: in order, the last document cut and decoded from its kept tokens)."""
    if isinstance(docs, str) or not all(isinstance(d, str) for d in docs):
        raise TypeError(f"rolling_task {name!r}: docs must be a sequence of str")
    if max_tokens is not None:
        if tokenizer is None:
            raise ValueError("max_tokens needs the tokenizer")
        docs = [d for d, _ in budget_docs(tokenizer, docs, positive_int(max_tokens, "max_tokens"))]
    docs = [d for d in docs if d]
    if not docs:
        raise ValueError(f"rolling_task {name!r} needs at least one non-empty document")
    return {"task": name, "custom_dataset": _in_memory([{"text": d} for d in docs]), "test_split": "test",
            "output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "text",
            "metric_list": [{"metric": m, "aggregation": a, "higher_is_better": False} for m, a in
                            (("word_perplexity", "weighted_perplexity"), ("byte_perplexity", "weighted_perplexity"),
                             ("bits_per_byte", "bits_per_byte"))],
            "metadata": {"version": 1.0}}


def choice_task(name: str, items: Sequence[Any], *, target_delimiter: str = "") -> dict[str, Any]:
    """An lm-eval multiple-choice task over `jaxlowfp.evaluation.ChoiceItem` s: each choice is scored as the
    continuation ``target_delimiter + choice`` of the context (default ``""``: the choices are continuations as
    given); ``acc`` and ``acc_norm`` (lm-eval: log-likelihood per character of the choice)."""
    rows = [{"context": it.context, "choices": list(it.choices), "label": int(it.label)} for it in items]
    if not rows:
        raise ValueError(f"choice_task {name!r} needs at least one item")
    return {"task": name, "custom_dataset": _in_memory(rows), "test_split": "test", "output_type": "multiple_choice",
            "doc_to_text": "context", "doc_to_choice": "choices", "doc_to_target": "label",
            "target_delimiter": target_delimiter,
            "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True}
                            for m in ("acc", "acc_norm")],
            "metadata": {"version": 1.0}}


def evaluate(lm: LM, tasks: Sequence[str | dict], *, include_path: str | None = None,
             **kwargs: Any) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` of the backend ``lm`` on ``tasks``: lm-eval task names (their datasets come
    from the Hugging Face hub), paths of local task YAMLs or directories, or config dicts (`rolling_task`,
    `choice_task`). Only names and groups (a config whose ``task`` is a list, which may name lm-eval's tasks) make
    lm-eval index its own task library (about 10 s). ``kwargs`` go to ``simple_evaluate`` (``limit``,
    ``num_fewshot``, ...); samples are logged. Returns lm-eval's results dict."""
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._yaml_loader import load_yaml

    if isinstance(tasks, (str, dict)):
        tasks = [tasks]
    expanded: list[str | dict] = []
    for t in tasks:  # local YAML files and directories as lm-eval's command line reads them
        path = Path(t) if isinstance(t, str) else None
        if path is not None and path.is_dir():
            files = sorted(path.glob("*.yaml"))
            if not files:
                raise ValueError(f"task directory {t!r} has no *.yaml task file")
            expanded += [load_yaml(str(f), resolve_func=True) for f in files]
        elif path is not None and path.suffix == ".yaml":
            if not path.is_file():
                raise ValueError(f"task file {t!r} does not exist")
            expanded.append(load_yaml(str(path), resolve_func=True))
        else:
            expanded.append(t)
    if not expanded:
        raise ValueError("evaluate needs at least one task")
    library = any(not isinstance(t, dict) or not isinstance(t.get("task"), str) for t in expanded)
    manager = TaskManager(include_path=include_path, include_defaults=library)
    kwargs.setdefault("verbosity", "ERROR")
    kwargs.setdefault("log_samples", True)
    task_log = logging.getLogger("lm_eval.api.task")
    task_log.addFilter(_quiet_custom_dataset)  # lm-eval's advice on --metadata for every in-memory task
    try:
        return lm_eval.simple_evaluate(model=lm, tasks=expanded, task_manager=manager, **kwargs)
    finally:
        task_log.removeFilter(_quiet_custom_dataset)


def _quiet_custom_dataset(record: logging.LogRecord) -> bool:
    return "Custom kwargs can be passed to `--metadata`" not in record.getMessage()


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
