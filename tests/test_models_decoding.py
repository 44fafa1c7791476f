"""jaxlowfp.models.llama for real checkpoints: padding masks and positions, the KV cache and `generate` (greedy decoding
equals the argmax of the full forward pass at every step; sampling), new config options."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlowfp import qat
from jaxlowfp.qnnx import paper_rules, quantize_model
from jaxlowfp.models.llama import KVCache, Llama, ModelConfig, generate, llama3_rope_factors

CFG = ModelConfig(vocab=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=64,
                  dtype="float32", rope_theta=500.0)
VARIANTS = {
    "plain": CFG,
    "qwen-like": dataclasses.replace(CFG, tie_embeddings=True, qkv_bias=True, qk_norm=True, explicit_head_dim=32),
}


def _model(cfg, seed=0):
    model = Llama(cfg, rngs=nnx.Rngs(seed))
    if cfg.qkv_bias:  # non-zero biases, so a wrong bias path shows
        for p, v in nnx.iter_graph(model):
            if p and p[-1] == "bias":
                v.set_value(jax.random.normal(jax.random.key(len(p)), v.shape) * 0.5)
    return model


@pytest.fixture(scope="module", params=list(VARIANTS))
def model(request):
    return _model(VARIANTS[request.param])


forward = jax.jit(lambda m, x: m(x))
masked = jax.jit(lambda m, x, a: m(x, attention_mask=a))


def test_left_and_right_padding_give_the_unpadded_logits(model):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(1, 97, n) for n in (5, 11, 16)]
    alone = [np.asarray(forward(model, jnp.asarray(s[None], jnp.int32)))[0] for s in seqs]
    for side in ("left", "right"):
        tokens = np.zeros((3, 16), np.int32)
        mask = np.zeros((3, 16), np.int32)
        for i, s in enumerate(seqs):
            sl = slice(16 - len(s), 16) if side == "left" else slice(0, len(s))
            tokens[i, sl], mask[i, sl] = s, 1
        out = np.asarray(masked(model, jnp.asarray(tokens), jnp.asarray(mask)))
        assert np.isfinite(out).all()  # padding queries see no key: finite, not NaN
        for i, s in enumerate(seqs):
            sl = slice(16 - len(s), 16) if side == "left" else slice(0, len(s))
            np.testing.assert_allclose(out[i, sl], alone[i], rtol=1e-5, atol=1e-5, err_msg=f"{side} row {i}")


def test_explicit_positions_shift_rope():
    """positions p..p+T-1 equal the same tokens after p dummy ones whose keys are masked out."""
    model = _model(CFG)
    x = np.random.default_rng(1).integers(1, 97, (1, 6))
    shifted = jax.jit(lambda m, x, p: m(x, positions=p))(model, jnp.asarray(x, jnp.int32),
                                                          jnp.arange(4, 10, dtype=jnp.int32)[None])
    padded = np.concatenate([np.zeros((1, 4), np.int64), x], axis=1)
    mask = np.concatenate([np.zeros((1, 4)), np.ones((1, 6))], axis=1)
    pos = jnp.arange(10, dtype=jnp.int32)[None]
    ref = jax.jit(lambda m, x, a, p: m(x, attention_mask=a, positions=p))(
        model, jnp.asarray(padded, jnp.int32), jnp.asarray(mask, jnp.int32), pos)
    np.testing.assert_allclose(np.asarray(shifted)[0], np.asarray(ref)[0, 4:], rtol=1e-5, atol=1e-5)
    # RoPE sees relative positions only: a constant shift changes nothing, a gap does
    base = np.asarray(forward(model, jnp.asarray(x, jnp.int32)))
    np.testing.assert_allclose(base, np.asarray(shifted), rtol=1e-5, atol=1e-5)
    gap = jax.jit(lambda m, x, p: m(x, positions=p))(model, jnp.asarray(x, jnp.int32),
                                                      jnp.asarray([[0, 1, 2, 3, 4, 20]], jnp.int32))
    np.testing.assert_allclose(np.asarray(gap)[0, :5], base[0, :5], rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(gap)[0, 5] - base[0, 5]).max() > 1e-3


def test_cache_prefill_and_steps_equal_the_full_forward(model):
    x = np.random.default_rng(2).integers(0, 97, (2, 12))
    full = np.asarray(forward(model, jnp.asarray(x, jnp.int32)))
    step = jax.jit(lambda m, x, c: m(x, cache=c))
    cache = KVCache.init(model.config, 2, 16)
    logits, cache = step(model, jnp.asarray(x[:, :7], jnp.int32), cache)
    parts = [np.asarray(logits)]
    for t in range(7, 12):
        logits, cache = step(model, jnp.asarray(x[:, t:t + 1], jnp.int32), cache)
        parts.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(parts, axis=1), full, rtol=1e-5, atol=1e-5)
    assert int(cache.index) == 12 and np.asarray(cache.valid).sum() == 24


def test_greedy_generation_is_the_argmax_of_the_full_forward_at_every_step(model):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 97, n).tolist() for n in (3, 9)]  # different lengths: left padding inside
    out = generate(model, prompts, max_new_tokens=10)
    for prompt, new in zip(prompts, out):
        assert len(new) == 10
        seq = list(prompt)
        for tok in new:  # right-padded to one length (one compilation); causal: padding is never read
            padded = np.zeros((1, 24), np.int32)
            padded[0, : len(seq)] = seq
            logits = np.asarray(forward(model, jnp.asarray(padded)))[0, len(seq) - 1]
            assert tok == int(np.argmax(logits))
            seq.append(tok)


def test_generation_stops_at_eos_and_samples_reproducibly():
    model = _model(CFG)
    prompt = [[5, 6, 7]]
    greedy = generate(model, prompt, max_new_tokens=8)[0]
    assert generate(model, prompt, max_new_tokens=8, eos_id=greedy[2])[0] == greedy[:3]
    assert generate(model, prompt, max_new_tokens=8, temperature=1.0, top_k=1)[0] == greedy  # top-1 = argmax
    a = generate(model, prompt, max_new_tokens=8, temperature=1.5, seed=1)[0]
    assert a == generate(model, prompt, max_new_tokens=8, temperature=1.5, seed=1)[0]
    draws = {tuple(generate(model, prompt, max_new_tokens=8, temperature=1.5, seed=s)[0]) for s in range(4)}
    assert len(draws) > 1  # sampling does sample
    # top-k: every drawn token is among the k most likely given its prefix
    seq = prompt[0] + generate(model, prompt, max_new_tokens=6, temperature=2.0, top_k=3, seed=5)[0]
    logits = np.asarray(forward(model, jnp.asarray([seq], jnp.int32)))[0]
    for t in range(3, len(seq)):
        assert seq[t] in np.argsort(-logits[t - 1])[:3]


def test_generate_argument_errors():
    model = _model(CFG)
    with pytest.raises(ValueError, match="exceeds max_seq_len=64"):
        generate(model, [[1] * 60], max_new_tokens=5)
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 97\)"):
        generate(model, [[97]], max_new_tokens=1)
    with pytest.raises(ValueError, match="temperature must be a number >= 0"):
        generate(model, [[1]], max_new_tokens=1, temperature=-1.0)
    with pytest.raises(ValueError, match="non-empty list of non-empty token lists"):
        generate(model, [[]], max_new_tokens=1)


def test_quantized_model_decodes_with_the_cache():
    """paper_rules apply unchanged (same module paths); fake-quantized MLPs work in the cached path."""
    model = _model(dataclasses.replace(CFG, n_layers=4, tie_embeddings=True))
    report = quantize_model(model, paper_rules(4, keep_first=1, keep_last=1, recipe=qat.hif8_w8a8()))
    assert "blocks/1/mlp/gate_proj" in str(report)
    out = generate(model, [[1, 2, 3]], max_new_tokens=4)[0]
    assert len(out) == 4 and all(0 <= t < 97 for t in out)


def test_bfloat16_compute_with_cache_under_strict_promotion():
    model = _model(dataclasses.replace(VARIANTS["qwen-like"], dtype="bfloat16"))
    out = generate(model, [[1, 2, 3]], max_new_tokens=3)[0]
    assert len(out) == 3
    logits = masked(model, jnp.ones((2, 5), jnp.int32), jnp.ones((2, 5), jnp.int32))
    assert logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()


def test_new_config_options_are_validated_and_counted():
    cfg = VARIANTS["qwen-like"]
    model = _model(cfg)
    assert cfg.num_params() == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert not hasattr(model, "lm_head") and model.blocks[0].attn.q_proj.kernel[...].shape == (64, 128)
    with pytest.raises(ValueError, match="rope_freq_factors must be 8"):
        dataclasses.replace(CFG, rope_freq_factors=(1.0, 2.0))
    with pytest.raises(ValueError, match="explicit_head_dim=5 must be even"):
        dataclasses.replace(CFG, explicit_head_dim=5)
    with pytest.raises(ValueError, match="tie_embeddings must be a bool"):
        dataclasses.replace(CFG, tie_embeddings=1)
    f = llama3_rope_factors(128, 500_000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=8192)
    assert f[0] == 1.0 and f[-1] == pytest.approx(8.0) and all(1.0 <= v <= 8.0 for v in f)
    assert dataclasses.replace(CFG, rope_freq_factors=[2.0] * 8).rope_freq_factors == (2.0,) * 8
