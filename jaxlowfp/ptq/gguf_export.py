"""Export of a PTQ'd `jaxlowfp.models.Llama` as a llama.cpp GGUF file: NVFP4 (GGUF type 40) and MXFP4 (type 39).

Layout (ggml-org/llama.cpp: ``ggml/src/ggml-common.h`` ``block_nvfp4`` / ``block_mxfp4``, ``gguf-py/gguf/quants.py``
``NVFP4`` / ``MXFP4`` (the ``gguf`` 0.19 numpy dequantizers), ``conversion/base.py: _nvfp4_pack`` and
``src/llama-model.cpp`` (the optional ``<tensor>.scale`` tensors))::

    NVFP4  per 64 inputs of a row, 36 bytes: 4 UE4M3 scale bytes (the E4M3 byte, sign 0), then for each of the four
           16-value groups 8 bytes, byte j = code j | code (j + 8) << 4   (code = sign << 3 | E2M1 index)
           w = E2M1(code) * s;  the per-tensor decode scale S_dec is a separate F32 tensor ``blk.N.<t>.scale`` [1]
           that llama.cpp multiplies into the matmul output: y = (x . (q * s)) * S_dec
    MXFP4  per 32 inputs, 17 bytes: the E8M0 exponent byte e (2^(e - 127)), then byte j = code j | code (j + 16) << 4

so the weights llama.cpp computes with are ``(q * s) * S_dec``, ours bit for bit (convention "jaxlowfp"; a
"compressed-tensors" checkpoint decodes ``q * (s / g)``, which may differ in the last bit). Four Over Six only
chooses each block's E4M3 scale: the file needs nothing llama.cpp lacks. Tensor names, the q/k row permutation of
the ``llama`` architecture (``convert_hf_to_gguf.py: LlamaModel.permute``, undone by
`jaxlowfp.models.gguf_loader.unpermute_rope_rows`) and the metadata follow llama.cpp's converter. Layers kept in high
precision, layers whose input size is not a multiple of the block (64 for NVFP4), norms and embeddings are F32.
The tokenizer and the other metadata are copied from a source GGUF, or built from a ``tokenizer.json``.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from jaxlowfp import mx
from jaxlowfp._core.checks import optional_module
from jaxlowfp.ptq import serving
from jaxlowfp.ptq.api import PTQResult
from jaxlowfp.ptq.layers import require_linear



def _gguf():
    """The ``gguf`` package (the ``jaxlowfp[models]`` extra), imported on use so `jaxlowfp.ptq` does not need it."""
    return optional_module("gguf", extra="models", feature="GGUF export")

NVFP4_BLOCK = 64  # values per GGUF NVFP4 super-block
MXFP4_BLOCK = 32
_SKIP_KEYS = ("GGUF.", "general.architecture", "general.file_type", "general.alignment")
_ARCH = {"llama": True, "qwen2": False, "qwen3": False}  # architecture -> q/k rows permuted


@dataclasses.dataclass(frozen=True)
class GGUFReport:
    """What `export_gguf` wrote: the file, {tensor name: GGUF type name}, and bits per parameter of the file's
    tensors."""

    path: Path
    types: dict[str, str]
    bits_per_parameter: float

    def __str__(self) -> str:
        counts: dict[str, int] = {}
        for t in self.types.values():
            counts[t] = counts.get(t, 0) + 1
        return (f"wrote {self.path}: {self.bits_per_parameter:.3f} bits per parameter; tensors by type "
                f"{dict(sorted(counts.items()))}")


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


def _copy_metadata(writer: Any, source: Path) -> None:
    gguf = _gguf()
    reader = gguf.GGUFReader(source)
    for key, field in reader.fields.items():
        if key.startswith(_SKIP_KEYS):
            continue
        vt = field.types[0]
        sub = field.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vt, sub)


def _config_metadata(writer: Any, cfg: Any, tokenizer_json: Path, pre: str) -> None:
    """Hyperparameters from the `ModelConfig` and a byte-level BPE tokenizer from ``tokenizer.json``."""
    gguf = _gguf()
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.d_model)
    writer.add_block_count(cfg.n_layers)
    writer.add_feed_forward_length(cfg.d_ff)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_vocab_size(cfg.vocab)
    tj = json.loads(Path(tokenizer_json).read_text())
    model = tj.get("model", {})
    if model.get("type") != "BPE":
        raise ValueError(f"{tokenizer_json}: tokenizer model {model.get('type')!r}; only byte-level BPE is written")
    vocab = dict(model["vocab"])
    added = {t["content"]: (t["id"], t.get("special", False)) for t in tj.get("added_tokens", [])}
    for tok, (i, _) in added.items():
        vocab[tok] = i
    n = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [gguf.TokenType.UNUSED] * n
    for tok, i in vocab.items():
        tokens[i] = tok
        types[i] = gguf.TokenType.NORMAL
    for tok, (i, special) in added.items():
        types[i] = gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)


def export_gguf(model: nnx.Module, result: PTQResult | None, path: str | Path, *, source_gguf: str | Path | None = None,
                tokenizer_json: str | Path | None = None, pre: str = "default", bos_id: int | None = None,
                eos_id: int | None = None, float32: bool = False, name: str | None = None) -> GGUFReport:
    """Write a `jaxlowfp.models.Llama` after `jaxlowfp.ptq.quantize` as a GGUF file (module docstring).

    NVFP4 layers become type 40 (plus their ``.scale`` tensor), MXFP4 layers type 39; everything else F32.
    ``float32=True`` writes every tensor as F32 (the model's values as they are: the control file with the same
    weights). Metadata and tokenizer: copied from `source_gguf` (e.g. the file the model was loaded from), or built
    from the config and `tokenizer_json` (byte-level BPE; `pre` is llama.cpp's pre-tokenizer name).
    """
    from jaxlowfp.models import Llama
    from jaxlowfp.models.common import tensor_specs

    gguf = _gguf()
    if not isinstance(model, Llama):
        raise TypeError(f"export_gguf writes a jaxlowfp.models.Llama; got {type(model).__name__}")
    if result is not None and not isinstance(result, PTQResult):
        raise TypeError(f"result must be a PTQResult or None; got {type(result).__name__}")
    if (source_gguf is None) == (tokenizer_json is None):
        raise ValueError("give exactly one of source_gguf (metadata and tokenizer copied) or tokenizer_json")
    cfg = model.config
    arch = "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"
    schemes = {} if result is None or float32 else result.schemes
    require_linear(model, schemes, "export_gguf")
    bad = {p: s.weight.name for p, s in schemes.items() if s.weight.kind not in ("nvfp4", "mxfp4")}
    if bad:
        raise ValueError(f"GGUF has no type for the weight formats {sorted(set(bad.values()))} (layers "
                         f"{list(bad)[:3]}); allowed: NVFP4, MXFP4 (or float32=True)")
    path = Path(path)
    writer = gguf.GGUFWriter(path, arch)
    if source_gguf is not None:
        _copy_metadata(writer, Path(source_gguf))
    else:
        _config_metadata(writer, cfg, Path(tokenizer_json), pre)
        if bos_id is not None:
            writer.add_bos_token_id(bos_id)
        if eos_id is not None:
            writer.add_eos_token_id(eos_id)
    if name is not None:
        writer.add_name(name)
    kinds = {s.weight.kind for s in schemes.values()}
    ftype = (gguf.LlamaFileType.MOSTLY_NVFP4 if kinds == {"nvfp4"} else gguf.LlamaFileType.MOSTLY_MXFP4_MOE
             if kinds == {"mxfp4"} else gguf.LlamaFileType.ALL_F32)
    writer.add_file_type(int(ftype))
    params = {"/".join(map(str, p)): v for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)}
    types: dict[str, str] = {}
    bits = 0
    n_params = 0
    for spec in tensor_specs(cfg):
        value = np.asarray(params[spec.path][...], np.float32)
        n_params += value.size
        w = value.T if spec.transpose else value
        n_rope = None
        if _ARCH[arch] and spec.rope is not None:
            n_rope = cfg.n_heads if spec.rope == "q" else cfg.n_kv_heads
        mod = spec.path.rsplit("/", 1)[0]
        sch = schemes.get(mod) if spec.path.endswith("/kernel") else None
        if sch is not None and sch.weight.kind == "nvfp4" and w.shape[1] % NVFP4_BLOCK == 0:
            arr, s_enc = result.packed[mod]
            if not np.array_equal(np.asarray(serving.decode(arr, s_enc, result.convention)), w):
                raise ValueError(f"{mod}: the model's kernel is not the packed NVFP4 weight")
            codes, scales = np.asarray(arr.codes), np.asarray(arr.scales)
            if sch.weight.rows > 1:
                scales = np.repeat(scales, sch.weight.rows, axis=0)
            if n_rope is not None:
                codes, scales = permute_rope_rows(codes, n_rope), permute_rope_rows(scales, n_rope)
            raw = nvfp4_bytes(codes, scales)
            writer.add_tensor(spec.gguf, raw, raw_dtype=gguf.GGMLQuantizationType.NVFP4)
            scale = np.asarray([np.float32(arr.global_scale)], np.float32)
            writer.add_tensor(spec.gguf.replace(".weight", ".scale"), scale)
            types[spec.gguf], types[spec.gguf.replace(".weight", ".scale")] = "NVFP4", "F32"
            bits += raw.nbytes * 8 + 32
            continue
        if n_rope is not None:
            w = permute_rope_rows(w, n_rope)
        if sch is not None and sch.weight.kind == "mxfp4" and w.shape[1] % MXFP4_BLOCK == 0:
            raw = mxfp4_bytes(w)
            writer.add_tensor(spec.gguf, raw, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            types[spec.gguf] = "MXFP4"
            bits += raw.nbytes * 8
            continue
        w = np.ascontiguousarray(w, np.float32)
        writer.add_tensor(spec.gguf, w)
        types[spec.gguf] = "F32"
        bits += w.nbytes * 8
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFReport(path=path, types=types, bits_per_parameter=bits / n_params)
