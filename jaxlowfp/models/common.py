"""What both checkpoint loaders share: the error type, the tokenizer wrapper, the tensor-name table and the step
that turns named arrays into a `jaxlowfp.models.llama.Llama` without ever initialising a parameter at random."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlowfp.models.llama import Llama, ModelConfig
from jaxlowfp.models.tensor_names import TensorSpec, tensor_specs

if TYPE_CHECKING:
    import tokenizers

__all__ = ["CheckpointError", "TensorSpec", "Tokenizer", "build_model", "tensor_specs"]


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded; the message names the file (and tensor) and says what was expected."""


class Tokenizer:
    """A `tokenizers.Tokenizer` with the checkpoint's special tokens.

    ``encode(text)`` adds what the checkpoint's tokenizer adds (a BOS token only if it is configured to);
    ``decode(ids)`` keeps special tokens as text unless ``skip_special_tokens``.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, bos_id: int | None, eos_id: int | None, source: str):
        self.tokenizer = tokenizer
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.source = source

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str; got {type(text).__name__}")
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=True)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        """The id of a token string (e.g. ``"<|im_start|>"``), or None."""
        return self.tokenizer.token_to_id(token)

    def check_fits(self, vocab: int, where: str) -> None:
        """Every token id must index a row of the embedding: ``vocab_size <= vocab``."""
        if self.vocab_size > vocab:
            raise CheckpointError(
                f"{where}: the tokenizer has {self.vocab_size} tokens but the model's vocabulary (embedding rows) "
                f"is {vocab}; tokenizer and weights do not belong together"
            )
        for name, i in (("bos", self.bos_id), ("eos", self.eos_id)):
            if i is not None and not 0 <= i < vocab:
                raise CheckpointError(f"{where}: {name} token id {i} is outside the vocabulary [0, {vocab})")

    def __repr__(self) -> str:
        return f"Tokenizer({self.vocab_size} tokens, bos={self.bos_id}, eos={self.eos_id}, from {self.source})"


def build_model(config: ModelConfig, fetch: Callable[[TensorSpec], tuple[np.ndarray, str]], source: str | Path
                ) -> Llama:
    """``Llama(config)`` with every parameter taken from the checkpoint.

    ``fetch(spec)`` returns the array in checkpoint layout and where it came from (``"<file>: tensor <name>"``;
    it raises `CheckpointError` when the tensor is missing). Shapes are checked against the config and values must
    be finite; the model is built abstractly first, so a parameter the checkpoint does not provide is an error,
    never a random initialisation.
    """
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    variables = {"/".join(map(str, p)): v for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)}
    specs = {s.path: s for s in tensor_specs(config)}
    if set(variables) != set(specs):  # the name table and the model disagree: a bug here, not in the file
        raise AssertionError(f"tensor table out of date: {sorted(set(variables) ^ set(specs))}")
    pdt = jnp.dtype(config.param_dtype)
    for path, var in variables.items():
        spec = specs[path]
        array, where = fetch(spec)
        array = np.asarray(array)
        want = tuple(reversed(var.shape)) if spec.transpose else tuple(var.shape)
        if array.shape != want:
            raise CheckpointError(f"{where} has shape {array.shape}; the model config ({source}) needs {want}")
        if not np.isfinite(array).all():
            raise CheckpointError(f"{where} has non-finite values")
        var.set_value(jnp.asarray(array.T if spec.transpose else array, pdt))
    return model
