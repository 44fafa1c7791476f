"""Datasets of the local lm-eval tasks in this directory: JSON Lines files next to this module, read by the
``json`` builder of Hugging Face ``datasets`` (offline: nothing is downloaded) into a ``test`` split.

lm-eval calls these through ``custom_dataset: !function utils.<name>`` with the run's metadata (the model arguments
among them) as keyword arguments, which are not needed here.
"""
from __future__ import annotations

from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def _load(name: str) -> datasets.DatasetDict:
    return datasets.load_dataset("json", data_files={"test": str(HERE / name)})


def multiple_choice(**_: object) -> datasets.DatasetDict:
    return _load("multiple_choice.jsonl")


def rolling(**_: object) -> datasets.DatasetDict:
    return _load("rolling.jsonl")


def generation(**_: object) -> datasets.DatasetDict:
    return _load("generation.jsonl")
