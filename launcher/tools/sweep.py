"""``k2-train -m``: run a sparsity sweep's grid on this machine (:mod:`k2.launcher.tools.sweep_grid` says
which runs; ``k2-submit -m`` submits the same runs to Slurm instead, :mod:`k2.launcher.tools.sweep_submit`).

Every run of the grid is checked as ``k2-train`` would check it before anything trains; then trunks and
their cooldown branches (cells) train as ordinary ``k2-train`` processes, ``sweep.jobs`` at a time, a branch
only once its trunk has saved its branch point. The command is resumable: finished cells are skipped,
partial ones resume from their own checkpoints, a trunk resumes from its latest. A failed run is named with
its log while the rest go on (its branches are skipped and named); the exit status says whether all finished.
SIGTERM / SIGUSR1 / SIGINT to the sweep are passed on as SIGTERM to the runs in flight, which save and stop;
the sweep then exits 42 (re-run the same command to continue).

Each run writes its output to ``<run dir>/k2-train.log``; a finished cell gets ``cell.json`` (its wall-clock,
the trunk's up to its branch point, the peak resident memory of its process, its final validation loss).

Test seam: ``K2_TEST_SWEEP_PYTHON=PATH`` runs each run with that interpreter instead of this one (the tests
point it at their fork server's client, so that a run skips a fresh interpreter's ~5 CPU-s import of torch
and megatron-core; the peak resident memory recorded is then the client's).
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from k2.config.errors import ConfigError
from k2.config.load import load_config
from k2.launcher.tools.sweep_grid import (
    CELL_FILE,
    Cell,
    Grid,
    Trunk,
    build_grid,
    cell_status,
    trunk_status,
    write_grid_manifest,
)
from k2.launcher.training.preemption import REQUEUE_EXIT_CODE
from k2.model.flops import TRAINING_FACTOR, flops_per_token

MULTIRUN_FLAGS = ("-m", "--multirun")
LOG_FILE = "k2-train.log"
_PROG = "k2-train -m"
TEST_PYTHON_ENV = "K2_TEST_SWEEP_PYTHON"


def split_multirun(argv: Sequence[str]) -> tuple[bool, list[str]]:
    """``(True, argv without -m)`` when ``-m`` / ``--multirun`` is present."""
    args = list(argv)
    multirun = any(a in MULTIRUN_FLAGS for a in args)
    return multirun, [a for a in args if a not in MULTIRUN_FLAGS]


def gemm_flops_per_token(model_cfg, seq_length: int) -> float:
    """Training FLOPs per token of everything but the router (the part the arms keep equal)."""
    terms = flops_per_token(model_cfg, seq_length).terms()
    return TRAINING_FACTOR * (sum(terms.values()) - terms["router"])


def run_overrides_for_check(overrides: Sequence[str]) -> list[str]:
    """A run's overrides without ``resume.branch_from`` (a branch's trunk may not have saved yet)."""
    return [o for o in overrides if not o.startswith("resume.branch_from=")]


def check_grid(grid: Grid, world_size_of) -> None:
    """Check every run as ``k2-train`` would (no process starts) and the arms' equal FLOPs: each trunk
    whole (:func:`k2.launcher.training.prepare.prepare_run`), each of its cells' schedules on the trunk's
    layout (a cell differs from its trunk only in the schedule after the branch point and its run dir).

    Args:
        world_size_of: cfg -> the world size the run will have.

    Raises:
        ConfigError: naming the run (its dir) and the setting.
    """
    from omegaconf import OmegaConf

    from k2.launcher.training.prepare import prepare_run
    from k2.schedules.resolve import resolve_schedule

    flops = {}
    for trunk in grid.trunks:
        name = trunk.run_dir
        try:
            cfg = load_config(run_overrides_for_check(trunk.overrides))
            plan = prepare_run(cfg, world_size_of(cfg))
            for cell in grid.cells_of(trunk):
                name = cell.run_dir
                resolve_schedule(OmegaConf.merge(cfg, {"schedule": {"phases": list(cell.phases)}}), plan.dims)
        except ConfigError as e:
            raise ConfigError(f"sweep run {name}: {e}") from None
        size = trunk.size
        flops.setdefault(size, set()).add(gemm_flops_per_token(cfg.model, plan.schedule.step_phase(1).seq_length))
    unequal = {k: v for k, v in flops.items() if len(v) != 1}
    if unequal:
        raise ConfigError(f"sweep arms differ in FLOPs per token beyond the router: {unequal}")


@dataclass
class Task:
    """One ``k2-train`` of the grid: a trunk, or a cell (whose ``after`` is its trunk's task name)."""

    name: str
    run_dir: Path
    overrides: tuple[str, ...]
    cell: Cell | None = None
    after: str | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)
    started: float = 0.0
    rc: int | None = None
    peak_rss_bytes: int | None = None


def plan_tasks(grid: Grid) -> tuple[list[Task], dict[str, str]]:
    """The unfinished runs in training order (each trunk, then its cells) and the status of every run."""
    tasks, status = [], {}

    def rel(p: Path) -> str:
        return os.path.relpath(p, grid.dir)

    for trunk in grid.trunks:
        cells = grid.cells_of(trunk)
        cstat = {rel(c.run_dir): cell_status(c) for c in cells}
        tstat = "finished" if all(s == "finished" for s in cstat.values()) else trunk_status(trunk)
        status[rel(trunk.run_dir)] = tstat
        status.update(cstat)
        if tstat != "finished":
            tasks.append(Task(rel(trunk.run_dir), trunk.run_dir, trunk.overrides))
        for c in cells:
            if cstat[rel(c.run_dir)] != "finished":
                tasks.append(
                    Task(
                        rel(c.run_dir),
                        c.run_dir,
                        c.overrides,
                        cell=c,
                        after=rel(trunk.run_dir) if tstat != "finished" else None,
                    )
                )
    return tasks, status


def _records(run_dir: Path) -> list[dict]:
    out = []
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # a torn last record of a killed run
                continue
    return out


def _machine(threads: str | None) -> dict:
    """The CPU that finished a cell (``/proc/cpuinfo``'s model name), its cores, the threads per run."""
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), None)
    except OSError:
        cpu = None
    return {
        "cpu": cpu or platform.processor(),
        "cpu_count": os.cpu_count(),
        "omp_num_threads": threads,
        "host": platform.node(),
    }


def write_cell_file(cell: Cell, peak_rss_bytes: int | None, threads: str | None = None) -> dict:
    """``cell.json`` of a finished cell: its own wall-clock and the trunk's up to the branch point (from the
    runs' goodput clocks in ``metrics.jsonl``), its process's peak resident memory, its final loss."""
    recs = _records(cell.run_dir)
    at_branch = next((r for r in recs if r.get("step") == cell.branch_step), {})
    last = recs[-1] if recs else {}
    trunk_s = at_branch.get("time_total_s")
    info = {
        "status": "finished",
        "tokens": last.get("consumed_tokens"),
        "final_val_loss": last.get("val_loss"),
        "wall_clock_s": (last["time_total_s"] - trunk_s) if trunk_s and "time_total_s" in last else None,
        "trunk_wall_clock_s": trunk_s,
        "peak_rss_bytes": peak_rss_bytes,
        "machine": _machine(threads),
    }
    tmp = cell.run_dir / (CELL_FILE + ".tmp")
    tmp.write_text(json.dumps(info, indent=1) + "\n")
    os.replace(tmp, cell.run_dir / CELL_FILE)
    return info


class Runner:
    """Trains the tasks of :func:`plan_tasks`, ``jobs`` at a time (see the module docstring)."""

    def __init__(self, tasks: list[Task], jobs: int):
        self.pending, self.jobs = list(tasks), jobs
        self.running: list[Task] = []
        self.done: dict[str, int] = {}  # task name -> exit status (None-free)
        self.stopping: str | None = None
        self.total, self.started_count = len(tasks), 0

    def _env(self) -> dict:
        env = dict(os.environ)
        if self.jobs > 1 and "OMP_NUM_THREADS" not in env:  # the cores shared among the runs at once
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.jobs))
        return env

    def command(self, task: Task) -> list[str]:
        """The process of ``task``: ``k2-train <its overrides>`` in this interpreter (or the test seam's,
        module docstring)."""
        return [os.environ.get(TEST_PYTHON_ENV) or sys.executable, "-m", "k2.launcher.train", *task.overrides]

    def _start(self, task: Task) -> None:
        task.run_dir.mkdir(parents=True, exist_ok=True)
        log = open(task.run_dir / LOG_FILE, "ab")
        task.proc = subprocess.Popen(
            self.command(task), stdout=log, stderr=subprocess.STDOUT, env=self._env(), start_new_session=True
        )
        log.close()
        task.started = time.time()
        self.running.append(task)
        self.started_count += 1
        print(
            f"{_PROG}: [{self.started_count}/{self.total}] {task.name}: started (log {task.run_dir / LOG_FILE})",
            flush=True,
        )

    def _poll(self, task: Task) -> bool:
        pid, status, usage = os.wait4(task.proc.pid, os.WNOHANG)
        if pid == 0:
            return False
        task.rc = os.waitstatus_to_exitcode(status)
        task.proc.returncode = task.rc
        task.peak_rss_bytes = int(usage.ru_maxrss) * 1024  # Linux: KiB
        return True

    def _finished(self, task: Task) -> None:
        self.running.remove(task)
        self.done[task.name] = task.rc
        took = time.time() - task.started
        if task.rc == 0:
            extra = ""
            if task.cell is not None:
                info = write_cell_file(task.cell, task.peak_rss_bytes, self._env().get("OMP_NUM_THREADS"))
                if info["final_val_loss"] is not None:
                    extra = f", val_loss {info['final_val_loss']:.4f}"
            print(f"{_PROG}: {task.name}: finished in {took:.0f} s{extra}", flush=True)
        elif task.rc == REQUEUE_EXIT_CODE:
            print(f"{_PROG}: {task.name}: stopped with a checkpoint (exit {task.rc})", flush=True)
        elif self.stopping and task.rc == -signal.SIGTERM:  # still starting: no handler, nothing trained yet
            print(f"{_PROG}: {task.name}: stopped while starting (nothing to save)", flush=True)
        else:
            print(
                f"{_PROG}: {task.name}: FAILED (exit {task.rc}) after {took:.0f} s; its log: {task.run_dir / LOG_FILE}",
                file=sys.stderr,
                flush=True,
            )

    def stop(self, signum, _frame=None) -> None:
        """A signal to the sweep: no new run starts; the ones in flight get SIGTERM (they save and stop)."""
        self.stopping = signal.Signals(signum).name
        for t in self.running:
            try:
                os.killpg(t.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def _ready(self) -> Task | None:
        for t in self.pending:
            dep = self.done.get(t.after) if t.after else 0
            if t.after and t.after not in self.done:
                continue
            self.pending.remove(t)
            if dep != 0:  # its trunk failed or stopped
                self.done[t.name] = -1
                if dep != REQUEUE_EXIT_CODE:
                    print(f"{_PROG}: {t.name}: skipped (its trunk {t.after} did not finish)", file=sys.stderr)
                continue
            return t
        return None

    def run(self) -> dict[str, int]:
        """Train every task; returns ``{task name: exit status}`` (-1: skipped)."""
        while (self.pending and not self.stopping) or self.running:
            while not self.stopping and len(self.running) < self.jobs:
                task = self._ready()
                if task is None:
                    break
                self._start(task)
            for t in list(self.running):
                if self._poll(t):
                    self._finished(t)
            time.sleep(0.5)
        return self.done


def run_sweep(overrides: Sequence[str]) -> int:
    """``k2-train -m ...``: check every run, then train the unfinished ones.

    Returns:
        0 when every cell finished; 42 when stopped by a signal or a run was preempted (re-run the same
        command to continue); 1 when a run failed (the others ran); 2 for a config error (nothing ran).
    """
    try:
        _, grid = build_grid(overrides)
        check_grid(grid, lambda c: c.launch.nproc_per_node)
    except ConfigError as e:
        print(f"k2-train: error: {e}", file=sys.stderr)
        return 2
    write_grid_manifest(grid)
    tasks, status = plan_tasks(grid)
    counts = {s: list(status.values()).count(s) for s in ("finished", "partial", "new")}
    print(
        f"{_PROG}: sweep '{grid.name}' in {grid.dir}: {len(grid.trunks)} trunks, {len(grid.cells)} cells "
        f"({counts['finished']} runs finished, {counts['partial']} partial, {counts['new']} new); "
        f"{len(tasks)} to train, {grid.jobs} at a time",
        flush=True,
    )
    runner = Runner(tasks, grid.jobs)
    handlers = {s: signal.signal(s, runner.stop) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        done = runner.run()
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    failed = [n for n, rc in done.items() if rc not in (0, REQUEUE_EXIT_CODE, -1)]
    skipped = [n for n, rc in done.items() if rc == -1]
    if runner.stopping or any(rc == REQUEUE_EXIT_CODE for rc in done.values()):
        print(
            f"{_PROG}: stopped ({runner.stopping or 'a run was preempted'}); re-run the same command to "
            "continue the sweep",
            file=sys.stderr,
        )
        return REQUEUE_EXIT_CODE
    if failed:
        print(
            f"{_PROG}: {len(failed)} run(s) failed: {', '.join(failed)}"
            + (f"; skipped (their trunk failed): {', '.join(skipped)}" if skipped else "")
            + "; the others finished; fix the cause and re-run the same command",
            file=sys.stderr,
        )
        return 1
    print(f"{_PROG}: all {len(grid.cells)} cells finished; report: k2-sweep-report {grid.dir}")
    return 0


__all__ = ["Runner", "Task", "Trunk", "check_grid", "plan_tasks", "run_sweep", "split_multirun"]
