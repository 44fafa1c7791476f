"""An lm-eval (EleutherAI lm-evaluation-harness) model backend for jaxlowfp models, registered as ``jaxlowfp``.

lm-eval turns a benchmark into requests of three kinds and a model backend answers them; the prompts, the answer
normalisations and the metrics stay lm-eval's, so the numbers compare with published ones:

- ``loglikelihood(context, continuation)`` -> ``(log p(continuation | context), is_greedy)``. The pair is tokenized
  by lm-eval's own ``TemplateLM`` (trailing whitespace of the context moves to the continuation; an empty context
  becomes the prefix token), then scored by `jaxlowfp.evaluation.score_requests`. A sequence longer than
  ``max_length + 1`` tokens keeps its end (left truncation, as lm-eval's HF backend; one warning says how many).
- ``loglikelihood_rolling(text)`` -> ``log p(text)``: lm-eval's disjoint rolling windows of ``max_length`` tokens
  after the prefix token (`jaxlowfp.evaluation.rolling_requests`), the sum over every token. lm-eval turns it into
  word perplexity ``exp(-LL / words)``, byte perplexity ``exp(-LL / bytes)`` and bits per byte.
- ``generate_until(context, gen_kwargs)`` -> text: `jaxlowfp.models.generate` with a KV cache, greedy or sampled
  (``do_sample``, ``temperature``, ``top_k``), ``max_gen_toks`` new tokens at most, stopped at the EOS token or at
  the first stop string of ``until`` (the text is cut there, lm-eval's ``postprocess_generated_text``). The prompt
  keeps its last ``max_length - max_gen_toks`` tokens. Other generation arguments are errors, not ignored.

Batches have ``batch_size`` rows and lengths padded to a power of two (right padding for scoring: a causal model
never looks right; left padding with an attention mask for generation), so the forward pass compiles once per
padded shape. An empty request list returns an empty list.

Model arguments (``--model_args k=v,...``; `ARGUMENTS` lists them):
  pretrained       registry name (``smollm2-135m``), ``.gguf`` file or Hugging Face directory (`jaxlowfp.models.load`)
  dtype            compute dtype ``float32`` (default) or ``bfloat16``; parameters stay float32
  ptq_export       a directory written by `jaxlowfp.ptq.export` (e.g. ``python -m train ptq --export``), loaded into
                   the ``pretrained`` architecture: the quantized weights and activation formats that were exported
  packed           how NVFP4 checkpoint weights run: ``fake`` (default: decoded into float kernels, the fake-quant
                   model) or a `jaxlowfp.backends` backend (``auto``, ``dequant``, ``scaled_matmul``, ``fp8``): the
                   ``ptq_export`` layers, or a compressed-tensors / ModelOpt NVFP4 ``pretrained`` directory, load as
                   packed layers holding the file's codes and scales (`jaxlowfp.ptq.load` / `jaxlowfp.models.load`
                   with ``packed=True``); the backend each layer ran is in ``quantization``
  quantize         fake quantization (`jaxlowfp.eval_quantize.fake_quantize_model`): ``none``, ``hif8`` (HiF8
                   W8A8, the Max-Window recipe), ``nvfp4`` (standard NVFP4 W4A4, static_6),
                   ``nvfp4-<rule>`` (static_6, static_4, abs_max, mae, mse), ``fp8`` (E4M3/E5M2 delayed scaling)
  layers           which Linear layers ``quantize`` takes: ``paper`` (default: the MLPs of blocks keep_first ..
                   n - keep_last - 1, `jaxlowfp.qnnx.paper_rules`), ``all`` (every attention and MLP projection)
                   or a regex of module paths; ``keep_first`` (3), ``keep_last`` (2)
  gemm             where ``quantize``'s forward products run (`jaxlowfp.qat.gemm`): ``dequant`` (default: the
                   dequantized operands in high precision), ``fp8`` (the float8 GEMM on the E4M3 codes: ``fp8``),
                   ``scaled_matmul`` (NVFP4 codes on ``jax.nn.scaled_matmul``, with ``act_scale=tensor``), ``auto``;
                   an explicit one that cannot run is an error; the backend that ran is in ``quantization``
  act_scale        where quantized activations get their amax: ``token`` (each token's own, dynamic), ``static``
                   (``ptq`` with calibration: each layer's calibrated input amax, what the export writes and vLLM
                   applies), ``tensor`` (the whole batch's: scores then depend on the other requests of a batch and
                   on padding), ``auto`` (default: token); recorded in ``quantization``
  ptq              post-training quantization (`jaxlowfp.eval_quantize.ptq_model`): ``none``, ``rtn``, ``gptq``,
                   ``smoothquant``, ``awq``, to ``ptq_scheme`` (default ``nvfp4-mse``; ``weights_only=true`` for
                   W4A16) of the layers matching ``ptq_layers``; all but RTN calibrate on ``calibration`` (a UTF-8
                   text file) cut into ``calib_seqs`` x ``calib_len`` tokens (8 x 256)
  batch_size (8; ``max_batch_tokens``, 32768, caps rows x padded length, fewer rows for long windows),
  max_length (the model's max_seq_len), max_gen_toks (256), prefix_token_id (BOS, else EOS),
  seed (0, for sampling), progress (false); stride (default max_length: lm-eval's disjoint rolling windows; less
  gives every later window ``max_length - stride`` tokens of extra context, which lm-eval's own backends do not)
  mesh             a device mesh, e.g. ``fsdp=4,tensor=2`` (`jaxlowfp.sharding.make_mesh`; in process also a
                   `jax.sharding.Mesh` the model= is on): ``pretrained`` loads straight into its shards
                   (`jaxlowfp.sharding.llama_rules`, `moe_rules`), batches and the KV cache are sharded;
                   ``ptq`` runs on the mesh (calibration rows over its data axes), ``packed`` loads shard the
                   packed arrays (not with ``ptq_export``)
  device, max_batch_size, trust_remote_code: accepted from lm-eval's command line and unused (JAX places the
  computation on its default backend).

The results lm-eval returns (and its ``--output_path`` JSON) hold ``config.quantization``, a record of what was
evaluated (`JaxLowFPLM.get_model_info`): kind, scheme, PTQ method, layers, activation scale, forward GEMM backend,
dtype, the jaxlowfp, lm-eval and jax versions, the device and the non-default model arguments (an in-process model
quantized by its caller: what its quantized ops say), and ``executed``: what the model held and ran, read from it after
the run (the quantized op modules, their count, how many executed, per op its scheme, activation scale and GEMM
backend; the packed weights, per weight its format, activation scale and backend; and the jaxlowfp version).

In-process (what ``python -m train eval`` does): ``JaxLowFPLM(model=model, tokenizer=tok)`` wraps a loaded (and
possibly quantized: `jaxlowfp.eval_quantize`) model, then ``lm_eval.simple_evaluate(model=lm, tasks=[...])`` or
`jaxlowfp.lm_eval_tasks.evaluate` (in-memory tasks: `jaxlowfp.lm_eval_tasks.rolling_task`, ``choice_task``).

From the command line, lm-eval 0.4.13 has no plugin mechanism that would let ``lm_eval --model jaxlowfp`` import
this module; ``python -m jaxlowfp.harness`` (console script ``jaxlowfp-lm-eval``, `jaxlowfp.lm_eval_cli`) registers
the backend and runs lm-eval's own command line with the same arguments::

    python -m jaxlowfp.harness --model jaxlowfp --model_args pretrained=smollm2-135m,quantize=hif8 \\
        --tasks hellaswag,arc_challenge,mmlu --batch_size 8

Needs the ``jaxlowfp[lm-eval]`` extra (``lm-eval``, no PyTorch) and ``jaxlowfp[models]`` for checkpoints.
"""
from __future__ import annotations

from jaxlowfp._core.surface import public_dir as _public_dir

import dataclasses
import json
import logging
import time
from typing import Any, Sequence

import numpy as np

try:
    import lm_eval
    import lm_eval.models  # the built-in backends: registered before ours, or get_model would never load them
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("jaxlowfp.harness needs lm-eval (EleutherAI's lm-evaluation-harness, no PyTorch): "
                      "pip install 'jaxlowfp[lm-eval]'") from e

from jaxlowfp._core.format import Format
from jaxlowfp._core.checks import flag, positive_int
from jaxlowfp._core.deprecation import deprecated_getattr
from jaxlowfp.eval_record import executed_record, given_model_record, layers_record
from jaxlowfp.eval_quantize import ACT_SCALES, PTQ_LAYERS, QUANTIZE, eval_recipe, fake_quantize_model, ptq_model
from jaxlowfp.evaluation import pair_request, rolling_requests, score_requests
from jaxlowfp.lm_eval_cli import main
from jaxlowfp.lm_eval_tasks import choice_task, evaluate, rolling_task

# the backend (JaxLowFPLM, its ARGUMENTS) and, re-exported from the modules that hold them, what its callers use
# with it: jaxlowfp.eval_quantize (QUANTIZE, ACT_SCALES, eval_recipe, fake_quantize_model), jaxlowfp.lm_eval_tasks
# (rolling_task, choice_task, evaluate) and jaxlowfp.lm_eval_cli (main)
__all__ = ["ACT_SCALES", "ARGUMENTS", "LM_EVAL_VERSION", "QUANTIZE", "JaxLowFPLM", "choice_task", "eval_recipe",
           "evaluate", "fake_quantize_model", "main", "rolling_task"]

log = logging.getLogger(__name__)

LM_EVAL_VERSION: str = lm_eval.__version__
_GEN_KEYS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")


def _bucket(n: int, cap: int) -> int:
    """Padded length: a power of two >= 16, at most ``cap``."""
    return min(max(16, 1 << (max(n, 1) - 1).bit_length()), cap)


def _arguments_record(a: dict[str, Any]) -> dict[str, Any]:
    """The model arguments that differ from their defaults (`ARGUMENTS`), as JSON values: the run can be repeated
    from them (an in-process object is named by its type)."""
    out = {}
    for k, v in a.items():
        if k in ("device", "max_batch_size", "trust_remote_code") or v == ARGUMENTS.get(k):
            continue
        out[k] = v if v is None or isinstance(v, (str, int, float, bool)) else type(v).__name__
    return out


# every model argument and its default (the constructor's keyword arguments)
ARGUMENTS: dict[str, Any] = {
    "pretrained": None, "model": None, "tokenizer": None, "dtype": "float32", "ptq_export": None, "packed": "fake",
    "quantize": "none", "gemm": "dequant", "layers": "paper", "keep_first": 3, "keep_last": 2, "act_scale": "auto",
    "ptq": "none", "ptq_scheme": "nvfp4-mse", "ptq_layers": PTQ_LAYERS, "weights_only": False, "calibration": None,
    "calib_seqs": 8, "calib_len": 256,
    "batch_size": 8, "max_batch_tokens": 32768, "max_length": None, "stride": None, "max_gen_toks": 256,
    "prefix_token_id": None, "seed": 0, "progress": False, "mesh": None,
    "device": None, "max_batch_size": None, "trust_remote_code": None,
}


class JaxLowFPLM(TemplateLM):
    """lm-eval's ``LM`` for a `jaxlowfp.models.Llama` (module docstring for the arguments).

    After every call, ``calls`` holds one record per request kind answered: ``{"kind", "requests", "tokens"
    (model inputs), "scored" (tokens), "log_likelihood" (sum), "seconds"}`` (generation: ``new_tokens``).
    """

    def __init__(self, pretrained: str | None = None, **kwargs: Any) -> None:
        super().__init__()
        unknown = sorted(set(kwargs) - set(ARGUMENTS))
        if unknown:
            raise ValueError(f"unknown model argument(s) {unknown} for --model jaxlowfp; allowed: "
                             f"{', '.join(k for k in ARGUMENTS if k not in ('model', 'tokenizer'))}")
        a = dict(ARGUMENTS, **kwargs, pretrained=pretrained)
        if a["quantize"] not in QUANTIZE:
            raise ValueError(f"quantize={a['quantize']!r}; allowed: {', '.join(QUANTIZE)}")
        from jaxlowfp.qat import GEMMS

        if a["gemm"] not in GEMMS:
            raise ValueError(f"gemm={a['gemm']!r}; allowed: {', '.join(GEMMS)}")
        if a["gemm"] != "dequant" and a["quantize"] == "none":
            raise ValueError(f"gemm={a['gemm']!r} chooses where quantize='s products run; give quantize= too (for "
                             f"PTQ exports and packed checkpoints the backend is packed=)")
        from jaxlowfp.ptq import METHODS, SCHEMES

        if a["ptq"] not in ("none", *METHODS):
            raise ValueError(f"ptq={a['ptq']!r}; allowed: none, {', '.join(METHODS)}")
        try:  # every spelling the registry parses ("nvfp4-static_6" is standard NVFP4, "nvfp4")
            canonical = Format.parse(a["ptq_scheme"]).name
        except (TypeError, ValueError):
            canonical = None
        if canonical not in SCHEMES:
            raise ValueError(f"ptq_scheme={a['ptq_scheme']!r}; allowed: {', '.join(SCHEMES)} (nvfp4-static_6 is "
                             f"nvfp4)")
        a["ptq_scheme"] = canonical
        if a["quantize"] != "none" and a["ptq"] != "none":
            raise ValueError("give quantize (fake quantization) or ptq (post-training quantization), not both")
        if a["act_scale"] not in ACT_SCALES:
            raise ValueError(f"act_scale={a['act_scale']!r}; allowed: {', '.join(ACT_SCALES)}")
        from jaxlowfp.backends import BACKENDS

        if a["packed"] not in ("fake", *BACKENDS):
            raise ValueError(f"packed={a['packed']!r}; allowed: fake, {', '.join(BACKENDS)}")
        packed = a["packed"] != "fake"
        if a["dtype"] not in ("float32", "bfloat16"):
            raise ValueError(f"dtype={a['dtype']!r}; allowed: float32, bfloat16")
        if a["batch_size"] in ("auto", None) or str(a["batch_size"]).startswith("auto"):
            raise ValueError(f"batch_size={a['batch_size']!r}: the jaxlowfp backend needs a fixed batch size (an int;"
                             " one compiled shape per padded length)")
        self._batch_size = positive_int(a["batch_size"], "batch_size")
        self._max_gen_toks = positive_int(a["max_gen_toks"], "max_gen_toks")
        self.seed = int(a["seed"])
        self.progress = flag(a["progress"], "progress")
        from jaxlowfp import sharding

        self.mesh = sharding.make_mesh(a["mesh"]) if isinstance(a["mesh"], str) else a["mesh"]
        if self.mesh is not None and packed and a["ptq_export"] is not None:
            raise ValueError("packed= with ptq_export= and mesh= is not supported yet (ptq.load places packed layers "
                             "on one device); evaluate the export packed without mesh=, or unpacked on the mesh")

        if a["model"] is not None:
            if isinstance(a["model"], str):
                raise ValueError(f"model={a['model']!r}: name a checkpoint with pretrained=; model= takes an "
                                 "in-process jaxlowfp.models.Llama")
            if pretrained is not None or a["tokenizer"] is None:
                raise ValueError("give pretrained=<name or path>, or model= with tokenizer= (an in-process model)")
            if a["ptq_export"] is not None or a["quantize"] != "none" or a["ptq"] != "none":
                raise ValueError("with model= the model is evaluated as given: quantize it before wrapping it "
                                 "(jaxlowfp.harness.fake_quantize_model, jaxlowfp.ptq.quantize_model)")
            self.model, self.tokenizer, self.source = a["model"], a["tokenizer"], type(a["model"]).__name__
        elif pretrained is None:
            raise ValueError("the jaxlowfp backend needs pretrained=<registry name, .gguf file or Hugging Face "
                             "directory> (or model= and tokenizer= in process)")
        else:
            from jaxlowfp.models import load

            direct = packed and a["ptq_export"] is None  # an NVFP4 checkpoint loaded packed (sharded with mesh=)
            self.model, self.tokenizer = load(pretrained, dtype=a["dtype"], mesh=self.mesh, packed=direct,
                                              **({"backend": a["packed"]} if direct else {}))
            self.source = str(pretrained)
        cfg = self.model.config
        self._max_length = cfg.max_seq_len if a["max_length"] is None else positive_int(a["max_length"],
                                                                                          "max_length")
        if self._max_length > cfg.max_seq_len:
            raise ValueError(f"max_length={self._max_length} exceeds the model's max_seq_len={cfg.max_seq_len}")
        self.stride = self._max_length if a["stride"] is None else positive_int(a["stride"], "stride")
        if self.stride > self._max_length:
            raise ValueError(f"stride={self.stride} exceeds max_length={self._max_length}")
        self.max_batch_tokens = None if a["max_batch_tokens"] is None else positive_int(a["max_batch_tokens"],
                                                                                         "max_batch_tokens")
        tok = self.tokenizer
        prefix = a["prefix_token_id"]
        if prefix is None:
            prefix = tok.bos_id if tok.bos_id is not None else tok.eos_id
        if prefix is None:
            raise ValueError("the tokenizer has neither a BOS nor an EOS token; give prefix_token_id")
        self._prefix = int(prefix)
        notes = []
        record: dict[str, Any] = {"kind": [], "scheme": None, "method": None, "layers": None,
                                  "activation_scale": None, "gemm": None}
        if a["model"] is not None:  # quantized (or not) by the caller: what its ops say
            record.update(given_model_record(self.model))
        if a["ptq_export"] is not None:
            from jaxlowfp import ptq

            schemes = ptq.load(self.model, a["ptq_export"], packed=packed, gemm=a["packed"] if packed else "auto")
            names = sorted({s.name for s in schemes.values()})
            notes.append(f"PTQ export {a['ptq_export']}: {len(schemes)} quantized layers "
                         f"({', '.join(names)})")
            record.update(kind=["ptq_export"], scheme=", ".join(names), export=str(a["ptq_export"]),
                          layers=layers_record(None, schemes), activation_scale="as exported (static)",
                          gemm="dequant")
        elif packed and a["model"] is not None:
            raise ValueError("packed= loads a checkpoint packed; with model= pack it first (jaxlowfp.ptq.pack_model)")
        if packed:
            from jaxlowfp.ptq.packing import report_of

            rep = report_of(self.model)
            ran = sorted({(b, n) for _, _, b, n in rep.layers})
            notes.append(f"packed: {len(rep.layers)} layers at {rep.bits_per_param:.3f} bits per weight, backend "
                         + ", ".join(f"{b}{' (native)' if n else ''}" for b, n in ran))
            self.backends = {p: b for p, _, b, _ in rep.layers}
            record["kind"].append("packed")
            record["gemm"] = ", ".join(f"{b}{' (native)' if n else ''}" for b, n in ran)
            if record["layers"] is None:
                record["layers"] = layers_record(None, self.backends)
        else:
            self.backends = {}
        if a["quantize"] != "none":
            act = "token" if a["act_scale"] == "auto" else a["act_scale"]
            report = fake_quantize_model(self.model, a["quantize"], layers=a["layers"],
                                         keep_first=int(a["keep_first"]), keep_last=int(a["keep_last"]),
                                         act_scale=act, gemm=a["gemm"])
            from jaxlowfp import qat

            recipe = eval_recipe(qat.named_recipe(a["quantize"]), act)
            gemm_plan = qat.gemm.plan(dataclasses.replace(recipe, gemm=a["gemm"]))
            notes.append(f"fake quantization {a['quantize']} of {len(report.quantized)} layers "
                         f"({100 * report.quantized_fraction:.1f} % of linear weights, layers={a['layers']}), "
                         f"activation scale: {act}, forward GEMM: {gemm_plan.backend}"
                         + (" (native)" if gemm_plan.native else ""))
            record.update(kind=["fake"], scheme=a["quantize"], activation_scale=act,
                          gemm=gemm_plan.backend + (" (native)" if gemm_plan.native else ""),
                          layers=layers_record(a["layers"], [p for p, _ in report.quantized],
                                                keep_first=int(a["keep_first"]), keep_last=int(a["keep_last"])))
        if a["ptq"] != "none":
            res = ptq_model(self.model, self.tokenizer, a["ptq"], scheme=a["ptq_scheme"], layers=a["ptq_layers"],
                       weights_only=flag(a["weights_only"], "weights_only"), calibration=a["calibration"],
                       calib_seqs=positive_int(a["calib_seqs"], "calib_seqs"),
                       calib_len=positive_int(a["calib_len"], "calib_len"), act_scale=a["act_scale"],
                       mesh=self.mesh)
            notes.append(f"PTQ {res.method} to {a['ptq_scheme']} of {len(res.schemes)} layers, activation scale: "
                         f"{res.activation_scale or 'none (weights only)'}")
            record.update(kind=["ptq"], scheme=a["ptq_scheme"] + (" (weights only)" if a["weights_only"] else ""),
                          method=res.method, activation_scale=res.activation_scale or "none (weights only)",
                          gemm="dequant", layers=layers_record(a["ptq_layers"], res.schemes),
                          calibration=None if a["calibration"] is None else {
                              "file": str(a["calibration"]), "seqs": int(a["calib_seqs"]),
                              "len": int(a["calib_len"])})
        if self.mesh is not None and notes and not packed:  # the quantized layers' new variables: onto the mesh
            from jaxlowfp.models import MoEDecoder  # (a packed load placed its packed arrays itself)

            moe = isinstance(self.model, MoEDecoder)
            sharding.shard_model(self.model, self.mesh, sharding.moe_rules() if moe else sharding.llama_rules())
        self.quantization = "; ".join(notes) or "none"
        import jaxlowfp

        record["kind"] = "+".join(record["kind"]) or "none"
        import jax

        if record["kind"] == "given":
            self.quantization = f"given model: {record['scheme']} ({record['layers']['quantized']} quantized ops)"
        dev = jax.devices()[0]
        self.quantization_record = {**record, "summary": self.quantization, "dtype": a["dtype"],
                                    "source": self.source, "jaxlowfp": jaxlowfp.__version__,
                                    "lm_eval": LM_EVAL_VERSION, "jax": jax.__version__,
                                    "device": f"{dev.platform} ({getattr(dev, 'device_kind', '?')})",
                                    "arguments": _arguments_record(dict(a, batch_size=self._batch_size))}
        self._warned_truncation = False
        self.calls: list[dict[str, Any]] = []
        log.info("jaxlowfp backend: %s (%s), max_length %d, batch %d; quantization: %s", self.source,
                 np.dtype(getattr(self.model, "dtype", np.float32)).name, self._max_length, self._batch_size,
                 self.quantization)

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval adds to its results' ``config`` (``simple_evaluate`` calls it): ``quantization``, the record
        of what this model is: ``kind`` (``none``, ``fake``, ``ptq``, ``ptq_export``, ``packed``, joined by ``+``),
        ``scheme``, ``method`` (PTQ), ``layers`` (the selection, how many and which were quantized),
        ``activation_scale``, ``gemm`` (the forward GEMM backend that ran), ``dtype``, ``source``, the
        ``jaxlowfp``, ``lm_eval`` and ``jax`` versions, the ``device`` and the model ``arguments`` that differ from
        their defaults. An in-process ``model=`` that holds quantized ops is kind ``given``, with their recipes,
        activation scales, GEMM backends and paths. ``executed`` is read from the model when this is called (lm-eval
        calls it after the run): the quantized ops it holds and what each ran (`executed_record`); it differs from
        the configured record where a rule's layer holds no op or an op never ran. Packed weights are not ops:
        ``executed.packed`` lists them, with their activation scales and the backends their layers plan."""
        return {"quantization": {**self.quantization_record, "executed": executed_record(self.model)}}

    # -- lm-eval's TemplateLM interface -------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_id
        return self._prefix if eos is None else int(eos)

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "source", type(self.tokenizer).__name__)).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """The tokenizer's ids; ``add_special_tokens=False`` (lm-eval's empty-context case) without a BOS the
        tokenizer would add."""
        inner = getattr(self.tokenizer, "tokenizer", None)
        if add_special_tokens is False and inner is not None and hasattr(inner, "encode"):
            return list(inner.encode(string, add_special_tokens=False).ids)
        return list(self.tokenizer.encode(string))

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _warn_truncation(self, n: int, what: str) -> None:
        if n and not self._warned_truncation:
            log.warning("%d %s longer than max_length=%d tokens: truncated from the left (lm-eval's HF backend "
                        "does the same); this warning is shown once", n, what, self._max_length)
            self._warned_truncation = True

    def _score(self, requests: list, kind: str, greedy: bool) -> tuple:
        out = score_requests(self.model, requests, batch_size=self._batch_size, progress=self.progress, desc=kind,
                             greedy=greedy, max_batch_tokens=self.max_batch_tokens, mesh=self.mesh)
        stats = out[-1]
        self.calls.append({"kind": kind, "requests": len(requests), "tokens": stats["tokens"],
                           "scored": stats["scored"], "log_likelihood": float(np.sum(out[0])),
                           "seconds": stats["seconds"]})
        return out

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """lm-eval's tokenization of the pairs (TemplateLM.loglikelihood), then `_loglikelihood_tokens`."""
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any
                              ) -> list[tuple[float, bool]]:
        """``requests``: ``((context, continuation), context ids, continuation ids)`` from TemplateLM."""
        if not requests:
            return []
        reqs = []
        for (strings, ctx, cont) in requests:
            try:
                reqs.append(pair_request(ctx, cont, max_length=self._max_length))
            except ValueError as e:
                raise ValueError(f"loglikelihood request {strings!r}: {e}") from None
        self._warn_truncation(sum(len(c) + len(t) > self._max_length + 1 for _, c, t in requests), "requests")
        ll, top, _ = self._score(reqs, "loglikelihood", greedy=True)
        answers = [(float(v), bool(g)) for v, g in zip(ll, top)]
        for (strings, _, _), ans in zip(requests, answers):
            self.cache_hook.add_partial("loglikelihood", strings, ans)
        return answers

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Per text: the total log-likelihood over lm-eval's disjoint rolling windows (an empty text: 0.0)."""
        if not requests:
            return []
        windows, owner = [], []
        for i, req in enumerate(requests):
            (text,) = req.args
            ws = rolling_requests(self.tok_encode(text), prefix_token=self._prefix, max_length=self._max_length,
                                  stride=self.stride)
            windows += ws
            owner += [i] * len(ws)
        totals = np.zeros(len(requests), np.float64)
        if windows:
            ll, _ = self._score(windows, "loglikelihood_rolling", greedy=False)
            np.add.at(totals, np.asarray(owner), ll)
        for req, v in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, float(v))
        return [float(v) for v in totals]

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Generate for each ``(context, gen_kwargs)``; requests with equal ``gen_kwargs`` share batches."""
        if not requests:
            return []
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        out: list[str | None] = [None] * len(requests)
        t0, new_tokens, n_trunc = time.perf_counter(), 0, 0
        for idx in groups.values():
            gen = requests[idx[0]].args[1]
            if not isinstance(gen, dict):
                raise ValueError(f"generate_until needs a dict of generation arguments; got {gen!r}")
            kw = dict(normalize_gen_kwargs(gen, self._max_gen_toks))
            until = handle_stop_sequences(kw.pop("until", None), eos=self.tok_decode([self.eot_token_id]) or None)
            max_new = positive_int(kw.pop("max_gen_toks"), "max_gen_toks")
            sample = bool(kw.pop("do_sample", False))
            temperature = float(kw.pop("temperature", 0.0) or 0.0) if sample else 0.0
            kw.pop("temperature", None)
            top_k = kw.pop("top_k", None)
            top_p = kw.pop("top_p", None)
            if top_p is not None and float(top_p) != 1.0:
                raise ValueError(f"generation argument top_p={top_p} is not supported by the jaxlowfp backend "
                                 "(nucleus sampling); use top_k or temperature")
            if kw:
                raise ValueError(f"generation argument(s) {sorted(kw)} not supported by the jaxlowfp backend; "
                                 f"supported: {', '.join(_GEN_KEYS)} (max_gen_toks aliases: max_new_tokens, "
                                 "max_tokens, max_completion_tokens)")
            max_ctx = self._max_length - max_new
            if max_ctx < 1:
                raise ValueError(f"max_gen_toks={max_new} leaves no room for a prompt within max_length="
                                 f"{self._max_length}")
            prompts = {}
            for i in idx:
                ids = self.tok_encode(requests[i].args[0]) or [self._prefix]
                n_trunc += len(ids) > max_ctx
                prompts[i] = ids[-max_ctx:]
            order = sorted(idx, key=lambda i: -len(prompts[i]))
            pad_to = _bucket(len(prompts[order[0]]), max_ctx)  # one compiled shape for every batch of the group
            for b, start in enumerate(range(0, len(order), self._batch_size)):
                rows = order[start:start + self._batch_size]
                batch = [prompts[i] for i in rows]
                batch += [[self._prefix]] * (self._batch_size - len(batch))  # fixed batch shape; stopped at once

                def stop(row: int, new: list[int], n_real: int = len(rows)) -> bool:
                    if row >= n_real:
                        return True
                    text = self.tok_decode(new)
                    return any(s and s in text for s in until)

                from jaxlowfp.models import generate

                outs = generate(self.model, batch, max_new_tokens=max_new, temperature=temperature,
                                top_k=None if top_k is None else positive_int(top_k, "top_k"),
                                eos_id=self.eot_token_id, seed=self.seed + b, stop=stop,
                                pad_to=pad_to, mesh=self.mesh)
                for i, new in zip(rows, outs):
                    new_tokens += len(new)
                    if new and new[-1] == self.eot_token_id:
                        new = new[:-1]
                    text = postprocess_generated_text(self.tok_decode(new), until, None)
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        self._warn_truncation(n_trunc, "prompts")
        self.calls.append({"kind": "generate_until", "requests": len(requests), "new_tokens": new_tokens,
                           "seconds": time.perf_counter() - t0})
        return out  # type: ignore[return-value]


if __name__ != "__main__":  # under `python -m jaxlowfp.harness` the importable module registers (below)
    register_model("jaxlowfp")(JaxLowFPLM)


# old names (one release): `fake_quantize` quantizes a whole model, so the name says so now
__getattr__ = deprecated_getattr(__name__, {"fake_quantize": ("jaxlowfp.harness.fake_quantize_model",
                                                              lambda: fake_quantize_model)})


if __name__ == "__main__":
    from jaxlowfp.lm_eval_cli import main as _main  # registers jaxlowfp.harness (importable name), not __main__

    _main()


__dir__ = _public_dir(__all__)  # dir() shows the API only (jaxlowfp._core.surface)
