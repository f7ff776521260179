"""A run dir that another trainer is writing at this moment (its first metrics, no checkpoint yet) is
refused as busy, naming the owner, not judged by its half-written contents (two trainers started
together on one run dir: the second used to be told the run "holds metrics but no checkpoint")."""

from __future__ import annotations

import os
import socket

from k2.launcher.checkpointing.run_lock import RunDirLock
from k2.launcher.train import main


def test_busy_run_dir_is_reported_before_its_contents(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 8.0}\n')  # the owner's first step, no checkpoint
    with RunDirLock.acquire(run):  # (another open file description: flock refuses it as it would another process)
        rc = main(["train.iters=2", "run.wandb.mode=disabled", "train.progress=false", f"run.dir={run}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "is in use by another trainer" in err[0] and f"host {socket.gethostname()}, pid {os.getpid()}" in err[0]
    # without an owner the same run dir is judged by what it holds
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "latest").write_text("")
    rc = main(["train.iters=2", "run.wandb.mode=disabled", "train.progress=false", f"run.dir={run}"])
    err = capsys.readouterr().err
    assert rc == 2 and "checkpoints/latest is empty and no checkpoint" in err, err
