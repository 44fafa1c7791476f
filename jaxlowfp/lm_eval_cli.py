"""The ``jaxlowfp-lm-eval`` command line: lm-eval's own command line with the ``jaxlowfp`` backend registered.

lm-eval 0.4.13 has no plugin mechanism that would let ``lm_eval --model jaxlowfp`` import the backend, so this
command imports `jaxlowfp.harness` (which registers `jaxlowfp.harness.JaxLowFPLM` as ``jaxlowfp``) and then runs
lm-eval's command line with the same arguments::

    jaxlowfp-lm-eval --model jaxlowfp --model_args pretrained=smollm2-135m,quantize=hif8 \\
        --tasks hellaswag,arc_challenge,mmlu --batch_size 8

``python -m jaxlowfp.harness`` and ``python -m jaxlowfp.lm_eval_cli`` run the same command. Needs the
``jaxlowfp[lm-eval]`` extra.
"""
from __future__ import annotations

from jaxlowfp._core.surface import public_dir as _public_dir

import sys
from typing import Sequence

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


def main(argv: Sequence[str] | None = None) -> None:
    """lm-eval's command line (``argv``, default ``sys.argv[1:]``) with the ``jaxlowfp`` backend registered."""
    from lm_eval.__main__ import cli_evaluate

    register()

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
