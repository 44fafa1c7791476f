"""The ``jaxlowfp-lm-eval`` command line: lm-eval's own command line with the ``jaxlowfp`` backend registered.

lm-eval 0.4.13 has no plugin mechanism that would let ``lm_eval --model jaxlowfp`` import the backend, so this
command imports `jaxlowfp.harness` (which registers `jaxlowfp.harness.JaxLowFPLM` as ``jaxlowfp``) and then runs
lm-eval's command line with the same arguments::

    jaxlowfp-lm-eval --model jaxlowfp --model_args pretrained=smollm2-135m,quantize=hif8 \\
        --tasks hellaswag,arc_challenge,mmlu --batch_size 8

``python -m jaxlowfp.harness`` and ``python -m jaxlowfp.lm_eval_cli`` run the same command. Needs the
``jaxlowfp[lm-eval]`` extra.

When ``--tasks`` names only existing YAML files of single tasks, lm-eval's own task library (about 14,000 files) is not
indexed: nothing in it is asked for, and indexing it took about 10 s of a 15 s run of one local task on 2 cores. Any
task name, directory, glob pattern or group file keeps lm-eval's behaviour.
"""
from __future__ import annotations

from jaxlowfp._core.surface import public_dir as _public_dir

import contextlib
import io
import sys
from pathlib import Path
from typing import Iterator, Sequence

__all__ = ["BACKEND", "main", "register"]

BACKEND = "jaxlowfp.harness:JaxLowFPLM"  # the backend class, as lm-eval's registry names a lazy entry


def register() -> None:
    """Register the ``jaxlowfp`` model in lm-eval's registry as the lazy entry `BACKEND` (nothing if importing
    `jaxlowfp.harness` registered the class already). lm-eval's built-in backends are registered first: with a
    non-empty registry lm-eval would never load them."""
    import lm_eval.models  # noqa: F401  # the built-in backends
    from lm_eval.api.registry import model_registry

    if "jaxlowfp" not in model_registry:
        model_registry.register("jaxlowfp", target=BACKEND)


def _local_task_files(argv: Sequence[str]) -> bool:
    """Whether the command line ``argv``, read by lm-eval's own parser (``--tasks`` / ``-t`` space- or
    comma-separated, repeatable, abbreviable), runs tasks that are all existing ``.yaml`` files of single tasks: then
    lm-eval needs nothing from its own task library. A group file (its ``task`` a list, which may name lm-eval's
    tasks), a file lm-eval cannot read or a command line it refuses keeps lm-eval's behaviour."""
    from lm_eval._cli.harness import HarnessCLI
    from lm_eval.tasks._yaml_loader import load_yaml

    cli = HarnessCLI()
    argv = list(argv)
    if argv and argv[0] not in cli._subparsers.choices:  # lm-eval inserts `run` the same way
        argv = ["run", *argv]
    try:  # lm-eval reports a bad command line (or prints --help) itself, when it runs
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args = cli._parser.parse_args(argv)
    except SystemExit:
        return False
    entries = (args.tasks or []) if args.command == "run" else []
    if not entries or not all(t.endswith(".yaml") and Path(t).is_file() for t in entries):
        return False
    try:
        return all(isinstance(load_yaml(t, resolve_func=False).get("task"), str) for t in entries)
    except Exception:  # lm-eval reports an unreadable file itself
        return False


@contextlib.contextmanager
def _without_task_library() -> Iterator[None]:
    """lm-eval 0.4.13's command line builds its ``TaskManager`` itself (``lm_eval.tasks.TaskManager``, looked up at
    each run) with no option to leave out the library: for the run, that name is a subclass whose
    ``include_defaults`` is False (``--include_path`` is still read)."""
    import lm_eval.tasks

    base = lm_eval.tasks.TaskManager

    class LocalTaskManager(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args, include_defaults: bool = False, **kw):
            super().__init__(*args, include_defaults=include_defaults, **kw)

    lm_eval.tasks.TaskManager = LocalTaskManager  # type: ignore[misc]
    try:
        yield
    finally:
        lm_eval.tasks.TaskManager = base  # type: ignore[misc]


def main(argv: Sequence[str] | None = None) -> None:
    """lm-eval's command line (``argv``, default ``sys.argv[1:]``) with the ``jaxlowfp`` backend registered."""
    from lm_eval.__main__ import cli_evaluate

    register()

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    with _without_task_library() if _local_task_files(sys.argv[1:]) else contextlib.nullcontext():
        cli_evaluate()


if __name__ == "__main__":
    main()


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
