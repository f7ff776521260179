"""Who owns a run and who gets its signals, in-process or with tiny helper processes (no trainer starts):
the run-dir lock, signal forwarding to the ranks only and a metrics logger that outlives a dead wandb.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest


def test_run_dir_lock_refuses_a_second_owner_naming_the_first(tmp_path):
    from k2.launcher.checkpointing.run_lock import OWNER_LOCK, RunDirBusy, RunDirLock

    run_dir = tmp_path / "a" / "run"
    with RunDirLock.acquire(run_dir):
        assert (run_dir / OWNER_LOCK).read_text() == f"{socket.gethostname()} {os.getpid()}\n"
        with pytest.raises(RunDirBusy) as e:
            RunDirLock.acquire(run_dir, wait_owner_s=0)
        msg = str(e.value)
        assert f"host {socket.gethostname()}, pid {os.getpid()}" in msg and f"run.dir={run_dir}" in msg
        assert (run_dir / OWNER_LOCK).read_text().split() == [socket.gethostname(), str(os.getpid())]
    RunDirLock.acquire(run_dir).release()  # released: the next owner gets it


def test_run_dir_lock_is_released_when_its_owner_is_killed(tmp_path):
    from k2.launcher.checkpointing.run_lock import RunDirBusy, RunDirLock

    code = (
        "import sys, time; from k2.launcher.checkpointing.run_lock import RunDirLock; "
        f"RunDirLock.acquire({str(tmp_path)!r}); print('locked', flush=True); time.sleep(60)"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirBusy, match=f"pid {p.pid}"):
            RunDirLock.acquire(tmp_path)
    finally:
        p.kill()
        p.wait()
    RunDirLock.acquire(tmp_path).release()


def test_resume_never_ignores_the_lock_file(tmp_path):
    from k2.config.load import load_config
    from k2.launcher.checkpointing.resume import plan_resume
    from k2.launcher.checkpointing.run_lock import RunDirLock

    cfg = load_config([f"run.dir={tmp_path}", "resume=never"])
    with RunDirLock.acquire(tmp_path):
        assert plan_resume(cfg, {}) is None


# a "torchrun": starts one "rank", which starts one "helper" (as rank 0 starts wandb's service); each
# records the signals it gets into <dir>/<role>
_TREE = r"""
import os, signal, subprocess, sys, time
role, out = sys.argv[1], sys.argv[2]
signal.signal(signal.SIGTERM, lambda *_: open(os.path.join(out, role), "a").write("SIGTERM\n"))
open(os.path.join(out, role + ".ready"), "w").close()
if role != "helper":
    subprocess.Popen([sys.executable, __file__, "rank" if role == "launcher" else "helper", out])
time.sleep(30)
"""


def test_forwarded_sigterm_reaches_the_ranks_only(tmp_path):
    """k2-train's forwarding: the launcher's direct children (the ranks) get SIGTERM, what a rank started
    (wandb's service) does not."""
    from k2.launcher.training.launch import forwarding_signals

    script = tmp_path / "tree.py"
    script.write_text(_TREE)
    child = subprocess.Popen([sys.executable, str(script), "launcher", str(tmp_path)], start_new_session=True)
    try:
        deadline = time.time() + 30
        while not all((tmp_path / f"{r}.ready").exists() for r in ("launcher", "rank", "helper")):
            assert time.time() < deadline
            time.sleep(0.05)
        with forwarding_signals(child, to_workers=True):
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.time() + 30  # (a loaded machine may take a while to run the rank's handler)
            while not ((tmp_path / "rank").exists() and (tmp_path / "rank").read_text()):
                assert time.time() < deadline
                time.sleep(0.05)
            time.sleep(1.0)  # time for a wrongly forwarded signal to reach the others too
        assert (tmp_path / "rank").read_text() == "SIGTERM\n"
        assert not (tmp_path / "helper").exists() and not (tmp_path / "launcher").exists()
    finally:
        os.killpg(child.pid, signal.SIGKILL)


class _DeadWandb:
    id = "abc123"

    def log(self, rec):
        raise ConnectionResetError("Connection lost")

    def finish(self):
        raise ConnectionResetError("Connection lost")


def test_metrics_logger_survives_a_dead_wandb(tmp_path, capsys):
    """wandb's service killed mid-run: one warning, metrics.jsonl keeps every step, close() does not raise,
    the run id is kept for the checkpoint."""
    import json

    from k2.launcher.training.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, enabled=True).open(total_steps=3, progress=False, wandb_run_id="abc123")
    logger._wandb = _DeadWandb()
    for step in (1, 2, 3):
        logger.log({"step": step, "loss": 1.0})
    logger.close()
    err = capsys.readouterr().err
    assert err.count("wandb failed") == 1 and "ConnectionResetError" in err, err
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert logger.wandb_run_id == "abc123"
