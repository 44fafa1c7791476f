"""Mixture-of-experts models (Qwen3-MoE, Mixtral, OLMoE) against transformers and llama.cpp.

Judges (fixtures under tests/fixtures/moe/, written by scripts/make_moe_fixtures.py): tiny random checkpoints
saved by transformers 5.24 itself (original per-expert layout for Qwen3-MoE, Mixtral and OLMoE, transformers' fused
``gate_up_proj`` layout for a Qwen3-MoE with a dense layer, no top-k renormalisation and tied embeddings), with
transformers' float32 logits, router logits, routed experts and greedy continuations; the same checkpoints
converted to GGUF by llama.cpp's ``convert_hf_to_gguf.py``, with llama.cpp's own logits.

Tolerances: logits within 1e-4 absolute (|logits| <= 35 here). Both sides are float32 programs that sum in
different orders (XLA here, PyTorch or ggml there); the measured differences are <= 1e-5, and an error in a
weight, a routing weight or a chosen expert moves logits by O(0.1-1). Routed experts must be equal (integers): the
fixture's seeds were kept only where the k-th and (k+1)-th routing probabilities differ by > 1e-4 for every token,
far above float32 rounding of a softmax.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlowfp.models import CheckpointError, MoEConfig, MoEDecoder, expert_paths, generate, load, with_experts_impl
from jaxlowfp.models.moe import Experts, MoEMLP

FIX = Path(__file__).parent / "fixtures" / "moe"
HF = ("qwen3_moe", "mixtral", "qwen3_moe_fused", "olmoe")
GGUF = ("qwen3_moe", "mixtral", "olmoe")
GENERATE = ("qwen3_moe", "mixtral", "qwen3_moe_fused")  # the decoding loop is the same for every family
ATOL = 1e-4

forward = jax.jit(lambda m, x: m(x))


@pytest.fixture(scope="module")
def models():
    """Every fixture checkpoint loaded once: ``{name or name.gguf: (model, tokenizer)}``."""
    out = {n: load(FIX / n) for n in HF}
    out |= {f"{n}.gguf": load(FIX / f"{n}.gguf") for n in GGUF}
    return out


def _fixture(name: str) -> dict:
    return dict(np.load(FIX / f"{name.removesuffix('.gguf')}.npz"))


@jax.jit
def _routing(model, tokens):
    """Logits, and the router logits [L, N, E] and routed experts [L, N, k] of the sparse layers, computed through
    the model's own modules in the order of `jaxlowfp.models.llama.Block`."""
    x = model.embed(tokens)
    logits, experts = [], []
    for block in model.blocks:
        x = x + block.attn(block.attn_norm(x))[0].astype(jnp.float32)
        h = block.mlp_norm(x)
        if isinstance(block.mlp, MoEMLP):
            flat = h.reshape(-1, h.shape[-1])
            logits.append(block.mlp.router(flat))
            experts.append(block.mlp.route(flat)[1])
        x = x + block.mlp(h).astype(jnp.float32)
    return model._head(x), jnp.stack(logits), jnp.stack(experts)


@pytest.mark.parametrize("name", [*HF, *(f"{n}.gguf" for n in GGUF)])
def test_logits_and_routing_match_transformers(models, name):
    model, _ = models[name]
    fx = _fixture(name)
    assert isinstance(model, MoEDecoder)
    assert fx["min_router_gap"] > 1e-4
    ours, r_logits, experts = _routing(model, jnp.asarray(fx["tokens"]))
    np.testing.assert_allclose(np.asarray(ours), fx["logits"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(r_logits), fx["router_logits"], atol=ATOL, rtol=0)
    np.testing.assert_array_equal(np.asarray(experts), fx["topk"])


@pytest.mark.parametrize("name", GGUF)
def test_gguf_logits_match_llamacpp(models, name):
    """llama.cpp's own forward of the GGUF file (F32 KV cache) against ours of the same file."""
    model, _ = models[f"{name}.gguf"]
    fx = _fixture(name)
    ref = np.load(FIX / f"{name}.llamacpp.npz")["logits"]
    np.testing.assert_allclose(np.asarray(forward(model, jnp.asarray(fx["tokens"]))), ref, atol=ATOL, rtol=0)


def test_bfloat16_compute():
    """``dtype="bfloat16"``: matmuls in bfloat16 (router logits too, as transformers computes them in the model
    dtype), softmax, routing weights and residual stream in float32. Against transformers' float32 logits: a
    mean difference of 5e-3 measured (bfloat16 has 8 bits of precision)."""
    model, _ = load(FIX / "qwen3_moe", dtype="bfloat16")
    assert model.blocks[0].mlp.experts.dtype == jnp.bfloat16
    fx = _fixture("qwen3_moe")
    ours = np.asarray(forward(model, jnp.asarray(fx["tokens"])))
    assert ours.dtype == np.float32 and np.abs(ours - fx["logits"]).mean() < 0.02


def test_loaded_configs_and_paths(models):
    q, m, f, o = (models[n][0].config for n in HF)
    assert (q.n_experts, q.n_experts_per_tok, q.d_expert, q.norm_topk_prob, q.qk_norm) == (8, 2, 16, True, True)
    assert (m.n_experts, m.n_experts_per_tok, m.d_expert, m.norm_topk_prob, m.qk_norm) == (4, 2, 24, True, False)
    assert (f.dense_layers, f.norm_topk_prob, f.tie_embeddings) == ((0,), False, True)
    assert (o.n_experts, o.d_expert, o.norm_topk_prob, o.qk_norm, o.qk_norm_all_heads) == (4, 24, False, True, True)
    # llama.cpp's converter kept everything the model needs (norm_eps as float32 there)
    assert dataclasses.replace(models["olmoe.gguf"][0].config, norm_eps=o.norm_eps) == o
    assert models["olmoe"][0].blocks[0].attn.q_norm.scale.shape == (32,)  # all 4 heads of 8
    gq = models["qwen3_moe.gguf"][0].config
    assert (gq.n_experts, gq.n_experts_per_tok, gq.d_expert, gq.dense_layers) == (8, 2, 16, ())
    paths = {"/".join(map(str, p)) for p, v in nnx.iter_graph(models["qwen3_moe_fused"][0])
             if isinstance(v, nnx.Variable)}
    assert {"blocks/1/mlp/router/kernel", *expert_paths(f), "blocks/0/mlp/gate_proj/kernel"} <= paths
    assert expert_paths(f) == [f"blocks/1/mlp/experts/{w}" for w in ("gate_proj", "up_proj", "down_proj")]
    assert models["mixtral"][0].blocks[0].mlp.experts.down_proj.shape == (4, 24, 32)


def test_gguf_tokenizer_matches_the_hf_tokenizer(models):
    text = "The router picks two experts; quantized to four bits."
    for name in GGUF:
        assert models[f"{name}.gguf"][1].encode(text) == models[name][1].encode(text)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe_fused"])  # the experts are the same module in every family
def test_ragged_dot_equals_the_dense_reference(models, name):
    model, _ = models[name]
    tokens = jnp.asarray(_fixture(name)["tokens"])
    dense = with_experts_impl(model, "dense")
    assert dense.config.experts_impl == "dense" and model.config.experts_impl == "ragged"
    np.testing.assert_allclose(np.asarray(forward(model, tokens)), np.asarray(forward(dense, tokens)),
                               atol=1e-5, rtol=0)


def test_experts_ragged_dense_and_a_per_token_loop_agree_with_unused_experts():
    """Random experts, routing that never picks experts 2 and 5 (``ragged_dot`` groups of size 0), against a plain
    per-token numpy loop."""
    e, d, f, n, k = 6, 8, 12, 10, 2
    ex = Experts(e, d, f, jnp.float32, jnp.float32, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, d)).astype(np.float32)
    choice = np.array([[a, b] for a, b in (rng.choice([0, 1, 3, 4], 2, replace=False) for _ in range(n))], np.int32)
    w = rng.dirichlet(np.ones(k), n).astype(np.float32)
    gate, up, down = (np.asarray(getattr(ex, p)[...], np.float64) for p in ("gate_proj", "up_proj", "down_proj"))
    want = np.zeros((n, d))
    for t in range(n):
        for j in range(k):
            g, u = x[t] @ gate[choice[t, j]], x[t] @ up[choice[t, j]]
            want[t] += w[t, j] * ((g / (1 + np.exp(-g)) * u) @ down[choice[t, j]])
    grads = {}
    for impl in ("ragged", "dense"):
        got = jax.jit(lambda m, a, b, c, impl=impl: m(a, b, c, impl))(ex, x, w, choice)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
        # gradients (for training later): the weights of unused experts get exactly zero in both
        def loss(m, impl=impl):
            return jnp.sum(m(jnp.asarray(x), jnp.asarray(w), jnp.asarray(choice), impl) ** 2)

        grads[impl] = jax.jit(nnx.grad(loss))(ex)
    for p in ("gate_proj", "up_proj", "down_proj"):
        r, d_ = (np.asarray(grads[i][p][...]) for i in ("ragged", "dense"))
        np.testing.assert_allclose(r, d_, atol=1e-4, rtol=1e-4)
        assert not r[[2, 5]].any() and r[[0, 1, 3, 4]].any()


@pytest.mark.parametrize("name", GENERATE)
def test_greedy_generation_matches_transformers_and_the_no_cache_argmax(models, name):
    """Greedy generation with the KV cache gives transformers' greedy tokens; with a second, shorter prompt in the
    same left-padded batch, every row's tokens are the argmax of the plain no-cache forward of its prompt and
    tokens so far (one right-padded batch: the forward is causal)."""
    model, _ = models[name]
    fx = _fixture(name)
    assert fx["min_greedy_gap"] > 1e-3
    prompts = [fx["prompt"].tolist(), [77, 8, 250]]
    out = generate(model, prompts, max_new_tokens=len(fx["greedy"]))
    assert out[0] == fx["greedy"].tolist()
    seqs = np.zeros_like(fx["tokens"])  # [3, 16]: the shape the logits test compiled
    for i, (p, new) in enumerate(zip(prompts, out, strict=True)):
        seqs[i, :len(p) + len(new)] = p + new
    logits = np.asarray(forward(model, jnp.asarray(seqs)))
    for i, (p, new) in enumerate(zip(prompts, out, strict=True)):
        assert logits[i, len(p) - 1:len(p) + len(new) - 1].argmax(-1).tolist() == new


def test_ptq_blocks_and_smoothing_folds(models):
    model, _ = models["qwen3_moe_fused"]
    tokens = jnp.asarray(_fixture("qwen3_moe_fused")["tokens"])
    embed, blocks, head = model.ptq_blocks()

    @jax.jit
    def sequential(model, tokens):
        x = embed(model, tokens)
        for path, call in blocks:
            x = call(model.blocks[int(path.split("/")[1])], x)
        return head(model, x)

    np.testing.assert_allclose(np.asarray(sequential(model, tokens)), np.asarray(forward(model, tokens)),
                               atol=1e-5, rtol=0)
    folds, skipped = model.smoothing_folds()
    assert ("blocks/0/mlp_norm", ("blocks/0/mlp/gate_proj", "blocks/0/mlp/up_proj")) in folds  # the dense layer
    assert not any(prev.startswith("blocks/1/mlp") for prev, _ in folds)
    assert {"blocks/1/mlp/router", "blocks/1/mlp/experts"} <= {p for p, _ in skipped}


def test_dense_writers_refuse_and_exports_write_the_moe_layout(tmp_path):
    """The dense `tensor_specs` still refuses a MoE config (a dense writer would put out a Qwen3 config.json with
    stray expert tensors); the exporters ask the model (`MoEDecoder.export_tensors`) and write the MoE layout
    (tests/test_moe_export.py checks it against the consumers)."""
    import json

    from jaxlowfp import ptq
    from jaxlowfp.models.tensor_names import tensor_specs

    model, _ = load(FIX / "qwen3_moe")
    with pytest.raises(ValueError, match="MoEConfig is a mixture of experts"):
        tensor_specs(model.config)
    result = ptq.quantize_model(model, [ptq.Rule(path="blocks/0/attn/q_proj",
                                           scheme=ptq.scheme("nvfp4-mse", weights_only=True))], method="rtn")
    ptq.export(model, result, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["num_experts"] == 8 and cfg["moe_intermediate_size"] == 16
    assert "model.layers.1.mlp.experts.7.down_proj" in cfg["quantization_config"]["ignore"]
    rep = ptq.export_gguf(model, result, tmp_path / "m.gguf", tokenizer_json=FIX / "qwen3_moe" / "tokenizer.json")
    assert "blk.1.ffn_down_exps.weight" in rep.types and "blk.1.ffn_gate_inp.weight" in rep.types


def test_random_init_and_config_validation():
    cfg = MoEConfig(vocab=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=32,
                    n_experts=4, n_experts_per_tok=2, d_expert=16, dense_layers=[1, 1], dtype="float32")
    assert cfg.dense_layers == (1,) and hash(cfg) == hash(cfg)
    model = nnx.eval_shape(lambda: MoEDecoder(cfg, rngs=nnx.Rngs(0)))
    n = sum(v.size for v in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n == cfg.num_params()
    for bad, match in [(dict(n_experts_per_tok=5), "exceeds n_experts"), (dict(experts_impl="loop"), "experts_impl"),
                       (dict(dense_layers=(2,)), "dense_layers"), (dict(d_expert=0), "d_expert")]:
        with pytest.raises(ValueError, match=match):
            MoEConfig(**{**{f: getattr(cfg, f) for f in ("vocab", "d_model", "n_layers", "n_heads", "n_kv_heads",
                                                           "d_ff", "max_seq_len", "n_experts", "n_experts_per_tok",
                                                           "d_expert")}, **bad})
    with pytest.raises(ValueError, match="experts_impl"):
        with_experts_impl(model, "sparse")


def test_hf_config_variants(tmp_path):
    """Hub checkpoints name the expert count ``num_experts`` (transformers 5 writes ``num_local_experts``);
    ``decoder_sparse_step`` makes layers ``i`` with ``(i + 1) % step != 0`` dense, as transformers builds them."""
    from jaxlowfp.models.moe_loader import read_hf_config

    d = tmp_path / "q"
    d.mkdir()
    cfg = json.loads((FIX / "qwen3_moe" / "config.json").read_text())
    cfg["num_experts"] = cfg.pop("num_local_experts")
    (d / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": 4, "decoder_sparse_step": 2,
                                                     "mlp_only_layers": [3]}))
    c = read_hf_config(d)
    assert (c.n_experts, c.dense_layers) == (8, (0, 2, 3))
    (d / "config.json").write_text(json.dumps(cfg | {"shared_expert_intermediate_size": 64}))
    with pytest.raises(CheckpointError, match="shared experts"):
        read_hf_config(d)


def _copy(tmp_path, name):
    d = tmp_path / name
    shutil.copytree(FIX / name, d)
    return d


def test_hf_errors_name_the_tensor(tmp_path):
    from safetensors.numpy import load_file, save_file

    d = _copy(tmp_path, "mixtral")
    w = load_file(str(d / "model.safetensors"))
    del w["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight is missing"):
        load(d)
    d = _copy(tmp_path, "qwen3_moe_fused")
    w = load_file(str(d / "model.safetensors"))
    w["model.layers.1.mlp.experts.gate_up_proj"] = w["model.layers.1.mlp.experts.gate_up_proj"][:, :20]
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"gate_up_proj has shape \(4, 20, 32\); \[4, 2 x 16, 32\]"):
        load(d)
    d = _copy(tmp_path, "qwen3_moe")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"num_experts_per_tok": 9}))
    with pytest.raises(CheckpointError, match="n_experts_per_tok=9 exceeds n_experts=8"):
        load(d)
    (d / "config.json").write_text(json.dumps(cfg | {"model_type": "qwen2_moe"}))
    with pytest.raises(CheckpointError, match="model_type 'qwen2_moe'"):
        load(d)


def test_gguf_errors(tmp_path):
    import gguf

    src = gguf.GGUFReader(FIX / "qwen3_moe.gguf")
    out = tmp_path / "scaled.gguf"
    writer = gguf.GGUFWriter(out, "qwen3moe")
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, vtype)
    writer.add_float32("qwen3moe.expert_weights_scale", 2.5)
    for t in src.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_shape=tuple(reversed([int(n) for n in t.shape])))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="expert_weights_scale=2.5"):
        load(out)


def test_the_readme_snippet_runs(monkeypatch, capsys):
    import re

    root = Path(__file__).resolve().parents[1]
    blocks = re.findall(r"```python\n(.*?)```", (root / "docs" / "moe.md").read_text(), re.S)  # moved from README
    (code,) = [b for b in blocks if b.startswith("# Mixture of experts")]
    monkeypatch.chdir(root)
    exec(compile(code, "docs/moe.md", "exec"), {})
    assert capsys.readouterr().out.splitlines() == ["MoEDecoder 8 2 True", "True", "8"]
