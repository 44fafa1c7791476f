"""Evaluation and generation of a sharded model (4 simulated CPU devices, conftest) equal one device's: the tiny
Q8_0 GGUF Llama of tests/test_sharding.py loaded with ``mesh=`` (FSDP x tensor parallel), scored with
`jaxlowfp.evaluation.perplexity` / `score_requests` / `score_choices` and continued greedily by
`jaxlowfp.models.generate` with its KV cache sharded, and through the lm-eval backend's ``mesh=`` argument.

Tolerance: the sharded programs split every contraction over a sharded model dimension into per-device partial
sums joined by an all-reduce, so float32 sums run in another order. Each logit then differs by a few float32 ulps
of the terms summed (eps = 1.2e-7; measured here: up to 1.3e-5 on logits of magnitude ~10-100, i.e. ~1e-6
relative), a token's log-likelihood by about as much, and a request's sum of n tokens by far less than n times that
(the errors are not of one sign; measured 1.5e-5 for 32 tokens): `_ATOL_PER_TOKEN` = 1e-5 per scored token.
Greedy generation is compared exactly, except where the one-device model has two logits within that rounding of
each other (then the sharded run may pick either; `_near_greedy` checks that its pick is still greedy within 1e-4)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_sharding import _write
from jaxlowfp import evaluation, sharding
from jaxlowfp.evaluation import ChoiceItem, Request
from jaxlowfp.models import KVCache, generate, load
from jaxlowfp.models.llama import cache_shardings

_ATOL_PER_TOKEN = 1e-5
DOCS = ["The quick brown fox jumps over the lazy dog. " * 3, "hello world, hello jax", "sharded models agree " * 4]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = _write(tmp_path_factory.mktemp("sharded_eval"), "gguf-q8_0")
    mesh = sharding.make_mesh("fsdp=2,tensor=2")
    ref, tok = load(path)
    model, _ = load(path, mesh=mesh)
    return ref, model, tok, mesh


def test_perplexity_and_scores_equal_one_device(models):
    ref, model, tok, mesh = models
    a = evaluation.perplexity(ref, tok, DOCS, max_length=32, batch_size=4)
    b = evaluation.perplexity(model, tok, DOCS, max_length=32, batch_size=4, mesh=mesh)
    assert (a.tokens, a.words, a.bytes) == (b.tokens, b.words, b.bytes)
    assert abs(a.log_likelihood - b.log_likelihood) <= _ATOL_PER_TOKEN * a.tokens
    rng = np.random.default_rng(0)
    requests = [Request(tuple(int(t) for t in rng.integers(0, 272, n)), k) for n, k in ((20, 5), (33, 32), (9, 1),
                                                                                       (40, 12), (17, 16))]
    ll_a, top_a, _ = evaluation.score_requests(ref, requests, batch_size=2, greedy=True)
    ll_b, top_b, _ = evaluation.score_requests(model, requests, batch_size=2, greedy=True, mesh=mesh)
    np.testing.assert_allclose(ll_b, ll_a, rtol=0, atol=_ATOL_PER_TOKEN * 32)
    assert np.array_equal(top_a, top_b)
    items = [ChoiceItem(context="hello", choices=(" world", " jax", " fox"), label=0),
             ChoiceItem(context="The quick brown", choices=(" fox", " dog", " cat"), label=0)]
    assert evaluation.score_choices(ref, tok, items, max_length=32, batch_size=3) | {"seconds": 0, "tokens_per_s": 0} \
        == evaluation.score_choices(model, tok, items, max_length=32, batch_size=3, mesh=mesh) | {
            "seconds": 0, "tokens_per_s": 0}  # batch 3: rows replicated (3 is not divisible by data x fsdp = 2)


def _near_greedy(model, prompt: list[int], new: list[int], tol: float) -> bool:
    """Every token of ``new`` is within ``tol`` of the largest logit of `model` (one device) at its position."""
    seq = jnp.asarray([prompt + new], jnp.int32)
    logits = np.asarray(jax.jit(lambda m, x: m(x))(model, seq))[0, len(prompt) - 1: -1]
    return bool(np.all(logits[np.arange(len(new)), new] >= logits.max(-1) - tol))


def test_generate_with_a_sharded_kv_cache_equals_one_device(models):
    ref, model, tok, mesh = models
    prompts = [tok.encode(d)[:n] for d, n in zip(DOCS + ["fox"], (12, 5, 9, 2))]
    want = generate(ref, prompts, max_new_tokens=10)
    got = generate(model, prompts, max_new_tokens=10, mesh=mesh)
    # equal, unless two logits of the one-device model lie within float32 rounding (~1e-5 here, logits of tens):
    # then the sharded run may take the other one, and every token it took must still be greedy within that
    for p, g, w in zip(prompts, got, want):
        assert g == w or _near_greedy(ref, p, g, tol=1e-4), (p, g, w)
    shard = cache_shardings(model.config, mesh, batch=4)
    cache = KVCache.init(model.config, 4, 24)
    assert shard.k[0].spec == sharding.P(("data", "fsdp"), None, "tensor", None)  # rows x kv heads
    assert shard.valid.spec == sharding.P(("data", "fsdp"))
    placed = sharding.shard(cache, shard)
    assert {s.data.shape for s in placed.k[0].addressable_shards} == {(2, 24, 1, 16)}  # 4 rows, 2 kv heads: / 2 / 2
    # a batch the data axes do not divide keeps its rows whole (replicated), kv heads still split
    assert cache_shardings(model.config, mesh, batch=3).k[0].spec == sharding.P(None, None, "tensor", None)


def test_mesh_needs_the_model_on_it(models):
    ref, _, tok, mesh = models
    with pytest.raises(ValueError, match=r"mesh= given, but parameter .* is on 1 device\(s\), not on the mesh's 4; "
                                         r"load the model with jaxlowfp.models.load\(\.\.\., mesh=mesh\)"):
        evaluation.perplexity(ref, tok, DOCS[:1], max_length=32, batch_size=4, mesh=mesh)


def test_harness_mesh_argument(models, tmp_path):
    from jaxlowfp.harness import JaxLowFPLM

    ref, model, tok, mesh = models
    path = _write(tmp_path, "gguf-q8_0")
    lm = JaxLowFPLM(pretrained=str(path), mesh="fsdp=2,tensor=2", batch_size=4, max_length=32)
    specs = {p: v.get_value().sharding.spec for p, v in sharding.variable_paths(lm.model).items()}
    assert specs["blocks/0/attn/q_proj/kernel"] == sharding.P("fsdp", "tensor")
    plain = JaxLowFPLM(model=ref, tokenizer=tok, batch_size=4, max_length=32)
    inproc = JaxLowFPLM(model=model, tokenizer=tok, mesh=mesh, batch_size=4, max_length=32)  # model= on the mesh

    class Req:  # lm-eval's Instance: only .args is read
        def __init__(self, *args):
            self.args = args

    texts = [Req(d) for d in DOCS]
    a, b = (x.loglikelihood_rolling(texts) for x in (plain, lm))
    n = max(len(tok.encode(d)) for d in DOCS)
    np.testing.assert_allclose(b, a, rtol=0, atol=_ATOL_PER_TOKEN * n)
    assert inproc.mesh is mesh and inproc.model is model
    gen = [Req("hello world", {"until": ["\n\n"], "max_gen_toks": 6})]
    assert lm.generate_until(gen) == plain.generate_until(gen)
    # PTQ inside the harness on the mesh (RTN NVFP4 4/6 W4A16 of the MLP: elementwise, the one-device weights bit
    # for bit), scored as the one-device harness scores it, within float32 rounding
    kw = dict(ptq="rtn", ptq_layers=r"blocks/\d+/mlp/\w+_proj", weights_only=True, batch_size=4, max_length=32)
    q_mesh = JaxLowFPLM(pretrained=str(path), mesh="fsdp=2,tensor=2", **kw)
    q_one = JaxLowFPLM(pretrained=str(path), **kw)
    assert q_mesh.quantization == q_one.quantization and "PTQ rtn" in q_mesh.quantization
    up = "blocks/0/mlp/up_proj/kernel"
    wm, wo = (sharding.variable_paths(x.model)[up].get_value() for x in (q_mesh, q_one))
    assert wm.sharding.spec == sharding.P("fsdp", "tensor") and np.array_equal(np.asarray(wm), np.asarray(wo))
    np.testing.assert_allclose(q_mesh.loglikelihood_rolling(texts), q_one.loglikelihood_rolling(texts), rtol=0,
                               atol=_ATOL_PER_TOKEN * n)
    with pytest.raises(ValueError, match="packed= with ptq_export= and mesh="):
        JaxLowFPLM(pretrained=str(path), mesh="fsdp=2,tensor=2", ptq_export=str(tmp_path), packed="auto")


@pytest.mark.slow
def test_gptq_nvfp4_of_a_sharded_model_equals_one_device(tmp_path):
    """GPTQ to NVFP4 4/6 (mse) of the MLP projections, calibration rows split over the data axes: the quantized
    weights and the packed codes and scales equal one device's bit for bit (here no Hessian sum moved a code), every
    kernel keeps its shards, and the W4A16 model scores as one device within float32 rounding.

    (W4A4 is not compared by score: its activations are quantized at run time from the current amax, and a float32
    ulp of difference in an activation or its amax flips FP4 roundings; on this model that moved the log-likelihood
    by 0.95 nats over 223 tokens, while the weights stayed bit-equal.)"""
    from jaxlowfp import ptq

    path = _write(tmp_path, "gguf-q8_0")
    mesh = sharding.make_mesh("fsdp=2,tensor=2")
    ref, tok = load(path)
    model, _ = load(path, mesh=mesh)
    tokens = np.random.default_rng(0).integers(0, 272, (4, 32)).astype(np.int32)
    rules = [ptq.Rule(path=r"blocks/\d+/mlp/\w+_proj", scheme=ptq.scheme("nvfp4-mse", weights_only=True))]
    ra = ptq.quantize_model(ref, rules, method=ptq.GPTQ(), calibration=jnp.asarray(tokens))
    rb = ptq.quantize_model(model, rules, method=ptq.GPTQ(), calibration=sharding.put_batch(tokens, mesh))
    specs = sharding.partition_specs({p: v.get_value().shape for p, v in sharding.variable_paths(model).items()},
                             sharding.llama_rules(), mesh)
    want = sharding.variable_paths(ref)
    for p, v in sharding.variable_paths(model).items():
        np.testing.assert_array_equal(np.asarray(v.get_value()).view(np.uint32),
                                      np.asarray(want[p].get_value()).view(np.uint32), err_msg=p)
        assert v.get_value().sharding.spec == specs[p], p
    assert sorted(ra.packed) == sorted(rb.packed) and len(ra.packed) == 6
    for p in ra.packed:
        for x, y in zip(jax.tree.leaves(ra.packed[p]), jax.tree.leaves(rb.packed[p])):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=p)
    a = evaluation.perplexity(ref, tok, DOCS, max_length=32, batch_size=4)
    b = evaluation.perplexity(model, tok, DOCS, max_length=32, batch_size=4, mesh=mesh)
    assert abs(a.log_likelihood - b.log_likelihood) <= _ATOL_PER_TOKEN * a.tokens
