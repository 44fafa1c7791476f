"""The pre-tokenizer regexes of byte-level BPE vocabularies, by llama.cpp's ``tokenizer.ggml.pre`` name (from
llama.cpp's ``src/llama-vocab.cpp``): what `jaxlowfp.models.gguf_loader` splits text with when it reads a GGUF
tokenizer, and what `jaxlowfp.ptq.gguf_export` matches a ``tokenizer.json`` against when it writes one.
"""
from __future__ import annotations

__all__ = ["PRE_TOKENIZERS"]

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regexes llama.cpp splits with (llama-vocab.cpp), applied in order
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2,),
    "gpt2": (_GPT2,),
    "gpt-2": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2),
    "starcoder": (r"\p{N}", _GPT2),
    "refact": (r"\p{N}", _GPT2),
    "qwen2": (_QWEN2,),
    "llama-bpe": (_LLAMA3,),
}
