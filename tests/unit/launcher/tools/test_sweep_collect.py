"""Reading a sweep grid: the training-FLOPs sum (each step at its own context length, the trunk's steps
included), the final loss, the medians after warm-up, the branch point (its loss measured or interpolated
between the trunk's evaluations, never extrapolated), the collapsed flag; the cells that
cannot be reported (torn line, no cell.json, no dir) named with their file; grid.json's checks."""

from __future__ import annotations

import json
import math

import pytest
from omegaconf import OmegaConf

from k2.launcher.tools.sweep_collect import SweepInputError, collect_grid, read_grid_spec
from k2.model.flops import flops_per_token
from support.fake_sweep import fake_params, model_config, write_cell


def _grid(tmp_path, cells: list[dict], **over) -> None:
    grid = {
        "name": "g",
        "topk": 2,
        "reference_arm": "sparsity_1",
        "cooldown": {"style": "minus_sqrt", "fraction": 0.2},
        "collapsed_load": 2.0,
        "warmup_steps": 2,
        "cells": cells,
    } | over
    (tmp_path / "grid.json").write_text(json.dumps(grid))


def _spec(arm: str, s: int, seed: int, budget: int, branch: int = 3) -> dict:
    name = f"{arm}/seed_{seed}/budget_{budget}"
    return {
        "cell": name,
        "arm": arm,
        "sparsity": s,
        "experts": 2 * s,
        "size": None,
        "seed": seed,
        "budget_tokens": budget,
        "branch_step": branch,
        "trunk_dir": f"{arm}/seed_{seed}/trunk",
        "run_dir": name,
    }


def test_flops_loss_medians_and_branch_point(tmp_path):
    """Steps 1-2 at 128 tokens of context, 3-4 at 512 (1024 tokens each); the trunk's steps 1-3 are in the
    branch's file and in its FLOPs."""
    cfg = model_config(8)
    d = tmp_path / "sparsity_4/seed_1/budget_4096"
    d.mkdir(parents=True)
    OmegaConf.save(cfg, d / "config.yaml")
    recs = [{"step": 0, "consumed_tokens": 0, "seq_length": 128, "val_loss": 8.0}]
    for step, seq, tps, load, val in [
        (1, 128, 10.0, 3.9, None),
        (2, 128, 20.0, 3.8, 7.0),
        (3, 512, 30.0, 1.3, None),
        (4, 512, 50.0, 1.5, 6.5),
    ]:
        recs.append(
            {
                "step": step,
                "consumed_tokens": 1024 * step,
                "seq_length": seq,
                "loss": 7.0,
                "tokens_per_s": tps,
                "moe_load_max_over_mean": load,
            }
            | ({"val_loss": val} if val else {})
        )
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (d / "cell.json").write_text(
        json.dumps(
            {
                "status": "finished",
                "wall_clock_s": 12.5,
                "trunk_wall_clock_s": 30.0,
                "peak_rss_bytes": 123,
                "final_val_loss": 6.5,
                "tokens": 4096,
            }
        )
    )
    _grid(tmp_path, [_spec("sparsity_4", 4, 1, 4096, branch=3)], reference_arm="sparsity_4")
    cell = collect_grid(tmp_path, params_of=fake_params).cells[0]
    short, long = (flops_per_token(cfg.model, n).training for n in (128, 512))
    assert cell.status == "finished" and cell.problem is None
    assert cell.flops == pytest.approx(2048 * short + 2048 * long, rel=1e-12)
    assert cell.curve == [(pytest.approx(2048 * short), 7.0), (pytest.approx(cell.flops), 6.5)]
    assert cell.final_val_loss == 6.5 and cell.tokens == 4096
    assert cell.tokens_per_s == 40.0 and (cell.load_median, cell.load_max) == (1.4, 1.5)  # steps 3-4
    assert cell.collapsed is False
    assert (cell.wall_clock_s, cell.trunk_wall_clock_s, cell.peak_rss_bytes) == (12.5, 30.0, 123)
    assert cell.params_total == fake_params(cfg)[0]
    # the branch point: after step 3 (2048 short + 1024 long); no trunk evaluation after it to interpolate to
    # (the branch's own at step 4 follows its cooldown, not the trunk's curve): the FLOPs, no loss
    f3 = 2048 * short + 1024 * long
    assert cell.branch_point[0] == pytest.approx(f3) and cell.branch_point[1] is None
    # the trunk (the same records up to step 3, then its own constant-LR step 4, evaluated at 6.8): the loss
    # interpolated in ln FLOPs between the trunk's evaluations at steps 2 and 4
    trunk = tmp_path / "sparsity_4/seed_1/trunk"
    trunk.mkdir()
    recs[4]["val_loss"] = 6.8
    (trunk / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    cell = collect_grid(tmp_path, params_of=fake_params).cells[0]
    t = (math.log(f3) - math.log(2048 * short)) / (math.log(cell.flops) - math.log(2048 * short))
    assert cell.branch_point[0] == pytest.approx(f3) and cell.branch_point[1] == pytest.approx(7.0 - 0.2 * t)


@pytest.mark.parametrize("with_trunk", [False, True])
def test_a_branch_point_loss_is_measured_never_extrapolated(tmp_path, with_trunk):
    """Evaluations every 4 steps and at the last (step 8): a branch point at step 4 has that evaluation's
    loss; one at step 3 has no evaluation before it (step 0 is not on the curve), so no loss, not the
    nearest evaluation's (an extrapolation); one at step 6 lies between evaluations 4 and 8 of the trunk,
    if there is a trunk to read (the branch's own step 8 is after its cooldown)."""
    specs = [_spec("sparsity_1", 1, seed, 8192, branch=b) for seed, b in ((1, 4), (2, 3), (3, 6))]
    for sp in specs:
        write_cell(tmp_path / sp["run_dir"], model_config(2), 8, sp["branch_step"], 5.0, 1.0)
        if with_trunk:  # a trunk evaluated at 5.3 at step 8 (up to a branch step, the branch's records are its)
            trunk = tmp_path / sp["trunk_dir"]
            write_cell(trunk, model_config(2), 8, 8, 5.3, 1.0)
    _grid(tmp_path, specs)
    cells = {c.spec.branch_step: c for c in collect_grid(tmp_path, params_of=fake_params).cells}
    step_4 = next(loss for f, loss in cells[4].curve if f == cells[4].branch_point[0])
    assert cells[4].branch_point[1] == step_4
    assert cells[3].branch_point[0] > 0 and cells[3].branch_point[1] is None
    if not with_trunk:
        assert cells[6].branch_point[1] is None
        return
    (f4, l4), (f8, l8) = cells[6].curve[0], (cells[6].flops, 5.3)
    t = (math.log(cells[6].branch_point[0]) - math.log(f4)) / (math.log(f8) - math.log(f4))
    assert cells[6].branch_point[1] == pytest.approx(l4 + t * (l8 - l4))


def test_incomplete_cells_are_named_with_their_files(tmp_path):
    cfg = model_config(2)
    specs = [_spec("sparsity_1", 1, seed, 8192) for seed in (1, 2, 3, 4, 5)]
    for i, sp in enumerate(specs[:4]):
        write_cell(tmp_path / sp["run_dir"], cfg, 8, 6, 5.0, 1.0, finished=i != 2)
    torn = tmp_path / specs[1]["run_dir"] / "metrics.jsonl"  # a finished cell torn mid-file
    lines = torn.read_text().splitlines()
    torn.write_text("\n".join(lines[:4] + [lines[4][:20]] + lines[5:]) + "\n")
    short = tmp_path / specs[2]["run_dir"] / "metrics.jsonl"  # no cell.json, and short of its budget
    short.write_text("".join(x + "\n" for x in short.read_text().splitlines()[:-1]))
    cut = tmp_path / specs[3]["run_dir"]  # an unfinished cell killed mid-write: its last line torn
    (cut / "cell.json").unlink()
    (cut / "metrics.jsonl").write_text((cut / "metrics.jsonl").read_text()[:-15])
    _grid(tmp_path, specs)
    cells = {c.spec.seed: c for c in collect_grid(tmp_path, params_of=fake_params).cells}
    assert cells[1].status == "finished"
    assert cells[2].status == "unreadable"
    assert cells[2].problem.startswith("sparsity_1/seed_2/budget_8192/metrics.jsonl:5: not a valid metrics record")
    assert (
        cells[3].status == "unfinished"
        and cells[3].problem == "sparsity_1/seed_3/budget_8192/cell.json: absent (not finished)"
    )
    assert cells[3].curve  # an unfinished cell's curve is read (it is drawn)
    assert cells[4].status == "unfinished" and cells[4].tokens == 7 * 1024  # its torn step-8 line skipped
    assert len(cells[4].notes) == 1
    assert cells[4].notes[0].startswith("sparsity_1/seed_4/budget_8192/metrics.jsonl:9: torn last line skipped")
    assert cells[5].status == "missing" and cells[5].problem == "sparsity_1/seed_5/budget_8192/: no such directory"


def test_collapsed_cell_flagged(tmp_path):
    write_cell(tmp_path / "a", model_config(8), 8, 6, 5.0, load=2.5)
    _grid(tmp_path, [_spec("sparsity_4", 4, 1, 8192) | {"run_dir": "a"}], reference_arm="sparsity_4")
    cell = collect_grid(tmp_path, params_of=fake_params).cells[0]
    assert cell.collapsed is True and cell.load_median == 2.5 and cell.load_max == 2.5


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda g: g.pop("cells"), "missing key 'cells'"),
        (lambda g: g.update(topk="2"), "'topk'='2' has the wrong type"),
        (lambda g: g.update(reference_arm="dense"), "reference_arm='dense'; allowed: sparsity_1"),
        (lambda g: g.update(collapsed_load=0.5), "collapsed_load=0.5; allowed: a number > 1"),
        (lambda g: g["cells"].append(dict(g["cells"][0])), "cell names repeat"),
        (lambda g: g["cells"][0].pop("run_dir"), r"cells\[0\]: missing key 'run_dir'"),
    ],
)
def test_grid_json_checks(tmp_path, mutate, message):
    _grid(tmp_path, [_spec("sparsity_1", 1, 1, 8192)])
    g = json.loads((tmp_path / "grid.json").read_text())
    mutate(g)
    (tmp_path / "grid.json").write_text(json.dumps(g))
    with pytest.raises(SweepInputError, match=message):
        read_grid_spec(tmp_path)


def test_no_grid_json_or_no_readable_cell(tmp_path):
    with pytest.raises(SweepInputError, match="grid.json: no such file"):
        read_grid_spec(tmp_path)
    (tmp_path / "grid.json").write_text('{"name": ')
    with pytest.raises(SweepInputError, match="grid.json: not valid JSON"):
        read_grid_spec(tmp_path)
    _grid(tmp_path, [_spec("sparsity_1", 1, 1, 8192)])
    with pytest.raises(SweepInputError, match="no readable cell among the 1 of grid.json"):
        collect_grid(tmp_path, params_of=fake_params)


def test_a_cell_trained_to_its_budget_without_cell_json_is_finished(tmp_path):
    """A cell run by k2-submit -m's Slurm jobs gets no cell.json (k2-train -m writes it): its metrics at its
    budget's last step, evaluated, make it finished, its wall-clock read off the goodput clock."""
    write_cell(tmp_path / "a", model_config(8), 8, 6, 5.0, 1.0, finished=False)
    recs = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    for r in recs:
        r["time_total_s"] = 10.0 * r["step"]
    (tmp_path / "a" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    _grid(tmp_path, [_spec("sparsity_4", 4, 1, 8192, branch=6) | {"run_dir": "a"}], reference_arm="sparsity_4")
    cell = collect_grid(tmp_path, params_of=fake_params).cells[0]
    assert cell.status == "finished" and cell.problem is None and cell.final_val_loss == 5.0
    assert (cell.wall_clock_s, cell.trunk_wall_clock_s) == (20.0, 60.0)
    (tmp_path / "a" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs[:-1]))
    assert collect_grid(tmp_path, params_of=fake_params).cells[0].status == "unfinished"  # short of its budget
