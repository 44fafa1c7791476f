"""Tiny random mixture-of-experts checkpoints written by transformers itself, their logits, and the same checkpoints
converted to GGUF by llama.cpp's own converter, for tests/test_models_moe.py (CI has neither PyTorch nor llama.cpp).

Run once (2026-12, CPU) in three steps; each writes under ``tests/fixtures/moe/``::

    /work/venvs/ct/bin/python scripts/make_moe_fixtures.py hf                      # transformers
    /work/venvs/ct/bin/python scripts/make_moe_fixtures.py gguf --llama-cpp DIR    # llama.cpp's converter
    /work/venvs/llamacpp/bin/python scripts/make_moe_fixtures.py llamacpp          # llama.cpp's forward

The ``ct`` venv: Python 3.11, torch 2.13.0+cpu, transformers 5.24.0 (see scripts/interop_live.py). ``DIR`` is the
llama.cpp source tree vendored by the llama-cpp-python 0.3.36 sdist (``pip download --no-binary :all: --no-deps
llama-cpp-python==0.3.36``, unpack, ``vendor/llama.cpp``: ``convert_hf_to_gguf.py``, ``conversion/``, ``gguf-py/``
0.19.0). The ``llamacpp`` venv: llama-cpp-python 0.3.36 built for CPU (as in scripts/interop_live.py).

Checkpoints (``tests/fixtures/moe/<name>/``: ``config.json``, ``model.safetensors`` in float32, ``tokenizer.json``
and ``tokenizer_config.json`` of a 280-token byte-level BPE trained here by ``tokenizers``, wrapped and saved by
transformers' ``PreTrainedTokenizerFast``):

- ``qwen3_moe``: ``Qwen3MoeForCausalLM``, 2 layers, hidden 32, 4 query / 2 key-value heads of 16 (q/k norms),
  8 experts of 16, top-2, ``norm_topk_prob=True`` (as Qwen3-30B-A3B); saved in transformers' default
  (original) layout, one tensor per expert: ``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``.
- ``mixtral``: ``MixtralForCausalLM``, 2 layers, hidden 32, 4 / 2 heads of 8, 4 experts of 24, top-2; the original
  layout ``model.layers.N.block_sparse_moe.{gate,experts.E.w1,w2,w3}.weight``.
- ``olmoe``: ``OlmoeForCausalLM``, 2 layers, hidden 32, 4 heads of 8 with q/k norms over all heads (no grouped
  keys: llama.cpp's OLMoE wants a k norm of ``n_embd``, as OLMoE-1B-7B has), 4 experts of 24, top-2,
  ``norm_topk_prob=False`` (as OLMoE-1B-7B), ``rms_norm_eps=1e-5`` (the value llama.cpp's OLMoE converter writes
  whatever the config says); per-expert layout ``model.layers.N.mlp.experts.E.*_proj.weight``.
- ``qwen3_moe_fused``: ``Qwen3MoeForCausalLM`` with ``norm_topk_prob=False``, ``mlp_only_layers=[0]`` (a dense
  SwiGLU layer 0), tied embeddings, saved with ``save_original_format=False``: transformers' in-memory layout,
  ``mlp.experts.gate_up_proj [E, 2I, H]`` and ``mlp.experts.down_proj [E, H, I]``.

Weights are drawn here (seeded torch generator; matrices N(0, 1/fan_in), embeddings N(0, 1), norm scales
1 + N(0, 0.1^2)) so that routing is decisive: the seed is kept only if, over every token of every recorded forward,
the k-th and (k+1)-th routing probabilities differ by more than 1e-4 (``min_router_gap`` in the npz) and greedy
generation's top-2 logits by more than 1e-3, so float32 rounding cannot flip an expert or a token.

``<name>.npz``: ``tokens`` int [3, 16] (random ids), transformers' (eager attention, float32) ``logits``
[3, 16, V], ``router_logits`` [n_moe_layers, 48, E] and ``topk`` [n_moe_layers, 48, k] (the routed experts, from
the router outputs), ``prompt`` [6] and ``greedy`` [8] (``generate(do_sample=False, max_new_tokens=8)``),
``min_router_gap``, ``min_greedy_gap``, and versions.

GGUF (``qwen3_moe.gguf``, ``mixtral.gguf``, ``olmoe.gguf``, F32): ``convert_hf_to_gguf.py --outtype f32`` on the
original-layout directories (its ``--fuse-gate-up-exps`` is not offered for these architectures). The converter needs
``sentencepiece`` in the venv (it tries a SentencePiece vocabulary first). One patch: llama.cpp identifies a BPE
pre-tokenizer by the hash of a test string's tokens and refuses unknown ones (our tiny tokenizer is not registered);
``get_vocab_base_pre`` is made to return ``"default"`` (the GPT-2 split, which this tokenizer uses). Everything else
(metadata, expert stacking, Mixtral's q/k RoPE permutation) is the converter's. ``<name>.llamacpp.npz``: llama.cpp's
own logits of each GGUF file for its checkpoint's ``tokens`` (one sequence per context, F32 KV cache).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "moe"
SEEDS = range(20)
T, N_SEQ, N_PROMPT, N_NEW = 16, 3, 6, 8
TRAIN_TEXT = ("The quick brown fox jumps over the lazy dog. Experts route tokens; the router picks two of them. "
              "Mixture of experts models quantized to four bits and eight bits run fast on the accelerators. ") * 4

MODELS = {
    "qwen3_moe": dict(arch="Qwen3MoeForCausalLM", original=True, config=dict(
        hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "mixtral": dict(arch="MixtralForCausalLM", original=True, config=dict(
        hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64, rms_norm_eps=1e-5,
        tie_word_embeddings=False)),
    "qwen3_moe_fused": dict(arch="Qwen3MoeForCausalLM", original=False, config=dict(
        hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=False, mlp_only_layers=[0], max_position_embeddings=64, rms_norm_eps=1e-6,
        tie_word_embeddings=True)),
    "olmoe": dict(arch="OlmoeForCausalLM", original=True, config=dict(
        hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, max_position_embeddings=64, rms_norm_eps=1e-5,
        tie_word_embeddings=False)),
}
# GGUF file -> (Hugging Face directory, extra converter flags)
GGUF_FILES = {"qwen3_moe": ("qwen3_moe", []), "mixtral": ("mixtral", []), "olmoe": ("olmoe", [])}


def _tokenizer():
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = tokenizers.Tokenizer(tokenizers.models.BPE())
    tk.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2 regex split
    tk.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|endoftext|>", "<|im_start|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator([TRAIN_TEXT], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|endoftext|>")


def _randomize(model, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # RMSNorm scales
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # [out, in] or [E, out, in]: N(0, 1 / fan_in)
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def _routing(model, tokens):
    """Router logits of every MoE layer [L, N, E], the routed experts [L, N, k] and the smallest k-th vs (k+1)-th
    probability gap, from the routers' own outputs (``(router_logits, scores, indices)`` in transformers 5)."""
    import torch

    outs = []
    hooks = [m.register_forward_hook(lambda mod, i, o: outs.append((o[0].detach(), o[2].detach())))
             for n, m in model.named_modules() if n.endswith("mlp.gate")]
    with torch.no_grad():
        model(torch.as_tensor(tokens))
    for h in hooks:
        h.remove()
    k = model.config.num_experts_per_tok
    logits = torch.stack([o[0] for o in outs])
    topk = torch.stack([o[1] for o in outs])
    p = torch.softmax(logits.double(), -1).sort(-1, descending=True).values
    return logits.numpy(), topk.numpy(), float((p[..., k - 1] - p[..., k]).min())


def stage_hf() -> None:
    import numpy as np
    import torch
    import transformers

    tok = _tokenizer()
    vocab = len(tok)
    for name, spec in MODELS.items():
        cls = getattr(transformers, spec["arch"])
        cfg_cls = cls.config_class
        for seed in SEEDS:
            torch.manual_seed(seed)
            config = cfg_cls(vocab_size=vocab, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                             **spec["config"])
            config._attn_implementation = "eager"
            model = cls(config).eval()
            _randomize(model, seed)
            rng = np.random.default_rng(seed)
            tokens = rng.integers(0, vocab, (N_SEQ, T)).astype(np.int64)
            prompt = rng.integers(0, vocab, (1, N_PROMPT)).astype(np.int64)
            r_logits, topk, gap = _routing(model, tokens)
            with torch.no_grad():
                logits = model(torch.as_tensor(tokens)).logits.float().numpy()
                gen = model.generate(torch.as_tensor(prompt), do_sample=False, max_new_tokens=N_NEW,
                                     min_new_tokens=N_NEW, output_scores=True, return_dict_in_generate=True,
                                     pad_token_id=tok.eos_token_id, eos_token_id=None)
            scores = torch.stack(gen.scores)[:, 0].sort(-1, descending=True).values
            ggap = float((scores[:, 0] - scores[:, 1]).min())
            _, _, pgap = _routing(model, gen.sequences.numpy())
            print(f"{name} seed {seed}: router gap {gap:.2e} (generation {pgap:.2e}), greedy gap {ggap:.2e}")
            if min(gap, pgap) > 1e-4 and ggap > 1e-3:
                break
        else:
            raise SystemExit(f"{name}: no seed in {SEEDS} gives decisive routing")
        d = OUT / name
        d.mkdir(parents=True, exist_ok=True)
        for f in d.iterdir():
            f.unlink()
        model.save_pretrained(d, save_original_format=spec["original"])
        tok.save_pretrained(d)
        np.savez_compressed(OUT / f"{name}.npz", tokens=tokens.astype(np.int32), logits=logits,
                            router_logits=r_logits, topk=topk.astype(np.int32),
                            prompt=prompt[0].astype(np.int32),
                            greedy=gen.sequences[0, N_PROMPT:].numpy().astype(np.int32),
                            min_router_gap=np.float32(min(gap, pgap)), min_greedy_gap=np.float32(ggap),
                            seed=np.int32(seed), transformers=transformers.__version__, torch=torch.__version__)
        print(name, "->", d, sorted(p.name for p in d.iterdir()))


def stage_gguf(llama_cpp: Path) -> None:
    sys.path.insert(0, str(llama_cpp))
    sys.path.insert(1, str(llama_cpp / "gguf-py"))
    from conversion import base  # llama.cpp's conversion package (next to convert_hf_to_gguf.py)

    # the one patch: our tokenizer's pre-tokenizer hash is not registered in llama.cpp (see the docstring)
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
    import convert_hf_to_gguf

    for name, (source, flags) in GGUF_FILES.items():
        sys.argv = ["convert_hf_to_gguf.py", str(OUT / source), "--outtype", "f32", "--outfile",
                    str(OUT / f"{name}.gguf"), *flags]
        convert_hf_to_gguf.main()


def stage_llamacpp() -> None:
    import llama_cpp
    import numpy as np

    for name, (source, _) in GGUF_FILES.items():
        tokens = np.load(OUT / f"{source}.npz")["tokens"]
        rows = []
        for seq in tokens:
            llm = llama_cpp.Llama(model_path=str(OUT / f"{name}.gguf"), logits_all=True, n_ctx=64, n_threads=2,
                                  type_k=0, type_v=0, verbose=False)  # F32 KV cache
            llm.eval([int(t) for t in seq])
            rows.append(np.asarray(llm.scores[: len(seq)], np.float32))
            del llm
        np.savez_compressed(OUT / f"{name}.llamacpp.npz", logits=np.stack(rows), llama_cpp=llama_cpp.__version__)
        print(name, "llama.cpp logits", np.stack(rows).shape)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", choices=["hf", "gguf", "llamacpp"])
    ap.add_argument("--llama-cpp", type=Path, help="llama.cpp source tree (stage gguf)")
    args = ap.parse_args()
    if args.stage == "hf":
        stage_hf()
    elif args.stage == "gguf":
        if args.llama_cpp is None or not (args.llama_cpp / "convert_hf_to_gguf.py").is_file():
            ap.error("stage gguf needs --llama-cpp DIR with convert_hf_to_gguf.py")
        stage_gguf(args.llama_cpp)
    else:
        stage_llamacpp()


if __name__ == "__main__":
    main()
