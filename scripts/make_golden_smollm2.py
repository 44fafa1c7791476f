"""Make tests/fixtures/smollm2_golden.npz: SmolLM2-135M-Instruct log-probabilities from two implementations we did
not derive from jaxlowfp/models/llama.py. Not run by CI; the tests only read the fixture.

(a) Hugging Face ``transformers`` (PyTorch, float32) loading the same GGUF file (``from_pretrained(dir,
    gguf_file=...)``: it dequantizes with the ``gguf`` package, undoes llama.cpp's q/k permutation itself and
    builds its own tokenizer from the GGUF metadata). It runs in a separate Python 3.11 virtual environment outside
    .venv, made once with::

        /root/.pyenv/versions/3.11.7/bin/python -m venv /tmp/refvenv
        /tmp/refvenv/bin/pip install torch==2.13.0 transformers gguf accelerate sentencepiece

    (here: torch 2.13.0+cpu, transformers 5.24.0, gguf 0.19.0, accelerate).
(b) The numpy float64 oracle of tests/test_models_oracle.py (its own GGUF reading, RoPE on the adjacent pairs
    llama.cpp stores, attention, norms), run in .venv.

For a few prompts (English, Shakespeare, Python, a chat turn, a 250-token passage of prose) the fixture holds the
Hugging Face token ids, the log-probability of every next token and the 16 most likely tokens at every position
from (a) and (b), the full log-softmax of the first prompt's last position from (a) (the first generated token's
distribution), (a)'s greedy continuation of the first prompt, and (a)'s token ids for texts that test the
tokenizer. Run from the repository root::

    .venv/bin/python scripts/make_golden_smollm2.py --reference-python /tmp/refvenv/bin/python
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "smollm2_golden.npz"
TOP = 16
GREEDY_TOKENS = 16


def prompts() -> list[str]:
    sys.path.insert(0, str(ROOT))
    from train.text_eval import prose_text

    alice = prose_text()
    start = alice.index("Alice was beginning")
    return [
        "The capital of France is",
        "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
        "The slings and arrows of outrageous fortune,",
        'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n    for _ in range(n):\n'
        "        a, b = b, a + b\n    return a\n",
        "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n",
        alice[start: start + 1100],
    ]


def tokenizer_texts() -> list[str]:
    sys.path.insert(0, str(ROOT))
    from train.text_eval import load_texts

    texts = load_texts()
    return [
        "Hello, world! It's 2024: 3.14159 x 10^5 = 314159.",
        "  leading spaces,\ttabs\tand\nnew\n\nlines  ",
        "Unicode: café, naïve, Zürich, 東京, emoji 🙂, math ∑ α β.",
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|endoftext|>",
        "x = {'a': [1, 2, 3]}  # comment\nif x['a'][0] >= 1: print(f\"{x!r}\")",
        texts["shakespeare"][0][:3000],
        texts["python"][0][:3000],
        texts["prose"][0][:3000],
    ]


def reference(spec_path: str, out_path: str) -> None:
    """(a): runs in the reference venv."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = json.loads(Path(spec_path).read_text())
    gguf = Path(spec["gguf"])
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for k, text in enumerate(spec["prompts"]):
            ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
            lp = torch.log_softmax(model(ids).logits[0].double(), dim=-1).numpy()
            out[f"ids_{k}"] = ids[0].numpy().astype(np.int32)
            out[f"hf_target_lp_{k}"] = lp[np.arange(ids.shape[1] - 1), ids[0, 1:].numpy()]
            top = np.argsort(-lp, axis=-1)[:, :TOP].astype(np.int32)
            out[f"hf_top_ids_{k}"] = top
            out[f"hf_top_lp_{k}"] = np.take_along_axis(lp, top, axis=-1)
            if k == 0:
                out["hf_last_lp_0"] = lp[-1].astype(np.float32)
                gen = model.generate(ids, max_new_tokens=GREEDY_TOKENS, do_sample=False)
                out["hf_greedy_0"] = gen[0, ids.shape[1]:].numpy().astype(np.int32)
    for k, text in enumerate(spec["tokenizer_texts"]):
        out[f"tok_ids_{k}"] = np.asarray(tok(text, add_special_tokens=False).input_ids, np.int32)
        out[f"tok_text_{k}"] = np.str_(text)
    import transformers

    out["versions"] = np.str_(f"torch {torch.__version__}, transformers {transformers.__version__}")
    np.savez(out_path, **out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reference-python", default="/tmp/refvenv/bin/python")
    p.add_argument("--phase", default="all", choices=("all", "reference"))
    p.add_argument("--spec")
    p.add_argument("--out")
    args = p.parse_args()
    if args.phase == "reference":
        reference(args.spec, args.out)
        return
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    from test_models_oracle import forward, log_softmax, read_gguf
    from jaxlowfp.models import smollm2_135m_path

    gguf = smollm2_135m_path()
    ps, tts = prompts(), tokenizer_texts()
    with tempfile.TemporaryDirectory() as d:
        # transformers wants a directory and a file name: a symlink keeps the 98 MB file where it is
        os.symlink(gguf, Path(d) / gguf.name)
        spec = Path(d) / "spec.json"
        spec.write_text(json.dumps({"gguf": str(Path(d) / gguf.name), "prompts": ps, "tokenizer_texts": tts}))
        ref_out = Path(d) / "reference.npz"
        subprocess.run([args.reference_python, __file__, "--phase", "reference", "--spec", str(spec), "--out",
                        str(ref_out)], check=True)
        data = dict(np.load(ref_out))
    w, cfg, layout = read_gguf(gguf)
    for k in range(len(ps)):
        ids = data[f"ids_{k}"]
        lp = log_softmax(forward(w, cfg, ids, layout))
        data[f"oracle_target_lp_{k}"] = lp[np.arange(len(ids) - 1), ids[1:]]
        data[f"oracle_top_lp_{k}"] = np.take_along_axis(lp, data[f"hf_top_ids_{k}"], axis=-1)
        diff = max(np.abs(data[f"oracle_target_lp_{k}"] - data[f"hf_target_lp_{k}"]).max(),
                   np.abs(data[f"oracle_top_lp_{k}"] - data[f"hf_top_lp_{k}"]).max())
        print(f"prompt {k}: {len(ids)} tokens, max |oracle - transformers| log-prob {diff:.2e}")
        if k == 0:
            d0 = np.abs(lp[-1] - data["hf_last_lp_0"]).max()
            print(f"prompt 0 last position, all {lp.shape[1]} tokens: max |oracle - transformers| {d0:.2e}")
    data["n_prompts"] = np.asarray(len(ps))
    data["n_tokenizer_texts"] = np.asarray(len(tts))
    data = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in data.items()}  # 1e-7 relative: enough
    np.savez_compressed(OUT, **data)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes); reference: {data['versions']}")


if __name__ == "__main__":
    main()
