"""The sparsity sweep's grid (launcher/tools/sweep_grid.py): which trunks and cooldown branches a sweep
trains, with which settings; bad grids are refused in one line before anything runs."""

from __future__ import annotations

import pytest

EXPERIMENT = ["+experiment=sparsity_sweep"]


@pytest.fixture(scope="module")
def grid():
    from k2.launcher.tools.sweep_grid import build_grid

    return build_grid(EXPERIMENT)


def _value(overrides, key: str) -> str:
    return next(o.split("=", 1)[1] for o in overrides if o.startswith(key + "="))


def test_the_committed_experiment_grid(grid):
    cfg, g = grid
    assert [(t.sparsity, t.experts, t.seed) for t in g.trunks] == [
        (s, 2 * s, seed) for s in (1, 4, 16, 32) for seed in (1, 2)
    ]
    assert len(g.cells) == 32
    t = g.trunks[0]
    assert t.branch_steps == (68, 136, 272, 544)  # floor(0.8 x budget / 16,384 tokens)
    assert _value(t.overrides, "checkpoint.save_steps") == "[68,136,272,544]"
    assert "until_tokens:8912896" in _value(t.overrides, "schedule.phases")  # constant to the last branch point
    cells = g.cells_of(t)
    assert [(c.budget_tokens, c.branch_step, c.last_step) for c in cells] == [
        (1_392_640, 68, 85),
        (2_785_280, 136, 170),
        (5_570_560, 272, 340),
        (11_141_120, 544, 680),
    ]
    c = cells[1]
    assert _value(c.overrides, "resume.branch_from") == str(t.run_dir / "checkpoints" / "iter_0000136")
    assert "{name:'cooldown',until_tokens:2785280,lr_style:'minus_sqrt',lr_start:0.003,lr_end:0.0}" in _value(
        c.overrides, "schedule.phases"
    )
    # every run: the same data order and held-out tokens; the seed is the model's
    for run in [*g.trunks, *g.cells]:
        assert _value(run.overrides, "data.seed") == str(cfg.run.seed)
        assert _value(run.overrides, "data.index_tokens") == "11141120"
    assert {_value(r.overrides, "run.seed") for r in g.trunks} == {"1", "2"}
    assert len({r.run_dir for r in [*g.trunks, *g.cells]}) == 40


def test_a_run_of_the_grid_loads_with_its_schedule(grid):
    from k2.config.load import load_config
    from k2.launcher.tools.sweep import gemm_flops_per_token, run_overrides_for_check
    from k2.schedules.resolve import resolve_schedule

    _, g = grid
    cell = g.cells[3]
    cfg = load_config(run_overrides_for_check(cell.overrides))
    s = resolve_schedule(cfg)
    assert [p.name for p in s.phases] == ["warmup", "stable", "cooldown"]
    assert s.total_steps == cell.last_step == 680
    assert s.step_lr(544) == 3.0e-3 and s.step_lr(680) == 0.0
    assert s.step_lr(612) == pytest.approx(3.0e-3 * (1 - 0.5**0.5))
    # the arms: equal FLOPs per token but for the router
    flops = {gemm_flops_per_token(load_config(run_overrides_for_check(t.overrides)).model, 256) for t in g.trunks[::2]}
    assert len(flops) == 1


@pytest.mark.parametrize(
    "bad,named",
    [
        (["schedule=tiny_wsd"], "schedule 'tiny_wsd' has phases"),
        (["sweep.budgets_tokens=[600000]"], "inside the warmup"),
        (["run.seed=5"], "run.seed=5: the sweep grid sets these itself"),
        (["sweep.cooldown.fraction=0.05"], "sweep.cooldown.fraction=0.05"),
        (["sweep.cooldown.style=step"], "sweep.cooldown.style='step'"),
        (["sweep.sparsities=[2,2]"], "sweep.sparsities"),
        (["sweep.sparsities=[]"], "sweep.sparsities"),
        # two budgets of the same whole number of steps would be one cell trained twice
        (["sweep.budgets_tokens=[1392640,1392000]"], "sweep.budgets_tokens: the budgets 1,392,000 and 1,392,640"),
        # a size may change the model's shape, never the batch (branch steps), top-k (sparsity) or seed
        (["+sweep.sizes={big:['schedule.global_batch_tokens=32768']}"], "sweep.sizes.big: schedule.global_batch"),
        (["+sweep.sizes={k1:['model.moe_router_topk=1']}"], "sweep.sizes.k1: model.moe_router_topk=1"),
        (["+sweep.sizes={s:['model.num_moe_experts=4']}"], "sweep.sizes.s: model.num_moe_experts=4"),
        (["+sweep.sizes={s:['schedule=tiny_wsd']}"], "sweep.sizes.s: schedule=tiny_wsd"),
        (["+sweep.sizes={s:['run.seed=3']}"], "sweep.sizes.s: run.seed=3"),
        (["+sweep.sizes={s:['model.nosuch=1']}"], "sweep.sizes.s: unknown config key 'model.nosuch'"),
        # the name is one directory under runs/sweeps/
        (["sweep.name="], "sweep.name=''"),
        (["sweep.name=../../../tmp/escape"], "sweep.name='../../../tmp/escape'"),
        (["sweep.name=/tmp/x"], "sweep.name='/tmp/x'"),
        (["sweep.name=a/b"], "sweep.name='a/b'"),
    ],
)
def test_bad_sweep_is_refused_before_anything_runs(tmp_path, no_process_start, capsys, monkeypatch, bad, named):
    from k2.launcher.tools.sweep import TEST_PYTHON_ENV
    from k2.launcher.train import main

    monkeypatch.setenv(TEST_PYTHON_ENV, "/bin/false")  # a grid let through fails at once instead of training

    rc = main(["-m", *EXPERIMENT, f"sweep.dir={tmp_path / 'sweep'}", *bad])
    err = capsys.readouterr().err
    assert rc == 2 and named in err and err.count("\n") == 1, err
    assert no_process_start == [] and not (tmp_path / "sweep").exists()


def test_hydra_value_round_trips_through_an_override():
    from k2.config.load import load_config
    from k2.launcher.tools.sweep_grid import hydra_value

    phases = [
        {"name": "warm'up", "steps": 3, "lr_style": "linear", "lr_start": 0.0, "lr_end": 1e-3, "seq_length": 128},
        {"name": "stable", "until_tokens": 20480, "lr_start": 1e-3},
    ]
    cfg = load_config(["schedule.phases=" + hydra_value(phases)])
    assert [p.name for p in cfg.schedule.phases] == ["warm'up", "stable"]
    assert cfg.schedule.phases[0].lr_end == 1e-3 and cfg.schedule.phases[1].until_tokens == 20480
