"""What of a sweep's grid is on disk (launcher/tools/sweep_state.py) and what the runner makes of it
(launcher/tools/sweep.py ``plan_tasks``, ``run_sweep``): a changed setting that would relabel trained runs
is refused, a branch whose trunk lost its branch point and a damaged finished cell are named with the
remedy while the other cells go on, grid.json is not rewritten when unchanged, and an unwritable sweep
directory is one error line. The runs on disk are stand-ins: files as a finished run leaves them."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

SMALL = [
    "+experiment=sparsity_sweep",
    "sweep.sparsities=[1]",
    "sweep.seeds=[1]",
    "sweep.budgets_tokens=[327680,491520]",  # 20 and 30 steps of 16,384 tokens, branching at 16 and 24
    "schedule.phases.0.steps=5",
]


def _grid(sweep_dir: Path, *extra: str):
    from k2.launcher.tools.sweep_grid import build_grid

    return build_grid([*SMALL, f"sweep.dir={sweep_dir}", *extra])[1]


def _checkpoint(run_dir: Path, step: int) -> None:
    """A checkpoint as :func:`k2.launcher.checkpointing.paths.latest_checkpoint` finds it, and ``latest``."""
    d = run_dir / "checkpoints" / f"iter_{step:07d}"
    d.mkdir(parents=True)
    (d / "k2_state.json").write_text(json.dumps({"step": step}))
    (d / "metadata.json").write_text("{}")
    (run_dir / "checkpoints" / "latest").write_text(d.name)


def _finished(cell, cell_file: bool = True) -> None:
    """A finished cell's files: its config, one metrics record per step (the last evaluated), cell.json."""
    from k2.launcher.tools.sweep import write_cell_file

    cell.run_dir.mkdir(parents=True)
    (cell.run_dir / "config.yaml").write_text("model: {}\n")
    recs = [{"step": s, "loss": 5.0, "time_total_s": float(s)} for s in range(cell.last_step + 1)]
    recs[-1].update(val_loss=4.5, consumed_tokens=cell.budget_tokens)
    (cell.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    if cell_file:
        write_cell_file(cell, None)


def _main(sweep_dir: Path, *extra: str) -> int:
    from k2.launcher.train import main

    return main(["-m", *SMALL, f"sweep.dir={sweep_dir}", *extra])


@pytest.fixture
def quiet_runs(monkeypatch, no_process_start):
    """A run the sweep starts exits at once (1) instead of training."""
    from k2.launcher.tools.sweep import TEST_PYTHON_ENV

    monkeypatch.setenv(TEST_PYTHON_ENV, "/bin/false")
    return no_process_start


@pytest.mark.parametrize(
    "change,named",
    [
        (["sweep.cooldown.style=linear"], "sweep.cooldown.style: 'minus_sqrt' in "),
        (["sweep.cooldown.lr_end=1e-3"], "sweep.cooldown.lr_end: 0.0 in "),
        (["sweep.cooldown.fraction=0.3"], "sweep.cooldown.fraction: 0.2 in "),
    ],
)
def test_a_setting_that_would_relabel_trained_cells_is_refused(tmp_path, quiet_runs, capsys, change, named):
    from k2.launcher.tools.sweep_state import write_grid_manifest

    grid = _grid(tmp_path)
    path = write_grid_manifest(grid)
    stored = path.read_text()
    for c in grid.cells:
        _finished(c)
    assert _main(tmp_path, *change) == 2
    err = capsys.readouterr().err
    assert named in err and "a new sweep.name, or delete those runs' directories" in err and err.count("\n") == 1
    assert path.read_text() == stored and quiet_runs == []


def test_a_changed_setting_of_a_grid_not_trained_yet_is_taken(tmp_path):
    from k2.launcher.tools.sweep_state import check_stored_grid, write_grid_manifest

    write_grid_manifest(_grid(tmp_path))
    grid = _grid(tmp_path, "sweep.cooldown.style=linear")
    check_stored_grid(grid)  # no run of it trained: nothing to relabel
    assert json.loads(write_grid_manifest(grid).read_text())["cooldown"]["style"] == "linear"


def test_a_lost_branch_point_is_named_and_the_other_cells_go_on(tmp_path):
    from k2.launcher.tools.sweep import plan_tasks

    grid = _grid(tmp_path)
    trunk = grid.trunks[0]
    _checkpoint(trunk.run_dir, 24)  # the trunk went on to 24; its checkpoint at 16 is gone
    tasks, status, problems = plan_tasks(grid)
    assert [t.name for t in tasks] == ["sparsity_1/seed_1/budget_491520"] and tasks[0].after is None
    assert status["sparsity_1/seed_1/budget_327680"] == "blocked"
    (line,) = problems
    assert line.startswith("sparsity_1/seed_1/budget_327680: cannot start: its trunk sparsity_1/seed_1/trunk")
    assert "step 16" in line and f"delete {trunk.run_dir / 'checkpoints'} to retrain the trunk" in line
    assert "resume.from" not in line


def test_a_trunk_that_has_not_reached_a_branch_point_trains_to_it(tmp_path):
    from k2.launcher.tools.sweep import plan_tasks

    grid = _grid(tmp_path)
    _checkpoint(grid.trunks[0].run_dir, 16)
    tasks, _, problems = plan_tasks(grid)
    assert [t.name for t in tasks] == [
        "sparsity_1/seed_1/trunk",
        "sparsity_1/seed_1/budget_327680",
        "sparsity_1/seed_1/budget_491520",
    ]
    assert problems == [] and tasks[1].after == "sparsity_1/seed_1/trunk"


@pytest.mark.parametrize(
    "damage,file",
    [
        (lambda d: (d / "cell.json").write_text("garbage{"), "cell.json"),
        (lambda d: (d / "metrics.jsonl").write_text((d / "metrics.jsonl").read_text()[:-20]), "metrics.jsonl"),
        (lambda d: (d / "config.yaml").unlink(), "config.yaml"),
    ],
)
def test_a_damaged_finished_cell_is_named_with_its_file_and_the_remedy(tmp_path, damage, file):
    from k2.launcher.tools.sweep import plan_tasks

    grid = _grid(tmp_path)
    for c in grid.cells:
        _finished(c)
    bad = grid.cells[0]
    damage(bad.run_dir)
    tasks, status, problems = plan_tasks(grid)
    assert tasks == [] and status["sparsity_1/seed_1/budget_327680"] == "damaged"
    assert status["sparsity_1/seed_1/budget_491520"] == "finished"
    (line,) = problems
    assert str(bad.run_dir / file) in line and f"delete {bad.run_dir} to retrain that cell" in line


def test_a_finished_cell_without_its_cell_file_gets_it_back(tmp_path):
    from k2.launcher.tools.sweep import plan_tasks

    grid = _grid(tmp_path)
    cell = grid.cells[1]
    _finished(cell, cell_file=False)
    _checkpoint(cell.run_dir, cell.last_step)  # (a stop between the run's end and its cell.json)
    _, status, problems = plan_tasks(grid)
    assert status["sparsity_1/seed_1/budget_491520"] == "finished" and problems == []
    info = json.loads((cell.run_dir / "cell.json").read_text())
    assert info["status"] == "finished" and info["final_val_loss"] == 4.5


def _read_only(monkeypatch):
    """Every write of the sweep's files fails as on a read-only file system."""

    def refuse(*_a, **_k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(Path, "write_text", refuse)
    monkeypatch.setattr(Path, "mkdir", refuse)
    monkeypatch.setattr(os, "replace", refuse)
    monkeypatch.setattr(os, "access", lambda *_a, **_k: False)


def test_an_unwritable_sweep_dir_of_a_finished_grid_is_not_written(tmp_path, quiet_runs, monkeypatch, capsys):
    from k2.launcher.tools.sweep_state import write_grid_manifest

    grid = _grid(tmp_path)
    write_grid_manifest(grid)
    for c in grid.cells:
        _finished(c)
    _read_only(monkeypatch)
    assert _main(tmp_path) == 0  # nothing to do, grid.json unchanged: nothing written
    assert "all 2 cells finished" in capsys.readouterr().out


@pytest.mark.parametrize("finished", [True, False])
def test_an_unwritable_sweep_dir_is_one_error_line(tmp_path, quiet_runs, monkeypatch, capsys, finished):
    from k2.launcher.tools.sweep_state import write_grid_manifest

    grid = _grid(tmp_path)
    if finished:  # grid.json must change (another collapse threshold): it cannot be written
        for c in grid.cells:
            _finished(c)
    else:  # grid.json as it is, but runs to train there
        write_grid_manifest(grid)
    _read_only(monkeypatch)
    assert _main(tmp_path, *(["sweep.collapsed_load=2.5"] if finished else [])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"sweep.dir={tmp_path}" in err and "Traceback" not in err, err
    assert quiet_runs == []
