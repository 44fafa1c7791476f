"""train.paired: paired differences of two arms from lm-eval's per-sample logs, with the paired standard error,
checked against hand computations on synthetic logs with known answers; the command writes the table; items that do
not pair are refused."""
from __future__ import annotations

import json
import math

import pytest

from train.paired import item_scores, load_samples, markdown, paired, paired_se
from train.tasks_cli import main


def _sample(doc_id, gold, lls, acc_norm=None, doc=None):
    """An lm-eval multiple-choice sample: ``filtered_resps`` [(ll, is_greedy)] per choice, target the gold index;
    acc is whether the gold choice has the largest log-likelihood."""
    s = {"doc_id": doc_id, "doc": doc or {"q": f"question {doc_id}"}, "target": gold,
         "filtered_resps": [[ll, False] for ll in lls], "acc": float(max(range(len(lls)), key=lls.__getitem__) == gold)}
    if acc_norm is not None:
        s["acc_norm"] = acc_norm
    return s


def test_paired_se_by_hand():
    # d = 1, 0, 0, -1, 1: mean 0.2, squared deviations .64 + .04 + .04 + 1.44 + .64 = 2.8, variance 2.8 / 4 = 0.7,
    # s.e. = sqrt(0.7) / sqrt(5) = 0.3741657
    mean, se = paired_se([1, 0, 0, -1, 1])
    assert mean == pytest.approx(0.2, abs=1e-12)
    assert se == pytest.approx(0.37416573867739417, rel=1e-12)
    assert paired_se([0.5])[0] == 0.5 and math.isnan(paired_se([0.5])[1])
    with pytest.raises(ValueError, match="non-empty"):
        paired_se([])


def _arms():
    # task t1: 5 items, gold 0. Arm A right on items 0,1,2,4; arm B right on 0,3,4 -> acc diffs 0,-1,-1,+1,0
    a1 = [_sample(0, 0, [-1.0, -2.0]), _sample(1, 0, [-1.0, -3.0]), _sample(2, 0, [-1.0, -1.5]),
          _sample(3, 0, [-2.0, -1.0]), _sample(4, 0, [-0.5, -4.0])]
    b1 = [_sample(0, 0, [-1.5, -2.0]), _sample(1, 0, [-3.5, -3.0]), _sample(2, 0, [-2.0, -1.5]),
          _sample(3, 0, [-1.0, -2.0]), _sample(4, 0, [-0.5, -4.0])]
    # task t2: 3 items with acc_norm as well; gold index 1
    a2 = [_sample(i, 1, [-2.0, -1.0], acc_norm=1.0) for i in range(3)]
    b2 = [_sample(0, 1, [-2.0, -1.0], acc_norm=1.0), _sample(1, 1, [-1.0, -2.0], acc_norm=0.0),
          _sample(2, 1, [-0.5, -3.0], acc_norm=1.0)]
    return {"samples": {"t1": a1, "t2": a2}}, {"samples": {"t1": b1, "t2": b2}}


def test_paired_rows_match_a_hand_computation():
    a, b = _arms()
    rows = {(r.task, r.score): r for r in paired(a, b)}
    r = rows["t1", "acc"]  # d = 0, -1, -1, +1, 0: mean -0.2; deviations .2,-.8,-.8,1.2,.2 -> 2.8/4 = .7
    assert (r.n, r.mean_a, r.mean_b) == (5, 0.8, 0.6)
    assert r.diff == pytest.approx(-0.2) and r.se == pytest.approx(math.sqrt(0.7 / 5))
    assert (r.b_only, r.a_only) == (1, 2)
    g = rows["t1", "gold_ll"]  # gold lls A -1,-1,-1,-2,-0.5; B -1.5,-3.5,-2,-1,-0.5 -> d -.5,-2.5,-1,1,0
    d = [-0.5, -2.5, -1.0, 1.0, 0.0]
    m = sum(d) / 5
    assert g.diff == pytest.approx(m) and g.se == pytest.approx(math.sqrt(sum((x - m) ** 2 for x in d) / 4 / 5))
    r2 = rows["t2", "acc"]  # d = 0, -1, -1: mean -2/3, deviations 2/3, -1/3, -1/3 -> (6/9) / 2 = 1/3
    assert r2.diff == pytest.approx(-2 / 3) and r2.se == pytest.approx(math.sqrt(1 / 3 / 3))
    assert rows["t2", "acc_norm"].diff == pytest.approx(-1 / 3)
    assert ("t1", "acc_norm") not in rows  # t1 has no acc_norm: no row, not a row of zeros
    p = rows["pooled", "acc"]  # item-weighted mean and stratified s.e.
    assert p.n == 8 and p.diff == pytest.approx((5 * -0.2 + 3 * -2 / 3) / 8)
    assert p.se == pytest.approx(math.sqrt(25 * 0.7 / 5 + 9 * (1 / 3) / 3) / 8)
    assert ("pooled", "acc_norm") not in rows  # one task only: nothing to pool
    table = markdown(paired(a, b), name_a="fp32", name_b="q")
    assert "| t1 | acc | 5 | 80.0 % | 60.0 % | -20.0 pp | 37.4 pp | -0.53 | 1 / 2 |" in table
    assert "| **pooled** | acc | 8 |" in table


def test_items_that_do_not_pair_are_refused():
    a, b = _arms()
    b["samples"]["t1"] = b["samples"]["t1"][:4]
    with pytest.raises(ValueError, match=r"task t1: the arms scored different items \(doc_id only in one: \[4\]"):
        paired(a, b)
    a, b = _arms()
    b["samples"]["t2"][0]["doc"] = {"q": "another document"}
    with pytest.raises(ValueError, match=r"task t2: doc_id \[0\] hold different documents"):
        paired(a, b)
    a, b = _arms()
    del b["samples"]["t2"]
    with pytest.raises(ValueError, match="different tasks"):
        paired(a, b)
    with pytest.raises(ValueError, match="log_samples=True"):
        load_samples({"results": {}})
    copa = dict(_sample(0, 0, [-1.0, -2.5]), target=" he ran.", arguments=[["ctx", " she sat."], ["ctx", " he ran."]])
    assert item_scores([copa])[0]["gold_ll"] == -2.5  # a target given as the gold choice's text
    with pytest.raises(ValueError, match="twice"):
        item_scores([_sample(0, 0, [-1.0, -2.0]), _sample(0, 0, [-1.0, -2.0])])


def test_compare_command_reads_lm_eval_sample_files(tmp_path, capsys):
    a, b = _arms()
    for name, arm in (("fp32", a), ("nvfp4", b)):
        for task, samples in arm["samples"].items():
            d = tmp_path / name / "model__name"
            d.mkdir(parents=True, exist_ok=True)
            old = d / f"samples_{task}_2020-01-01T00-00-00.000000.jsonl"  # an older run of the same task: ignored
            old.write_text(json.dumps(_sample(99, 0, [-1.0, -2.0])) + "\n")
            with open(d / f"samples_{task}_2026-12-05T04-00-00.123456.jsonl", "w") as f:
                f.writelines(json.dumps(s) + "\n" for s in samples)
    assert sorted(load_samples(tmp_path / "fp32")) == ["t1", "t2"]
    assert main(["compare", str(tmp_path / "fp32"), str(tmp_path / "nvfp4"), "--out", str(tmp_path / "t.md")]) == 0
    out = capsys.readouterr().out
    assert "| t1 | acc | 5 | 80.0 % | 60.0 % | -20.0 pp |" in out
    assert (tmp_path / "t.md").read_text().strip() == out.strip()


def test_paired_rows_match_numpy_on_many_items():
    """Per task and pooled, the rows against a direct numpy computation from the logged values (random log-
    likelihoods of 4 choices, 3 tasks of different sizes)."""
    import numpy as np

    rng = np.random.default_rng(7)
    arms: dict[str, dict] = {"a": {"samples": {}}, "b": {"samples": {}}}
    direct = {}
    for task, n in (("t1", 37), ("t2", 120), ("t3", 5)):
        gold = rng.integers(0, 4, n)
        lla = rng.normal(-10, 3, (n, 4))
        llb = lla + rng.normal(-0.3, 1.0, (n, 4))  # B: a perturbed A, so that the arms agree on most items
        for arm, ll in (("a", lla), ("b", llb)):
            arms[arm]["samples"][task] = [_sample(i, int(gold[i]), [float(x) for x in ll[i]]) for i in range(n)]
        acc_a = (lla.argmax(1) == gold).astype(float)
        acc_b = (llb.argmax(1) == gold).astype(float)
        g = np.arange(n)
        direct[task] = {"acc": acc_b - acc_a, "gold_ll": llb[g, gold] - lla[g, gold]}
    rows = {(r.task, r.score): r for r in paired(arms["a"], arms["b"])}
    for score in ("acc", "gold_ll"):
        for task, d in direct.items():
            r = rows[task, score]
            assert r.n == d[score].size
            assert r.diff == pytest.approx(d[score].mean(), abs=1e-12)
            assert r.se == pytest.approx(d[score].std(ddof=1) / np.sqrt(d[score].size), rel=1e-9)
        p = rows["pooled", score]  # pooled: item-weighted mean; s.e. of the stratified mean
        allv = np.concatenate([d[score] for d in direct.values()])
        assert p.n == allv.size and p.diff == pytest.approx(allv.mean(), abs=1e-12)
        var = sum(d[score].size ** 2 * d[score].var(ddof=1) / d[score].size for d in direct.values())
        assert p.se == pytest.approx(np.sqrt(var) / allv.size, rel=1e-9)
    assert rows["pooled", "gold_ll"].diff < 0  # B's gold answers lost about 0.3 nats
    assert rows["t2", "acc"].b_only == int(np.sum(direct["t2"]["acc"] > 0))


def test_other_per_item_metrics_and_partial_scoring():
    """exact_match of a generation task is paired like acc; f1's [pred, gold] pairs are not per-item scores;
    WinoGrande's logged target (the shared continuation) gives the gold index through acc with two choices."""
    def gen(i, em):
        return {"doc_id": i, "doc": {"q": i}, "target": "x", "arguments": [["Q?", {"until": ["\n"]}]],
                "resps": [["x"]], "filtered_resps": ["x"], "metrics": ["exact_match"], "exact_match": em}

    a = {"samples": {"gen": [gen(0, 1.0), gen(1, 0.0), gen(2, 1.0), gen(3, 0.0)]}}
    b = {"samples": {"gen": [gen(0, 1.0), gen(1, 1.0), gen(2, 0.0), gen(3, 1.0)]}}
    rows = {(r.task, r.score): r for r in paired(a, b)}
    r = rows["gen", "exact_match"]  # d = 0, 1, -1, 1: mean .25, deviations -.25,.75,-1.25,.75 -> 2.75/3
    assert r.diff == pytest.approx(0.25) and r.se == pytest.approx(math.sqrt(2.75 / 3 / 4))
    assert (r.b_only, r.a_only) == (2, 1) and set(rows) == {("gen", "exact_match")}
    assert "| gen | exact_match | 4 | 50.0 % | 75.0 % | +25.0 pp |" in markdown(paired(a, b))
    with pytest.raises(ValueError, match="neither of"):
        paired(a, b, scores=["bleu"])
    cb = dict(_sample(0, 1, [-3.0, -1.0, -2.0]), metrics=["acc", "f1"], f1=[1, "1"])
    assert set(item_scores([cb])[0]) == {"doc", "acc", "gold_ll"}

    def wino(lls, acc):
        return {"doc_id": 0, "doc": {"s": "x"}, "target": "ran off.", "metrics": ["acc"], "acc": acc,
                "arguments": [["Tom", " ran off."], ["Ann", " ran off."]], "filtered_resps": [[x, False] for x in lls]}

    assert item_scores([wino([-5.0, -7.0], 1.0)])[0]["gold_ll"] == -5.0  # right: the gold is the argmax
    assert item_scores([wino([-5.0, -7.0], 0.0)])[0]["gold_ll"] == -7.0  # wrong: the other one
