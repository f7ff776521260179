"""The hang watchdog on whole ``k2-train`` processes (its own launcher: forked cpu4 ranks): one rank
stopped (SIGSTOP) during a save, during an evaluation, and from outside in the middle of training. Each
time k2-train exits with the requeue status within ``run.hang_timeout_s`` + 60 s, one line names the
stopped rank, every rank's stacks are on disk, no process is left, and ``latest`` is the last committed
checkpoint; each restart resumes from it and re-runs the steps after it bitwise (the reference: the
records of the same steps in the attempt that hung, set aside in metrics.replayed.jsonl).

Three launches in one test (each needs the previous one's run dir), micro batches of 4, and a timeout of
15 s, or, on a machine too busy for it, :data:`STEP_MARGIN` times the slowest step, evaluation or save the
test measured (the records of the earlier launches): one that outlasts the timeout would be taken for the hang,
and the test would name the slowed rank instead of the stopped one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from support import REPO
from support.distributed import trainer_env

#: the least hang timeout, seconds (an idle machine's steps take a few seconds)
TIMEOUT_S = 15
#: the timeout is at least this many times the slowest step measured so far
STEP_MARGIN = 4
ARGS = [
    "parallel=cpu4",
    "train.iters=14",
    "train.save_interval=2",
    "train.eval_interval=3",
    "train.eval_iters=1",
    "train.micro_batch_size=4",
    "run.hang_startup_timeout_s=180",
    "train.progress=false",
    "run.wandb.mode=disabled",
    # synchronous saves: the checkpoint each hang leaves as latest does not depend on when a
    # background writer finishes (the abandoned background write: test_checkpoint.py's kill -9 case)
    "checkpoint.async_save=false",
]


def _left(run_dir: Path) -> list[str]:
    return subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()


def _records(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / name
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _timeout_s(steps_s: list[float]) -> float:
    """The hang timeout for a machine whose steps took ``steps_s`` seconds (module docstring)."""
    return max(TIMEOUT_S, STEP_MARGIN * max(steps_s, default=0.0))


def _steps_s(run_dir: Path) -> list[float]:
    """Seconds of every step, evaluation and checkpoint stall the launches in ``run_dir`` recorded (the
    re-run ones and their first runs): each step's ``step_time_s``, and the growth of the records'
    cumulative ``time_eval_s`` / ``time_checkpoint_s`` from one record to the next (the watchdog watches
    evaluations and saves too, and a busy machine's evaluation outlasts its steps)."""
    out = []
    for name in ("metrics.jsonl", "metrics.replayed.jsonl"):
        last: dict[str, float] = {}  # (the totals run on over restarts: only their growth counts)
        for r in _records(run_dir, name):
            if r.get("step", 0) > 0 and "step_time_s" in r:
                out.append(float(r["step_time_s"]))
            for k in ("time_eval_s", "time_checkpoint_s"):
                if k in r:
                    if k in last:
                        out.append(max(0.0, float(r[k]) - last[k]))
                    last[k] = float(r[k])
    return out


def _names_only(out: str, rank: int) -> bool:
    """The one hang line of ``out`` names ``rank`` and no other rank."""
    lines = [x for x in out.splitlines() if x.startswith("k2-train: hang:")]
    return (
        len(lines) == 1
        and f"rank {rank} " in lines[0]
        and not any(f"rank {r} " in lines[0] for r in range(4) if r != rank)
    )


def _first_hang_launch(run_dir: Path, fault: str, stop_rank: int) -> tuple[str, float, Path, float]:
    """The first launch (:func:`_hang_launch`), with no step measured yet: when it names another rank than the
    stopped one and its own steps show the machine too busy for the timeout it ran with, it is run again
    from an empty run dir with the timeout those steps ask for."""
    out, waited, attempt, timeout = _hang_launch(run_dir, fault, stop_rank)
    measured = _timeout_s(_steps_s(run_dir))
    if _names_only(out, stop_rank) or measured <= timeout:
        return out, waited, attempt, timeout
    shutil.rmtree(run_dir)
    return _hang_launch(run_dir, fault, stop_rank, measured)


def _hang_launch(
    run_dir: Path, fault: str | None, stop_rank: int, timeout: float | None = None
) -> tuple[str, float, Path, float]:
    """One k2-train launch that hangs (seam ``fault``, or SIGSTOP of ``stop_rank`` from here once a step
    after the resume has a record), with ``timeout`` (default: :func:`_timeout_s` of the steps measured in
    ``run_dir``); returns its output, seconds from the stop to the exit, its attempt dir, the timeout."""
    env = trainer_env({"K2_TEST_HANG": fault} if fault else {})
    before = len(_records(run_dir, "metrics.jsonl"))
    timeout = _timeout_s(_steps_s(run_dir)) if timeout is None else timeout
    p = subprocess.Popen(
        [sys.executable, "-m", "k2.launcher.train", *ARGS, f"run.hang_timeout_s={timeout:g}", f"run.dir={run_dir}"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    stopped_at = None
    try:
        if fault is None:  # from outside, in the middle of training
            while len(_records(run_dir, "metrics.jsonl")) < before + 2:
                assert p.poll() is None, p.stdout.read()[-3000:]
                time.sleep(0.1)
            beat = max((run_dir / "hang").glob(f"*/rank{stop_rank}.json"), key=lambda f: f.stat().st_mtime)
            os.kill(json.loads(beat.read_text())["pid"], signal.SIGSTOP)
            stopped_at = time.time()
        out, _ = p.communicate(timeout=timeout + 240)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    # a launch that ended without a hang report (it failed before or instead of hanging) fails here with its
    # own output and exit status, not with a missing directory
    reports = [d for d in (run_dir / "hang").glob("*") if (d / "report.txt").exists()]
    assert reports, f"exit status {p.returncode}, no hang report under {run_dir / 'hang'}:\n{out[-4000:]}"
    attempt = max(reports, key=lambda d: d.stat().st_mtime)
    if stopped_at is None:  # the seam: the stopped rank's last heartbeat
        stopped_at = json.loads((attempt / f"rank{stop_rank}.json").read_text())["alive"]
    assert p.returncode == 42, out[-4000:]
    return out, time.time() - stopped_at, attempt, timeout


def _check_hang(run_dir: Path, out: str, waited: float, attempt: Path, rank: int, latest: str, timeout: float) -> None:
    assert _names_only(out, rank), [x for x in out.splitlines() if x.startswith("k2-train: hang:")] or out[-4000:]
    assert waited <= timeout + 60, (waited, timeout)
    for r in range(4):  # faulthandler for the live ranks, py-spy for the stopped one
        text = (attempt / f"stacks_rank{r}.txt").read_text()
        assert "trainer.py" in text or "train.py" in text, (r, text[:2000])
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == latest
    t0 = time.time()
    while _left(run_dir) and time.time() - t0 < 10:
        time.sleep(0.2)
    assert not _left(run_dir), _left(run_dir)


def _assert_replays_bitwise(run_dir: Path) -> list[int]:
    """Every re-run step's loss and grad norm equal the hung attempt's record of that step."""
    first = {}
    for r in _records(run_dir, "metrics.replayed.jsonl"):
        first.setdefault(r["step"], r)
    replayed = []
    for r in _records(run_dir, "metrics.jsonl"):
        if r.get("replayed") and r["step"] in first:
            assert (r["loss"], r["grad_norm"]) == (first[r["step"]]["loss"], first[r["step"]]["grad_norm"]), r["step"]
            replayed.append(r["step"])
    return replayed


def test_stopped_rank_during_save_eval_and_training_requeues_with_stacks(tmp_path, stdlib_corpus):
    run_dir = tmp_path / "run"
    # 1. rank 2 stops as the save of step 4 starts: latest stays iter_0000002
    out, waited, attempt, timeout = _first_hang_launch(run_dir, "save:4:2", 2)
    _check_hang(run_dir, out, waited, attempt, 2, "iter_0000002", timeout)
    assert (run_dir / "checkpoints" / "iter_0000004.partial").exists() or not (
        run_dir / "checkpoints" / "iter_0000004"
    ).exists()
    # 2. resumed from step 2; rank 3 stops as the evaluation after step 6 starts: latest iter_0000004
    out, waited, attempt, timeout = _hang_launch(run_dir, "eval:6:3", 3)
    _check_hang(run_dir, out, waited, attempt, 3, "iter_0000004", timeout)
    assert "resumed from" in out and _assert_replays_bitwise(run_dir) == [3, 4], out[-3000:]
    # 3. resumed from step 4; rank 1 stopped from outside while training
    out, waited, attempt, timeout = _hang_launch(run_dir, None, 1)
    complete = sorted(d.name for d in (run_dir / "checkpoints").glob("iter_*") if d.suffix != ".partial")
    assert complete[-1] >= "iter_0000006", complete
    _check_hang(run_dir, out, waited, attempt, 1, complete[-1], timeout)
    # launch 2's re-runs, then launch 3's (step 6 of launch 2 hung in its evaluation, before its record)
    assert _assert_replays_bitwise(run_dir) == [3, 4, 5]
