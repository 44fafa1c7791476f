"""``python -m train stream``: delayed scaling on a real model without training.

    python -m train stream --model smollm2-135m
    python -m train stream --model smollm2-135m --algorithms most_recent,max_window --batches 4

Real evaluation batches (held-out Python standard library, Shakespeare and English prose, `train.text_eval`) are
streamed through the model with HiF8 W8A8 fake quantization of the middle blocks' MLP projections
(`jaxlowfp.qnnx.paper_rules`, SmolLM2: blocks 3..27 of 30), once per scaling algorithm, every quantized tensor
carrying its delayed-scaling state from batch to batch as in training (``most_recent``, ``ema``, ``max_window``
over ``--history-len`` batches, and current scaling, which has no delay). Batch ``t`` is quantized with the
estimate from batches ``0..t-1`` (the first batch falls back to its own amax), so an activation whose amax rises
above the estimate is clipped to it. Per algorithm the command reports the token perplexity of the stream (against
the high-precision model), the clipped fraction of every quantized activation per batch, and, per layer, the input
channels whose values were clipped (a channel is one column of the layer's input, ``x[..., c]``).

The counting is exact: a value counts as clipped when ``|x| > estimate`` (what `jaxlowfp.qat` counts as saturated,
`QuantStats.saturated_fraction`); the per-channel counts add up to it.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .report import text_table

__all__ = [
    "ALGORITHMS",
    "ChannelProbe",
    "StreamResult",
    "main",
    "parse_args",
    "probe_model",
    "recipe_for",
    "run_stream",
    "stream_batches",
    "summarize",
]

ALGORITHMS = ("most_recent", "ema", "max_window", "current")
TEXT_ORDER = ("python", "shakespeare", "prose")


class ClippedCount(nnx.Variable):
    """int32 [in_features]: per input channel, the values of the last call above the amax estimate (clipped)."""


class ChannelAmax(nnx.Variable):
    """float32 [in_features]: per input channel, max |x| of the last call."""


class ChannelProbe(nnx.Module):
    """A `jaxlowfp.qnnx.QuantLinear` that also counts, per input channel, the activations its scale clipped.

    After the layer's call, with its activation statistics ``est = amax_estimate`` and ``scale``:
    ``clipped[c] = #{|x[..., c]| > bound}``, ``bound = est`` (or ``target * scale`` when ``est`` is 0/NaN/Inf),
    the saturation count of `jaxlowfp.qat` split by channel; ``channel_amax[c] = max |x[..., c]|``.
    """

    def __init__(self, layer: Any) -> None:
        self.layer = layer
        d = layer.kernel.shape[0]
        self.clipped = ClippedCount(jnp.zeros((d,), jnp.int32))
        self.channel_amax = ChannelAmax(jnp.zeros((d,), jnp.float32))

    def __call__(self, x: jax.Array, *args: Any, **kw: Any) -> jax.Array:
        y = self.layer(x, *args, **kw)
        act = self.layer.stats.get_value().activation
        spec = self.layer.recipe.activation
        xq = x if self.layer.dtype is None else x.astype(self.layer.dtype)  # what the layer quantized
        a = jnp.abs(xq.astype(jnp.float32)).reshape(-1, x.shape[-1])
        est = act.amax_estimate
        bound = jnp.where(jnp.isfinite(est) & (est > 0), est, jnp.float32(spec.clip_bound) * act.scale)
        self.clipped.set_value(jnp.sum(a > bound, axis=0, dtype=jnp.int32))
        self.channel_amax.set_value(jnp.max(a, axis=0))
        return y


def recipe_for(algorithm: str, history_len: int = 64) -> Any:
    """HiF8 W8A8 with per-tensor `algorithm` delayed scaling (or current scaling): `train.grid.make_recipe`."""
    from .grid import ArmSpec, make_recipe

    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is not supported; allowed: {', '.join(ALGORITHMS)}")
    return make_recipe(ArmSpec(name=algorithm, label=algorithm, format="hif8", algorithm=algorithm,
                               history_len=history_len, warmup_steps=0))


def _resolve(model: nnx.Module, path: str) -> tuple[Any, str]:
    node: Any = model
    parts = path.split("/")
    for p in parts[:-1]:
        node = node[int(p)] if p.isdigit() else getattr(node, p)
    return node, parts[-1]


def probe_model(model: nnx.Module, recipe: Any, *, keep_first: int, keep_last: int) -> list[str]:
    """Quantize `model` in place (`paper_rules` with `recipe`) and wrap every quantized layer in a `ChannelProbe`;
    returns the quantized layers' paths (``blocks/<i>/mlp/<name>``)."""
    from jaxlowfp.qnnx import iter_quant_linears, paper_rules, quantize_model

    report = quantize_model(model, paper_rules(model.config.n_layers, keep_first=keep_first, keep_last=keep_last,
                                         recipe=recipe))
    if not report.quantized:
        raise ValueError("the rules quantized no layer: the model has no blocks/<i>/mlp/<proj> linear layers")
    paths = [p for p, _ in iter_quant_linears(model)]
    for path in paths:
        parent, name = _resolve(model, path)
        setattr(parent, name, ChannelProbe(getattr(parent, name)))
    return paths


def stream_batches(tokenizer: Any, texts: dict[str, list[str]], *, batch_size: int, seq_len: int,
                   batches_per_text: int, order: str = "interleave") -> list[tuple[str, np.ndarray]]:
    """``(text name, int32 [batch_size, seq_len + 1])`` batches: each text's documents tokenized and joined with
    EOS, cut into windows spread evenly over the text (`train.data.eval_batches`); ``order="interleave"`` takes one
    batch of each text in turn (the amax moves with the domain), ``"sequential"`` one text after the other."""
    from .real_qat import token_eval_batches

    if order not in ("interleave", "sequential"):
        raise ValueError(f"order={order!r} is not supported; allowed: 'interleave', 'sequential'")
    eos = [] if tokenizer.eos_id is None else [int(tokenizer.eos_id)]
    per_text = {}
    for name, docs in texts.items():
        ids = np.concatenate([np.asarray(t + eos, np.int32) for t in tokenizer.encode_batch(list(docs))])
        per_text[name] = token_eval_batches(ids, batch_size=batch_size, seq_len=seq_len,
                                            max_batches=batches_per_text)
    if order == "sequential":
        return [(name, b) for name, bs in per_text.items() for b in bs]
    out = []
    for i in range(max(len(bs) for bs in per_text.values())):
        out += [(name, bs[i]) for name, bs in per_text.items() if i < len(bs)]
    return out


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef: nnx.GraphDef, params: nnx.State, rest: nnx.State, batch: jax.Array
             ) -> tuple[jax.Array, nnx.State]:
    """Per row: summed next-token log-likelihood; and the new non-parameter state (amax histories, statistics)."""
    from jaxlowfp.models.llama import token_log_likelihood

    model = nnx.merge(graphdef, params, rest)
    ll = jnp.sum(token_log_likelihood(model, batch), axis=-1)
    return ll, nnx.split(model, nnx.Param, ...)[2]


@dataclasses.dataclass
class StreamResult:
    """One algorithm's pass over the stream. Arrays are per batch ``[n_batches]`` or per layer and batch
    ``[n_layers, n_batches]``; channel arrays ``[n_layers]`` of ``[in_features]``."""

    algorithm: str
    layers: list[str]
    texts: list[str]  # the text of every batch
    log_likelihood: np.ndarray  # [n_batches] summed over the batch's tokens
    tokens: int  # scored tokens per batch
    saturated: np.ndarray  # [n_layers, n_batches] clipped fraction of the layer's input
    amax: np.ndarray  # [n_layers, n_batches] observed input amax
    estimate: np.ndarray  # [n_layers, n_batches] the amax estimate the scale came from
    clipped: list[np.ndarray]  # [n_layers] int64 [in_features]: clipped values per channel over the stream
    channel_amax: list[np.ndarray]  # [n_layers] float32 [in_features]: max |x| per channel over the stream
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(-float(self.log_likelihood.sum()) / (self.tokens * len(self.log_likelihood)))

    def text_perplexity(self, name: str) -> float:
        ll = self.log_likelihood[[i for i, t in enumerate(self.texts) if t == name]]
        return math.exp(-float(ll.sum()) / (self.tokens * len(ll)))


def run_stream(model: nnx.Module, batches: Sequence[tuple[str, np.ndarray]], algorithm: str | None, *,
               history_len: int = 64, keep_first: int = 3, keep_last: int = 2, progress: bool = False) -> StreamResult:
    """Stream `batches` through a copy of `model` quantized with `algorithm` (None: high precision, for the
    reference perplexity), its scaling state carried from batch to batch. `model` itself is not changed."""
    graphdef, state = nnx.split(model)
    m = nnx.merge(graphdef, state)  # shares the parameter arrays; quantize swaps modules in this view only
    layers = [] if algorithm is None else probe_model(m, recipe_for(algorithm, history_len), keep_first=keep_first,
                                                      keep_last=keep_last)
    graphdef, params, rest = nnx.split(m, nnx.Param, ...)
    probes = [_resolve(m, p) for p in layers]
    n, t = len(batches), batches[0][1].shape
    sat, amax, est = (np.zeros((len(layers), n), np.float64) for _ in range(3))
    clipped = [np.zeros(getattr(par, name).clipped.shape, np.int64) for par, name in probes]
    ch_amax = [np.zeros(getattr(par, name).clipped.shape, np.float32) for par, name in probes]
    ll = np.zeros(n, np.float64)
    t0 = time.perf_counter()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=n, desc=algorithm or "high precision", file=sys.stderr, leave=False)
    for i, (_, batch) in enumerate(batches):
        if batch.shape != t:
            raise ValueError(f"every batch must have shape {t}; batch {i} has {batch.shape}")
        rows, rest = _forward(graphdef, params, rest, jnp.asarray(batch))
        ll[i] = float(np.sum(np.asarray(rows, np.float64)))
        if layers:
            nnx.update(m, rest)
            for j, (par, name) in enumerate(probes):
                probe = getattr(par, name)
                s = probe.layer.stats.get_value().activation
                sat[j, i], amax[j, i], est[j, i] = (float(v) for v in
                                                    jax.device_get((s.saturated_fraction, s.amax, s.amax_estimate)))
                c, a = jax.device_get((probe.clipped.get_value(), probe.channel_amax.get_value()))
                clipped[j] += np.asarray(c, np.int64)
                ch_amax[j] = np.maximum(ch_amax[j], np.asarray(a))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return StreamResult(algorithm or "high precision", layers, [name for name, _ in batches], ll, t[0] * (t[1] - 1),
                        sat, amax, est, clipped, ch_amax, time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------------------------
# report


def summarize(results: Sequence[StreamResult], reference: StreamResult | None) -> list[dict[str, Any]]:
    """One row per algorithm: perplexity (and its change vs `reference`), the clipped fraction averaged over
    layers and batches, the largest (layer, batch), how many layers and batches clipped at all."""
    rows = []
    for r in results:
        row = {"algorithm": r.algorithm, "ppl": r.perplexity,
               "ppl_change": None if reference is None or r is reference else
               100.0 * (r.perplexity / reference.perplexity - 1.0),
               "layers": len(r.layers), "batches": r.saturated.shape[1], "seconds": r.seconds}
        if r.layers:
            j, i = np.unravel_index(int(np.argmax(r.saturated)), r.saturated.shape)
            row |= {"mean_clipped": float(r.saturated.mean()), "max_clipped": float(r.saturated.max()),
                    "max_at": f"{r.layers[j]} @ batch {i}" if r.saturated.max() > 0 else "-",
                    "layers_clipping": int((r.saturated.max(axis=1) > 0).sum()),
                    "batches_clipping": int((r.saturated.max(axis=0) > 0).sum())}
        for name in dict.fromkeys(r.texts):
            row[f"ppl_{name}"] = r.text_perplexity(name)
        rows.append(row)
    return rows


def outlier_channels(result: StreamResult, *, top_layers: int = 5, top_channels: int = 3) -> list[dict[str, Any]]:
    """The `top_layers` layers with the most clipped values and, in each, the `top_channels` channels holding the
    most of them: their share of the layer's clipped values and their max |x| against the layer's median channel
    max (how far out the outlier channel sits)."""
    totals = np.array([c.sum() for c in result.clipped])
    out = []
    for j in np.argsort(-totals, kind="stable")[:top_layers]:
        if totals[j] == 0:
            break
        c, a = result.clipped[j], result.channel_amax[j]
        med = float(np.median(a))
        for ch in np.argsort(-c, kind="stable")[:top_channels]:
            if c[ch] == 0:
                break
            out.append({"layer": result.layers[j], "channel": int(ch), "clipped": int(c[ch]),
                        "share": float(c[ch] / totals[j]), "channel_amax": float(a[ch]),
                        "x_median_channel": float(a[ch] / med) if med > 0 else math.inf,
                        "layer_clipped_fraction": float(result.saturated[j].mean())})
    return out


def summary_table(rows: Sequence[dict[str, Any]], markdown: bool = False) -> str:
    texts = [k[4:] for k in rows[0] if k.startswith("ppl_") and k != "ppl_change"]
    header = ["algorithm", "token ppl", "ppl change %", *[f"{t} ppl" for t in texts], "mean clipped", "max clipped",
              "layers clipping", "batches clipping"]
    body = []
    for r in rows:
        change = "-" if r["ppl_change"] is None else f"{r['ppl_change']:+.3f}"
        quantized = r["layers"] > 0
        body.append([r["algorithm"], f"{r['ppl']:.4f}", change, *[f"{r['ppl_' + t]:.4f}" for t in texts],
                     f"{r['mean_clipped']:.2e}" if quantized else "-", f"{r['max_clipped']:.2e}" if quantized else "-",
                     f"{r['layers_clipping']}/{r['layers']}" if quantized else "-",
                     f"{r['batches_clipping']}/{r['batches']}" if quantized else "-"])
    return text_table(header, body, markdown=markdown)


def layer_table(results: Sequence[StreamResult], markdown: bool = False, top: int | None = None) -> str:
    """Mean clipped fraction over the stream per layer (rows) and algorithm (columns), most clipped first."""
    layers = results[0].layers
    mat = np.stack([r.saturated.mean(axis=1) for r in results], axis=1)  # [layers, algorithms]
    order = np.argsort(-mat.max(axis=1), kind="stable")
    if top is not None:
        order = order[:top]
    body = [[layers[j], *[f"{v:.2e}" for v in mat[j]]] for j in order]
    return text_table(["layer", *[r.algorithm for r in results]], body, markdown=markdown)


def channel_table(result: StreamResult, markdown: bool = False, **kw: Any) -> str:
    rows = outlier_channels(result, **kw)
    body = [[r["layer"], str(r["channel"]), str(r["clipped"]), f"{100 * r['share']:.1f}", f"{r['channel_amax']:.1f}",
             f"{r['x_median_channel']:.1f}", f"{r['layer_clipped_fraction']:.2e}"] for r in rows]
    return text_table(["layer", "channel", "clipped values", "% of layer's", "channel max |x|", "x median channel",
                       "layer clipped fraction"], body, markdown=markdown)


def plot_estimates(result: StreamResult, path: Path, layer: str | None = None) -> str:
    """Observed input amax and the estimate of one layer (default: the most clipped) over the stream."""
    from matplotlib.figure import Figure

    j = int(np.argmax(result.saturated.mean(axis=1))) if layer is None else result.layers.index(layer)
    fig = Figure(figsize=(7, 3.2), layout="constrained")
    ax = fig.subplots()
    x = np.arange(result.amax.shape[1])
    ax.plot(x, result.amax[j], "o-", lw=1, ms=3, label="observed amax")
    ax.plot(x, result.estimate[j], "s--", lw=1, ms=3, label=f"estimate ({result.algorithm})")
    clipped = result.saturated[j] > 0
    ax.plot(x[clipped], result.amax[j][clipped], "rx", ms=7, label="batch with clipping")
    ax.set(xlabel="batch", ylabel="|x| max", title=f"{result.layers[j]}: input amax vs delayed estimate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    return result.layers[j]


# ---------------------------------------------------------------------------------------------------------------
# command line


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int; got {text}")
    return v


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train stream", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m",
                   help="registry name (smollm2-135m), a .gguf file or a Hugging Face directory (default: %(default)s)")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS),
                   help=f"comma separated, from {', '.join(ALGORITHMS)} (default: all)")
    p.add_argument("--history-len", type=_positive, default=64, help="window of max_window (default: %(default)s)")
    p.add_argument("--texts", default=",".join(TEXT_ORDER), help="comma separated (default: %(default)s)")
    p.add_argument("--batches", type=_positive, default=4, help="batches per text (default: %(default)s)")
    p.add_argument("--batch-size", type=_positive, default=4, help="(default: %(default)s)")
    p.add_argument("--seq-len", type=_positive, default=128, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--order", choices=("interleave", "sequential"), default="interleave",
                   help="interleave the texts batch by batch, or one after the other (default: %(default)s)")
    p.add_argument("--keep-first", type=int, default=3)
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--out", default=None, help="report directory (default: runs/stream-<model>)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(list(argv))
    args.algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    bad = [a for a in args.algorithms if a not in ALGORITHMS]
    if bad or not args.algorithms:
        p.error(f"--algorithms: unknown {bad}; allowed: {', '.join(ALGORITHMS)}")
    from .text_eval import TEXTS

    args.texts = [t.strip() for t in args.texts.split(",") if t.strip()]
    bad = [t for t in args.texts if t not in TEXTS]
    if bad or not args.texts:
        p.error(f"--texts: unknown {bad}; allowed: {', '.join(TEXTS)}")
    if args.keep_first < 0 or args.keep_last < 0:
        p.error("--keep-first and --keep-last must be >= 0")
    return args


def _name(model: str) -> str:
    return model.rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from .data import DataError
    from jaxlowfp.models import CheckpointError, load
    from .text_eval import load_texts

    t0 = time.perf_counter()
    try:
        model, tok = load(args.model, dtype=args.dtype)
    except CheckpointError as e:
        raise SystemExit(f"error: --model {args.model!r}: {e}") from e
    n = model.config.n_layers
    if args.keep_first + args.keep_last >= n:
        raise SystemExit(f"error: --keep-first {args.keep_first} + --keep-last {args.keep_last} leaves none of the "
                         f"{n} blocks of {args.model} to quantize")
    if args.seq_len > model.config.max_seq_len:
        raise SystemExit(f"error: --seq-len {args.seq_len} exceeds the model's max_seq_len {model.config.max_seq_len}")
    try:
        texts = load_texts(args.texts)
    except DataError as e:
        raise SystemExit(f"error: {e}") from e
    batches = stream_batches(tok, texts, batch_size=args.batch_size, seq_len=args.seq_len,
                             batches_per_text=args.batches, order=args.order)
    print(f"model {args.model}: {n} blocks, quantized MLPs of blocks {args.keep_first}..{n - args.keep_last - 1}; "
          f"stream of {len(batches)} batches of {args.batch_size} x {args.seq_len} tokens ({args.order}: "
          f"{', '.join(args.texts)})", file=sys.stderr)
    kw = dict(history_len=args.history_len, keep_first=args.keep_first, keep_last=args.keep_last,
              progress=not args.no_progress)
    reference = run_stream(model, batches, None, **kw)
    results = [run_stream(model, batches, a, **kw) for a in args.algorithms]
    rows = summarize([reference, *results], reference)
    wall = time.perf_counter() - t0

    print(summary_table(rows))
    print()
    print("most clipped layers (mean clipped fraction of the layer's input over the stream):")
    print(layer_table(results, top=10))
    worst = max(results, key=lambda r: r.saturated.mean())
    print()
    print(f"channels holding the clipped values ({worst.algorithm}):")
    print(channel_table(worst))
    print(f"total wall time {wall:.0f} s")

    out = Path(args.out or f"runs/stream-{_name(args.model)}")
    out.mkdir(parents=True, exist_ok=True)
    plots = []
    for r in results:
        if r.saturated.max() > 0:
            layer = plot_estimates(r, out / f"amax_{r.algorithm}.png")
            plots.append(f"![amax_{r.algorithm}.png](amax_{r.algorithm}.png)\n\n{r.algorithm}: {layer}, the layer "
                         "it clips most.")
    channels = "\n\n".join(f"### {r.algorithm}\n\n{channel_table(r, markdown=True)}" for r in results
                           if r.saturated.max() > 0) or "No algorithm clipped any value."
    report = "\n\n".join([
        f"# Delayed scaling on {args.model} without training",
        f"HiF8 W8A8 fake quantization of the MLP projections of blocks {args.keep_first}..{n - args.keep_last - 1} "
        f"({len(results[0].layers) if results else 0} layers); a stream of {len(batches)} batches of "
        f"{args.batch_size} x {args.seq_len} tokens ({args.order}: {', '.join(args.texts)}); max_window over "
        f"{args.history_len} batches; each quantized tensor's scale comes from the amaxes of the earlier batches.",
        summary_table(rows, markdown=True),
        "**token ppl**: perplexity of the stream's tokens (per text next to it); **ppl change**: against high "
        "precision; **mean clipped**: the fraction of a quantized layer's input clipped by its scale, averaged over "
        "layers and batches; **max clipped**: the largest for one layer and batch; **layers / batches clipping**: "
        "how many clipped at least one value.",
        "## Clipped fraction per layer (mean over the stream)",
        layer_table(results, markdown=True),
        "## Channels holding the clipped values",
        "For the layers with the most clipped values: the input channels that hold most of them, their largest "
        "|x| and how many times the median channel's largest |x| that is.",
        channels,
        "## Estimate vs observed amax",
        *plots,
        f"Total wall time {wall:.0f} s.",
    ]) + "\n"
    (out / "report.md").write_text(report)
    (out / "results.json").write_text(json.dumps({"rows": rows, "channels": {r.algorithm: outlier_channels(r)
                                                                             for r in results},
                                                  "args": vars(args), "wall_s": wall}, indent=1, default=str))
    print(f"report: {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
