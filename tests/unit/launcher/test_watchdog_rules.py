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
    beats = {0: {"seq": 7, "point": "save 4", "alive": now, "host": "h", "pid": 1},
             1: {"seq": 7, "point": "save 4", "alive": now - 60, "host": "h", "pid": 2},
             2: {"seq": 6, "point": "step 4", "alive": now, "host": "h", "pid": 3}}
    named = dog.culprits(beats, now)
    assert sorted(named) == [1, 2, 3]
    assert named[1].startswith("stopped responding (last heartbeat at 'save 4'") and "did not reach 'save 4'" in named[2]
    assert named[3] == "wrote no heartbeat"


def test_a_stopped_rank_is_reported_dumped_and_killed(tmp_path, monkeypatch):
    """Rank 1 is a real stopped process on this host: rank 0's watchdog names it in one line, writes its
    own stacks (faulthandler) and rank 1's (py-spy), kills it, leaves the requeue marker and exits 42."""
    victim = subprocess.Popen([sys.executable, "-c", "import time\ndef in_train_step():\n time.sleep(600)\n"
                               "in_train_step()"])
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
        (dog.dir / "rank1.json").write_text(json.dumps(
            {"rank": 1, "host": dog.host, "pid": victim.pid, "point": "step 5", "seq": 1, "alive": time.time() - 30}))
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
