"""Ctrl-C as a person stops a run at a terminal: SIGINT to the whole process group of ``k2-train`` (its
launcher, the rank launcher, the ranks, the background checkpoint writers, wandb's service alike).

* multi-rank (k2-train's own launcher, ``parallel=pp2``): the first press saves the step in progress --
  after finishing the background save in flight -- and exits 130; the next start resumes from it, bitwise
  with an uninterrupted run, and moves a torn ``metrics.jsonl`` record aside first; a second press during
  the save stops every process at once in one line, leaving the save ``.partial``;
* one rank (``parallel=single``, the rank is ``k2-train`` itself: tests/support/scripts/fault_train.py
  with a background write slowed to seconds): the first press waits for that save and saves the next
  step; a second press during that wait stops at once, without a KeyboardInterrupt traceback.

The rules without a trainer: tests/unit/launcher/training/test_interrupt.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support import REPO, SCRIPTS
from support.distributed import run_trainer, trainer_env

pytestmark = pytest.mark.slow

RUN = ["train.iters=5", "train.save_interval=2", "train.eval_interval=0", "train.progress=false"]
STOPPED_AT_ONCE = "Ctrl-C again: stopped at once"


def _start(target: list[str], run_dir: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    """``target`` (``-m k2.launcher.train`` or a script) in a session of its own: the test's SIGINT to the
    group is what a terminal's Ctrl-C sends."""
    return subprocess.Popen(
        [sys.executable, *target, *RUN, *overrides, f"run.dir={run_dir}"],
        cwd=REPO,
        env=trainer_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _wait(pred, p: subprocess.Popen, what: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not pred():
        assert p.poll() is None and time.time() < deadline, f"{what} (exit {p.poll()})"
        time.sleep(0.05)


def _logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def _ctrl_c(p: subprocess.Popen) -> None:
    os.killpg(p.pid, signal.SIGINT)


def _finish(p: subprocess.Popen, timeout: float = 600) -> tuple[str, float]:
    t0 = time.time()
    try:
        out, _ = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    return out, time.time() - t0


def _state(run_dir: Path) -> dict:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return json.loads((run_dir / "checkpoints" / latest / "k2_state.json").read_text())


def _complete_checkpoints_are_sound(run_dir: Path) -> list[str]:
    """Every ``iter_N`` directory (not ``.partial``) passes the structure check against its manifest, and
    ``latest`` names one of them or is absent: nothing looks complete that is not."""
    from k2.launcher.checkpointing.manifest import check_structure

    root = run_dir / "checkpoints"
    done = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.endswith(".partial"))
    assert all(check_structure(root / d) == [] for d in done), done
    if (root / "latest").exists():
        assert (root / "latest").read_text().strip() in done
    return done


def _left(run_dir: Path) -> list[str]:
    return subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()


def test_ctrl_c_saves_the_step_in_progress_and_the_rerun_is_bitwise_uninterrupted(tmp_path, stdlib_corpus):
    run_dir = tmp_path / "run"
    layout = ["parallel=pp2", "run.wandb.mode=offline"]
    p = _start(["-m", "k2.launcher.train"], run_dir, *layout)
    _wait(lambda: _logged(run_dir) >= 3, p, "step 3")
    pressed_after = _logged(run_dir)
    _ctrl_c(p)
    out, _ = _finish(p)
    assert p.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out and "wandb failed" not in out, out[-3000:]
    assert "Ctrl-C (SIGINT) during step" in out and "then exiting with status 130" in out, out[-3000:]
    state = _state(run_dir)
    assert state["step"] in (pressed_after, pressed_after + 1), (state, pressed_after)
    # (a stop at a step that train.save_interval saves anyway keeps that periodic checkpoint)
    assert state["reason"] in ("interrupted: Ctrl-C (SIGINT)", "train.save_interval"), state
    assert (run_dir / "interrupted").read_text().strip() == str(state["step"]) and not (run_dir / "requeue").exists()
    assert f"the ranks saved step {state['step']} and stopped (Ctrl-C); exit status 130" in out
    assert not _left(run_dir), _left(run_dir)

    with open(run_dir / "metrics.jsonl", "a") as f:  # a record cut by a kill of an earlier start
        f.write('{"step": 99, "loss": 1.2')
    # the rerun and the uninterrupted reference (no checkpoint: saves do not change the steps) are forked by
    # the session's fork server: what is checked of them is the trainer's resume, not k2-train's launcher
    out = tmp_path / "rerun.txt"
    run_trainer([*RUN, "parallel=pp2"], 2, run_dir, stdout_to=out)
    assert "torn record" in out.read_text() and "moved to metrics.jsonl.torn" in out.read_text(), out.read_text()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]  # every line
    assert [r["step"] for r in records] == list(range(1, 6))
    no_saves = ["train.save_interval=null", "checkpoint.save_at_end=false"]
    ref = run_trainer([*RUN, "parallel=pp2", *no_saves], 2, tmp_path / "ref")
    assert [(r["loss"], r["grad_norm"]) for r in records] == [(r["loss"], r["grad_norm"]) for r in ref]


def test_a_second_ctrl_c_during_the_save_stops_every_rank_at_once(tmp_path, stdlib_corpus):
    """A save every step; rank 1 stops itself (SIGSTOP) as it enters the save of step 1 (the watchdog's
    K2_TEST_HANG seam): the save cannot end, so the first press cannot either; the second press kills every
    process at once."""
    run_dir = tmp_path / "run"
    p = _start(
        ["-m", "k2.launcher.train"],
        run_dir,
        "parallel=pp2",
        "train.save_interval=1",
        "run.wandb.mode=disabled",
        env={"K2_TEST_HANG": "save:1:1"},
    )
    _wait(lambda: _logged(run_dir) >= 1, p, "step 1")  # step 1's save starts now
    time.sleep(1.0)
    _ctrl_c(p)
    time.sleep(1.0)
    _ctrl_c(p)
    out, took = _finish(p, timeout=60)
    assert p.returncode == 130 and took < 15, (took, out[-3000:])
    assert out.count(STOPPED_AT_ONCE) == 1 and "Traceback" not in out, out[-3000:]
    assert "the step in progress is not saved; no checkpoint exists yet" in out, out[-3000:]
    assert not _left(run_dir), _left(run_dir)
    assert _complete_checkpoints_are_sound(run_dir) == []


@pytest.mark.parametrize("presses", [1, 2])
def test_one_rank_finishes_the_save_in_flight_or_stops_at_once(tmp_path, stdlib_corpus, presses):
    """``parallel=single`` with step 2's background write slowed to 6 s: Ctrl-C after step 3 finishes that
    save and saves the step in progress (1 press), or stops at once while it waits for it (2 presses)."""
    run_dir = tmp_path / "run"
    p = _start(
        [str(SCRIPTS / "fault_train.py")],
        run_dir,
        "parallel=single",
        "run.wandb.mode=disabled",
        env={"K2_FAULT": "slow_write:2:0", "K2_SLOW_WRITE_S": "6"},
    )
    _wait(lambda: _logged(run_dir) >= 3, p, "step 3")
    pressed_after = _logged(run_dir)
    _ctrl_c(p)
    if presses == 2:
        time.sleep(1.0)  # the step-2 write has seconds to go
        _ctrl_c(p)
    out, took = _finish(p)
    assert p.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    done = _complete_checkpoints_are_sound(run_dir)
    if presses == 1:  # step 2's save, in flight at the press, finished (after the press's line), then this one
        assert "iter_0000002" in done and _state(run_dir)["step"] in (pressed_after, pressed_after + 1), out[-3000:]
        assert out.index("Ctrl-C (SIGINT) during step") < out.index("iter_0000002 (train.save_interval"), out[-3000:]
        return
    assert took < 15 and out.count(STOPPED_AT_ONCE) == 1, (took, out[-3000:])
    assert done == [] and (run_dir / "checkpoints" / "iter_0000002.partial").is_dir()
    assert "no checkpoint exists yet: the next start begins at step 1" in out.split(STOPPED_AT_ONCE)[1]
