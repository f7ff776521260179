"""The checkpoint manager (k2.launcher.checkpointing.manager) without a process group: a ``k2_state.json``
written before the manager existed restores every registered part and is written back key for key;
saves happen when due, with the stall counted and the commit reported as before; the run dir is prepared,
the restore is described and ``latest`` is answered by the manager, which the trainer reaches checkpoints
through alone."""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf, read_write

import k2.launcher.checkpointing.manager as manager
import k2.launcher.training.state as state_module
from k2.config.load import load_config
from k2.launcher.checkpointing.manager import RUN_STATE, CheckpointManager, load_record, state_record
from k2.launcher.checkpointing.reasons import SaveReason
from k2.launcher.training.goodput import GoodputClock
from k2.launcher.training.spike import SpikeGuard
from k2.launcher.training.state import TrainState
from support import REPO
from support.fake_runs import SINGLE, fake_checkpoint

# k2_state.json of iter_0000004 of `k2-train parallel=cpu4 train.iters=6 train.save_interval=2`, written by
# the trainer that packed the record by hand (before the checkpoint manager); paths shortened
_PREFIX = "/data/stdlib-3.12.1-v4096/train"
_FINGERPRINT = {
    "bin_bytes": 18435922,
    "idx_bytes": 34162,
    "sha256": "8fce263bef8c664b31f988e73775304425e859024e2b3faa58e548c3442e6cf7",
}
OLD_RECORD = {
    "consumed_samples_in_context": 64,
    "consumed_tokens": 8192,
    "data_fingerprint": {_PREFIX: _FINGERPRINT},
    "data_path": [_PREFIX],
    "goodput": {
        "checkpoint": 0.3399170890006644,
        "eval": 3.615871938001874,
        "lost": 0.0,
        "other": 0.10756428149034036,
        "productive": 3.098515978997966,
        "replayed": 0.0,
        "starts": 1,
        "startup": 18.310744762420654,
        "total": 25.4726140499115,
    },
    "layout": {"dp": 2, "ep": 2, "pp": 2, "vpp": 2, "world_size": 4},
    "manifest": True,
    "optimizer": "adamw",
    "optimizer_dp_fixed": False,
    "phase": "warmup",
    "reason": "train.save_interval",
    "scheduler": {"consumed_tokens": 8192, "global_batch_tokens": 2048, "schedule": "tiny_wsd", "steps": 4},
    "seq_length": 128,
    "spike": {
        "consecutive": 0,
        "grad_norms": [0.9259521712892733, 0.8647418202445928, 0.943789303194878, 1.2361390751212773],
        "losses": [8.341770648956299, 8.319100022315979, 8.29623568058014, 8.205024123191833],
    },
    "step": 4,
    "wandb_run_id": None,
}


class _Scheduler:
    """TokenLRScheduler's checkpoint surface (its own round trip: tests/unit/schedules)."""

    def __init__(self):
        self.consumed_tokens, self.steps = 0, 0

    def state_dict(self) -> dict:
        return {
            "consumed_tokens": self.consumed_tokens,
            "global_batch_tokens": 2048,
            "schedule": "tiny_wsd",
            "steps": self.steps,
        }

    def load_state_dict(self, saved: dict) -> None:
        self.consumed_tokens, self.steps = int(saved["consumed_tokens"]), int(saved["steps"])


def _parts(monkeypatch, now: float = 2000.0) -> dict:
    """The trainer's JSON parts, fresh: the run state (phase 'warmup' at 16 x 128, entered at step 1),
    the goodput clock and the spike window."""
    monkeypatch.setattr(state_module, "dataset_fingerprint", lambda prefix: dict(_FINGERPRINT))
    phase = SimpleNamespace(name="warmup", global_batch_size=16, seq_length=128)
    data = SimpleNamespace(
        phase=phase, samples_before=0, first_step=1, data=SimpleNamespace(train_blend=[[_PREFIX], None])
    )
    layout = {"pp": 2, "vpp": 2, "ep": 2, "dp": 2, "world_size": 4}
    spike_cfg = SimpleNamespace(window=100, sigma=6.0, action="log", max_consecutive_skips=3)
    return {
        RUN_STATE: TrainState(_Scheduler(), data, layout, "adamw", False),
        "goodput": GoodputClock(started=now),
        "spike": SpikeGuard(spike_cfg),
    }


def test_a_record_written_before_the_manager_restores_every_part_and_is_written_back_key_for_key(monkeypatch):
    now = [2000.0]
    monkeypatch.setattr("k2.launcher.training.goodput.time.time", lambda: now[0])
    parts = _parts(monkeypatch, now[0])
    load_record(parts, json.loads(json.dumps(OLD_RECORD)))
    train, clock, spike = parts[RUN_STATE], parts["goodput"], parts["spike"]
    assert (train.step, train.scheduler.consumed_tokens, train.scheduler.steps) == (4, 8192, 4)
    assert clock.starts == 2 and clock.base["startup"] == OLD_RECORD["goodput"]["startup"]
    assert list(spike.losses) == OLD_RECORD["spike"]["losses"] and spike.consecutive == 0

    written = state_record(parts, "train.save_interval")
    old = {k: v for k, v in OLD_RECORD.items() if k != "manifest"}  # (added by the commit: store.commit_save)
    assert sorted(written) == sorted(old)
    assert {k: v for k, v in written.items() if k != "goodput"} == {k: v for k, v in old.items() if k != "goodput"}
    # goodput continues: no time has passed in this start, so every counter is the checkpoint's
    assert written["goodput"] == {**old["goodput"], "starts": 2}


def test_an_older_record_without_goodput_or_spike_leaves_them_fresh(monkeypatch):
    parts = _parts(monkeypatch)
    load_record(parts, {k: v for k, v in OLD_RECORD.items() if k not in ("goodput", "spike")})
    assert parts[RUN_STATE].step == 4 and parts["goodput"].starts == 1 and not parts["spike"].losses


def test_the_record_needs_the_run_state_and_refuses_a_name_clash(monkeypatch):
    parts = _parts(monkeypatch)
    with pytest.raises(ValueError, match="need a 'train_state' part"):
        state_record({"goodput": parts["goodput"]}, "x")
    with pytest.raises(ValueError, match="'step' would overwrite"):
        state_record({**parts, "step": parts["spike"]}, "x")


class _Clock(GoodputClock):
    """A GoodputClock whose ``timed`` records when the checkpoint stall starts and ends."""

    def __init__(self, events: list):
        super().__init__(started=2000.0)
        self.events = events

    def timed(self, category: str):
        events = self.events

        class _Timed:
            def __enter__(self):
                events.append(("stall", category))

            def __exit__(self, *exc):
                events.append(("/stall", category))

        return _Timed()


@functools.cache
def _base_config():
    """The config the managers here start from, composed once (a composition takes seconds on a busy machine)."""
    return load_config(["train.save_interval=2", "checkpoint.async_save=false"])


def _manager(
    monkeypatch,
    tmp_path,
    events: list,
    settings: dict | None = None,
    resume_from: Path | None = None,
    hangs: list | None = None,
) -> CheckpointManager:
    """A manager of the trainer's parts for ``run.dir=tmp_path`` (synchronous saves every 2 steps unless
    ``settings``, dotted key -> value, say otherwise); the watchdog's hang callbacks go to ``hangs``."""

    def save_checkpoint(run_dir, step, model, optimizer, state, config_yaml, keep_last, keep_every, keep_steps=()):
        events.append(("write", step, state["reason"], state["step"]))
        return Path(run_dir) / "checkpoints" / f"iter_{step:07d}"

    monkeypatch.setattr(manager, "save_checkpoint", save_checkpoint)
    cfg = copy.deepcopy(_base_config())
    with read_write(cfg):  # (a loaded config is read-only)
        for key, value in {"run.dir": str(tmp_path), **(settings or {})}.items():
            OmegaConf.update(cfg, key, value)
    parts = _parts(monkeypatch)
    watchdog = SimpleNamespace(
        progress=lambda kind, step: events.append((kind, step)),
        keep_alive=lambda: None,
        on_hang=(hangs if hangs is not None else []).append,
    )
    return CheckpointManager(
        config=cfg,
        resume_from=resume_from,
        run_state=parts[RUN_STATE],
        clock=_Clock(events),
        states={"spike": parts["spike"]},
        model=[],
        optimizer=None,
        watchdog=watchdog,
        log=lambda line: events.append(("log", line)),
        after_last_save=lambda path, step: events.append(("after", step)),
    )


def test_the_manager_takes_keyword_arguments_and_the_trainer_reaches_checkpoints_only_through_it():
    params = list(inspect.signature(CheckpointManager).parameters.values())
    assert params and all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params), params
    tree = ast.parse((REPO / "launcher" / "training" / "trainer.py").read_text())
    imported = [
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if (node.module or "").startswith("k2.launcher.checkpointing")
    ]
    assert imported == [("k2.launcher.checkpointing.manager", "CheckpointManager")]


def test_saves_every_interval_and_at_the_end_and_reports_after_the_stall(monkeypatch, tmp_path):
    events: list = []
    ckpt = _manager(monkeypatch, tmp_path, events)
    ckpt.states[RUN_STATE].step = 2
    assert ckpt.maybe_save(2, last_step=False) is True
    assert events[:4] == [
        ("save", 2),
        ("stall", "checkpoint"),
        ("write", 2, "train.save_interval", 2),
        ("/stall", "checkpoint"),
    ]
    assert events[4][0] == "log" and len(events) == 5  # (after_last_save: only after the end of the run)
    line = f"step 2: checkpoint {tmp_path / 'checkpoints' / 'iter_0000002'} (train.save_interval, "
    assert events[4][1].startswith(line)
    events.clear()
    assert ckpt.maybe_save(3, last_step=False) is False and events == []
    assert ckpt.maybe_save(5, last_step=True) is True  # checkpoint.save_at_end
    assert ("write", 5, "end of run", 2) in events and events[-1] == ("after", 5)
    assert ckpt.in_flight_step is None


def test_saves_at_each_of_checkpoint_save_steps(monkeypatch, tmp_path):
    """A sweep's trunk saves exactly at its branch points (``checkpoint.save_steps``) besides the interval."""
    events: list = []
    ckpt = _manager(monkeypatch, tmp_path, events, {"checkpoint.save_steps": [3, 7]})
    saved = [s for s in range(1, 9) if ckpt.maybe_save(s, last_step=False)]
    assert saved == [2, 3, 4, 6, 7, 8]
    reasons = {e[1]: e[2] for e in events if e[0] == "write"}
    assert reasons == {
        2: "train.save_interval",
        3: "checkpoint.save_steps",
        4: "train.save_interval",
        6: "train.save_interval",
        7: "checkpoint.save_steps",
        8: "train.save_interval",
    }


def test_no_periodic_or_end_save_when_switched_off(monkeypatch, tmp_path):
    events: list = []
    ckpt = _manager(monkeypatch, tmp_path, events, {"checkpoint.save_at_end": False, "train.save_interval": None})
    assert not any(ckpt.maybe_save(s, last_step=s == 4) for s in range(1, 5)) and events == []


def test_latest_is_the_run_s_newest_checkpoint_or_the_one_it_resumed_from(monkeypatch, tmp_path):
    ckpt = _manager(monkeypatch, tmp_path, [])
    assert ckpt.latest() is None and ckpt.restore(world_size=4) is None  # a fresh run
    assert ckpt.latest_note() is None
    ckpt = _manager(monkeypatch, tmp_path, [], resume_from=tmp_path / "elsewhere" / "iter_0000004")
    assert ckpt.latest() == ckpt.resume_from and ckpt.latest(this_run_only=True) is None


def test_restore_says_what_it_resumed_asking_the_run_state(monkeypatch, tmp_path):
    """The line of a resume names the step and tokens the run state continues from (the checkpoint's
    record is the run state's to read); a world-size change says the RNG streams were reseeded."""
    loaded = []
    monkeypatch.setattr(manager, "load_checkpoint", lambda path, model, opt, same_world: loaded.append(same_world))
    ck = tmp_path / "checkpoints" / "iter_0000004"
    ck.mkdir(parents=True)
    (ck / "k2_state.json").write_text(json.dumps(OLD_RECORD))
    (ck / "metadata.json").write_text("{}")
    ckpt = _manager(monkeypatch, tmp_path, [], resume_from=ck)
    assert ckpt.restore(world_size=4) == f"resumed from {ck} (step 4, 8,192 tokens)"
    assert ckpt.run_state.step == 4 and ckpt.states["goodput"].starts == 2 and loaded == [True]
    note = _manager(monkeypatch, tmp_path, [], resume_from=ck).restore(world_size=2)
    assert note.endswith("8,192 tokens; world size changed: RNG streams reseeded, not restored)") and not loaded[-1]


def test_prepare_removes_killed_saves_and_seeds_a_branch_from_its_trunk(monkeypatch, tmp_path):
    """Rank 0's ``prepare``: ``iter_*.partial`` leftovers go; a branch's first start copies the trunk's
    records up to the branch point, writes ``branch.json`` and its restore line says where it branched
    from; a run of its own dir whose ``latest`` is missing gets the line naming the checkpoint taken."""
    trunk = tmp_path / "trunk"
    ck = fake_checkpoint(trunk, 2, [f"run.dir={trunk}"], SINGLE)
    (trunk / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    branch = tmp_path / "branch"
    (branch / "checkpoints" / "iter_0000004.partial").mkdir(parents=True)
    ckpt = _manager(monkeypatch, branch, [], {"resume.branch_from": str(ck)}, resume_from=ck)
    assert ckpt.branch_start
    ckpt.prepare()
    assert not (branch / "checkpoints" / "iter_0000004.partial").exists()
    assert [json.loads(x)["step"] for x in (branch / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert json.loads((branch / "branch.json").read_text())["trunk_step"] == 2
    (trunk / "checkpoints" / "latest").unlink()
    own = _manager(monkeypatch, trunk, [], resume_from=ck)
    assert not own.branch_start
    assert own.latest_note() == (
        f"{trunk / 'checkpoints' / 'latest'} is missing; resuming from the newest "
        "checkpoint that verifies: iter_0000002"
    )


class _Background:
    """BackgroundSaver's surface: a save stays in flight until ``poll`` finds its (simulated) writers done."""

    def __init__(self, run_dir, keep_last, keep_every, on_commit, on_write_progress=None, keep_steps=()):
        self.on_commit, self.in_flight, self.done, self.events = on_commit, None, False, None

    def save(self, step, why, model, optimizer, state, config_yaml):
        self.poll(blocking=True)  # at most one in flight
        self.events.append(("stage", step, why))
        self.in_flight, self.done = {"step": step, "why": why}, False

    def poll(self, blocking=False):
        if self.in_flight is not None and (blocking or self.done):
            flight, self.in_flight = self.in_flight, None
            self.events.append(("commit", flight["step"]))
            self.on_commit(Path("iter") / str(flight["step"]), flight["step"], flight["why"], 1.0)

    def abandon(self):
        self.events.append(("abandon",))
        self.in_flight = None

    def close(self):
        self.abandon()


def test_a_background_save_is_staged_then_committed_at_a_later_boundary_and_before_the_run_stops(monkeypatch, tmp_path):
    events: list = []
    hangs: list = []
    monkeypatch.setattr(manager, "BackgroundSaver", _Background)
    ckpt = _manager(monkeypatch, tmp_path, events, {"checkpoint.async_save": True}, hangs=hangs)
    ckpt.saver.events = events
    assert ckpt.maybe_save(2, last_step=False) and ckpt.in_flight_step == 2
    assert [e[0] for e in events] == ["save", "stall", "stage", "log", "/stall"]
    assert "step 2: checkpoint staged in" in events[3][1] and "written in the background" in events[3][1]
    events.clear()
    assert not ckpt.maybe_save(3, last_step=False) and ckpt.in_flight_step == 2  # writers still busy
    ckpt.saver.done = True
    assert not ckpt.maybe_save(3, last_step=False) and ckpt.in_flight_step is None
    # committed, reported inside the stall (the loop waited for it there)
    assert [e[0] for e in events] == ["stall", "/stall", "stall", "commit", "log", "/stall"]
    for i, reason in enumerate((SaveReason.PREEMPTED_SIGNAL, SaveReason.INTERRUPTED)):
        events.clear()
        ckpt.save(3 + i, reason)  # the run stops here: committed before save returns
        assert ("commit", 3 + i) in events and ("save", 3 + i) in events and ckpt.in_flight_step is None
        assert any(e[0] == "log" and f"({reason}, 1.0 s)" in e[1] for e in events), events
    ckpt.maybe_save(6, last_step=False)
    ckpt.abandon()
    assert events[-1] == ("abandon",) and ckpt.in_flight_step is None
    ckpt.maybe_save(8, last_step=False)  # a hang (the watchdog's thread): the save in flight is abandoned
    assert ckpt.in_flight_step == 8 and len(hangs) == 1
    hangs[0]("rank 1 hung")
    assert events[-1] == ("abandon",) and ckpt.in_flight_step is None
