"""train.report: table formatting, summary rows (saturation, loss APE by hand), report.md and PNG plots."""
import json
import math
import re

import pytest

from train.report import COLUMNS, format_table, markdown_table, nonfinite_note, read_metrics, saturation_summary
from train.report import summary_rows
from train.report import write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rows(losses, sat=None, warmup=0, amax=False):
    out = []
    for i, loss in enumerate(losses):
        r = {"step": i + 1, "loss": loss, "finite": math.isfinite(loss), "observe_only": i < warmup}
        if sat is not None:
            r["max_saturated_fraction"], r["mean_saturated_fraction"] = sat[i]
        if amax:
            r["amax"], r["amax_estimate"] = 10.0 + i, 11.0
        out.append(r)
    return out


HP = _rows([2.0, 1.0, 4.0, 2.0])
# saturation during the warmup (observe-only) rows must be ignored: (0.9, 0.9) is never quantized
MW = _rows([2.2, 1.1, float("nan"), 2.0], sat=[(0.9, 0.9), (1e-3, 1e-4), (0.0, 0.0), (3e-3, 2e-4)], warmup=1,
           amax=True)


def test_summary_rows_by_hand():
    arms = {"hp": {"label": "high precision", "metrics": HP, "val_loss_b": 1.25, "wall_s": 12.0},
            "mw": {"label": "HiF8 max_window", "metrics": MW, "acc": 0.5}}
    hp, mw = summary_rows(arms)
    assert hp["arm"] == "high precision" and hp["loss_ape"] is None and hp["max_saturated_fraction"] is None
    assert hp["val_loss_b"] == 1.25 and hp["wall_s"] == 12.0
    # steps 1, 2, 4 (step 3 non-finite): 10 %, 10 %, 0 %
    assert mw["loss_ape"] == pytest.approx(20 / 3) and mw["ape_skipped"] == 1
    assert mw["max_saturated_fraction"] == pytest.approx(3e-3)
    assert mw["mean_saturated_fraction"] == pytest.approx((1e-4 + 0.0 + 2e-4) / 3)
    assert mw["acc"] == 0.5 and mw["val_loss_a"] is None
    assert saturation_summary(HP) == (None, None)
    # the skipped step (non-finite) and the non-finite values counted in quantized tensors reach the report
    assert (hp["skipped"], hp["nonfinite_quantized"]) == (0, 0) and mw["skipped"] == 1
    counted = [dict(r, nonfinite_quantized=3 if r["step"] == 3 else 0) for r in MW]
    (row,) = summary_rows({"mw": {"label": "mw", "metrics": counted}}, baseline=None)
    assert nonfinite_note([hp, row]).endswith("mw: 1 steps, 3 values.")
    assert nonfinite_note([hp]).startswith("Non-finite values: no step was skipped")


def test_format_table_aligns_and_marks_missing_values():
    rows = [{"arm": "hp", "val_loss_b": 1.23456, "acc": 0.5, "max_saturated_fraction": 0.000123, "wall_s": 61.7},
            {"arm": "HiF8 W8A8 most_recent", "loss_ape": 1.5, "val_loss_a": float("nan")}]
    text = format_table(rows)
    lines = text.splitlines()
    assert len(lines) == 4 and len({len(line) for line in lines}) == 1  # fixed width
    assert lines[0].split("  ")[0].strip() == "arm" and "B val loss" in lines[0] and "loss APE %" in lines[0]
    assert "1.2346" in lines[2] and "0.500" in lines[2] and "1.23e-04" in lines[2] and lines[2].endswith("62")
    assert lines[3].startswith("HiF8 W8A8 most_recent") and "1.500" in lines[3]
    cells = re.split(r"\s{2,}", lines[3])
    assert len(cells) == len(COLUMNS) and cells.count("-") == 7  # 7 of 9 cells missing (None or NaN)
    md = markdown_table(rows).splitlines()
    assert md[0].count("|") == len(COLUMNS) + 1 and md[1].startswith("|:---|---:")


def test_write_report_from_run_dirs(tmp_path):
    for name, rows in (("hp", HP), ("mw", MW)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_metrics(tmp_path / "mw")[2]["finite"] is False
    table = [{"arm": "high precision", "val_loss_b": 1.0}, {"arm": "HiF8", "val_loss_b": 1.1, "loss_ape": 0.25}]
    arms = [{"name": "hp", "label": "high precision", "dir": str(tmp_path / "hp")},
            {"name": "mw", "label": "HiF8", "dir": str(tmp_path / "mw")}]
    path = write_report(tmp_path / "out", arms, rows=table, config={"lr": 1e-5}, total_wall_s=42.0,
                        amax_layer="blocks/1/mlp/down_proj")
    md = path.read_text()
    assert path.name == "report.md" and "| high precision | 1.0000 |" in md and "| 0.250 |" in md
    assert "Total wall time: 42 s" in md and '"lr": 1e-05' in md
    for png in ("loss_curves.png", "saturation.png", "amax.png"):
        assert f"]({png})" in md
        data = (tmp_path / "out" / png).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000


def test_write_report_high_precision_only_has_no_quant_plots(tmp_path):
    path = write_report(tmp_path, {"hp": {"metrics": HP, "val_loss_b": 1.0}})
    assert "Non-finite values: no step was skipped" in path.read_text()
    assert (tmp_path / "loss_curves.png").is_file()
    assert not (tmp_path / "saturation.png").exists() and not (tmp_path / "amax.png").exists()
    assert "| hp | 1.0000 |" in path.read_text()


def test_bad_arms_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="needs 'metrics'"):
        write_report(tmp_path, {"hp": {"val_loss_b": 1.0}})
    with pytest.raises(ValueError, match="needs a 'name'"):
        write_report(tmp_path, [{"metrics": HP}])
    with pytest.raises(FileNotFoundError, match="no metrics file"):
        read_metrics(tmp_path / "missing")
