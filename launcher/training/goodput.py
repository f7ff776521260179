"""Goodput: where a run's wall time went, summed over every start of the run (restarts included).

Goodput = productive time / total time, the measure of effective training time used in reports of
large-scale runs (Llama 3, "The Llama 3 Herd of Models", section 3.3.4: >90% effective training time
over 54 days with 419 interruptions; Google's ``ml-goodput-measurement`` splits the rest into
"badput" categories the same way). Categories (seconds, wall clock of rank 0, cumulative):

* ``productive`` -- optimizer steps whose result the run kept (forward, backward, optimizer, QK-Clip);
* ``startup`` -- from the process start (k2-train's own, for the ranks it forks) to the first step:
  imports, process groups, model and optimizer build, checkpoint verification and load;
* ``checkpoint`` -- the time the training loop waits for saves;
* ``eval`` -- validation;
* ``replayed`` -- step computations a restart threw away: steps an earlier start ran after the
  checkpoint the restart resumed from (their ``step_time_s`` in the set-aside records), run again;
* ``lost`` -- the rest of an earlier start's time that no checkpoint kept (its start-up, validation or
  saves after that checkpoint). The time between a kill and the next start (detection, requeue, queue
  wait) is not seen by any process and is not counted;
* ``other`` -- the remainder of the total (logging, phase switches, ...).

The counters are stored in every checkpoint (``k2_state.json`` key ``goodput``) so that a resumed run
continues them; each ``metrics.jsonl`` record carries the ``time_*_s`` fields and ``goodput``, and the
end-of-run summary prints them (:meth:`GoodputClock.summary`).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable
from pathlib import Path

__all__ = ["CATEGORIES", "GoodputClock", "earlier_start_cost", "process_start_time"]

#: the measured categories (``other`` is the remainder of the total)
CATEGORIES = ("productive", "startup", "checkpoint", "replayed", "eval", "lost")


def process_start_time(parent: bool = False) -> float:
    """Unix time (seconds) at which this process -- or, with ``parent``, its parent (k2-train, which
    imports the trainer once and forks the ranks) -- was started; now when it cannot be read."""
    try:
        import psutil

        proc = psutil.Process()
        return (proc.parent() if parent and proc.parent() is not None else proc).create_time()
    except Exception:
        return time.time()


def earlier_start_cost(records: Iterable[dict], checkpoint_total_s: float) -> dict:
    """``{"replayed": s, "lost": s}`` of an earlier start from its ``metrics.jsonl`` records that a
    restart throws away (steps after the checkpoint resumed from; all records for a run killed before
    its first save). ``checkpoint_total_s``: the checkpoint's ``time_total_s`` (0 without one).

    ``replayed`` is the sum of their ``step_time_s``; ``lost`` is the earlier start's time after the
    checkpoint (the last record's ``time_total_s`` minus ``checkpoint_total_s``) less ``replayed``,
    never negative. Records written before goodput was counted (no ``time_total_s``) give ``lost`` 0.
    """
    records = [r for r in records if isinstance(r, dict)]
    replayed = sum(float(r.get("step_time_s") or 0.0) for r in records if int(r.get("step", 0)) > 0)
    ends = [float(r["time_total_s"]) for r in records if r.get("time_total_s") is not None]
    lost = max(0.0, max(ends) - checkpoint_total_s - replayed) if ends else 0.0
    return {"replayed": replayed, "lost": lost}


def read_records_after(path: Path, step: int) -> list[dict]:
    """The JSON records of ``path`` (``metrics.jsonl``) with ``"step" > step`` (lines cut by a kill are
    skipped); ``step=-1``: every record."""
    out: list[dict] = []
    if not Path(path).exists():
        return out
    for line in Path(path).read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if int(rec.get("step", 0)) > step:
            out.append(rec)
    return out


class GoodputClock:
    """Cumulative wall-time split of one run (module docstring), continued from a checkpoint.

    Args:
        started: Unix time (seconds) this start of the run began (:func:`process_start_time`).
    """

    def __init__(self, started: float):
        self.started = started
        self.base = {c: 0.0 for c in CATEGORIES}  # earlier starts, from the checkpoint
        self.base_total = 0.0
        self.starts = 1
        self.spent = {c: 0.0 for c in CATEGORIES}  # this start
        self.startup_done = False

    def load_state_dict(self, saved: dict | None) -> None:
        """Continue the counters of a checkpoint's ``goodput`` state (None: a checkpoint without one)."""
        if not saved:
            return
        self.base = {c: float(saved.get(c, 0.0)) for c in CATEGORIES}
        self.base_total = float(saved.get("total", 0.0))
        self.starts = int(saved.get("starts", 1)) + 1

    def add(self, category: str, seconds: float) -> None:
        """Count ``seconds`` of this start as ``category`` (one of :data:`CATEGORIES`)."""
        self.spent[category] += seconds

    @contextlib.contextmanager
    def timed(self, category: str):
        """Count the wall time of the ``with`` body as ``category``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(category, time.perf_counter() - t0)

    def end_startup(self) -> None:
        """The first step begins: the time since :attr:`started` not counted otherwise is start-up."""
        if not self.startup_done:
            self.startup_done = True
            counted = sum(self.spent.values())
            self.spent["startup"] += max(0.0, time.time() - self.started - counted)

    def totals(self) -> dict:
        """Cumulative seconds per category, ``other``, ``total`` and ``starts``."""
        total = self.base_total + (time.time() - self.started)
        out = {c: self.base[c] + self.spent[c] for c in CATEGORIES}
        out["other"] = max(0.0, total - sum(out.values()))
        out["total"] = total
        out["starts"] = self.starts
        return out

    def fields(self) -> dict:
        """The ``metrics.jsonl`` fields: ``time_<category>_s`` (also ``other``, ``total``) and
        ``goodput`` (productive / total)."""
        t = self.totals()
        rec = {f"time_{c}_s": t[c] for c in (*CATEGORIES, "other", "total")}
        rec["goodput"] = t["productive"] / t["total"] if t["total"] > 0 else 0.0
        return rec

    def state_dict(self) -> dict:
        """The ``goodput`` entry of ``k2_state.json`` (:meth:`load_state_dict` continues it)."""
        return self.totals()

    def summary(self) -> str:
        """One line for the end-of-run summary."""
        t, f = self.totals(), self.fields()
        parts = ", ".join(
            f"{name} {t[c]:.1f} s"
            for c, name in (
                ("startup", "start-up"),
                ("checkpoint", "checkpoint stall"),
                ("eval", "evaluation"),
                ("replayed", "replayed steps"),
                ("lost", "lost to restarts"),
                ("other", "other"),
            )
        )
        return (
            f"goodput {f['goodput']:.3f}: productive {t['productive']:.1f} s of {t['total']:.1f} s "
            f"over {t['starts']} start{'s' if t['starts'] != 1 else ''} ({parts})"
        )


def set_aside_earlier_start(run_dir, resume_step: int | None, clock: GoodputClock) -> tuple[int, str | None]:
    """Rank 0, before the metrics logger opens: move the records a restart throws away to
    ``metrics.replayed.jsonl`` (:func:`k2.launcher.training.metrics.set_aside_replayed_metrics`) and
    count their time into ``clock`` (:func:`earlier_start_cost`).

    Args:
        resume_step: the step of the checkpoint resumed from; None for a fresh start, where every
            record of ``metrics.jsonl`` (a run killed before its first save) is set aside.

    Returns:
        The last step an earlier start had logged (those up to it are re-run, marked ``replayed``; 0
        when none), and for a fresh start over such records a line saying so (else None).
    """
    from k2.launcher.training.metrics import REPLAYED_METRICS, set_aside_replayed_metrics

    metrics = Path(run_dir) / "metrics.jsonl"
    after = -1 if resume_step is None else resume_step
    records = read_records_after(metrics, after)
    if not records:
        return max(0, after), None
    cost = earlier_start_cost(records, clock.base_total)
    clock.base["replayed"] += cost["replayed"]
    clock.base["lost"] += cost["lost"]
    clock.base_total += cost["replayed"] + cost["lost"]
    last = max(0, set_aside_replayed_metrics(run_dir, after))
    if resume_step is not None:
        return last, None
    clock.starts += 1
    return last, (
        f"k2-train: run.dir={run_dir} holds a run killed before its first checkpoint (steps up to "
        f"{last} logged): starting it afresh; its records moved to {REPLAYED_METRICS}, "
        f"{cost['replayed'] + cost['lost']:.1f} s counted as replayed and lost time"
    )
