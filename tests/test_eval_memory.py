"""Bounded evaluation memory (issue 32): `jaxlowfp.evaluation.score_requests` runs a model with ``ptq_blocks()`` block
by block, so the compiled programs do not grow with the number of (fake-quantized) blocks.

What is measured is deterministic: the compiled programs' HLO instruction counts and XLA's own memory analysis
(temporary bytes), not the process's RSS. The judge of "unchanged numerics" is the whole-forward program the
library ran before (`evaluation._ll_sums`), on the same requests: bitwise equal log-likelihoods. The peak-RSS
numbers on SmolLM2 are bench/eval_memory.py's (bench/RESULTS.md)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlowfp import evaluation as ev
from jaxlowfp.harness import fake_quantize_model as fake_quantize
from jaxlowfp.models import Llama, preset

ROWS, LENGTH = 2, 64
MAX_TEMP_MULTIPLE = 2.0  # a quantized program may hold at most this many times the float one's temporary bytes


def _model(n_layers, quantize):
    model = Llama(preset("tiny", vocab=96, n_layers=n_layers), rngs=nnx.Rngs(0))
    if quantize != "none":
        fake_quantize(model, quantize, layers="all")
    return model


def _n_instructions(compiled) -> int:
    return len(re.findall(r"^\s*(?:ROOT )?%?\S+ = ", compiled.as_text(), re.M))


def _programs(model):
    """The compiled programs `score_requests` runs for one [ROWS, LENGTH] batch: the embedding, each distinct block
    structure, the head with the sums; as (HLO instructions, temp bytes)."""
    f = ev._Forward(model)
    assert f.blocks is not None, "a Llama says its blocks (ptq_blocks): scored block by block"
    tok = jnp.zeros((ROWS, LENGTH), jnp.int32)
    h = jax.ShapeDtypeStruct((ROWS, LENGTH, model.config.d_model), jnp.float32)
    distinct = {(call, g): s for call, g, s in f.blocks}
    lowered = [ev._embed.lower(f.embed, f.graphdef, f.state, tok)]
    lowered += [ev._block.lower(call, g, s, h) for (call, g), s in distinct.items()]
    lowered.append(ev._head_sums.lower(f.head, f.graphdef, f.state, h, tok, jnp.zeros((ROWS, LENGTH), bool)))
    out = []
    for low in lowered:
        c = low.compile()
        out.append((_n_instructions(c), c.memory_analysis().temp_size_in_bytes))
    return len(distinct), out


def test_identical_quantized_blocks_share_one_program_that_does_not_grow_with_depth():
    n2, small = _programs(_model(2, "hif8"))
    n6, deep = _programs(_model(6, "hif8"))
    assert n2 == n6 == 1  # every block quantized alike: one block program, whatever the depth
    assert deep == small  # the same programs, instruction for instruction and byte for byte
    _, fp = _programs(_model(6, "none"))
    temp_q, temp_f = max(t for _, t in deep), max(t for _, t in fp)
    assert temp_q <= MAX_TEMP_MULTIPLE * temp_f, (temp_q, temp_f)
    # the former single program: its size grew with every quantized block (what compiled to >7.5 GB on SmolLM2)
    g, s = nnx.split(_model(6, "hif8"))
    tok = jnp.zeros((ROWS, LENGTH), jnp.int32)
    whole = ev._ll_sums.lower(g, s, tok, tok, jnp.zeros((ROWS, LENGTH), bool)).compile()
    assert _n_instructions(whole) > 5 * max(n for n, _ in deep)
    assert whole.memory_analysis().temp_size_in_bytes > MAX_TEMP_MULTIPLE * temp_f


@pytest.mark.parametrize("quantize", ["none", "hif8"])
def test_block_by_block_scores_equal_the_whole_forward_program_bitwise(quantize, monkeypatch):
    model = _model(3, quantize)
    rng = np.random.default_rng(0)
    reqs = [ev.Request(tuple(int(t) for t in rng.integers(0, 96, n)), max(1, n // 3)) for n in (5, 9, 17, 30, 64, 3)]
    before = ev._block._cache_size()
    blocks, greedy, _ = ev.score_requests(model, reqs, batch_size=4, greedy=True)
    assert ev._block._cache_size() - before <= 2  # two padded lengths (64 and 16: ev._bucket), one block structure
    whole = ev._Forward(model)
    whole.blocks = None  # the former path: the whole forward pass as one program (_ll_sums)
    monkeypatch.setattr(ev, "_Forward", lambda m, *a, **k: whole)
    ll, top, _ = ev.score_requests(model, reqs, batch_size=4, greedy=True)
    np.testing.assert_array_equal(blocks, ll)
    np.testing.assert_array_equal(greedy, top)


def test_generation_runs_block_by_block_with_one_shared_program():
    """`models.generate` of a quantized model: one block program per token count (prefill, decode) shared by every
    block, whatever the depth, and the same tokens as the whole-step program it ran before (greedy decoding of
    float32 logits; the two programs compute the same values in the same order per block)."""
    from jaxlowfp import execution
    from jaxlowfp.models.llama import _gen_block, generate

    model = _model(4, "hif8")
    prompts = [[5, 9, 17, 3], [30, 2]]
    before = _gen_block._cache_size()
    tokens = generate(model, prompts, max_new_tokens=6)
    assert _gen_block._cache_size() - before == 2  # prefill and decode, for all 4 blocks
    assert execution.check_executed(model) == ()  # the blocks sharing the program are marked executed
    assert generate(model, prompts, max_new_tokens=6, blockwise=False) == tokens
    sampled = dict(max_new_tokens=6, temperature=0.8, seed=3)  # the same programs (the temperature is traced)
    assert generate(model, prompts, **sampled) == generate(model, prompts, blockwise=False, **sampled)
    with pytest.raises(TypeError, match="blockwise"):
        generate(model, prompts, max_new_tokens=1, blockwise="yes")


def test_float_generation_shares_one_block_program_too():
    """A float model generates block by block by default as well (issue 44: generation compiles one block program
    per token count, not the whole model), with the tokens of the whole-step program."""
    from jaxlowfp.models.llama import _gen_block, generate

    model = _model(3, "none")
    prompts = [[7, 1, 40], [11]]
    before = _gen_block._cache_size()
    tokens = generate(model, prompts, max_new_tokens=5)
    assert _gen_block._cache_size() - before == 2  # prefill and decode, for all 3 blocks
    assert generate(model, prompts, max_new_tokens=5, blockwise=False) == tokens
