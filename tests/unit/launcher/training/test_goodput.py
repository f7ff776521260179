"""Goodput counting (k2.launcher.training.goodput): the split adds up, continues from a checkpoint, and
the time of a start that a restart throws away is counted from its records."""

from __future__ import annotations

import json

import pytest

from k2.launcher.training.goodput import GoodputClock, earlier_start_cost, set_aside_earlier_start


def test_split_adds_up_and_continues_from_a_checkpoint(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("k2.launcher.training.goodput.time.time", lambda: now[0])
    clock = GoodputClock(started=990.0)  # 10 s of imports before the trainer
    clock.end_startup()
    clock.add("productive", 6.0)
    clock.add("checkpoint", 1.0)
    now[0] = 1010.0
    t = clock.totals()
    assert (t["startup"], t["productive"], t["checkpoint"], t["total"]) == (10.0, 6.0, 1.0, 20.0)
    assert t["other"] == pytest.approx(3.0) and t["starts"] == 1
    f = clock.fields()
    assert f["goodput"] == pytest.approx(0.3) and f["time_total_s"] == 20.0
    resumed = GoodputClock(started=now[0])
    resumed.load_state_dict(clock.state_dict())
    now[0] = 1015.0
    resumed.end_startup()
    t2 = resumed.totals()
    assert t2["total"] == pytest.approx(25.0) and t2["startup"] == pytest.approx(15.0)
    assert t2["productive"] == 6.0 and t2["starts"] == 2
    assert "over 2 starts" in resumed.summary()


def test_earlier_start_cost_from_its_records():
    records = [
        {"step": 3, "step_time_s": 2.0, "time_total_s": 30.0},
        {"step": 4, "step_time_s": 2.5, "time_total_s": 33.0},
    ]
    # the checkpoint (step 2) was taken at 25 s: 8 s after it, 4.5 s of it in steps 3-4
    assert earlier_start_cost(records, 25.0) == {"replayed": 4.5, "lost": pytest.approx(3.5)}
    assert earlier_start_cost([{"step": 1, "step_time_s": 1.0}], 0.0) == {"replayed": 1.0, "lost": 0.0}


def test_fresh_start_over_a_run_killed_before_its_first_save(tmp_path):
    lines = [{"step": 0, "val_loss": 8.0}, {"step": 1, "step_time_s": 2.0, "time_total_s": 9.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    clock = GoodputClock(started=0.0)
    last, note = set_aside_earlier_start(tmp_path, None, clock)
    assert last == 1 and "killed before its first checkpoint" in note
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    assert len((tmp_path / "metrics.replayed.jsonl").read_text().splitlines()) == 2
    assert (clock.base["replayed"], clock.base["lost"], clock.base_total, clock.starts) == (2.0, 7.0, 9.0, 2)
    assert set_aside_earlier_start(tmp_path, None, GoodputClock(started=0.0)) == (0, None)  # nothing left
