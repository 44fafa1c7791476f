"""Load a Llama-family GGUF file (llama.cpp's format) into `jaxlowfp.models.llama.Llama` and its tokenizer.

The file is read by `jaxlowfp._core.gguf_read.GGUFFile` (tensor table validated first, metadata decoded when
asked for); weights go through ``gguf.quants.dequantize`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_x and
the K-quants, ...), so a quantized file loads as its dequantized float32 values.

GGUF stores tensors in PyTorch ``[out, in]`` row order, except that llama.cpp's converter permutes the rows of the
q and k projections of the ``llama`` architecture: Hugging Face's RoPE rotates pairs ``(i, i + D/2)`` of every
head (rotate-half), llama.cpp's rotates adjacent pairs ``(2i, 2i + 1)``, and ``convert_hf_to_gguf.py``
(``LlamaModel.permute``) reorders each head's rows accordingly::

    w.reshape(n_head, 2, D // 2, *rest).swapaxes(1, 2).reshape(w.shape)   # n_head = n_kv_head for k

We undo it (`unpermute_rope_rows`). Qwen2 and Qwen3 use rotate-half in llama.cpp too (NEOX RoPE) and are not
permuted.

``packed=True``: the projections stored as NVFP4 (type 40) or MXFP4 (type 39) become `jaxlowfp.ptq.PackedLinear`
layers holding the file's codes and scales re-laid out, never decoded (`packed_weight`; ggml-org/llama.cpp
``ggml/src/ggml-common.h`` ``block_nvfp4`` / ``block_mxfp4``)::

    NVFP4  36 bytes per 64 inputs: 4 UE4M3 scale bytes, then per 16-value group 8 bytes, byte j = code j | code
           (j + 8) << 4;  w = E2M1(code) * s * S_dec (S_dec: the optional F32 tensor ``<name>.scale``, else 1)
    MXFP4  17 bytes per 32 inputs: the E8M0 byte e, then byte j = code j | code (j + 16) << 4;  w = E2M1 * 2^(e-127)

UE4M3 as ``gguf.quants.NVFP4`` decodes it: the sign bit is ignored and the byte 0x7F reads as 0, so the packed
E4M3 scale is the byte with its sign cleared and 0x7F replaced by 0 (the value llama.cpp computes with). The byte
0xFF (gguf-py: 480, more than E4M3 holds) and an E8M0 byte 0xFF (NaN in the OCP MX specification; gguf-py reads
2^127) are refused.

The tokenizer is rebuilt from the metadata (``tokenizer.ggml.tokens``, ``.merges``, ``.token_type``,
``.bos_token_id``, ``.add_bos_token``, ``.pre``) as a byte-level BPE in the ``tokenizers`` library, with the
pre-tokenizer regexes llama.cpp uses for the ``pre`` type.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxlowfp._core.checks import optional_module
from jaxlowfp._core.deprecation import renamed_kwarg
from jaxlowfp._core.gguf_read import check_tensor_infos, open_reader, read_tensor_table  # re-exported (public here)
from jaxlowfp._core.pretokenizers import PRE_TOKENIZERS
from jaxlowfp.models.common import (CheckpointError, LazyTensor, TensorSpec, Tokenizer, build_model,
                                    install_packed, tensor_specs)
from jaxlowfp.models.llama import Llama, ModelConfig

tokenizers = optional_module("tokenizers", extra="models", feature="loading a GGUF checkpoint")
gguf = optional_module("gguf", extra="models", feature="loading a GGUF checkpoint")
Regex, decoders, models = tokenizers.Regex, tokenizers.decoders, tokenizers.models
pre_tokenizers, processors = tokenizers.pre_tokenizers, tokenizers.processors

__all__ = ["ARCHITECTURES", "PACKED_TYPES", "PRE_TOKENIZERS", "check_tensor_infos", "config_fields", "decode_scale",
           "load_gguf", "packed_weight", "read_config", "read_tensor_table", "read_tokenizer", "unpermute_rope_rows"]

# architecture -> whether the converter permuted the q/k rows (llama.cpp RoPE type NORM vs NEOX)
ARCHITECTURES = {"llama": True, "qwen2": False, "qwen3": False}

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types that are matched verbatim in text


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute``: rows ``[n_head, D/2, 2]`` (pairs adjacent) -> ``[n_head, 2, D/2]``."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_field(reader: Any, key: str, path: Path, default: Any = ...) -> Any:
    """The value of the metadata field `key`; `default` when absent (a CheckpointError without a default)."""
    f = reader.fields.get(key)
    if f is None:
        if default is ...:
            raise CheckpointError(f"{path}: metadata key {key!r} is missing")
        return default
    try:
        return f.contents()
    except ValueError as e:  # a string that is not UTF-8, an array of arrays
        raise CheckpointError(f"{path}: metadata key {key!r} cannot be read: {e}") from e


def read_config(reader: Any, path: Path, *, dtype: str = "float32", param_dtype: str = "float32") -> ModelConfig:
    """The `ModelConfig` of a GGUF file from its metadata and tensor shapes."""
    arch = read_field(reader, "general.architecture", path)
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: architecture {arch!r} is not supported; allowed: "
                              f"{', '.join(map(repr, ARCHITECTURES))}")
    try:
        return ModelConfig(**config_fields(reader, path, arch), dtype=dtype, param_dtype=param_dtype)
    except ValueError as e:
        raise CheckpointError(f"{path}: metadata gives an invalid model config: {e}") from e


def config_fields(reader: Any, path: Path, arch: str) -> dict[str, Any]:
    """The `ModelConfig` fields (all but the dtypes) from the ``{arch}.*`` metadata and the tensor shapes."""
    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise CheckpointError(f"{path}: tensor token_embd.weight is missing")
    d_model = int(read_field(reader, f"{arch}.embedding_length", path))
    n_heads = int(read_field(reader, f"{arch}.attention.head_count", path))
    head_dim = int(read_field(reader, f"{arch}.attention.key_length", path, d_model // max(n_heads, 1)))
    rope_dim = int(read_field(reader, f"{arch}.rope.dimension_count", path, head_dim))
    if rope_dim != head_dim:
        raise CheckpointError(f"{path}: partial RoPE (rope.dimension_count {rope_dim} < head dim {head_dim}) is "
                              "not supported")
    scaling = read_field(reader, f"{arch}.rope.scaling.type", path, "none")
    factors = None
    if scaling == "linear":
        factors = (float(read_field(reader, f"{arch}.rope.scaling.factor", path)),) * (head_dim // 2)
    elif scaling not in ("none", ""):
        raise CheckpointError(f"{path}: rope scaling type {scaling!r} is not supported; allowed: 'none', 'linear', "
                              "and Llama-3 frequency factors (tensor rope_freqs.weight)")
    if "rope_freqs.weight" in names:
        factors = tuple(float(v) for v in _dequantize(names["rope_freqs.weight"], path).reshape(-1))
    return dict(
        vocab=int(names["token_embd.weight"].shape[1]),
        d_model=d_model,
        n_layers=int(read_field(reader, f"{arch}.block_count", path)),
        n_heads=n_heads,
        n_kv_heads=int(read_field(reader, f"{arch}.attention.head_count_kv", path, n_heads)),
        d_ff=int(read_field(reader, f"{arch}.feed_forward_length", path)),
        max_seq_len=int(read_field(reader, f"{arch}.context_length", path)),
        rope_theta=float(read_field(reader, f"{arch}.rope.freq_base", path, 10_000.0)),
        norm_eps=float(read_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", path)),
        explicit_head_dim=None if head_dim * n_heads == d_model else head_dim,
        tie_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rope_freq_factors=factors,
    )


def _shape(tensor: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first


def _read(tensor: Any, path: Path, index: tuple[slice, ...]) -> np.ndarray:
    """float32 values of ``index`` (slices over the ``[out, in]`` numpy order) of a GGUF tensor.

    The reader's ``tensor.data`` is a numpy memmap of the file, rows of the last dimension stored as blocks of
    ``block`` values in ``type_size`` bytes (F32: 1 value in 4 bytes; Q4_1: 32 in 20): only the rows of ``index``
    and the blocks covering its last-dimension range are read and dequantized (``gguf.quants.dequantize``).
    """
    shape = _shape(tensor)
    block, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    raw = tensor.data.view(np.uint8)  # [..., bytes per row]
    if shape[-1] % block or raw.shape != (*shape[:-1], shape[-1] // block * type_size):
        raise CheckpointError(f"{path}: tensor {tensor.name} holds {raw.size} bytes for shape {shape} of type "
                              f"{tensor.tensor_type.name} (truncated file?)")
    cols = index[-1]
    b0, b1 = cols.start // block, -(-cols.stop // block)
    part = np.ascontiguousarray(raw[(*index[:-1], slice(b0 * type_size, b1 * type_size))])
    try:
        values = gguf.quants.dequantize(part, tensor.tensor_type)
    except NotImplementedError as e:
        raise CheckpointError(f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which the gguf "
                              f"package cannot dequantize: {e}") from e
    return np.asarray(values, np.float32)[..., cols.start - b0 * block: cols.stop - b0 * block]


def _dequantize(tensor: Any, path: Path) -> np.ndarray:
    """float32 values of a whole GGUF tensor in ``[out, in]`` (numpy) order."""
    return _read(tensor, path, tuple(slice(0, n) for n in _shape(tensor)))


def _lazy(tensor: Any, path: Path, rope_heads: int | None) -> LazyTensor:
    """The tensor as a `LazyTensor`; ``rope_heads``: undo the converter's q/k row permutation of that many heads
    (a slice of rows reads the whole heads that cover it, whose rows the permutation only moves among each other)."""
    where, shape = f"{path}: tensor {tensor.name}", _shape(tensor)
    if rope_heads is None:
        return LazyTensor(shape, where, lambda index: _read(tensor, path, index))
    rows = shape[0] // rope_heads

    def read(index: tuple[slice, ...]) -> np.ndarray:
        h0, h1 = index[0].start // rows, -(-index[0].stop // rows)
        w = unpermute_rope_rows(_read(tensor, path, (slice(h0 * rows, h1 * rows), *index[1:])), h1 - h0)
        return w[index[0].start - h0 * rows: index[0].stop - h0 * rows]

    return LazyTensor(shape, where, read)


def decode_scale(tensor: Any, path: Path) -> np.float32:
    """The value of a GGUF NVFP4 decode scale tensor: one finite, positive F32 value, else a CheckpointError naming
    the file and the tensor."""
    where = f"{path}: tensor {tensor.name}"
    if tensor.tensor_type.name != "F32" or int(np.prod(tensor.shape)) != 1:
        raise CheckpointError(f"{where} is a {tensor.tensor_type.name} tensor of shape {tuple(tensor.shape)}; an NVFP4 "
                              f"decode scale is one F32 value")
    g = np.float32(np.asarray(tensor.data, np.float32).reshape(-1)[0])
    if not (np.isfinite(g) and g > 0):
        raise CheckpointError(f"{where} is {float(g)}; an NVFP4 decode scale must be finite and > 0")
    return g


PACKED_TYPES = ("NVFP4", "MXFP4")  # GGUF types packed=True keeps as codes and scales


def packed_weight(tensor: Any, path: Path, rope_heads: int | None = None, scale: Any = None) -> Any:
    """The `jaxlowfp.packed.PackedWeight` of a GGUF NVFP4 / MXFP4 tensor ``[out, in]`` (the GEMM matrix ``W' [in,
    out]``) from its bytes as stored (module docstring); ``rope_heads``: undo the converter's q/k row permutation of
    that many heads (on codes and scales: whole rows move); ``scale``: NVFP4's ``<name>.scale`` tensor, or None."""
    import ml_dtypes

    from jaxlowfp import packed as packing
    from jaxlowfp._core.format import Format
    from jaxlowfp._core.qarray import QArray

    kind, (n, k) = tensor.tensor_type.name, _shape(tensor)
    where = f"{path}: tensor {tensor.name}"
    if kind not in PACKED_TYPES or len(_shape(tensor)) != 2:
        raise CheckpointError(f"{where} is {len(_shape(tensor))}-D {kind}; packed=True keeps 2-D "
                              f"{' / '.join(PACKED_TYPES)} tensors")
    block, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    raw = np.asarray(tensor.data.view(np.uint8))
    if k % block or raw.shape != (n, k // block * type_size):
        raise CheckpointError(f"{where} holds {raw.size} bytes for shape {(n, k)} of type {kind} (truncated file?)")
    blocks = raw.reshape(n, k // block, type_size)
    if kind == "NVFP4":  # [4 scale bytes | 4 groups x 8 bytes]
        raw_d = blocks[..., :4]
        if (raw_d == 0xFF).any():  # gguf-py: exponent 15, mantissa 7 = 480, which E4M3 cannot hold
            raise CheckpointError(f"{where}: a UE4M3 block scale byte is 0xFF (gguf-py decodes it as 480, above "
                                  f"E4M3's 448)")
        d = np.where(raw_d == 0x7F, np.uint8(0), raw_d & np.uint8(0x7F)).reshape(n, k // 16)
        qs = blocks[..., 4:].reshape(n, k // 16, 8)
    else:  # [E8M0 byte | 16 bytes]
        d = blocks[..., 0]
        if (d == 0xFF).any():
            raise CheckpointError(f"{where}: an E8M0 block scale is 0xFF (NaN in the OCP MX specification)")
        qs = blocks[..., 1:]
    nib = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(n, k)  # element j, then element j + half
    codes = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)  # element 2j in the low nibble
    if rope_heads is not None:
        codes, d = unpermute_rope_rows(codes, rope_heads), unpermute_rope_rows(d, rope_heads)
    if kind == "MXFP4":
        mxa = QArray(codes=jnp.asarray(codes), scales=jnp.asarray(d.view(ml_dtypes.float8_e8m0fnu)), global_scale=None,
                     format=Format(kind="mxfp4"), dtype=jnp.dtype(jnp.float32), shape=(n, k))
        return packing.PackedWeight(array=mxa, s_enc=None, format=packing.Format(kind="mxfp4"), k=k, n=n)
    s_dec = np.float32(1.0) if scale is None else decode_scale(scale, path)
    if not (np.isfinite(s_dec) and s_dec > 0):
        raise CheckpointError(f"{path}: tensor {scale.name} is {float(s_dec)}; an NVFP4 decode scale must be finite "
                              f"and > 0")
    arr = QArray(codes=jnp.asarray(codes), scales=jnp.asarray(d.view(ml_dtypes.float8_e4m3fn)),
                 global_scale=jnp.float32(s_dec), format=Format(kind="nvfp4"), dtype=jnp.dtype(jnp.float32),
                 shape=(n, k))
    return packing.from_nvfp4(arr)


def read_tokenizer(reader: Any, path: Path) -> Tokenizer:
    """The byte-level BPE tokenizer described by the ``tokenizer.ggml.*`` metadata."""
    kind = read_field(reader, "tokenizer.ggml.model", path)
    if kind != "gpt2":
        raise CheckpointError(f"{path}: tokenizer model {kind!r} is not supported; allowed: 'gpt2' (byte-level BPE)")
    tokens = list(read_field(reader, "tokenizer.ggml.tokens", path))
    merges = [tuple(m.split(" ", 1)) for m in read_field(reader, "tokenizer.ggml.merges", path)]
    pre = read_field(reader, "tokenizer.ggml.pre", path, "default")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"{path}: tokenizer pre-tokenizer {pre!r} is not supported; allowed: "
                              f"{', '.join(map(repr, PRE_TOKENIZERS))}")
    if len(set(tokens)) != len(tokens):
        raise CheckpointError(f"{path}: tokenizer.ggml.tokens has duplicate entries")
    bad = [m for m in merges if len(m) != 2]
    if bad:
        raise CheckpointError(f"{path}: tokenizer.ggml.merges entry {' '.join(bad[0])!r} is not 'left right'")
    vocab = {t: i for i, t in enumerate(tokens)}
    try:
        tk = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    except Exception as e:  # tokenizers raises its own exception type for merges outside the vocabulary
        raise CheckpointError(f"{path}: tokenizer vocabulary and merges do not fit together: {e}") from e
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
    tk.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    types = read_field(reader, "tokenizer.ggml.token_type", path, None)
    if types is not None:
        special = [tokenizers.AddedToken(tokens[i], special=True, normalized=False)
                   for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)]
        tk.add_special_tokens(special)
    bos = read_field(reader, "tokenizer.ggml.bos_token_id", path, None)
    eos = read_field(reader, "tokenizer.ggml.eos_token_id", path, None)
    if read_field(reader, "tokenizer.ggml.add_bos_token", path, False):
        if bos is None:
            raise CheckpointError(f"{path}: tokenizer.ggml.add_bos_token is set but bos_token_id is missing")
        tk.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B",
                                                          special_tokens=[(tokens[bos], int(bos))])
    return Tokenizer(tk, bos_id=None if bos is None else int(bos), eos_id=None if eos is None else int(eos),
                     source=str(path))


def read_tensor(names: dict[str, Any], spec: TensorSpec, path: Path, config: ModelConfig, permuted: bool
                ) -> tuple[np.ndarray, str]:
    """The float32 array of ``spec`` in checkpoint layout and where it came from; q/k rows un-permuted when the
    converter ``permuted`` them (`ARCHITECTURES`)."""
    where = f"{path}: tensor {spec.gguf}"
    if spec.gguf not in names:
        raise CheckpointError(f"{where} is missing")
    w = _dequantize(names[spec.gguf], path)
    if permuted and spec.rope is not None:
        n = config.n_heads if spec.rope == "q" else config.n_kv_heads
        if w.shape[0] != n * config.head_dim:
            raise CheckpointError(f"{where} has {w.shape[0]} rows; {n} heads x {config.head_dim} expected")
        w = unpermute_rope_rows(w, n)
    return w, where


def load_gguf(path: str | Path, *, dtype: str = "float32", param_dtype: str = "float32", mesh: Any = None,
              rules: Any = None, packed: bool = False, gemm: str = "auto", backend: str | None = None
              ) -> tuple[Llama, Tokenizer]:
    """`Llama` (weights dequantized to ``param_dtype``) and `Tokenizer` of a GGUF file; with ``mesh``, every
    parameter is read slice by slice into its shards (`jaxlowfp.models.common.build_model`, ``rules`` as there).

    ``packed=True``: the NVFP4 / MXFP4 projections are `jaxlowfp.ptq.PackedLinear` layers on the GEMM backend `gemm`
    (`jaxlowfp.backends`; ``backend=`` is its deprecated name; module docstring; no float copy of them is made), the
    other tensors dequantized as without it; a file with no such tensor raises. With ``mesh``, the packed arrays are
    placed as their kernel's rule places ``W'`` (`jaxlowfp.sharding.packed_shardings`)."""
    gemm = renamed_kwarg("models.gguf_loader.load_gguf", "backend", backend, "gemm", gemm, "auto")
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file")
    reader = open_reader(path)
    config = read_config(reader, path, dtype=dtype, param_dtype=param_dtype)
    tokenizer = read_tokenizer(reader, path)
    tokenizer.check_fits(config.vocab, str(path))
    names = {t.name: t for t in reader.tensors}
    permuted = ARCHITECTURES[read_field(reader, "general.architecture", path)]

    packs: dict[str, Any] = {}

    def fetch(spec: TensorSpec) -> LazyTensor | None:
        where = f"{path}: tensor {spec.gguf}"
        if spec.gguf not in names:
            raise CheckpointError(f"{where} is missing")
        tensor, heads = names[spec.gguf], None
        if permuted and spec.rope is not None:
            heads = config.n_heads if spec.rope == "q" else config.n_kv_heads
            if _shape(tensor)[0] != heads * config.head_dim:
                raise CheckpointError(f"{where} has {_shape(tensor)[0]} rows; {heads} heads x {config.head_dim} "
                                      "expected")
        scale = names.get(spec.gguf.replace(".weight", ".scale")) if spec.gguf.endswith(".weight") else None
        if packed and spec.transpose and tensor.tensor_type.name in PACKED_TYPES:
            packs[spec.path.rsplit("/", 1)[0]] = packed_weight(tensor, path, heads, scale)
            return None  # the module is replaced by a PackedLinear: its float kernel is never made
        lazy = _lazy(tensor, path, heads)
        if scale is None:
            return lazy
        # NVFP4's per-tensor decode scale (llama.cpp multiplies it into the matmul output): elementwise, so every
        # slice is scaled exactly as the whole tensor would be
        g = decode_scale(scale, path)
        return LazyTensor(lazy.shape, lazy.where, lambda index, read=lazy.read: read(index) * g)  # type: ignore[misc]

    used = {s.gguf for s in tensor_specs(config)} | {"rope_freqs.weight"}
    used |= {n.replace(".weight", ".scale") for n in used if n.endswith(".weight")}
    extra = sorted(set(names) - used)
    if extra:
        raise CheckpointError(f"{path}: tensors this model class does not have: {', '.join(extra[:5])}"
                              f"{' ...' if len(extra) > 5 else ''} (an unsupported architecture variant?)")
    model = build_model(config, fetch, path, mesh=mesh, rules=rules)
    if packed:
        if not packs:
            types = sorted({t.tensor_type.name for t in reader.tensors})
            raise CheckpointError(f"{path}: packed=True keeps {' / '.join(PACKED_TYPES)} projections as codes and "
                                  f"scales; this file has none (tensor types {', '.join(types)}). Load it without "
                                  f"packed=")
        install_packed(model, packs, gemm=gemm, source=path, mesh=mesh, rules=rules)
    return model, tokenizer

