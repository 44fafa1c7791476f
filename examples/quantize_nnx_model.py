"""Quantize a Flax NNX model with jaxlowfp: HiF8 W8A8 on the MLPs of the middle blocks, the rest in high precision.

    python examples/quantize_nnx_model.py                 # 8 blocks, d_model 64, 20 steps on CPU in seconds
    python examples/quantize_nnx_model.py --blocks 4 --d-model 32 --steps 6

What it shows:
1. `jaxlowfp.qnnx.quantize_model(model, rules)` swaps matching `nnx.Linear` modules for `QuantLinear` in place and
   returns a report (what was quantized, what was kept, which rules matched nothing).
2. The functional view: `jaxlowfp.training` splits the model into params (for optax), the amax histories
   (qstate) and the rest, and builds one jitted train step `(state, batch) -> (state, metrics)`.
3. The warmup: the first steps run observe-only (high precision, histories still recorded), then the traced flag
   flips to quantized without recompiling.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxlowfp import qnnx as jnnx
from jaxlowfp import qat, training


class Block(nnx.Module):
    """Pre-norm transformer block: causal self-attention (q/k/v/o) and a SwiGLU MLP (gate/up/down)."""

    def __init__(self, d: int, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(d, rngs=rngs)
        self.attn = nnx.Dict(q_proj=nnx.Linear(d, d, rngs=rngs), k_proj=nnx.Linear(d, d, rngs=rngs),
                             v_proj=nnx.Linear(d, d, rngs=rngs), o_proj=nnx.Linear(d, d, rngs=rngs))
        self.mlp_norm = nnx.RMSNorm(d, rngs=rngs)
        self.mlp = nnx.Dict(gate_proj=nnx.Linear(d, 4 * d, use_bias=False, rngs=rngs),
                            up_proj=nnx.Linear(d, 4 * d, use_bias=False, rngs=rngs),
                            down_proj=nnx.Linear(4 * d, d, use_bias=False, rngs=rngs))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.attn_norm(x)
        q, k, v = (self.attn[n](h) for n in ("q_proj", "k_proj", "v_proj"))
        s = jnp.einsum("btd,bsd->bts", q, k) / (x.shape[-1] ** 0.5)
        s = jnp.where(jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool)), s, -1e9)
        x = x + self.attn["o_proj"](jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, axis=-1), v))
        h = self.mlp_norm(x)
        return x + self.mlp["down_proj"](jax.nn.silu(self.mlp["gate_proj"](h)) * self.mlp["up_proj"](h))


class TinyLM(nnx.Module):
    def __init__(self, vocab: int, d: int, n_blocks: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, rngs) for _ in range(n_blocks)])
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=None, help="observe-only steps (default: steps // 2)")
    args = ap.parse_args()
    warmup = args.steps // 2 if args.warmup is None else args.warmup

    model = TinyLM(args.vocab, args.d_model, args.blocks, nnx.Rngs(0))
    keep_first, keep_last = (1, 1) if args.blocks < 8 else (2, 1)
    rules = jnnx.paper_rules(args.blocks, keep_first=keep_first, keep_last=keep_last, recipe=qat.hif8_w8a8())
    rules.append(jnnx.Rule(path=r"encoder/.*", recipe=qat.hif8_w8a8()))  # a typo'd rule: the report flags it
    print("rules:")
    for r in rules:
        print(f"  {r.path!r:60} -> {r.recipe.name if r.recipe else 'high precision'}")
    report = jnnx.quantize_model(model, rules)
    print("\n" + str(report) + "\n")

    def loss_fn(m: TinyLM, tokens: jax.Array):
        logits = m(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean(), {}

    tx = optax.adam(1e-3)
    graphdef, state = training.init(model, tx)
    train_step = jax.jit(training.make_step(graphdef, tx, loss_fn, warmup=qat.Warmup(steps=warmup)))

    key = jax.random.key(1)
    for step in range(args.steps):
        key, sub = jax.random.split(key)
        # a toy task: a repeating pattern with random offsets per sequence
        tokens = (jax.random.randint(sub, (8, 1), 0, args.vocab) + jnp.arange(17)[None] * 3) % args.vocab
        state, metrics = train_step(state, tokens)
        phase = "warmup (observe only)" if bool(metrics["observe_only"]) else "quantized"
        print(f"step {step:3d}  {phase:22}  loss {float(metrics['loss']):.4f}  max saturated fraction "
              f"{float(metrics['max_saturated_fraction']):.4f}")

    nnx.update(model, state.params, state.qstate, state.rest)
    stats = jnnx.collect_stats(model)
    print("\nlast stats of one layer:")
    first = report.quantized[0][0]
    for name, value in stats.items():
        if name.startswith(first + "/"):
            print(f"  {name:60} {value:.6g}")


if __name__ == "__main__":
    main()
