"""The hang watchdog's rules in one process: allowances, which ranks are named, and the handling of a hang
(report line, stacks by faulthandler and py-spy, the stopped process killed, the requeue marker); whole
cpu4 runs: tests/integration/test_hang_watchdog.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from k2.config import ConfigError, load_config
from k2.launcher.training.watchdog import FLOOR_S, HangWatchdog, process_group_timeout_s


def _dog(tmp_path, timeout_s=None, world=2, **kw):
    return HangWatchdog(tmp_path, 0, world, "a1", timeout_s, startup_timeout_s=300, pg_timeout_s=3600, **kw)


def test_allowances_startup_first_of_each_kind_then_derived_or_set(tmp_path, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    dog = _dog(tmp_path)
    assert dog.allowance("start-up") == 300 and dog.allowance("step") == 300  # nothing measured yet
    dog.progress("step", 1)
    clock[0] += 20.0  # the first step: 20 s
    dog.progress("step", 2)
    assert dog.allowance("step") == 200.0 and dog.allowance("save") == 300
    clock[0] += 2.0
    dog.progress("save", 2)
    clock[0] += 1.0
    dog.progress("step", 3)
    assert dog.allowance("save") == FLOOR_S  # 10 x 1 s is under the floor
    assert _dog(tmp_path, timeout_s=15).allowance("step") == 300  # the first step keeps the start-up's
    fixed = _dog(tmp_path, timeout_s=15)
    fixed.progress("step", 1)
    fixed.progress("step", 2)
    assert fixed.allowance("step") == 15
    run = SimpleNamespace(hang_timeout_s=None, hang_startup_timeout_s=1800.0)
    assert process_group_timeout_s(run) == 3600


def test_named_ranks_stale_behind_missing(tmp_path):
    dog = _dog(tmp_path, world=4)
    now = 1000.0
    beats = {
        0: {"seq": 7, "point": "save 4", "alive": now, "host": "h", "pid": 1},
        1: {"seq": 7, "point": "save 4", "alive": now - 60, "host": "h", "pid": 2},
        2: {"seq": 6, "point": "step 4", "alive": now, "host": "h", "pid": 3},
    }
    named = dog.culprits(beats, now)
    assert sorted(named) == [1, 2, 3]
    assert named[1].startswith("stopped responding (last heartbeat at 'save 4'")
    assert "did not reach 'save 4'" in named[2]
    assert named[3] == "wrote no heartbeat"


def test_a_stopped_rank_is_reported_dumped_and_killed(tmp_path, monkeypatch):
    """Rank 1 is a real stopped process on this host: rank 0's watchdog names it in one line, writes its
    own stacks (faulthandler) and rank 1's (py-spy), kills it, leaves the requeue marker and exits 42."""
    victim = subprocess.Popen(
        [sys.executable, "-c", "import time\ndef in_train_step():\n time.sleep(600)\nin_train_step()"]
    )
    try:
        time.sleep(1.0)
        victim.send_signal(signal.SIGSTOP)
        exits, lines = [], []
        monkeypatch.setattr(HangWatchdog, "_kill_children", staticmethod(lambda: None))
        dog = _dog(tmp_path, timeout_s=15, exit=exits.append)
        dog.dir.mkdir(parents=True)
        dog.on_hang(lines.append)
        dog.progress("step", 5)
        dog._beat()
        (dog.dir / "rank1.json").write_text(
            json.dumps(
                {"rank": 1, "host": dog.host, "pid": victim.pid, "point": "step 5", "seq": 1, "alive": time.time() - 30}
            )
        )
        dog._handle_hang()
        assert victim.wait(timeout=10) == -signal.SIGKILL
    finally:
        if victim.poll() is None:
            victim.kill()
    assert exits == [42] and len(lines) == 1 and lines[0].startswith("k2-train: hang: no progress for ")
    assert "rank 1 stopped responding (last heartbeat at 'step 5'" in lines[0] and "rank 0" not in lines[0]
    assert (dog.dir / "report.txt").read_text().strip() == lines[0]
    assert "in_train_step" in (dog.dir / "stacks_rank1.txt").read_text()
    assert "test_a_stopped_rank_is_reported" in (dog.dir / "stacks_rank0.txt").read_text()
    assert (tmp_path / "requeue").read_text().startswith("hang step 5")


def test_bad_settings_name_the_key():
    with pytest.raises(ConfigError, match="run.hang_timeout_s"):
        load_config(["run.hang_timeout_s=0"])
    with pytest.raises(ConfigError, match="run.hang_startup_timeout_s"):
        load_config(["run.hang_startup_timeout_s=-1"])


def _run_thread(dog, seconds: float) -> list:
    """Start ``dog``'s thread (its exit recorded, not taken), let it run ``seconds``, stop it."""
    exits = []
    dog._exit = exits.append
    dog._kill_children = lambda: None
    dog.start()
    time.sleep(seconds)
    dog.stop()
    return exits


def test_progress_inside_a_point_is_not_a_hang_and_a_point_without_it_is(tmp_path):
    """A point (an evaluation) longer than its allowance whose batches report progress (k2.launcher.progress,
    as evaluate() does per batch) is not a hang; the same point without progress is, after its allowance."""
    from k2.launcher.progress import moved

    dog = _dog(tmp_path, timeout_s=1.0, world=1)
    dog.startup_timeout_s = 1.0
    dog._allowance = 1.0
    exits = []
    dog._exit = exits.append
    dog._kill_children = lambda: None
    dog.start()
    dog.progress("eval", 3)
    for _ in range(30):  # 3 s of batches, 0.1 s each: 3x the allowance
        time.sleep(0.1)
        moved()
    assert exits == [] and dog.report is None
    time.sleep(2.5)  # the batches stop: a hang within the allowance plus a tick or two
    dog.stop()
    assert exits == [42] and "no progress for 1 s at 'eval 3'" in dog.report, dog.report


def test_a_growing_probe_is_progress(tmp_path):
    """Work the rank waits on in a library (a synchronous save's writer threads): the bytes of its files
    grow (k2.launcher.progress.measured), which keeps the point alive."""
    from k2.launcher.progress import measured

    dog = _dog(tmp_path, timeout_s=1.0, world=1)
    dog.startup_timeout_s = dog._allowance = 1.0
    written = [0]

    def grow():
        written[0] += 1
        return written[0]

    with measured(grow):
        exits = _run_thread(dog, 3.0)
    assert exits == [] and dog.report is None


def test_waiting_ranks_are_not_hung_while_another_rank_moves(tmp_path):
    """This rank's allowance ran out (it waits in a collective), but rank 1 -- at the same point, not
    stopped -- made progress within the allowance (it builds a dataset the others wait for): not a hang.
    Rank 1 stops moving: a hang that says every rank waits. Rank 1 behind but moving is not named."""
    dog = _dog(tmp_path, timeout_s=10)
    dog._allowance = 10.0
    now = 1000.0
    beats = {
        0: {"seq": 3, "point": "phase 4", "alive": now, "moved": now - 30, "host": "h", "pid": 1},
        1: {"seq": 3, "point": "phase 4", "alive": now, "moved": now - 2, "host": "h", "pid": 2},
    }
    dog.read_heartbeats = lambda: beats
    time_now = time.time
    try:
        time.time = lambda: now
        assert dog.culprits(beats, now) == {} and dog._another_rank_moves()
        beats[1]["moved"] = now - 20
        assert not dog._another_rank_moves()
        beats[1].update(seq=2, point="step 4", moved=now - 1)  # behind, but moving: working, not hung
        assert dog.culprits(beats, now) == {}
        beats[1]["moved"] = now - 20
        assert list(dog.culprits(beats, now)) == [1]
    finally:
        time.time = time_now


def test_a_rank_stopped_as_the_others_stop_moving_is_named_when_their_allowance_ends(tmp_path):
    """run.hang_timeout_s=5 (a tick of 0.5 s): the others' allowance ends 5 s after their last progress,
    when the stopped rank's last heartbeat is about as old; it is named then, not reported as a rank
    that waits like the others."""
    dog = _dog(tmp_path, timeout_s=5)
    dog._allowance = 5.0
    now = 1000.0
    beats = {
        0: {"seq": 9, "point": "eval 6", "alive": now, "moved": now - 5.2, "host": "h", "pid": 1},
        1: {"seq": 9, "point": "eval 6", "alive": now - 4.8, "moved": now - 5.3, "host": "h", "pid": 2},
    }
    assert list(dog.culprits(beats, now)) == [1]


def test_a_stopped_background_writer_is_named(tmp_path):
    beats = {
        0: {
            "seq": 5,
            "point": "save 4",
            "alive": 1.0,
            "host": "n1",
            "pid": 10,
            "writer": {"pid": 11, "step": 4, "partial": "/r/checkpoints/iter_0000004.partial", "state": "T"},
        },
        1: {
            "seq": 5,
            "point": "save 4",
            "alive": 1.0,
            "host": "n1",
            "pid": 12,
            "writer": {"pid": 13, "step": 4, "partial": "/r/checkpoints/iter_0000004.partial", "state": "S"},
        },
    }
    assert HangWatchdog.writer_notes(beats) == [
        "rank 0's background checkpoint writer (host n1, pid 11) is stopped (SIGSTOP or a debugger) while "
        "writing step 4 into /r/checkpoints/iter_0000004.partial"
    ]


def test_a_checkpoint_load_reports_progress_per_object_through_the_allow_list(tmp_path):
    """A DCP load under load_progress() reports every tensor and object it reads (the hang watchdog's
    progress of a load), and under restricted_unpickling() the pickled parts -- .metadata and an object
    holding a NumPy array, as megatron's RNG state does -- load through the allow-list."""
    import numpy as np
    import torch
    import torch.distributed.checkpoint as dcp

    from k2.launcher.checkpointing.load_progress import load_progress
    from k2.launcher.checkpointing.unpickle import restricted_unpickling
    from k2.launcher.progress import watch

    state = {f"w{i}": torch.full((4,), float(i)) for i in range(5)}
    state["rng"] = {"numpy": np.random.RandomState(3).get_state(), "step": 7}
    dcp.save(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    target = {k: torch.zeros(4) for k in state if k != "rng"} | {"rng": {"numpy": None, "step": 0}}
    moves = []
    with watch(lambda: moves.append(1)), restricted_unpickling(), load_progress():
        dcp.load(target, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert torch.equal(target["w4"], state["w4"]) and target["rng"]["step"] == 7
    assert np.array_equal(target["rng"]["numpy"][1], state["rng"]["numpy"][1])
    assert len(moves) >= 6  # five tensors and the object (or its parts)
    # an object that would call a function when unpickled: refused by the load itself, never called
    mark = tmp_path / "PWNED"
    dcp.save({"evil": _Calls(mark)}, checkpoint_id=str(tmp_path / "bad"), no_dist=True)
    with restricted_unpickling(), pytest.raises(BaseException) as e:  # (DCP's CheckpointException)
        dcp.load({"evil": None}, checkpoint_id=str(tmp_path / "bad"), no_dist=True)
    causes = [exc for exc, _ in getattr(e.value, "failures", {}).values()] or [e.value]
    assert any("GLOBAL posix.system" in str(c) for c in causes), causes
    assert not mark.exists()


class _Calls:
    def __init__(self, mark):
        self.mark = mark

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.mark}",)
