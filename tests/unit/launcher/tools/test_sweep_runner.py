"""The grid's runner on one machine (launcher/tools/sweep.py ``Runner``): runs at most ``jobs`` at a time, a
branch only after its trunk finished, a failed trunk named with its log while the other trunk's runs go on
(its own branches skipped and named), a signal stopping the runs in flight, a run another live process
trains named and not started again, the runs of a killed sweep stopped. The runs are stand-in processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from k2.launcher.tools.sweep import Runner, Task


def _tasks(root: Path) -> list[Task]:
    out = []
    for arm in ("a", "b"):
        out.append(Task(f"{arm}/trunk", root / arm / "trunk", (arm, "trunk")))
        out += [
            Task(f"{arm}/budget_{n}", root / arm / f"budget_{n}", (arm, "cell"), after=f"{arm}/trunk") for n in (1, 2)
        ]
    return out


def _sigterm_when_both_run(runner: Runner, ready: str | None = None) -> None:
    """SIGTERM to ``runner`` from another thread once two runs are in flight (and, with ``ready``, each has
    written that file in its run dir: a loaded machine may take seconds to start python)."""

    def stop():
        while len(runner.running) < 2 or (ready and not all((t.run_dir / ready).exists() for t in runner.running)):
            time.sleep(0.05)
        runner.stop(signal.SIGTERM)

    threading.Thread(target=stop, daemon=True).start()


class _Fake(Runner):
    """Trunk ``a`` fails (exit 3); every other run sleeps briefly and succeeds; start order recorded."""

    def __init__(self, tasks, jobs):
        super().__init__(tasks, jobs)
        self.order, self.peak = [], 0

    def command(self, task):
        self.order.append(task.name)
        self.peak = max(self.peak, len(self.running) + 1)
        code = 3 if task.name == "a/trunk" else 0
        return [sys.executable, "-c", f"import time, sys; time.sleep(0.3); sys.exit({code})"]


def test_a_failed_trunk_is_named_its_branches_skipped_and_the_rest_run(tmp_path, capsys):
    runner = _Fake(_tasks(tmp_path), jobs=2)
    done = runner.run()
    assert done == {"a/trunk": 3, "a/budget_1": -1, "a/budget_2": -1, "b/trunk": 0, "b/budget_1": 0, "b/budget_2": 0}
    assert runner.order.index("b/budget_1") > runner.order.index("b/trunk") and "a/budget_1" not in runner.order
    assert runner.peak == 2  # sweep.jobs
    err = capsys.readouterr().err
    assert "a/trunk: FAILED (exit 3) after" in err and str(tmp_path / "a" / "trunk" / "k2-train.log") in err
    assert "a/budget_1: skipped (its trunk a/trunk did not finish)" in err
    assert not (tmp_path / "a" / "budget_1").exists()


def test_a_signal_stops_the_runs_in_flight_and_starts_no_other(tmp_path):
    class Slow(Runner):
        def command(self, task):  # saves and exits 42 on SIGTERM, as k2-train does; says when it can
            ready = task.run_dir / "handler_installed"
            return [
                sys.executable,
                "-c",
                "import pathlib, signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(42))\n"
                f"pathlib.Path({str(ready)!r}).touch()\ntime.sleep(60)",
            ]

    runner = Slow(_tasks(tmp_path), jobs=2)
    _sigterm_when_both_run(runner, ready="handler_installed")
    t0 = time.time()
    done = runner.run()
    assert time.time() - t0 < 30 and runner.stopping == "SIGTERM"
    assert done == {"a/trunk": 42, "b/trunk": 42}  # no branch started


def test_a_run_stopped_while_starting_is_not_reported_as_failed(tmp_path, capsys):
    class Starting(Runner):
        def command(self, task):  # no SIGTERM handler yet, as a k2-train still importing
            return [sys.executable, "-c", "import time\ntime.sleep(60)"]

    runner = Starting(_tasks(tmp_path), jobs=2)
    _sigterm_when_both_run(runner)
    done = runner.run()
    assert done == {"a/trunk": -signal.SIGTERM, "b/trunk": -signal.SIGTERM}
    out, err = capsys.readouterr()
    assert "FAILED" not in err and out.count("stopped while starting (nothing to save)") == 2, (out, err)


def test_a_run_still_running_in_another_process_is_named_not_failed_and_its_branches_wait(tmp_path, capsys):
    from k2.launcher.checkpointing.run_lock import RunDirLock
    from k2.launcher.tools.sweep import BUSY

    owner = RunDirLock.acquire(tmp_path / "a" / "trunk")  # a live trainer of a/trunk: this process
    try:
        runner = _Fake(_tasks(tmp_path), jobs=1)
        done = runner.run()
    finally:
        owner.release()
    assert done == {"a/trunk": BUSY, "a/budget_1": -1, "a/budget_2": -1, "b/trunk": 0, "b/budget_1": 0, "b/budget_2": 0}
    assert not any(n.startswith("a/") for n in runner.order)  # not started a second time
    err = capsys.readouterr().err
    assert f"a/trunk: still running as pid {os.getpid()} on host" in err and "FAILED" not in err, err
    assert "a/budget_1: not started (its trunk a/trunk is still running)" in err


def test_the_runs_of_a_sweep_killed_with_sigkill_are_stopped_with_sigterm(tmp_path):
    """The runs have a session of their own (a signal to the sweep's group does not reach them); when the
    sweep dies they get SIGTERM from the kernel, so that they save and stop rather than train on unseen."""
    pid_file, stopped = tmp_path / "t" / "pid", tmp_path / "t" / "stopped"
    run = (
        "import os, pathlib, signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path({str(stopped)!r}).touch(), sys.exit(42)))\n"
        f"pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))\n"
        "time.sleep(60)\n"
    )
    sweep = (
        "import sys\nfrom pathlib import Path\nfrom k2.launcher.tools.sweep import Runner, Task\n"
        "class R(Runner):\n"
        f"    def command(self, task):\n        return [sys.executable, '-c', {run!r}]\n"
        f"R([Task('t', Path({str(tmp_path / 't')!r}), ())], 1).run()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", sweep])
    try:
        deadline = time.time() + 60
        while not pid_file.exists() and time.time() < deadline:
            assert proc.poll() is None
            time.sleep(0.05)
        proc.kill()  # kill -9: no handler of the sweep runs
        proc.wait()
        deadline = time.time() + 20
        while not stopped.exists() and time.time() < deadline:
            time.sleep(0.05)
        assert stopped.exists(), "the run of the killed sweep is still training"
    finally:
        if pid_file.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
