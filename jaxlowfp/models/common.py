"""What both checkpoint loaders share: the error type, the tokenizer wrapper, the tensor-name table and the step
that turns named arrays into a `jaxlowfp.models.llama.Llama` without ever initialising a parameter at random.

Streaming: a loader hands `build_model` each tensor as a `LazyTensor` (its shape and a function that reads any
slice of it), so with a ``mesh`` every parameter is built straight into its shards (`jax.device_put` of each
device's slice, `jax.make_array_from_single_device_arrays`): each device's slice is read from the file on its own
(safetensors ``get_slice``, GGUF rows and blocks of a numpy memmap), and the host holds one slice at a time beyond
what the devices hold."""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlowfp._core.deprecation import renamed_kwarg
from jaxlowfp._core.errors import CheckpointError
from jaxlowfp.models.llama import Llama, ModelConfig
from jaxlowfp.models.tensor_names import TensorSpec, tensor_specs

if TYPE_CHECKING:
    import tokenizers

__all__ = ["CheckpointError", "LazyTensor", "TensorSpec", "Tokenizer", "abstract_model", "build_model",
           "install_packed", "tensor_specs"]


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


Index = tuple[slice, ...]  # one slice(start, stop) per dimension, explicit bounds, step 1


@dataclasses.dataclass(frozen=True)
class LazyTensor:
    """A checkpoint tensor read on demand: ``shape`` in checkpoint layout, ``where`` (``"<file>: tensor <name>"``)
    for messages, and ``read(index)``, the float32 values of ``index`` (`Index`, checkpoint layout)."""

    shape: tuple[int, ...]
    where: str
    read: Callable[[Index], np.ndarray]

    @classmethod
    def of(cls, array: Any, where: str) -> "LazyTensor":
        """A tensor already in memory (e.g. decoded from packed NVFP4 codes)."""
        array = np.asarray(array)
        return cls(tuple(array.shape), where, lambda index: array[index])


def _bounds(index: Any, shape: Sequence[int]) -> Index:
    """`jax.make_array_from_callback`'s index (slices, possibly open) as explicit ``slice(start, stop)``."""
    out = []
    for s, n in zip(tuple(index) + (slice(None),) * (len(shape) - len(tuple(index))), shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise AssertionError(f"a shard index with step {step}")
        out.append(slice(start, stop))
    return tuple(out)


@functools.lru_cache(maxsize=16)
def _template(model_class: type[Llama], config: ModelConfig) -> Llama:
    return nnx.eval_shape(lambda: model_class(config, rngs=nnx.Rngs(0)))


def abstract_model(model_class: type[Llama], config: ModelConfig) -> Llama:
    """``model_class(config)`` built abstractly (`nnx.eval_shape`: shapes and dtypes, no values), a model of its own
    to fill. The constructor is traced once per class and configuration and the result cloned (tracing took 0.4 s
    for SmolLM2-135M, cloning 0.02 s)."""
    return nnx.clone(_template(model_class, config))


def build_model(config: ModelConfig, fetch: Callable[[TensorSpec], LazyTensor | tuple[np.ndarray, str] | None],
                source: str | Path, *, mesh: jax.sharding.Mesh | None = None, rules: Any = None,
                model_class: type[Llama] = Llama, specs: Sequence[TensorSpec] | None = None) -> Llama:
    """``model_class(config)`` with every parameter taken from the checkpoint (``specs``: the tensor table,
    default `tensor_specs`).

    ``fetch(spec)`` returns the tensor in checkpoint layout as a `LazyTensor` (or an ``(array, where)`` pair; it
    raises `CheckpointError` when the tensor is missing), or None: the parameter is left abstract, for the caller
    to replace its module (`jaxlowfp.models.quantized.load_quantized` with ``packed=True``). Shapes are checked
    against the config and values must
    be finite; the model is built abstractly first, so a parameter the checkpoint does not provide is an error,
    never a random initialisation.

    ``mesh``: every parameter is placed by ``rules`` (`jaxlowfp.sharding.ShardRule`s; default
    `jaxlowfp.sharding.llama_rules`), each device's shard read by itself (`_put_shards`), so no device and no
    host ever holds a whole sharded tensor. The values are those of the unsharded load, bit for bit.
    """
    model = abstract_model(model_class, config)
    variables = {"/".join(map(str, p)): v for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)}
    by_path = {s.path: s for s in (tensor_specs(config) if specs is None else specs)}
    if set(variables) != set(by_path):  # the name table and the model disagree: a bug here, not in the file
        raise AssertionError(f"tensor table out of date: {sorted(set(variables) ^ set(by_path))}")
    shardings = None
    if mesh is not None:
        from jaxlowfp import sharding

        shardings = sharding.model_shardings(model, mesh, sharding.llama_rules() if rules is None else rules)
    elif rules is not None:
        raise ValueError("rules= places parameters on a mesh; pass mesh= too (jaxlowfp.sharding.make_mesh)")
    pdt = jnp.dtype(config.param_dtype)
    for path, var in variables.items():
        spec = by_path[path]
        tensor = fetch(spec)
        if tensor is None:  # the caller replaces this parameter's module (a packed load): left abstract
            continue
        if not isinstance(tensor, LazyTensor):
            tensor = LazyTensor.of(*tensor)
        # transposed tensors swap their last two axes (a [E, K, N] expert weight keeps its expert axis first)
        want = (*var.shape[:-2], var.shape[-1], var.shape[-2]) if spec.transpose else tuple(var.shape)
        if tuple(tensor.shape) != want:
            raise CheckpointError(f"{tensor.where} has shape {tuple(tensor.shape)}; the model config ({source}) "
                                  f"needs {want}")
        if shardings is None:
            array = np.asarray(tensor.read(_bounds((), want)))
            if not np.isfinite(array).all():
                raise CheckpointError(f"{tensor.where} has non-finite values")
            var.set_value(jnp.asarray(np.swapaxes(array, -1, -2) if spec.transpose else array, pdt))
            continue

        def shard(index: Any, tensor: LazyTensor = tensor, transpose: bool = spec.transpose,
                  shape: tuple[int, ...] = tuple(var.shape)) -> np.ndarray:
            index = _bounds(index, shape)
            part = np.asarray(tensor.read((*index[:-2], index[-1], index[-2]) if transpose else index))
            if not np.isfinite(part).all():
                raise CheckpointError(f"{tensor.where} has non-finite values")
            # round to nearest even, as jnp.asarray(x, pdt)
            return (np.swapaxes(part, -1, -2) if transpose else part).astype(pdt)

        var.set_value(_put_shards(tuple(var.shape), shardings[path], shard))
    return model


def _put_shards(shape: tuple[int, ...], sharding: jax.sharding.Sharding, read: Callable[[Any], np.ndarray]
                ) -> jax.Array:
    """`jax.make_array_from_callback`, one device at a time: each shard is read, put on its device and dropped
    before the next is read (``make_array_from_callback`` reads every addressable shard first, so the host would
    hold the whole tensor at once on a one-host mesh). Shards with the same index (replicas) are read once."""
    arrays: list[jax.Array] = []
    last: tuple[Any, Any] = (None, None)
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        key = tuple((s.start, s.stop) for s in _bounds(index, shape))
        if key != last[0]:
            last = (key, read(index))
        arrays.append(jax.device_put(last[1], device))
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def install_packed(model: nnx.Module, weights: Mapping[str, Any], *, gemm: str = "auto",
                   act_fns: Mapping[str, Any] | None = None, source: Any = "", mesh: Any = None,
                   rules: Any = None, backend: str | None = None) -> None:
    """Replace each ``nnx.Linear`` at a path of `weights` (``{path: PackedWeight of its W' [in, out]}``, read from a
    checkpoint) by a `PackedLinear` holding that weight, in place: the loaders' ``packed=True``. The Linear may be
    abstract (``nnx.eval_shape``: its kernel is never materialised); its bias, dtypes and shape are kept, and a
    weight that does not fit its kernel is a `CheckpointError` naming `source` and the layer.
    `act_fns`: ``{path: hashable x -> fake-quantized x}``, a checkpoint's own activation quantizer. ``mesh``: each
    weight is placed as ``rules`` (default `jaxlowfp.sharding.llama_rules`) place its kernel
    (`jaxlowfp.sharding.packed_shardings`). The layers run on the GEMM backend `gemm` (`jaxlowfp.backends`;
    ``backend=`` is its deprecated name)."""
    gemm = renamed_kwarg("models.common.install_packed", "backend", backend, "gemm", gemm, "auto")
    from jaxlowfp import sharding
    from jaxlowfp.packed_layer import PackedLinear, replace_modules

    mods = {"/".join(map(str, p)): x for p, x in nnx.iter_graph(model) if isinstance(x, nnx.Linear)}
    specs = (None if mesh is None else
             sharding.model_shardings(model, mesh, sharding.llama_rules() if rules is None else rules))
    layers = {}
    for path, w in weights.items():
        lin = mods.get(path)
        if lin is None:
            raise CheckpointError(f"{source}: packed weight for {path}, which is not an nnx.Linear of the model")
        if w.shape != tuple(lin.kernel.shape):
            raise CheckpointError(f"{source}: layer {path}: packed weight W' {w.shape} does not fit the model's "
                                  f"kernel {tuple(lin.kernel.shape)}")
        if specs is not None:
            w = jax.device_put(w, sharding.packed_shardings(w, specs[f"{path}/kernel"].spec, mesh,
                                                            where=f"{source}: layer {path}"))
        fn = (act_fns or {}).get(path)
        layers[path] = (lin, PackedLinear(w, lin.bias, activation=None, gemm=gemm, dtype=lin.dtype,
                                          param_dtype=lin.param_dtype, path=path, act_fn=fn))
    replace_modules(model, layers)
