"""jaxlowfp.harness, the lm-eval backend: the three local task kinds (tests/lm_eval_tasks: multiple choice, rolling
perplexity, generation with exact match) run through lm-eval's own ``simple_evaluate`` on a tiny random-weight
model and on SmolLM2. lm-eval builds the requests (prompts, whitespace handling, rolling windows) and computes the
metrics; the log-likelihoods equal the library's own scoring (`jaxlowfp.evaluation`) and the numpy oracle, the
generations equal the oracle's greedy decoding; bad input is a clear error; the command line prints lm-eval's table."""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the local tasks must load without the Hugging Face hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lm_eval  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from test_models_gguf import write_gguf  # noqa: E402
from test_models_oracle import forward, log_softmax, random_weights, read_gguf  # noqa: E402
from jaxlowfp import evaluation as ev  # noqa: E402
from jaxlowfp.harness import JaxLowFPLM  # noqa: E402
from jaxlowfp.models import load  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "lm_eval_tasks"
MC, ROLLING, GEN = "jaxlowfp_local_mc", "jaxlowfp_local_rolling", "jaxlowfp_local_gen"
CFG = dict(vocab=272, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=96, tied=False,
           theta=10_000.0, eps=1e-5)  # max_seq_len 64: the tasks' longer requests exercise left truncation
LL_TOL = 1e-4  # per request; float32 forward passes of the same tokens in other batch rows / padded lengths


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("h") / "tiny.gguf"
    write_gguf(path, random_weights(CFG, seed=7))
    model, tok = load(path)
    w, cfg, layout = read_gguf(path)
    return path, model, tok, lambda ids: log_softmax(forward(w, cfg, np.asarray(ids), layout))


def _evaluate(lm, tasks, **kw):
    tm = TaskManager(include_path=str(TASKS), include_defaults=False)  # not lm-eval's own tasks: 10 s to index
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=tm, log_samples=True, verbosity="ERROR", **kw)


@pytest.fixture(scope="module")
def tiny_run(tiny):
    _, model, tok, _ = tiny
    lm = JaxLowFPLM(model=model, tokenizer=tok, batch_size=4)
    return lm, _evaluate(lm, [MC, ROLLING, GEN])


def _oracle_ll(oracle, r: ev.Request) -> tuple[float, bool]:
    """log p and is_greedy of a request from the numpy oracle."""
    lp = oracle(r.tokens[:-1])
    pos = range(len(r.tokens) - r.n_pred, len(r.tokens))
    return (float(sum(lp[t - 1, r.tokens[t]] for t in pos)),
            all(int(np.argmax(lp[t - 1])) == r.tokens[t] for t in pos))


def test_registered_beside_the_built_in_backends():
    assert get_model("jaxlowfp") is JaxLowFPLM
    assert get_model("dummy").__name__ == "DummyLM"  # registering ours did not hide lm-eval's own


def test_multiple_choice_equals_the_library_and_the_oracle(tiny, tiny_run):
    _, model, tok, oracle = tiny
    lm, res = tiny_run
    samples = sorted(res["samples"][MC], key=lambda s: s["doc_id"])
    items = [ev.ChoiceItem(s["arguments"][0][0], tuple(c for _, c in s["arguments"]), s["doc"]["label"])
             for s in samples]
    got = np.asarray([[r[0] for r in s["resps"]] for s in samples])[..., 0]
    greedy = [[bool(r[0][1]) for r in s["resps"]] for s in samples]
    reqs = ev.choice_requests(tok, items, max_length=lm.max_length)
    ours, _ = ev.score_requests(model, reqs, batch_size=4)
    np.testing.assert_allclose(got.ravel(), ours, atol=LL_TOL, rtol=0)
    assert (got.argmax(1) == ours.reshape(got.shape).argmax(1)).all()  # identical choices
    one_row, _ = ev.score_requests(model, reqs, batch_size=4, max_batch_tokens=64)  # rows x length <= 64: 1 row
    np.testing.assert_allclose(one_row, ours, atol=LL_TOL, rtol=0)
    lib = ev.score_choices(model, tok, items, max_length=lm.max_length, batch_size=4)
    assert res["results"][MC]["acc,none"] == lib["acc"]
    # acc_norm: lm-eval divides by the characters of the choice without the leading space
    chars = np.asarray([[len(c) for c in s["doc"]["choices"]] for s in samples])
    want_norm = np.mean((got / chars).argmax(1) == [s["doc"]["label"] for s in samples])
    assert res["results"][MC]["acc_norm,none"] == pytest.approx(want_norm)
    for r, v, g in zip(reqs, got.ravel(), sum(greedy, [])):
        want, want_greedy = _oracle_ll(oracle, r)
        assert v == pytest.approx(want, abs=2e-4) and g == want_greedy
    assert any(len(r.tokens) == lm.max_length + 1 for r in reqs)  # some were left-truncated to the window


def test_rolling_perplexity_equals_the_library(tiny, tiny_run):
    _, model, tok, _ = tiny
    lm, res = tiny_run
    docs = [s["doc"]["text"] for s in sorted(res["samples"][ROLLING], key=lambda s: s["doc_id"])]
    s = ev.perplexity(model, tok, docs, max_length=lm.max_length, batch_size=4)
    r = res["results"][ROLLING]
    assert s.tokens > 2 * lm.max_length  # several windows per document
    assert r["word_perplexity,none"] == pytest.approx(s.word_perplexity, rel=1e-5)
    assert r["byte_perplexity,none"] == pytest.approx(s.byte_perplexity, rel=1e-5)
    assert r["bits_per_byte,none"] == pytest.approx(s.bits_per_byte, rel=1e-5)


def test_generation_equals_the_oracles_greedy_decoding(tiny, tiny_run):
    _, _, tok, oracle = tiny
    lm, res = tiny_run
    samples = res["samples"][GEN]
    until = samples[0]["arguments"][0][1]["until"]
    assert until == ["\n", ".", ","]
    for s in samples:
        ids = tok.encode(s["arguments"][0][0])[-(lm.max_length - 8):]
        new = []
        for _ in range(8):  # max_gen_toks of the task
            lp = oracle(ids + new)[-1]
            top2 = np.sort(lp)[-2:]
            assert top2[1] - top2[0] > 1e-4, "a near tie: the comparison would depend on rounding"
            new.append(int(np.argmax(lp)))
            text = tok.decode(new, skip_special_tokens=True)
            if new[-1] == tok.eos_id or any(u in text for u in until):
                break
        if new[-1] == tok.eos_id:
            new = new[:-1]
        text = tok.decode(new, skip_special_tokens=True)
        for u in until:
            text = text.split(u)[0]
        assert s["resps"][0][0] == text
    assert res["results"][GEN]["exact_match,strip"] == np.mean([s["exact_match"] for s in samples])


def test_calls_are_recorded(tiny_run):
    lm, _ = tiny_run
    kinds = {c["kind"]: c for c in lm.calls}
    assert set(kinds) == {"loglikelihood", "loglikelihood_rolling", "generate_until"}
    assert kinds["loglikelihood"]["requests"] == 8 * 4 and kinds["generate_until"]["requests"] == 6


def test_ptq_scheme_takes_every_spelling_the_registry_parses(tiny):
    """ptq_scheme="nvfp4-static_6" is standard NVFP4 (`jaxlowfp.Format.parse` says so): accepted and recorded by its
    canonical name, as ptq_scheme="nvfp4" is."""
    path, *_ = tiny
    info = JaxLowFPLM(pretrained=str(path), ptq="rtn", ptq_scheme="nvfp4-static_6", act_scale="token")
    assert info.quantization_record["scheme"] == "nvfp4", info.quantization_record


def _inst(kind, *args):
    return Instance(request_type=kind, doc={}, arguments=tuple(args), idx=0)


def test_bad_input_is_a_clear_error(tiny, caplog):
    path, model, tok, oracle = tiny
    lm = JaxLowFPLM(model=model, tokenizer=tok, batch_size=4)  # tiny_run's shapes: compiled already
    for kw, msg in [(dict(colour="red"), r"unknown model argument\(s\) \['colour'\].*allowed: pretrained, dtype"),
                    (dict(batch_size="auto"), "needs a fixed batch size"),
                    (dict(quantize="int3"), "quantize='int3'; allowed: none, hif8, nvfp4"),
                    (dict(quantize="hif8", ptq="rtn"), "not both"),
                    (dict(ptq="gptq"), "needs calibration"),
                    (dict(layers="nothing/here", quantize="hif8"), "selects no Linear layer"),
                    (dict(max_length=128), "max_length=128 exceeds the model's max_seq_len=64"),
                    (dict(dtype="float16"), "dtype='float16'; allowed: float32, bfloat16"),
                    (dict(ptq="rtn", ptq_scheme="nvfp4-bogus"), r"ptq_scheme='nvfp4-bogus'; allowed: nvfp4, "),
                    (dict(progress="yes"), "progress must be true or false; got 'yes'"),
                    (dict(ptq="rtn", weights_only="no"), "weights_only must be true or false; got 'no'"),
                    (dict(progress=2), "progress must be true or false; got 2")]:
        with pytest.raises(ValueError, match=msg):
            JaxLowFPLM(pretrained=str(path), **kw)
    # a command line's strings (``python -m train tasks run --arm a=...,progress=false``): "false" is False
    assert [JaxLowFPLM(pretrained=str(path), progress=v).progress for v in ("false", "True", "0", 1, False)] == [
        False, True, False, True, False]
    with pytest.raises(ValueError, match="name a checkpoint with pretrained="):
        JaxLowFPLM(model="smollm2-135m")
    with pytest.raises(ValueError, match="needs pretrained="):
        JaxLowFPLM()
    gen = "the cat"
    for kw, msg in [({"top_p": 0.9, "do_sample": True, "temperature": 1.0}, "top_p=0.9 is not supported"),
                    ({"repetition_penalty": 1.1}, r"\['repetition_penalty'\] not supported"),
                    ({"max_gen_toks": 64}, "max_gen_toks=64 leaves no room for a prompt")]:
        with pytest.raises(ValueError, match=msg):
            lm.generate_until([_inst("generate_until", gen, kw)])
    with pytest.raises(ValueError, match="a continuation of [0-9]+ tokens exceeds max_length=64"):
        lm.loglikelihood([_inst("loglikelihood", "a", " b" * 70)])
    assert lm.loglikelihood([]) == [] and lm.loglikelihood_rolling([]) == [] and lm.generate_until([]) == []
    assert lm.loglikelihood_rolling([_inst("loglikelihood_rolling", "")]) == [0.0]  # no token, nothing to score
    # a context longer than the window: truncated from the left, said once, scored on the tokens it keeps
    long_ctx = "the thin cat sat on the mat " * 8
    with caplog.at_level(logging.WARNING, logger="jaxlowfp.harness"):
        (ll, _), (ll2, _) = lm.loglikelihood([_inst("loglikelihood", long_ctx, " and ran"),
                                             _inst("loglikelihood", long_ctx, " away")])
        lm.loglikelihood([_inst("loglikelihood", long_ctx, " again")])
    warned = [r for r in caplog.records if "truncated from the left" in r.getMessage()]
    assert len(warned) == 1 and warned[0].getMessage().startswith("2 requests longer than max_length=64")
    ctx, cont = ev.encode_pair(tok, long_ctx, " and ran")
    assert len(ctx) + len(cont) > 65
    req = ev.pair_request(ctx, cont, max_length=64)
    assert req.tokens == tuple((ctx + cont)[-65:])
    assert ll == pytest.approx(_oracle_ll(oracle, req)[0], abs=2e-4)
    # an empty context is the prefix (BOS) token, as in lm-eval
    (e, _), = lm.loglikelihood([_inst("loglikelihood", "", "the cat")])
    cat = tok.encode("the cat")
    assert e == pytest.approx(_oracle_ll(oracle, ev.Request((1, *cat), len(cat)))[0], abs=2e-4)


def test_quantization_from_model_arguments(tiny):
    path, model, tok, _ = tiny
    req = [_inst("loglikelihood", "the thin cat sat", " on the mat")]
    (hp, _), = JaxLowFPLM(model=model, tokenizer=tok, batch_size=1).loglikelihood(req)
    lm = JaxLowFPLM(pretrained=str(path), quantize="nvfp4", layers=r"blocks/1/mlp/\w+_proj", batch_size=1)
    assert re.fullmatch(r"fake quantization nvfp4 of 3 layers \(23\.4 % of linear weights, layers=.*\), "
                        r"activation scale: token, forward GEMM: dequant", lm.quantization)  # 3 x 64 x 96 of 79 k
    (q, _), = lm.loglikelihood(req)
    assert q != hp and abs(q - hp) < 0.2 * abs(hp)  # 4-bit weights and activations move it, a little
    with pytest.raises(ValueError, match="leaves no block of n_blocks=2"):
        JaxLowFPLM(pretrained=str(path), quantize="hif8")  # the paper's layers: keep_first 3, keep_last 2


def test_a_ptq_export_from_model_arguments(tiny, tmp_path):
    path, _, tok, _ = tiny
    from jaxlowfp import ptq

    model, _ = load(path)
    calib = np.random.default_rng(0).integers(0, CFG["vocab"], (2, 32)).astype(np.int32)
    res = ptq.quantize_model(model, [ptq.Rule(path=r"blocks/1/mlp/down_proj", scheme=ptq.scheme("nvfp4-mse"))],
                       method="rtn", calibration=calib)
    ptq.export(model, res, tmp_path / "export", dtype="float32")  # float32: the reload is compared bit for bit
    req = [_inst("loglikelihood", "the thin cat sat", " on the mat")]
    want = JaxLowFPLM(model=model, tokenizer=tok, batch_size=1).loglikelihood(req)
    lm = JaxLowFPLM(pretrained=str(path), ptq_export=str(tmp_path / "export"), batch_size=1)
    assert lm.quantization.endswith("1 quantized layers (nvfp4-mse)")
    assert lm.loglikelihood(req) == want  # the exported weights reload bit for bit (jaxlowfp.ptq.load)


def _mc_requests(seed=0, n=12, contexts=None):
    """Multiple-choice-like requests: contexts of 8..60 tokens (or the lengths `contexts`), continuations of 1..6
    (scored positions only)."""
    rng = np.random.default_rng(seed)
    contexts = rng.integers(8, 58, n) if contexts is None else contexts
    return [ev.Request(tuple(int(t) for t in rng.integers(3, CFG["vocab"], c + k)), k)
            for c, k in zip(contexts, rng.integers(1, 7, len(contexts)))]


def test_scoring_the_continuations_only_equals_scoring_every_position(tiny, monkeypatch):
    """The backend's head and log-softmax run at the scored positions only (`evaluation._head_sums_at`) when a
    batch's continuations pad to fewer positions than its rows: the same log-likelihoods and greedy flags as the
    head at every position (another XLA program: float32 rounding), and against the numpy oracle; the shortcut
    is taken (its program compiled) and not for a batch whose continuations fill the row."""
    _, model, _, oracle = tiny
    assert ev._gather_len(13, 16) == 16 and ev._gather_len(3, 64) == 16 and ev._gather_len(17, 64) == 24
    reqs = _mc_requests()
    before = ev._head_sums_at._cache_size()
    ll, top, _ = ev.score_requests(model, reqs, batch_size=4, greedy=True)
    assert ev._head_sums_at._cache_size() > before  # the gathered program ran
    for r, v, g in zip(reqs, ll, top):
        want, want_greedy = _oracle_ll(oracle, r)
        assert v == pytest.approx(want, abs=2e-4) and g == want_greedy
    monkeypatch.setattr(ev, "_gather_len", lambda n_pred, length: length)  # the head at every position
    full, full_top, _ = ev.score_requests(model, reqs, batch_size=4, greedy=True)
    np.testing.assert_allclose(ll, full, rtol=2e-6, atol=2e-5)
    np.testing.assert_array_equal(top, full_top)


def test_quantized_continuation_scores_do_not_depend_on_the_batch(tiny):
    """NVFP4 W4A4 with per-token activation scales, scored at the continuations only: each request alone (its
    batch filled with zero rows) and batched with the others, to float32 rounding (other padded lengths and
    gathered widths are other programs). The control: per-tensor (the batch's amax) scales move by far more."""
    path, _, _, _ = tiny
    from jaxlowfp.harness import fake_quantize_model

    # contexts in two length buckets (`evaluation._bucket`: 16 and 56), one compiled program each per batch shape
    reqs = _mc_requests(seed=1, contexts=(8, 9, 10, 11, 50, 51, 50, 51))
    assert {ev._bucket(len(r.tokens) - 1) for r in reqs} == {16, 56}
    for act, close in (("token", True), ("tensor", False)):
        model, _ = load(path)
        fake_quantize_model(model, "nvfp4", layers="all", act_scale=act)
        scales = "token" if act == "token" else "warn"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the per-tensor control warns that it is batch-dependent
            batched = ev.score_requests(model, reqs, batch_size=8, batch_scales=scales)[0]
            alone = np.array([ev.score_requests(model, [r], batch_size=8, batch_scales=scales)[0][0] for r in reqs])
        if close:
            np.testing.assert_allclose(batched, alone, rtol=2e-6, atol=2e-5)
        else:
            assert np.max(np.abs(batched - alone)) > 1e-3


class _LocalTaskManager(TaskManager):
    """lm-eval's TaskManager without its own task library (``include_defaults=False``), for a command line given a
    task directory (which keeps lm-eval's library: a registered task of the directory's name would win); indexing
    lm-eval's ~14,000 task files takes 10-15 s on 2 cores. Given task YAML files, `jaxlowfp.lm_eval_cli` leaves the
    library out itself (`test_the_command_line_indexes_lm_evals_library_only_for_what_needs_it`)."""

    def __init__(self, *args, include_defaults=False, **kw):
        super().__init__(*args, include_defaults=include_defaults, **kw)


def test_the_command_line_indexes_lm_evals_library_only_for_what_needs_it(tmp_path):
    """`jaxlowfp.lm_eval_cli` leaves lm-eval's own task library out only when every task asked for is an existing
    YAML file of one task; a task name, a directory, a glob pattern, a missing file or a group file (which may list
    lm-eval's tasks) keep lm-eval's TaskManager as it is."""
    import lm_eval.tasks

    from jaxlowfp.lm_eval_cli import _local_task_files, _without_task_library

    task = str(TASKS / f"{MC}.yaml")
    group = tmp_path / "group.yaml"
    group.write_text("group: mine\ntask:\n  - arc_easy\n  - jaxlowfp_local_mc\n")
    for argv in (["--tasks", task], ["-t", task], [f"--tasks={task},{task}"], ["--model", "jaxlowfp", "--tasks", task],
                 ["run", "--tasks", task, task], ["--task", task]):  # lm-eval's parser: lists, `run`, abbreviations
        assert _local_task_files(argv), argv
    for argv in (["--tasks", "arc_easy"], ["--tasks", f"{task},arc_easy"], ["--tasks", str(TASKS)],
                 ["--tasks", task, "arc_easy"], ["--tasks", task, "-t", "arc_easy"], ["ls", "tasks"], ["--help"],
                 ["--tasks", str(TASKS / "*.yaml")], ["--tasks", str(tmp_path / "missing.yaml")], ["--tasks"], [],
                 ["--tasks", str(group)], ["--tasks", f"{task},{group}"]):
        assert not _local_task_files(argv), argv
    base = lm_eval.tasks.TaskManager
    with _without_task_library():
        local = lm_eval.tasks.TaskManager(include_path=str(TASKS))
        assert issubclass(lm_eval.tasks.TaskManager, base) and MC in local.all_tasks
        assert not local.match_tasks(["arc_easy"])  # lm-eval's own tasks are not indexed
    assert lm_eval.tasks.TaskManager is base


def test_evaluate_indexes_lm_evals_library_only_for_names_and_groups(tmp_path, monkeypatch):
    """`jaxlowfp.harness.evaluate` asks lm-eval's TaskManager for its own library exactly when a task is given by
    name or a group (a YAML file, a file in a directory, or a dict, whose ``task`` is a list that may name lm-eval's
    tasks) is among the tasks; single-task files, directories and dicts do without it."""
    import lm_eval.tasks

    from jaxlowfp.harness import choice_task, evaluate

    asked = []

    class Spy:  # records what evaluate asks for; indexes nothing
        def __init__(self, include_path=None, include_defaults=True):
            asked.append(include_defaults)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Spy)
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kw: kw)
    group = tmp_path / "groups" / "group.yaml"
    group.parent.mkdir()
    group.write_text("group: mine\ntask:\n  - arc_easy\n  - jaxlowfp_local_mc\n")
    single = str(TASKS / f"{MC}.yaml")
    inline = choice_task("mine_mc", [ev.ChoiceItem("a", (" b", " c"), 0)])
    cases = [([single], False), ([str(TASKS)], False), ([inline], False), ([single, inline], False),
             (["arc_easy"], True), ([single, "arc_easy"], True), ([str(group)], True), ([str(group.parent)], True),
             ([{"group": "g", "task": ["arc_easy"]}], True), ([inline, str(group)], True)]
    for tasks, library in cases:
        asked.clear()
        run = evaluate(None, tasks)
        assert asked == [library], (tasks, asked)
        assert isinstance(run["task_manager"], Spy) and run["tasks"], run


def test_the_results_json_records_the_quantization(tiny, tmp_path):
    """``jaxlowfp-lm-eval --output_path``: lm-eval's results JSON holds ``config.quantization``: scheme, layers,
    activation scale, GEMM backend, the library's (and lm-eval's, jax's) version, the device and the model
    arguments; an in-process model quantized by its caller is recorded from its quantized ops."""
    import json

    import jax

    import jaxlowfp
    from jaxlowfp.harness import fake_quantize_model
    from jaxlowfp.lm_eval_cli import main as lm_eval_main

    path, _, tok, _ = tiny
    layers = r"blocks/1/mlp/\w+_proj"
    lm_eval_main(["--model", "jaxlowfp", "--model_args",
                  f"pretrained={path},quantize=nvfp4-mse,layers={layers},act_scale=token,max_length=32",
                  "--tasks", str(TASKS / f"{MC}.yaml"), "--limit", "2", "--batch_size", "2",
                  "--output_path", str(tmp_path / "out")])
    (res,) = (tmp_path / "out").rglob("results_*.json")
    rec = json.loads(res.read_text())["config"]["quantization"]
    assert (rec["kind"], rec["scheme"], rec["activation_scale"], rec["gemm"]) == ("fake", "nvfp4-mse", "token",
                                                                                   "dequant")
    assert rec["layers"] == {"pattern": layers, "quantized": 3,
                             "paths": [f"blocks/1/mlp/{p}_proj" for p in ("down", "gate", "up")]}
    assert (rec["jaxlowfp"], rec["lm_eval"], rec["jax"]) == (jaxlowfp.__version__, lm_eval.__version__,
                                                              jax.__version__)
    assert rec["device"].startswith(jax.default_backend())
    assert (rec["executed"]["ops"], rec["executed"]["ran"]) == (3, 3)  # read after lm-eval's run: the ops ran
    assert rec["arguments"] == {"pretrained": str(path), "quantize": "nvfp4-mse", "layers": layers,
                                "act_scale": "token", "max_length": 32, "batch_size": 2}
    model, _ = load(path)
    assert JaxLowFPLM(model=model, tokenizer=tok).get_model_info()["quantization"]["kind"] == "none"
    fake_quantize_model(model, "hif8", layers=layers, act_scale="token")
    given = JaxLowFPLM(model=model, tokenizer=tok).get_model_info()["quantization"]
    assert (given["kind"], given["activation_scale"], given["gemm"]) == ("given", "token", "dequant")
    assert "hif8" in given["scheme"] and given["layers"]["paths"] == rec["layers"]["paths"]


def test_the_record_holds_what_the_model_executed(tiny):
    """``config.quantization.executed`` is read from the model when lm-eval asks (after the run), not copied from
    the arguments: the quantized op modules present, how many ran, per op scheme | activation scale | the GEMM
    backend it ran on, and the version. Before any request nothing has run; a model that holds no quantized op
    records 0 ops, while the configured record still says what the arguments asked for."""
    import json

    import jaxlowfp

    path, _, _, _ = tiny
    req = [_inst("loglikelihood", "the thin cat sat", " on the mat")]
    lm = JaxLowFPLM(pretrained=str(path), ptq="rtn", ptq_scheme="nvfp4-mse", act_scale="token", batch_size=1)
    ex = lm.get_model_info()["quantization"]["executed"]
    assert (ex["ops"], ex["ran"], ex["by_kind"]) == (14, 0, {"nvfp4-mse | token | not run": 14})
    lm.loglikelihood(req)
    rec = lm.get_model_info()["quantization"]
    ex = rec["executed"]
    assert ex["ops"] == ex["ran"] == rec["layers"]["quantized"] == 14  # 2 blocks x 7 projections
    assert sorted(ex["per_op"]) == rec["layers"]["paths"]
    assert ex["by_kind"] == {"nvfp4-mse | token | dequant": 14} and ex["jaxlowfp"] == jaxlowfp.__version__
    assert json.loads(json.dumps(ex)) == ex  # flat, JSON-serializable
    lm.model, _ = load(path)  # the same configuration, a model where nothing got quantized
    after = lm.get_model_info()["quantization"]
    assert after["executed"] == {"ops": 0, "ran": 0, "by_kind": {}, "per_op": {}, "jaxlowfp": jaxlowfp.__version__,
                                 "packed": {"weights": 0, "by_kind": {}, "per_weight": {}}}
    assert after["layers"]["quantized"] == 14 and after["executed"]["ops"] != after["layers"]["quantized"]
    fake = JaxLowFPLM(pretrained=str(path), quantize="nvfp4", layers=r"blocks/1/mlp/\w+_proj", batch_size=1)
    fake.loglikelihood(req)
    assert fake.get_model_info()["quantization"]["executed"]["by_kind"] == {"nvfp4_w4a4_static_6 | token | dequant": 3}


@pytest.mark.parametrize("entry", ["python -m jaxlowfp.harness", "jaxlowfp.lm_eval_cli.main"])
def test_command_line_prints_lm_evals_table(tiny, entry, capsys):
    """``python -m jaxlowfp.harness`` in a fresh process; `jaxlowfp.lm_eval_cli.main` (what ``jaxlowfp-lm-eval``
    and ``python -m jaxlowfp.lm_eval_cli`` call) in this one. One task file, so neither indexes lm-eval's own task
    library; the three task kinds through simple_evaluate are tiny_run's."""
    args = ["--model", "jaxlowfp", "--model_args", f"pretrained={tiny[0]},max_length=32", "--tasks",
            str(TASKS / f"{MC}.yaml"), "--limit", "2", "--batch_size", "2"]
    if entry.startswith("python -m"):
        env = dict(os.environ, JAX_PLATFORMS="cpu", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
        proc = subprocess.run([sys.executable, "-m", entry.split()[-1], *args], capture_output=True, text=True,
                              cwd=ROOT, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        stdout = proc.stdout
    else:
        from jaxlowfp.lm_eval_cli import main as lm_eval_main

        lm_eval_main(args)
        stdout = capsys.readouterr().out
    assert re.search(rf"\|{MC}\s*\|\s*1\|none\s*\|\s*0\|acc\s", stdout), stdout  # lm-eval's table
    assert "jaxlowfp ({'pretrained': " in stdout and "'max_length': 32" in stdout


def test_smollm2_end_to_end(smollm2_shared):
    model, tok = smollm2_shared  # conftest's, loaded once per worker (read only here)
    lm = JaxLowFPLM(model=model, tokenizer=tok, batch_size=8, max_length=64)
    res = _evaluate(lm, [MC, ROLLING], limit=3)
    samples = sorted(res["samples"][MC], key=lambda s: s["doc_id"])
    items = [ev.ChoiceItem(s["arguments"][0][0], tuple(c for _, c in s["arguments"]), s["doc"]["label"])
             for s in samples]
    got = np.asarray([[r[0][0] for r in s["resps"]] for s in samples])
    ours, _ = ev.score_requests(model, ev.choice_requests(tok, items, max_length=64), batch_size=8)
    np.testing.assert_allclose(got.ravel(), ours, atol=LL_TOL, rtol=0)
    assert (got.argmax(1) == ours.reshape(got.shape).argmax(1)).all()
    docs = [s["doc"]["text"] for s in sorted(res["samples"][ROLLING], key=lambda s: s["doc_id"])]
    ppl = ev.perplexity(model, tok, docs, max_length=64, batch_size=8)
    assert res["results"][ROLLING]["word_perplexity,none"] == pytest.approx(ppl.word_perplexity, rel=1e-5)
    assert res["results"][ROLLING]["byte_perplexity,none"] == pytest.approx(ppl.byte_perplexity, rel=1e-5)
    assert 1.5 < ppl.byte_perplexity < 4  # a trained model on English prose (a random one would be ~400)


def test_sampled_generation_and_bfloat16_compute(tiny):
    """Sampling through generate_until (do_sample, temperature, top_k): the same seed gives the same texts and
    another seed other texts; top_k=1 is greedy decoding whatever the temperature. dtype=bfloat16 computes in
    bfloat16: log-likelihoods move by bfloat16 rounding, not more."""
    path, model, tok, _ = tiny
    prompts = ["the thin cat", "a dog ran", "on the mat", "we sat"]

    def texts(seed, **gen):
        gen = {"max_gen_toks": 6, "until": ["\n\n\n"], **gen}
        lm = JaxLowFPLM(model=model, tokenizer=tok, batch_size=4, seed=seed)
        return lm.generate_until([_inst("generate_until", p, gen) for p in prompts])

    hot = dict(do_sample=True, temperature=1.5)
    first = texts(1, **hot)
    assert texts(1, **hot) == first and texts(2, **hot) != first  # 4 x 6 draws at T = 1.5 over 272 tokens
    assert texts(3, top_k=1, **hot) == texts(0, do_sample=False)

    req = [_inst("loglikelihood", "the thin cat sat", " on the mat")]
    (f32, _), = JaxLowFPLM(pretrained=str(path), batch_size=1).loglikelihood(req)
    bf16 = JaxLowFPLM(pretrained=str(path), dtype="bfloat16", batch_size=1)
    (b, _), = bf16.loglikelihood(req)
    assert b != f32 and abs(b - f32) < 0.05 * abs(f32), (b, f32)  # bfloat16: 8 mantissa bits, ~0.4 % per op
