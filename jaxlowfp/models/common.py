"""What both checkpoint loaders share: the error type, the tokenizer wrapper, the tensor-name table and the step
that turns named arrays into a `jaxlowfp.models.llama.Llama` without ever initialising a parameter at random."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlowfp.models.llama import Llama, ModelConfig

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


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One parameter: its NNX path in `Llama`, its checkpoint names and how to lay it out.

    ``transpose``: the checkpoint stores ``[out, in]`` (PyTorch and GGUF order), NNX kernels are ``[in, out]``
    (the last two axes are swapped: expert weights ``[E, out, in]`` become ``[E, in, out]``).
    ``rope``: a q or k projection weight/bias whose rows GGUF conversion permutes for llama.cpp's RoPE
    (``"q"`` or ``"k"``; None otherwise).
    """

    path: str
    hf: str
    gguf: str
    transpose: bool = False
    rope: str | None = None


def tensor_specs(config: ModelConfig) -> list[TensorSpec]:
    """Every parameter of ``Llama(config)`` with its Hugging Face and GGUF tensor names.

    A mixture-of-experts config is refused: its experts have other names and layouts
    (`jaxlowfp.models.moe_loader.moe_tensor_specs`), so a writer that asks here for a MoE model's names stops
    instead of writing a dense checkpoint.
    """
    from jaxlowfp.models.moe import MoEConfig

    if isinstance(config, MoEConfig):
        raise ValueError(f"tensor_specs names the tensors of the dense Llama family; {type(config).__name__} is a "
                         "mixture of experts (its tensors: jaxlowfp.models.moe_loader.moe_tensor_specs). Writing "
                         "mixture-of-experts checkpoints (compressed-tensors, GGUF) is not implemented yet")
    specs = [TensorSpec("embed/embedding", "model.embed_tokens.weight", "token_embd.weight")]
    for i in range(config.n_layers):
        b, hb, gb = f"blocks/{i}/", f"model.layers.{i}.", f"blk.{i}."
        specs.append(TensorSpec(b + "attn_norm/scale", hb + "input_layernorm.weight", gb + "attn_norm.weight"))
        for p, g in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
            rope = p if p in "qk" else None
            specs.append(TensorSpec(f"{b}attn/{p}_proj/kernel", f"{hb}self_attn.{p}_proj.weight", f"{gb}{g}.weight",
                                    transpose=True, rope=rope))
            if config.qkv_bias and p != "o":
                specs.append(TensorSpec(f"{b}attn/{p}_proj/bias", f"{hb}self_attn.{p}_proj.bias", f"{gb}{g}.bias",
                                        rope=rope))
        if config.qk_norm:
            for p in "qk":
                specs.append(TensorSpec(f"{b}attn/{p}_norm/scale", f"{hb}self_attn.{p}_norm.weight",
                                        f"{gb}attn_{p}_norm.weight"))
        specs.append(TensorSpec(b + "mlp_norm/scale", hb + "post_attention_layernorm.weight", gb + "ffn_norm.weight"))
        for p, g in (("gate", "ffn_gate"), ("up", "ffn_up"), ("down", "ffn_down")):
            specs.append(TensorSpec(f"{b}mlp/{p}_proj/kernel", f"{hb}mlp.{p}_proj.weight", f"{gb}{g}.weight",
                                    transpose=True))
    specs.append(TensorSpec("final_norm/scale", "model.norm.weight", "output_norm.weight"))
    if not config.tie_embeddings:
        specs.append(TensorSpec("lm_head/kernel", "lm_head.weight", "output.weight", transpose=True))
    return specs


def build_model(config: ModelConfig, fetch: Callable[[TensorSpec], tuple[np.ndarray, str]], source: str | Path,
                *, model_class: type[Llama] = Llama, specs: Sequence[TensorSpec] | None = None) -> Llama:
    """``model_class(config)`` with every parameter taken from the checkpoint (``specs``: the tensor table,
    default `tensor_specs`).

    ``fetch(spec)`` returns the array in checkpoint layout and where it came from (``"<file>: tensor <name>"``;
    it raises `CheckpointError` when the tensor is missing). Shapes are checked against the config and values must
    be finite; the model is built abstractly first, so a parameter the checkpoint does not provide is an error,
    never a random initialisation.
    """
    model = nnx.eval_shape(lambda: model_class(config, rngs=nnx.Rngs(0)))
    variables = {"/".join(map(str, p)): v for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)}
    specs = {s.path: s for s in (tensor_specs(config) if specs is None else specs)}
    if set(variables) != set(specs):  # the name table and the model disagree: a bug here, not in the file
        raise AssertionError(f"tensor table out of date: {sorted(set(variables) ^ set(specs))}")
    pdt = jnp.dtype(config.param_dtype)
    for path, var in variables.items():
        spec = specs[path]
        array, where = fetch(spec)
        array = np.asarray(array)
        want = (*var.shape[:-2], var.shape[-1], var.shape[-2]) if spec.transpose else tuple(var.shape)
        if array.shape != want:
            raise CheckpointError(f"{where} has shape {array.shape}; the model config ({source}) needs {want}")
        if not np.isfinite(array).all():
            raise CheckpointError(f"{where} has non-finite values")
        var.set_value(jnp.asarray(np.swapaxes(array, -1, -2) if spec.transpose else array, pdt))
    return model
