"""The tokenizer of a GGUF file written by `jaxlowfp.ptq.gguf_export.export_gguf`, built from a ``tokenizer.json``
(or a `jaxlowfp.models.Tokenizer`): byte-level BPE (llama.cpp's ``gpt2`` tokenizer model) with its merges, one token
per embedding row, llama.cpp's pre-tokenizer name found from the pre-tokenizer's regexes (SmolLM2's: ``smollm``;
``convert_hf_to_gguf.py: get_vocab_base_pre`` and ``src/llama-vocab.cpp`` name them, `PRE_NAMES`), the chat
template and ``add_bos_token`` from ``tokenizer_config.json`` / the post-processor.

Refused: a tokenizer that is not byte-level BPE, has no merges, or whose pre-tokenizer llama.cpp does not name.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxlowfp._core.checks import optional_module
from jaxlowfp._core.pretokenizers import PRE_TOKENIZERS  # the regexes llama.cpp applies

__all__ = ["PRE_NAMES", "pre_tokenizer_name", "tokenizer_metadata"]

# llama.cpp pre-tokenizer names (src/llama-vocab.cpp) whose regexes jaxlowfp._core.pretokenizers knows, in the
# order they are tried when the pre-tokenizer's regexes are matched ("default" is not one: llama.cpp splits it
# with regexes of its own, which the reader does not reproduce; SmolLM2 written as "default" tokenized otherwise
# than the original file in 3 of 5 texts, issue 31)
PRE_NAMES = ("smollm", "qwen2", "llama-bpe", "gpt-2", "starcoder", "refact")


def _pre_pieces(pt: Any) -> tuple[str, ...] | None:
    """The regexes a ``tokenizers`` pre-tokenizer (its JSON) splits with, in order; None where it does something
    else (then llama.cpp has no name for it)."""

    gpt2 = PRE_TOKENIZERS["gpt-2"][0]
    if pt is None:
        return None
    kind = pt.get("type")
    if kind == "Sequence":
        out: list[str] = []
        for p in pt.get("pretokenizers", []):
            sub = _pre_pieces(p)
            if sub is None:
                return None
            out += sub
        return tuple(out)
    if kind == "ByteLevel":
        return (gpt2,) if pt.get("use_regex", True) else ()
    if kind == "Digits":
        return (r"\p{N}",) if pt.get("individual_digits") else (r"\p{N}+",)
    if kind == "Split" and isinstance(pt.get("pattern"), dict) and "Regex" in pt["pattern"] \
            and pt.get("behavior") == "Isolated" and not pt.get("invert"):
        return (pt["pattern"]["Regex"],)
    return None


def _is_byte_level(pt: Any) -> bool:
    if not isinstance(pt, dict):
        return False
    if pt.get("type") == "ByteLevel":
        return True
    return pt.get("type") == "Sequence" and any(_is_byte_level(p) for p in pt.get("pretokenizers", []))


def pre_tokenizer_name(tj: Mapping[str, Any], where: str) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for a ``tokenizer.json`` (module docstring); ValueError if none fits."""

    pieces = _pre_pieces(tj.get("pre_tokenizer"))
    for name in PRE_NAMES:
        if pieces is not None and tuple(PRE_TOKENIZERS[name]) == pieces:
            return name
    raise ValueError(f"{where}: its pre-tokenizer ({json.dumps(tj.get('pre_tokenizer'))[:200]}) is none that "
                     f"llama.cpp names among {', '.join(PRE_NAMES)}; pass pre= explicitly if you know it")


def tokenizer_metadata(writer: Any, tokenizer: Any, vocab_rows: int, *, pre: str | None, bos_id: int | None,
                       eos_id: int | None, add_bos: bool | None, chat_template: str | None) -> list[str]:
    """Write a byte-level BPE tokenizer from a ``tokenizer.json`` path or a `jaxlowfp.models.Tokenizer` (module
    docstring) with the ``gguf.GGUFWriter`` `writer`, one token per embedding row (`vocab_rows`); returns notes
    for the export report."""

    gguf = optional_module("gguf", extra="models", feature="GGUF export")
    tok_cfg: dict[str, Any] = {}
    if hasattr(tokenizer, "tokenizer") and hasattr(tokenizer.tokenizer, "to_str"):  # a jaxlowfp Tokenizer
        tj, where = json.loads(tokenizer.tokenizer.to_str()), f"tokenizer ({tokenizer.source})"
        bos_id = tokenizer.bos_id if bos_id is None else bos_id
        eos_id = tokenizer.eos_id if eos_id is None else eos_id
    else:
        where = str(tokenizer)
        tj = json.loads(Path(tokenizer).read_text())
        cfg_path = Path(tokenizer).with_name("tokenizer_config.json")
        tok_cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    model = tj.get("model", {})
    if model.get("type") != "BPE" or not _is_byte_level(tj.get("pre_tokenizer")):
        raise ValueError(f"{where}: tokenizer model {model.get('type')!r} with pre-tokenizer "
                         f"{(tj.get('pre_tokenizer') or {}).get('type')!r}; only byte-level BPE is written (llama.cpp "
                         f"'gpt2' tokenizer model)")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    if not merges:
        raise ValueError(f"{where}: the BPE tokenizer has no merges; llama.cpp refuses a 'gpt2' vocabulary without "
                         f"tokenizer.ggml.merges")
    if pre is None:
        pre = pre_tokenizer_name(tj, where)
    elif pre not in PRE_NAMES:
        raise ValueError(f"pre={pre!r} is not a llama.cpp pre-tokenizer name this exporter knows; allowed: "
                         f"{', '.join(map(repr, PRE_NAMES))} (or None: found from the tokenizer)")
    elif _pre_pieces(tj.get("pre_tokenizer")) != tuple(PRE_TOKENIZERS[pre]):
        raise ValueError(f"{where}: pre={pre!r} splits text with other regexes than this tokenizer's; llama.cpp "
                         f"would tokenize differently (pre=None finds the name)")
    vocab = dict(model["vocab"])
    added = {t["content"]: (t["id"], t.get("special", False)) for t in tj.get("added_tokens", [])}
    for tok, (i, _) in added.items():
        vocab[tok] = i
    n = max(vocab.values()) + 1
    if n > vocab_rows:
        raise ValueError(f"{where}: token ids go up to {n - 1}, the model's embedding has {vocab_rows} rows")
    tokens = [f"[PAD{i}]" for i in range(vocab_rows)]  # llama.cpp needs one token per embedding row
    types = [gguf.TokenType.UNUSED] * vocab_rows
    for tok, i in vocab.items():
        tokens[i] = tok
        types[i] = gguf.TokenType.NORMAL
    for i, special in added.values():
        types[i] = gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED

    def token_id(name: str, given: int | None) -> int | None:
        if given is not None:
            return int(given)
        t = tok_cfg.get(f"{name}_token")
        t = t.get("content") if isinstance(t, dict) else t
        return vocab.get(t) if isinstance(t, str) else None

    bos_id, eos_id = token_id("bos", bos_id), token_id("eos", eos_id)
    if add_bos is None:
        post = tj.get("post_processor") or {}
        first = (post.get("single") or [{}])[0] if post.get("type") == "TemplateProcessing" else {}
        add_bos = bool(tok_cfg.get("add_bos_token", "SpecialToken" in first))
    if add_bos and bos_id is None:
        raise ValueError(f"{where}: add_bos is set but no BOS token id is known; pass bos_id=")
    template = chat_template if chat_template is not None else tok_cfg.get("chat_template")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_add_bos_token(bool(add_bos))
    if bos_id is not None:
        writer.add_bos_token_id(bos_id)
    if eos_id is not None:
        writer.add_eos_token_id(eos_id)
    if isinstance(template, str):
        writer.add_chat_template(template)
    return [f"tokenizer: pre {pre!r}, add_bos {bool(add_bos)}, chat template "
            f"{'written' if isinstance(template, str) else 'none given'}"]
