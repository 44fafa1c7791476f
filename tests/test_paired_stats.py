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
