"""k2-sweep-report on synthetic sweep points (no training): the training-FLOPs sum over steps at two context
lengths, the FLOPs to the target interpolated in log FLOPs (written out here in closed form), the savings
column, "not reached", and a plot that really has the curves in it."""

from __future__ import annotations

import csv
import json
import math

import pytest
from omegaconf import OmegaConf

from k2.config.load import load_config
from k2.launcher.sweep_report import main as report_main
from k2.model.flops import flops_per_token

TARGET = 8.25
# per point: (step, consumed tokens, seq_length, val_loss or None); step 0 is the evaluation before training
STEPS = [(0, 0, 128, 8.50), (1, 2048, 128, None), (2, 4096, 128, 8.40), (3, 6144, 512, None),
         (4, 8192, 512, None)]
VAL_AT_4 = {2: 8.30, 4: 8.20, 8: 8.10}  # sparsity -> val loss at step 4


def _point(sweep_dir, sparsity: int, val_at_4: float, val_at_2: float = 8.40):
    cfg = load_config(["+experiment=sparsity_sweep", f"model.num_moe_experts={2 * sparsity}",
                       f"sweep.val_loss_target={TARGET}"])
    d = sweep_dir / f"sparsity_{sparsity}"
    d.mkdir(parents=True)
    OmegaConf.save(cfg, d / "config.yaml")
    with open(d / "metrics.jsonl", "w") as f:
        for step, tokens, seq, val in STEPS:
            rec = {"step": step, "consumed_tokens": tokens, "seq_length": seq}
            if step == 2:
                val = val_at_2
            if step == 4:
                val = val_at_4
            if val is not None:
                rec["val_loss"] = val
            f.write(json.dumps(rec) + "\n")
    return cfg


def test_flops_sum_interpolation_and_savings(tmp_path, capsys):
    cfgs = {s: _point(tmp_path, s, v) for s, v in VAL_AT_4.items()}
    assert report_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = {int(r["sparsity"]): r for r in csv.DictReader(open(tmp_path / "sweep.csv"))}
    assert sorted(rows) == [2, 4, 8]
    f2 = {}
    for s, cfg in cfgs.items():
        short, long = (flops_per_token(cfg.model, n).training for n in (128, 512))
        total = 2 * 2048 * short + 2 * 2048 * long  # steps 1-2 at seq 128, steps 3-4 at 512
        assert float(rows[s]["flops"]) == pytest.approx(total, rel=1e-12)
        at2, at4 = 2 * 2048 * short, total  # the FLOPs of the evaluations after steps 2 and 4
        assert float(rows[s]["final_val_loss"]) == VAL_AT_4[s]
        if VAL_AT_4[s] > TARGET:
            assert rows[s]["flops_to_target"] == ""  # never reached
            continue
        # crossing between step 2 (8.40) and step 4: t = (8.40 - 8.25) / (8.40 - v4) of the way in log FLOPs
        t = (8.40 - TARGET) / (8.40 - VAL_AT_4[s])
        f2[s] = at2 ** (1 - t) * at4 ** t
        assert float(rows[s]["flops_to_target"]) == pytest.approx(f2[s], rel=1e-9)
        assert at2 < f2[s] < at4
    # sparsity 2 never reached the target: no savings column, and the report says why
    assert all(rows[s]["flops_savings_vs_lowest"] == "" for s in rows)
    assert "not reached" in (tmp_path / "sweep.md").read_text()
    assert ("sparsity 4: FLOPs to val loss 8.25 not comparable with sparsity 2 (sparsity 2 did not reach it)"
            in out.splitlines()) and " with (" not in out


def test_help_exits_0(capsys):
    assert report_main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: k2-sweep-report SWEEP_DIR")
    assert report_main([]) == 2 and "expected one SWEEP_DIR" in capsys.readouterr().err


def test_savings_against_the_lowest_sparsity(tmp_path, capsys):
    """All three reach the target; sparsity 2 right at its first evaluation after training (no
    interpolation: the loss is already below it), the others in between."""
    _point(tmp_path, 2, 8.20, val_at_2=8.24)
    _point(tmp_path, 4, 8.10, val_at_2=8.30)
    cfg8 = _point(tmp_path, 8, 8.05, val_at_2=8.26)
    assert report_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = {int(r["sparsity"]): r for r in csv.DictReader(open(tmp_path / "sweep.csv"))}
    short, long = (flops_per_token(cfg8.model, n).training for n in (128, 512))
    f_of = {s: float(rows[s]["flops_to_target"]) for s in rows}
    base = f_of[2]
    # sparsity 2: step 2's evaluation (8.24) is the first at or below 8.25: exactly step 2's FLOPs
    cfg2 = OmegaConf.load(tmp_path / "sparsity_2" / "config.yaml")
    assert base == pytest.approx(2 * 2048 * flops_per_token(cfg2.model, 128).training, rel=1e-12)
    # sparsity 8: 8.26 at step 2, 8.05 at step 4
    t = (8.26 - TARGET) / (8.26 - 8.05)
    at2, at4 = 2 * 2048 * short, 2 * 2048 * (short + long)
    assert f_of[8] == pytest.approx(math.exp((1 - t) * math.log(at2) + t * math.log(at4)), rel=1e-9)
    for s in (2, 4, 8):
        assert float(rows[s]["flops_savings_vs_lowest"]) == pytest.approx(base / f_of[s], rel=1e-12)
    assert float(rows[2]["flops_savings_vs_lowest"]) == 1.0
    assert f"{base / f_of[4]:.2f}x fewer FLOPs than sparsity 2" in out


def test_plot_has_one_curve_per_point_and_the_target_line(tmp_path, capsys):
    import matplotlib.image as mpimg
    import numpy as np

    for s, v in VAL_AT_4.items():
        _point(tmp_path, s, v)
    assert report_main([str(tmp_path)]) == 0
    img = mpimg.imread(tmp_path / "sweep.png")[..., :3]  # decoded pixels, not only the header
    assert img.shape[0] > 300 and img.shape[1] > 500
    # matplotlib's default cycle: C0 blue, C1 orange, C2 green for the three points
    for rgb in ((0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E), (0x2C, 0xA0, 0x2C)):
        close = np.all(np.abs(img - np.array(rgb) / 255.0) < 0.03, axis=-1)
        assert close.sum() > 50, rgb
