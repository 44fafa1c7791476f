"""Export of a PTQ'd model as a llama.cpp GGUF file: NVFP4 (GGUF type 40) and MXFP4 (type 39).

The model says what the file holds (`jaxlowfp.ptq.protocol`: ``export_tensors("gguf")``, ``export_config("gguf")``;
`jaxlowfp.models.Llama` implements it, `jaxlowfp.models.export`), so any NNX model that does exports.

Layout (ggml-org/llama.cpp: ``ggml/src/ggml-common.h`` ``block_nvfp4`` / ``block_mxfp4``, ``gguf-py/gguf/quants.py``
``NVFP4`` / ``MXFP4`` (the ``gguf`` 0.19 numpy dequantizers), ``conversion/base.py: _nvfp4_pack`` and
``src/llama-model.cpp`` (the optional ``<tensor>.scale`` tensors))::

    NVFP4  per 64 inputs of a row, 36 bytes: 4 UE4M3 scale bytes (the E4M3 byte, sign 0), then for each of the four
           16-value groups 8 bytes, byte j = code j | code (j + 8) << 4   (code = sign << 3 | E2M1 index)
           w = E2M1(code) * s;  the per-tensor decode scale S_dec is a separate F32 tensor ``blk.N.<t>.scale`` [1]
           that llama.cpp multiplies into the matmul output: y = (x . (q * s)) * S_dec
    MXFP4  per 32 inputs, 17 bytes: the E8M0 exponent byte e (2^(e - 127)), then byte j = code j | code (j + 16) << 4

so the weights llama.cpp computes with are ``(q * s) * S_dec``, ours bit for bit (convention "jaxlowfp"; up to
the sign of zero: a -0.0 weight reads back as +0.0 where its code is the negative zero). Four Over Six only chooses
each block's E4M3 scale: the file needs nothing llama.cpp lacks. Tensors that stay in high precision are written
as ``dtype`` (by default the dtype the model was quantized and evaluated in, `PTQResult.dtype`: float32 unless
`jaxlowfp.ptq.quantize_model` was given another; F16 without a PTQ result, as llama.cpp's converter does), 1-D
tensors (norms, biases,
``rope_freqs``) always F32; the report counts the values that rounding to ``dtype`` changed. With a
``source_gguf``, a high-precision tensor whose values are exactly what the source's quantized tensor decodes to
(a model loaded from that file and not changed there, e.g. SmolLM2's Q4_1 embedding) is copied in the source's
encoding: lossless and as small as the source.

A packed model (`jaxlowfp.ptq.pack_model`) writes the file of the model it was packed from, byte for byte (NVFP4 layers
from their own codes and scales, never decoded). After writing, the tensor index written to the header is checked: a
quantized layer of the result missing from it raises, and nothing is written.

Refused (nothing is written): a NaN / Inf in any tensor (or one that overflows ``dtype``); a W4A4 result without
``weights_only=True`` (GGUF has no activation quantization: llama.cpp would run the layers with high-precision
inputs); a result quantized in the compressed-tensors convention without ``allow_reordered_decode=True`` (llama.cpp
decodes ``(q * s) * S_dec``, 1 ulp off ``q * (s / g)`` for about a quarter of the weights); a ``source_gguf`` whose
architecture, hyperparameters, tensor names / shapes or vocabulary differ from the model's; a tokenizer llama.cpp
cannot represent (not byte-level BPE, no merges, a pre-tokenizer it does not name); files a consumer is known to
misrun (`jaxlowfp.ptq.known_gaps`, ``allow_known_gaps=True`` to override); a quantized layer of the result that no
tensor of the model's ``export_tensors("gguf")`` writes.

The tokenizer and the other metadata are copied from a source GGUF, or built from a ``tokenizer.json`` (or a
`jaxlowfp.models.Tokenizer`) by `jaxlowfp.ptq.gguf_tokenizer`: byte-level BPE, llama.cpp's pre-tokenizer name found
from the pre-tokenizer's regexes, the chat template and ``add_bos_token``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxlowfp import mx
from jaxlowfp._core.checks import optional_module
from jaxlowfp._core.gguf_read import open_reader
from jaxlowfp.ptq import checks, known_gaps, serving, stream
from jaxlowfp.ptq.api import PTQResult
from jaxlowfp.ptq.export_layout import PackedView, check_finite_param, export_params, same_packed_nvfp4
from jaxlowfp.ptq.gguf_tokenizer import PRE_NAMES, pre_tokenizer_name  # noqa: F401  (their old home: re-exported)
from jaxlowfp.ptq.gguf_tokenizer import tokenizer_metadata
from jaxlowfp.ptq.layers import require_linear
from jaxlowfp.ptq.protocol import require_exportable


def _gguf():
    """The ``gguf`` package (the ``jaxlowfp[models]`` extra), imported on use so `jaxlowfp.ptq` does not need it."""
    return optional_module("gguf", extra="models", feature="GGUF export")


NVFP4_BLOCK = 64  # values per GGUF NVFP4 super-block
MXFP4_BLOCK = 32
DTYPES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}  # dtype= -> GGUF type of high-precision tensors
_SKIP_KEYS = ("GGUF.", "general.architecture", "general.file_type", "general.alignment")


@dataclasses.dataclass(frozen=True)
class GGUFReport:
    """What `export_gguf` wrote.

    path:               the file
    types:              {tensor name: GGUF type name}
    bits_per_parameter: stored bits of the file's tensors / parameters of the model
    dtype:              the type of the high-precision tensors of 2 or more dimensions ("F16", "BF16", "F32")
    rounded:            high-precision values that rounding to `dtype` changed, and how many were written
    notes:              known gaps of consumers that the file hits (warnings), tokenizer facts
    """

    path: Path
    types: dict[str, str]
    bits_per_parameter: float
    dtype: str = "F32"
    rounded: tuple[int, int] = (0, 0)
    notes: tuple[str, ...] = ()

    def __str__(self) -> str:
        counts: dict[str, int] = {}
        for t in self.types.values():
            counts[t] = counts.get(t, 0) + 1
        lines = [f"wrote {self.path}: {self.bits_per_parameter:.3f} bits per parameter; tensors by type "
                 f"{dict(sorted(counts.items()))}; high precision in {self.dtype} ({self.rounded[0]} of "
                 f"{self.rounded[1]} values rounded)"]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def permute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``permute`` of q/k rows (rotate-half pairs -> adjacent pairs); works on any row payload
    (float rows, packed codes, scales)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def nvfp4_bytes(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """GGUF NVFP4 rows (uint8 [out, in / 64 * 36]) from our packed codes [out, in / 2] (element 2j in the low
    nibble) and E4M3 block scales [out, in / 16]."""
    out, half = codes.shape
    k = 2 * half
    if k % NVFP4_BLOCK:
        raise ValueError(f"GGUF NVFP4 needs rows of a multiple of {NVFP4_BLOCK} values; got {k}")
    nib = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(out, k // 16, 16)
    qs = (nib[..., :8] | (nib[..., 8:] << 4)).astype(np.uint8).reshape(out, k // 64, 32)
    d = np.ascontiguousarray(scales).view(np.uint8).reshape(out, k // 64, 4)
    if ((d & 0x80) != 0).any() or (d == 0x7F).any():
        raise ValueError("NVFP4 block scales must be finite and non-negative for GGUF (UE4M3)")
    return np.concatenate([d, qs], axis=-1).reshape(out, k // 64 * 36)


def mxfp4_bytes(w: np.ndarray) -> np.ndarray:
    """GGUF MXFP4 rows (uint8 [out, in / 32 * 17]) of a float32 weight [out, in] whose blocks are already MXFP4
    values: re-quantized with `jaxlowfp.mx` (exact for such values) and checked."""
    out, k = w.shape
    q = mx.quantize(w, format="e2m1")
    back = np.asarray(mx.dequantize(q, np.float32))
    if not np.array_equal(back, w):
        raise ValueError("the weight is not an MXFP4 tensor (its re-quantization changed values)")
    codes = np.asarray(q.codes)
    nib = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(out, k // 32, 32)
    qs = (nib[..., :16] | (nib[..., 16:] << 4)).astype(np.uint8)
    e = np.asarray(q.scales).view(np.uint8).reshape(out, k // 32, 1)  # the E8M0 byte: 2^(e - 127)
    return np.concatenate([e, qs], axis=-1).reshape(out, k // 32 * 17)


class _Calls:
    """Records ``writer.add_*(...)`` calls, to replay on the real writer once every check has passed."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: self.calls.append((name, a, k))

    def replay(self, writer: Any) -> None:
        for name, a, k in self.calls:
            getattr(writer, name)(*a, **k)


class _Host:
    """A parameter whose ``[...]`` is its host value (`jaxlowfp.ptq.stream.fetch`: one tensor's shards)."""

    def __init__(self, var: Any) -> None:
        self.var = var

    def __getitem__(self, key: Any) -> np.ndarray:
        return stream.fetch(self.var[...])[key]


def _value_type(v: Any) -> Any:
    gguf = _gguf()
    if isinstance(v, bool):
        return gguf.GGUFValueType.BOOL
    if isinstance(v, (int, np.integer)):
        return gguf.GGUFValueType.UINT32
    if isinstance(v, (float, np.floating)):
        return gguf.GGUFValueType.FLOAT32
    if isinstance(v, str):
        return gguf.GGUFValueType.STRING
    raise TypeError(f"GGUF metadata value {v!r} ({type(v).__name__}): allowed str, bool, int, float or lists of them")


def _add_metadata(writer: Any, meta: Mapping[str, Any]) -> None:
    for key, v in meta.items():
        if isinstance(v, (list, tuple)):
            writer.add_array(key, list(v))
        else:
            writer.add_key_value(key, v, _value_type(v))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return np.float32(a) == np.float32(b)
    return a == b


def _check_source(reader: Any, source: Path, arch: str, meta: Mapping[str, Any], shapes: Mapping[str, tuple],
                  vocab_rows: int | None) -> None:
    """Refuse a source GGUF that describes another model: architecture, hyperparameters, tensor names and shapes,
    vocabulary size."""
    src_arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else None
    if src_arch != arch:
        raise ValueError(f"source_gguf {source}: architecture {src_arch!r}, the model's is {arch!r}; its metadata "
                         f"would describe another model")
    diff = [f"{k}: {reader.fields[k].contents()!r} there, {v!r} here" for k, v in meta.items()
            if k in reader.fields and not _same(reader.fields[k].contents(), v)]
    if diff:
        raise ValueError(f"source_gguf {source}: its hyperparameters differ from the model's ({'; '.join(diff[:4])})")
    src = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    skip = lambda n: n.endswith(".scale")  # noqa: E731  (per-tensor NVFP4 scales: ours, not the source's)
    missing = sorted(n for n in shapes if n not in src and not skip(n))
    extra = sorted(n for n in src if n not in shapes and not skip(n))
    bad = [f"{n} {src[n]} there, {shapes[n]} here" for n in shapes if n in src and src[n] != shapes[n]]
    if missing or extra or bad:
        raise ValueError(f"source_gguf {source} does not hold this model's tensors: missing there {missing[:3]}, "
                         f"extra there {extra[:3]}, other shapes {bad[:3]}")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None and vocab_rows is not None and len(tokens) != vocab_rows:
        raise ValueError(f"source_gguf {source}: its vocabulary has {len(tokens)} tokens, the model's "
                         f"embedding {vocab_rows} rows; llama.cpp refuses such a file")


def _same_values(src: Any, w: np.ndarray) -> bool:
    """Whether a source GGUF tensor decodes (``gguf``'s dequantizer) to exactly `w`, bit for bit."""
    shape = tuple(int(n) for n in reversed(src.shape))
    if shape != tuple(w.shape):
        return False
    back = np.asarray(_gguf().quants.dequantize(src.data, src.tensor_type), np.float32).reshape(shape)
    return bool(np.array_equal(back.view(np.uint32), np.ascontiguousarray(w, np.float32).view(np.uint32)))


def _copy_metadata(writer: Any, reader: Any, meta: Mapping[str, Any]) -> None:
    """The source's metadata (its tokenizer, chat template, names), then the model's keys the source lacks."""
    gguf = _gguf()
    for key, field in reader.fields.items():
        if key.startswith(_SKIP_KEYS):
            continue
        vt = field.types[0]
        sub = field.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vt, sub)
    _add_metadata(writer, {k: v for k, v in meta.items() if k not in reader.fields})


def export_gguf(model: nnx.Module, result: PTQResult | None, path: str | Path, *, source_gguf: str | Path | None = None,
                tokenizer_json: Any = None, pre: str | None = None, bos_id: int | None = None,
                eos_id: int | None = None, add_bos: bool | None = None, chat_template: str | None = None,
                float32: bool = False, dtype: str | None = None, weights_only: bool = False,
                allow_reordered_decode: bool = False, allow_known_gaps: bool = False,
                name: str | None = None, overwrite: bool = False) -> GGUFReport:
    """Write a model (after `jaxlowfp.ptq.quantize`, or `result=None`) as a GGUF file (module docstring).

    NVFP4 layers become type 40 (plus their ``.scale`` tensor), MXFP4 layers type 39; other tensors of two or more
    dimensions `dtype` ("float16", "bfloat16" or "float32"; default None: the dtype the model was quantized and
    evaluated in, `PTQResult.dtype`, so the file is the evaluated model; float16 without a result, as llama.cpp's
    converter writes), 1-D tensors F32; a dtype other than the result's that changes any value warns that the file
    is not the evaluated model, with the count of changed values. ``float32=True`` writes every
    tensor as F32 (the model's values as they are: the control file with the same weights). Metadata and tokenizer:
    copied from `source_gguf` (checked to describe this model), or built from the model's config and
    `tokenizer_json` (a path or a `jaxlowfp.models.Tokenizer`; `pre` None: found from it, `add_bos` and
    `chat_template` None: from ``tokenizer_config.json`` next to it / its post-processor).
    `weights_only=True` writes a W4A4 result's weights alone (GGUF has no activation quantization);
    `allow_reordered_decode` and `allow_known_gaps` override the refusals of the module docstring.
    Atomic: written to a temporary sibling file, then renamed to `path`; an existing `path` is refused
    (`jaxlowfp.ptq.atomic.TargetExistsError`) unless ``overwrite=True``.
    """
    from jaxlowfp.ptq.atomic import target_check, write_atomically

    target_check(path, overwrite, "export_gguf")
    gguf = _gguf()
    if result is not None and not isinstance(result, PTQResult):
        raise TypeError(f"result must be a PTQResult or None; got {type(result).__name__}")
    if (source_gguf is None) == (tokenizer_json is None):
        raise ValueError("give exactly one of source_gguf (metadata and tokenizer copied) or tokenizer_json")
    evaluated = getattr(result, "dtype", None)  # PTQResult.dtype: what quantize_model rounded the model to
    if dtype is None:
        dtype = evaluated if evaluated is not None else "float16"
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: {', '.join(map(repr, DTYPES))} or None (the "
                         f"dtype the model was quantized in, {evaluated!r}; float16 without a result)")
    specs, config = require_exportable(model, "gguf", "export_gguf")
    arch, meta = config["architecture"], dict(config["metadata"])
    expert_schemes = {} if result is None or float32 else {p: r.scheme for p, r in result.experts.items()
                                                            if r.scheme is not None}
    w4a4 = [] if result is None else [p for p, s in {**result.schemes, **expert_schemes}.items()
                                      if s.activation is not None]
    if w4a4 and not weights_only:
        raise ValueError(f"export_gguf: layers {w4a4[:3]}{' ...' if len(w4a4) > 3 else ''} quantize their inputs "
                         f"(W4A4), which GGUF cannot say: llama.cpp would run them with high-precision activations, "
                         f"not the model you evaluated. Pass weights_only=True to write the weights alone (the file "
                         f"is then the W4A16 model), or quantize with weights_only schemes")
    schemes = {} if result is None or float32 else {p: s for p, s in result.schemes.items() if p not in expert_schemes}
    packed = {} if result is None else result.packed
    conv = "jaxlowfp" if result is None else result.arithmetic
    if schemes and conv != "jaxlowfp" and not allow_reordered_decode:
        raise ValueError(f"export_gguf: the result was quantized with arithmetic={conv!r} (weights "
                         f"decode as q * (s / g)); llama.cpp computes (q * s) * S_dec, 1 ulp off for about a quarter "
                         f"of the weights, so the file would not be the model you evaluated. Quantize with "
                         f"arithmetic='jaxlowfp' for GGUF, or pass allow_reordered_decode=True")
    require_linear(model, schemes, "export_gguf")
    bad = {p: s.weight.name for p, s in schemes.items() if s.weight.kind not in ("nvfp4", "mxfp4")}
    if bad:
        raise ValueError(f"GGUF has no type for the weight formats {sorted(set(bad.values()))} (layers "
                         f"{list(bad)[:3]}); allowed: NVFP4, MXFP4 (or float32=True)")
    hp_type = DTYPES["float32" if float32 else dtype]
    params = export_params(model)  # a packed model's packed parameters too (checkpoint.PackedView)
    covered = {t.path for t in specs if t.path is not None}
    left = sorted(set(params) - covered)
    if left:
        raise ValueError(f"export_gguf: {type(model).__name__}.export_tensors('gguf') does not write the parameters "
                         f"{left[:4]}{' ...' if len(left) > 4 else ''}; the file would not hold the whole model")
    for t in specs:  # every value finite before anything is written (the high-precision tensors too)
        if t.path is not None and t.path not in params:
            raise ValueError(f"export_gguf: tensor {t.name} names parameter {t.path!r}, which the model does not have")
        if t.transform is not None and t.module in schemes:
            raise ValueError(f"export_gguf: tensor {t.name} transforms the quantized kernel of {t.module}")
        if t.path is not None:
            check_finite_param(params[t.path], f"{t.name} (parameter {t.path})")
        else:
            checks.check_finite_tensor(t.value, f"{t.name} (constant)")
    # every quantized layer of the result is written by one of the model's tensors
    unwritten = sorted({*(p for p in schemes if f"{p}/kernel" not in covered),
                        *(p for p in expert_schemes if p not in covered)})
    if unwritten:
        raise ValueError(f"export_gguf: the quantized layers {unwritten[:4]} of the PTQ result are not among the "
                         f"tensors {type(model).__name__}.export_tensors('gguf') writes; the file would miss them")

    # every tensor in file layout, decided before the file is opened
    # (name, its bytes in the spool, raw dtype or None, type name): made tensor by tensor, one on the host at a time
    # (ptq/stream.py); the spool is an unnamed temporary file, gone when closed (or collected, if a check refuses)
    spool = stream.Spool(near=path)
    planned: list[tuple[str, stream.SpoolEntry, Any, str]] = []
    shapes: dict[str, tuple] = {}
    bits = 0
    n_params = sum(int(np.prod(v.shape)) for v in params.values())
    rounded = written_hp = 0
    reader = open_reader(Path(source_gguf)) if source_gguf is not None else None  # its tensor table validated
    src_tensors = {x.name: x for x in reader.tensors} if reader is not None else {}
    notes_pre: list[str] = []
    host = {p: _Host(v) for p, v in params.items()}  # what t.array reads: a host copy per tensor, none cached
    for t in specs:
        mod = t.module
        sch = schemes.get(mod) if mod is not None else None
        view = params.get(t.path) if t.path is not None else None
        # a packed NVFP4 layer is written from its codes and scales, never decoded
        direct = (isinstance(view, PackedView) and sch is not None and sch.weight.kind == "nvfp4"
                  and t.expert is None and t.transform is None and len(view.shape) == 2)
        w: Any = None
        if direct:
            assert isinstance(view, PackedView)
            shape = tuple(view.shape[::-1]) if t.transpose else tuple(view.shape)
        else:
            w = t.array(host)
            shape = tuple(w.shape)
        shapes[t.name] = shape
        if (mod is not None and sch is not None and sch.weight.kind == "nvfp4" and len(shape) == 2
                and shape[1] % NVFP4_BLOCK == 0):
            s_enc: Any  # the device scale, then its host copy (stream.fetch), which serving.decode reads too
            arr, s_enc = packed[mod]
            checks.check_packed_nvfp4(mod, arr, s_enc)
            if direct:  # the packed model's own codes and scales, checked to be the result's
                assert isinstance(view, PackedView)
                arr, s_enc = same_packed_nvfp4(mod, view.packed, arr, s_enc)
            # host copies of this layer's codes and scales (gathered when they span processes: a collective)
            arr = jax.tree.map(stream.fetch, arr)
            s_enc = None if s_enc is None else stream.fetch(s_enc)
            if not direct and not np.array_equal(np.asarray(serving.decode(arr, s_enc, conv)), w):
                raise ValueError(f"{mod}: the model's kernel is not the packed NVFP4 weight (was the model changed "
                                 f"after quantize?)")
            codes, scales = np.asarray(arr.codes), np.asarray(arr.scales)
            if sch.weight.rows > 1:
                scales = np.repeat(scales, sch.weight.rows, axis=0)
            if t.permute_heads is not None:
                codes, scales = (permute_rope_rows(codes, t.permute_heads),
                                 permute_rope_rows(scales, t.permute_heads))
            try:
                raw = nvfp4_bytes(codes, scales)
            except ValueError as e:
                raise ValueError(f"{t.name} ({mod}): {e}") from None
            scale = np.asarray([np.float32(arr.global_scale)], np.float32)
            checks.check_finite_tensor(scale, f"{t.name}: the NVFP4 decode scale")
            planned += [(t.name, spool.put(raw), gguf.GGMLQuantizationType.NVFP4, "NVFP4"),
                        (t.name.replace(".weight", ".scale"), spool.put(scale), None, "F32")]
            shapes[t.name.replace(".weight", ".scale")] = (1,)
            bits += raw.nbytes * 8 + 32
            continue
        if w is None:
            w = t.array(host)
        if t.permute_heads is not None:
            w = permute_rope_rows(w, t.permute_heads)
        if sch is not None and sch.weight.kind == "mxfp4" and w.ndim == 2 and w.shape[1] % MXFP4_BLOCK == 0:
            raw = mxfp4_bytes(w)
            planned.append((t.name, spool.put(raw), gguf.GGMLQuantizationType.MXFP4, "MXFP4"))
            bits += raw.nbytes * 8
            continue
        if t.path in expert_schemes:  # [E, out, in]
            esch = expert_schemes[t.path]
            if esch.weight.kind not in ("nvfp4", "mxfp4"):
                raise ValueError(f"GGUF has no type for the expert weight format {esch.weight.name} ({t.path}); "
                                 f"allowed: NVFP4, MXFP4 (or float32=True)")
            if esch.weight.kind == "mxfp4" and w.ndim == 3 and w.shape[-1] % MXFP4_BLOCK == 0:
                # MXFP4 has no global scale: each expert's rows are whole MXFP4 blocks, stacked as llama.cpp's
                # MXFP4 expert tensors are (gpt-oss, LlamaFileType.MOSTLY_MXFP4_MOE)
                raw = np.stack([mxfp4_bytes(np.asarray(w[e], np.float32)) for e in range(w.shape[0])])
                planned.append((t.name, spool.put(raw), gguf.GGMLQuantizationType.MXFP4, "MXFP4"))
                bits += raw.nbytes * 8
                continue
            notes_pre.append(f"{t.name}: {esch.weight.name} experts carry one global scale each, and GGUF NVFP4 has "
                             f"one decode scale per tensor (<tensor>.scale [1]); written as F32 (the quantized values, "
                             f"exactly)")
            out = np.ascontiguousarray(w, np.float32)
            planned.append((t.name, spool.put(out), None, "F32"))
            bits += out.nbytes * 8
            continue
        src = src_tensors.get(t.name) if sch is None and not float32 else None
        if src is not None and src.tensor_type.name not in ("F32", "F16", "BF16") and _same_values(src, w):
            # the source file's own encoding of exactly these values (e.g. a Q4_1 embedding): copied, lossless
            planned.append((t.name, spool.put(np.asarray(src.data)), src.tensor_type, src.tensor_type.name))
            bits += int(np.asarray(src.data).nbytes) * 8
            continue
        if sch is not None:  # a quantized layer GGUF has no block for (its rows are not whole blocks): exact
            notes_pre.append(f"{t.name}: {sch.weight.name} rows of {w.shape[-1]} values are not whole GGUF blocks; "
                             f"written as F32 (its quantized values, exactly)")
        if w.ndim <= 1 or hp_type == "F32" or sch is not None:
            out, tname, raw_dtype = np.ascontiguousarray(w, np.float32), "F32", None
        elif hp_type == "F16":
            out, tname, raw_dtype = np.ascontiguousarray(w.astype(np.float16)), "F16", None
        else:  # BF16: gguf's own round-to-nearest-even packing (quants.quantize), written as raw bytes
            out = gguf.quants.quantize(np.ascontiguousarray(w), gguf.GGMLQuantizationType.BF16)
            tname, raw_dtype = "BF16", gguf.GGMLQuantizationType.BF16
        if tname != "F32":
            back = gguf.quants.dequantize(out, gguf.GGMLQuantizationType[tname]).reshape(w.shape)
            checks.check_finite_tensor(back, f"{t.name}: rounded to {tname}",
                                       action=f"refusing to export (its values overflow {tname}: use dtype='float32'"
                                              f"{'' if tname == 'BF16' else ' or bfloat16'})")
            rounded += int(np.sum(back != w))
            written_hp += w.size
        planned.append((t.name, spool.put(out), raw_dtype, tname))
        bits += out.nbytes * 8
    types = {n: tn for n, _, _, tn in planned}
    notes = notes_pre + known_gaps.check("gguf", arch, types, {p: False for p in schemes},
                                         allow_known_gaps=allow_known_gaps, caller="export_gguf")
    vocab_rows = shapes.get("token_embd.weight", (None,))[0]
    tok_calls = _Calls()  # the tokenizer's metadata, checked before the file is opened
    if reader is not None:
        _check_source(reader, Path(str(source_gguf)), arch, meta, shapes, vocab_rows)
    else:
        notes += tokenizer_metadata(tok_calls, tokenizer_json, vocab_rows if vocab_rows is not None else
                                     int(meta.get(f"{arch}.vocab_size", 0)), pre=pre, bos_id=bos_id, eos_id=eos_id,
                                     add_bos=add_bos, chat_template=chat_template)

    path = Path(path)
    atomic = write_atomically(path, overwrite, directory=False)
    tmp = atomic.__enter__()  # a temporary sibling file, renamed to path on success, deleted on an error
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        if reader is not None:
            _copy_metadata(writer, reader, meta)
        else:
            _add_metadata(writer, meta)
            tok_calls.replay(writer)
        if name is not None:
            writer.add_name(name)
        kinds = {s.weight.kind for s in schemes.values()}
        ftype = (gguf.LlamaFileType.MOSTLY_NVFP4 if kinds == {"nvfp4"} else gguf.LlamaFileType.MOSTLY_MXFP4_MOE
                 if kinds == {"mxfp4"} else {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                                             "BF16": gguf.LlamaFileType.MOSTLY_BF16}[hp_type])
        writer.add_file_type(int(ftype))
        for n, entry, raw_dtype, _ in planned:  # what add_tensor records, without the data
            writer.add_tensor_info(n, entry.shape, entry.dtype, entry.nbytes, raw_dtype=raw_dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _, entry, _, _ in planned:  # in order, one tensor at a time (the bytes write_tensors_to_file writes)
            writer.write_tensor_data(spool.get(entry))
        writer.close()
        spool.close()
        # every quantized layer of the result is in the file as written: in the tensor index written to its header
        # (checked before the temporary file is renamed: on an error it is deleted). Not read back with gguf-py's
        # reader, whose parse of every tensor made the export's peak grow with the model (test_sharded_export)
        want = {t.name for t in specs if t.module in schemes or t.path in expert_schemes}
        want |= {n.replace(".weight", ".scale") for n, _, _, tn in planned if tn == "NVFP4"}
        found = {n for n, _, _, _ in planned}
        if not want <= found:
            raise ValueError(f"export_gguf: the written file lacks the quantized tensors {sorted(want - found)[:4]}; "
                             f"nothing was written")
    except BaseException as e:
        if not atomic.__exit__(type(e), e, e.__traceback__):
            raise
    atomic.__exit__(None, None, None)
    if evaluated is not None and rounded:
        import warnings

        why = (f"dtype={dtype!r} but the model was quantized and evaluated in {evaluated!r} (PTQResult.dtype)"
               if dtype != evaluated else f"the model was changed after jaxlowfp.ptq.quantize_model (dtype {dtype!r})")
        warnings.warn(f"export_gguf: {why}: the file is not the evaluated model ({rounded} of {written_hp} "
                      f"high-precision values changed by the rounding to {hp_type}; its scores differ). Export with "
                      f"dtype=None, or quantize with dtype={dtype!r} and evaluate that", UserWarning, stacklevel=2)
    return GGUFReport(path=path, types=types, bits_per_parameter=bits / n_params, dtype=hp_type,
                      rounded=(rounded, written_hp), notes=tuple(notes))
