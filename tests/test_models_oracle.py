"""A Llama-family forward pass in numpy float64, written from the papers as the test oracle for jaxlowfp.models.llama
and the checkpoint loaders, and tests of the oracle itself.

It shares no code with train/: its own file readers (``gguf.GGUFReader`` / ``safetensors`` plus ``config.json``), its
own RoPE (complex rotation of pairs, Su et al. 2021), RMSNorm (Zhang & Sennrich 2019), SwiGLU (Shazeer 2020) and
grouped-query attention (Ainslie et al. 2023), one sequence at a time. RoPE pairs are ``(j, j + D/2)`` for
Hugging Face weights (``layout="half"``) and ``(2j, 2j+1)`` for the q/k rows of a llama-architecture GGUF file as
llama.cpp's converter stores them (``layout="interleaved"``): the oracle reads GGUF weights as they are, without
undoing any permutation, so it checks our un-permutation instead of repeating it.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

# ---------------------------------------------------------------------------------------------------------------
# the oracle


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, positions, theta, factors, layout):
    """x [T, H, D]: rotate each pair of coordinates, as one complex number, by ``p * theta^(-2j/D) / factors[j]``."""
    d = x.shape[-1]
    freq = theta ** (-2.0 * np.arange(d // 2) / d) / factors
    turn = np.exp(1j * positions[:, None] * freq[None, :])[:, None, :]  # [T, 1, D/2]
    if layout == "half":
        z = (x[..., : d // 2] + 1j * x[..., d // 2:]) * turn
        return np.concatenate([z.real, z.imag], axis=-1)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * turn
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def forward(w: dict, cfg: dict, ids, layout: str = "half") -> np.ndarray:
    """Logits [T, vocab] (float64) of one token sequence, positions 0..T-1, causal.

    ``w``: Hugging Face names without the ``model.`` prefix, ``[out, in]`` matrices; ``cfg``: n_layers, n_heads,
    n_kv_heads, head_dim, eps, theta, factors (None or D/2 divisors), tied.
    """
    ids = np.asarray(ids)
    t = len(ids)
    n, kv, d = cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"]
    factors = np.ones(d // 2) if cfg.get("factors") is None else np.asarray(cfg["factors"], np.float64)
    pos = np.arange(t, dtype=np.float64)
    x = w["embed_tokens.weight"][ids]
    for i in range(cfg["n_layers"]):
        p = f"layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], cfg["eps"])
        proj = {}
        for name, heads in (("q", n), ("k", kv), ("v", kv)):
            y = h @ w[f"{p}self_attn.{name}_proj.weight"].T
            if f"{p}self_attn.{name}_proj.bias" in w:
                y = y + w[f"{p}self_attn.{name}_proj.bias"]
            y = y.reshape(t, heads, d)
            if name != "v" and f"{p}self_attn.{name}_norm.weight" in w:
                y = _rms(y, w[f"{p}self_attn.{name}_norm.weight"], cfg["eps"])
            proj[name] = y
        q = _rope(proj["q"], pos, cfg["theta"], factors, layout)
        k = _rope(proj["k"], pos, cfg["theta"], factors, layout)
        heads = []
        for head in range(n):
            g = head // (n // kv)  # the key/value head this query head shares
            s = q[:, head] @ k[:, g].T / np.sqrt(d)
            s[np.triu_indices(t, 1)] = -np.inf
            a = np.exp(s - s.max(axis=1, keepdims=True))
            heads.append((a / a.sum(axis=1, keepdims=True)) @ proj["v"][:, g])
        x = x + np.concatenate(heads, axis=1) @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], cfg["eps"])
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    head = w["embed_tokens.weight"] if cfg["tied"] else w["lm_head.weight"]
    return _rms(x, w["norm.weight"], cfg["eps"]) @ head.T


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


_GGUF_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
               "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
               "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def read_gguf(path) -> tuple[dict, dict, str]:
    """(weights with Hugging Face names, config, RoPE layout) of a GGUF file, q/k rows left as stored."""
    from gguf import GGUFReader, quants

    r = GGUFReader(path)
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.")}
    arch = meta["general.architecture"]
    w = {}
    for t in r.tensors:
        a = np.asarray(quants.dequantize(t.data, t.tensor_type), np.float64).reshape([int(s) for s in t.shape[::-1]])
        if t.name.startswith("blk."):
            _, i, kind, leaf = t.name.split(".")
            w[f"layers.{i}.{_GGUF_NAMES[kind]}.{leaf}"] = a
        else:
            w[{"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
               "output.weight": "lm_head.weight", "rope_freqs.weight": "rope_freqs"}[t.name]] = a
    n_heads = meta[f"{arch}.attention.head_count"]
    cfg = dict(n_layers=meta[f"{arch}.block_count"], n_heads=n_heads,
               n_kv_heads=meta.get(f"{arch}.attention.head_count_kv", n_heads),
               head_dim=meta.get(f"{arch}.attention.key_length", meta[f"{arch}.embedding_length"] // n_heads),
               eps=meta[f"{arch}.attention.layer_norm_rms_epsilon"], theta=meta.get(f"{arch}.rope.freq_base", 1e4),
               factors=w.pop("rope_freqs", None), tied="lm_head.weight" not in w)
    # llama.cpp: LLM_ARCH_LLAMA uses "normal" RoPE on adjacent pairs; Qwen2/Qwen3 use NEOX (rotate-half)
    return w, cfg, "interleaved" if arch == "llama" else "half"


def read_hf(directory) -> tuple[dict, dict]:
    """(weights without the ``model.`` prefix, config) of a Hugging Face directory (config.json, safetensors)."""
    from safetensors.numpy import load_file

    directory = Path(directory)
    c = json.loads((directory / "config.json").read_text())
    w = {}
    for f in sorted(directory.glob("*.safetensors")):
        for k, v in load_file(f).items():
            w[k.removeprefix("model.")] = np.asarray(v, np.float64)
    n = c["num_attention_heads"]
    d = c.get("head_dim") or c["hidden_size"] // n
    factors = None
    rs = c.get("rope_scaling")
    if rs and rs.get("rope_type") == "llama3":  # Llama 3.1's frequency-dependent interpolation, as published
        base = c["rope_theta"] ** (-2.0 * np.arange(d // 2) / d)
        wavelen = 2 * np.pi / base
        lo, hi = rs["original_max_position_embeddings"] / rs["low_freq_factor"], \
            rs["original_max_position_embeddings"] / rs["high_freq_factor"]
        smooth = (rs["original_max_position_embeddings"] / wavelen - rs["low_freq_factor"]) / (
            rs["high_freq_factor"] - rs["low_freq_factor"])
        new = np.where(wavelen > lo, base / rs["factor"],
                       np.where(wavelen < hi, base, (1 - smooth) * base / rs["factor"] + smooth * base))
        factors = base / new
    cfg = dict(n_layers=c["num_hidden_layers"], n_heads=n, n_kv_heads=c.get("num_key_value_heads", n), head_dim=d,
               eps=c["rms_norm_eps"], theta=c.get("rope_theta", 1e4), factors=factors,
               tied=c.get("tie_word_embeddings", False))
    return w, cfg


# ---------------------------------------------------------------------------------------------------------------
# shared test data: a tiny byte-level BPE vocabulary and random Llama-family weights


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-in character for every byte (openai/gpt-2 encoder.py)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = (("\u0120", "t"), ("h", "e"), ("\u0120t", "he"), ("i", "n"), ("\u0120", "a"))


def tiny_bpe() -> tuple[list[str], list[tuple[str, str]], list[int]]:
    """(tokens, merges, llama.cpp token types): special tokens first (ids 0-2, type 3 = control), then the 256 bytes
    and five merges (type 1 = normal), 264 tokens."""
    tokens = list(SPECIAL) + _bytes_to_unicode() + ["".join(m) for m in MERGES]
    return tokens, list(MERGES), [3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL))


def random_weights(cfg: dict, *, seed: int = 0, bias: bool = False, qk_norm: bool = False) -> dict:
    """Float32 weights with Hugging Face names (``model.`` prefix left out) and [out, in] layout."""
    rng = np.random.default_rng(seed)
    d, ff, v = cfg["d_model"], cfg["d_ff"], cfg["vocab"]
    q, kv = cfg["n_heads"] * cfg["head_dim"], cfg["n_kv_heads"] * cfg["head_dim"]
    f = lambda *shape, s=0.2: (rng.normal(size=shape) * s).astype(np.float32)
    w = {"embed_tokens.weight": f(v, d, s=1.0), "norm.weight": 1 + f(d, s=0.1)}
    if not cfg["tied"]:
        w["lm_head.weight"] = f(v, d)
    for i in range(cfg["n_layers"]):
        p = f"layers.{i}."
        w |= {p + "input_layernorm.weight": 1 + f(d, s=0.1), p + "post_attention_layernorm.weight": 1 + f(d, s=0.1),
              p + "self_attn.q_proj.weight": f(q, d), p + "self_attn.k_proj.weight": f(kv, d),
              p + "self_attn.v_proj.weight": f(kv, d), p + "self_attn.o_proj.weight": f(d, q),
              p + "mlp.gate_proj.weight": f(ff, d), p + "mlp.up_proj.weight": f(ff, d),
              p + "mlp.down_proj.weight": f(d, ff)}
        if bias:
            w |= {p + "self_attn.q_proj.bias": f(q), p + "self_attn.k_proj.bias": f(kv),
                  p + "self_attn.v_proj.bias": f(kv)}
        if qk_norm:
            w |= {p + "self_attn.q_norm.weight": 1 + f(cfg["head_dim"], s=0.1),
                  p + "self_attn.k_norm.weight": 1 + f(cfg["head_dim"], s=0.1)}
    return w


# ---------------------------------------------------------------------------------------------------------------
# tests of the oracle


def test_rope_layouts_agree_on_permuted_rows():
    """Rotating pairs (j, j+D/2) of HF rows equals rotating pairs (2j, 2j+1) of the rows llama.cpp's converter
    permutes (``reshape(n_head, 2, D/2, ...).swapaxes(1, 2)``), and relative position is all attention sees."""
    rng = np.random.default_rng(0)
    t, h, d = 7, 3, 8
    x = rng.normal(size=(t, h, d))
    interleaved = x.reshape(t, h, 2, d // 2).swapaxes(2, 3).reshape(t, h, d)
    pos = np.arange(t, dtype=np.float64)
    a = _rope(x, pos, 1e4, np.ones(d // 2), "half")
    b = _rope(interleaved, pos, 1e4, np.ones(d // 2), "interleaved")
    np.testing.assert_allclose(b, a.reshape(t, h, 2, d // 2).swapaxes(2, 3).reshape(t, h, d), atol=1e-12)
    # q_m . k_n depends on m - n only
    q, k = x[:, 0], x[:, 1]
    s0 = _rope(q[None, None, 0], np.array([3.0]), 1e4, np.ones(d // 2), "half")[0, 0] @ \
        _rope(k[None, None, 0], np.array([1.0]), 1e4, np.ones(d // 2), "half")[0, 0]
    s1 = _rope(q[None, None, 0], np.array([12.0]), 1e4, np.ones(d // 2), "half")[0, 0] @ \
        _rope(k[None, None, 0], np.array([10.0]), 1e4, np.ones(d // 2), "half")[0, 0]
    assert s0 == pytest.approx(s1, abs=1e-12)


def test_oracle_attention_is_causal_and_first_token_ignores_attention_mixing():
    """With one token, attention returns v exactly: the oracle's first position is embed -> v -> o -> MLP."""
    rng = np.random.default_rng(1)
    d, heads = 8, 2
    w = {"embed_tokens.weight": rng.normal(size=(5, d)), "norm.weight": np.ones(d),
         "layers.0.input_layernorm.weight": np.ones(d), "layers.0.post_attention_layernorm.weight": np.ones(d)}
    for p in "qkvo":
        w[f"layers.0.self_attn.{p}_proj.weight"] = rng.normal(size=(d, d))
    for p, shape in (("gate", (4, d)), ("up", (4, d)), ("down", (d, 4))):
        w[f"layers.0.mlp.{p}_proj.weight"] = np.zeros(shape)
    cfg = dict(n_layers=1, n_heads=heads, n_kv_heads=heads, head_dim=d // heads, eps=1e-6, theta=1e4, tied=True)
    out = forward(w, cfg, [3, 1, 4])
    x = w["embed_tokens.weight"][3]
    h = x / np.sqrt(np.mean(x * x) + 1e-6)
    x1 = x + (h @ w["layers.0.self_attn.v_proj.weight"].T) @ w["layers.0.self_attn.o_proj.weight"].T
    np.testing.assert_allclose(out[0], _rms(x1, np.ones(d), 1e-6) @ w["embed_tokens.weight"].T, atol=1e-12)
    np.testing.assert_allclose(forward(w, cfg, [3, 1])[:2], out[:2], atol=1e-12)  # the future is not read
