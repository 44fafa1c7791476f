"""`python -m train generate`: see `train.eval_cli`."""
from .eval_cli import main_generate as main

__all__ = ["main"]
