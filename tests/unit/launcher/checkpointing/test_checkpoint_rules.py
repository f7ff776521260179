"""Resume decisions, retention, replayed metrics and the preemption flag, in-process (no ranks start): which
checkpoint a run continues from, what it refuses, which checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from support.fake_runs import SINGLE
from support.fake_runs import fake_checkpoint as _fake_checkpoint


def _plan(overrides, world=1):
    from k2.config.load import load_config
    from k2.launcher.training.prepare import prepare_run

    return prepare_run(load_config(overrides), world)


def test_auto_resume_finds_latest_and_resume_from_accepts_run_or_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    ck = _fake_checkpoint(run_dir, 4, [f"run.dir={run_dir}"], SINGLE)
    assert _plan([f"run.dir={run_dir}"]).resume_from == ck
    other = tmp_path / "other"
    for where in (run_dir, ck, run_dir / "checkpoints"):
        assert _plan([f"run.dir={other}", f"resume.from={where}"]).resume_from == ck
    assert _plan([f"run.dir={other}"]).resume_from is None  # empty dir: a fresh start


def test_resume_refuses_partial_incomplete_and_never(tmp_path):
    from k2.config.errors import ConfigError

    run_dir = tmp_path / "run"
    ck = _fake_checkpoint(run_dir, 4, [f"run.dir={run_dir}"], SINGLE)
    partial = ck.parent / "iter_0000006.partial"
    partial.mkdir()
    with pytest.raises(ConfigError, match="partial save.*iter_0000004"):
        _plan([f"run.dir={tmp_path / 'x'}", f"resume.from={partial}"])
    (ck / "k2_state.json").unlink()
    with pytest.raises(ConfigError, match="not a complete k2-launcher checkpoint"):
        _plan([f"run.dir={run_dir}"])
    with pytest.raises(ConfigError, match="resume=never and run.dir=.* is not empty"):
        _plan([f"run.dir={run_dir}", "resume=never"])
    with pytest.raises(ConfigError, match="unknown setting resume.frm; allowed: resume.mode, resume.from"):
        _plan([f"run.dir={run_dir}", "+resume.frm=3"])


def test_missing_empty_or_dangling_latest_falls_back_to_the_newest_that_verifies(tmp_path):
    """``latest`` missing, empty or naming a deleted checkpoint: the newest complete one is resumed, with
    a note naming the marker; a dangling marker with nothing that verifies is refused naming it; no
    marker and no checkpoint (a run killed before its first save) is a fresh start."""
    from k2.config.errors import ConfigError
    from k2.launcher.checkpointing.paths import resume_point

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "step_time_s": 1.0}\n')
    assert resume_point(run_dir) == (None, None)
    assert _plan([f"run.dir={run_dir}"]).resume_from is None  # early crash: afresh
    old = _fake_checkpoint(run_dir, 2, [f"run.dir={run_dir}"], SINGLE)
    new = _fake_checkpoint(run_dir, 4, [f"run.dir={run_dir}"], SINGLE)
    latest = run_dir / "checkpoints" / "latest"
    for marker, problem in (
        (None, "is missing"),
        ("", "is empty"),
        ("iter_0000006", "names iter_0000006, which does not exist"),
    ):
        if marker is None:
            latest.unlink(missing_ok=True)
        else:
            latest.write_text(marker)
        path, note = resume_point(run_dir)
        assert path == new
        assert note == f"{latest} {problem}; resuming from the newest checkpoint that verifies: iter_0000004"
        assert _plan([f"run.dir={run_dir}"]).resume_from == new
        assert _plan([f"run.dir={tmp_path / 'x'}", f"resume.from={run_dir / 'checkpoints'}"]).resume_from == new
    import shutil

    shutil.rmtree(new)
    shutil.rmtree(old)
    refusal = f"{latest} names iter_0000006, which does not exist and no checkpoint in .* verifies: delete {latest}"
    with pytest.raises(ConfigError, match=refusal):
        _plan([f"run.dir={run_dir}"])


@pytest.mark.parametrize(
    "change,allowed",
    [
        (["parallel=pp2"], None),  # PP 1 -> 2
        (["parallel=cpu4"], None),  # PP, VPP, EP
    ],
)
def test_layout_change_names_compatible_layouts(tmp_path, change, allowed):
    from k2.config.errors import ConfigError

    run_dir = tmp_path / "run"
    _fake_checkpoint(run_dir, 4, [f"run.dir={run_dir}"], SINGLE)
    world = {"parallel=pp2": 2, "parallel=cpu4": 4}[change[0]]
    with pytest.raises(ConfigError, match=r"Compatible layouts: parallel.pp=1, parallel.vpp=1, parallel.ep=1"):
        _plan([f"run.dir={run_dir}", *change], world)


def test_dp_change_refused_for_layer_wise_muon_state(tmp_path):
    from k2.config.errors import ConfigError

    run_dir = tmp_path / "run"
    ck = _fake_checkpoint(run_dir, 4, [f"run.dir={run_dir}", "optim=muonclip"], {**SINGLE, "dp": 2, "world_size": 2})
    st = json.loads((ck / "k2_state.json").read_text())
    (ck / "k2_state.json").write_text(json.dumps({**st, "optimizer_dp_fixed": True}))
    with pytest.raises(ConfigError, match="fixed DP size: run with world size 2"):
        _plan([f"run.dir={run_dir}", "optim=muonclip"], 1)


def test_config_change_that_alters_training_needs_force(tmp_path):
    from k2.config.errors import ConfigError

    run_dir = tmp_path / "run"
    ck = _fake_checkpoint(run_dir, 4, [f"run.dir={run_dir}"], SINGLE)
    for change, key in (
        (["model.moe_router_topk=3"], "model.moe_router_topk: 2 -> 3"),
        (["schedule.phases.1.lr_start=0.01"], r"schedule.phases.1.lr_start: \S+ -> 0.01"),
        (["run.seed=7"], "run.seed: 1234 -> 7"),
    ):
        with pytest.raises(ConfigError, match=f"would change training: .*{key}.*resume.force=true"):
            _plan([f"run.dir={run_dir}", *change])
        assert _plan([f"run.dir={run_dir}", *change, "resume.force=true"]).resume_from == ck
    # each changed key once, as `key: old -> new` (dotted, list items by index), not the whole section
    with pytest.raises(ConfigError) as e:
        _plan([f"run.dir={run_dir}", "schedule.phases.1.lr_start=0.002", "schedule.phases.0.steps=30"])
    changes = str(e.value).split("would change training: ")[1].split(". Restore")[0].split("; ")
    assert changes == ["schedule.phases.0.steps: 20 -> 30", "schedule.phases.1.lr_start: 0.003 -> 0.002"], changes
    # settings that do not change what is computed are free
    assert (
        _plan([f"run.dir={run_dir}", "train.iters=100", "train.eval_interval=7", "checkpoint.keep_last=5"]).resume_from
        == ck
    )


def test_prune_keeps_last_k_every_m_and_latest(tmp_path):
    from k2.launcher.checkpointing.store import prune

    root = tmp_path / "checkpoints"
    for s in range(10, 101, 10):
        (root / f"iter_{s:07d}").mkdir(parents=True)
        (root / f"iter_{s:07d}" / "k2_state.json").write_text("{}")
    (root / "latest").write_text("iter_0000040\n")  # e.g. resumed from 40 by resume.from
    removed = prune(root, keep_last=2, keep_every=50)
    left = sorted(int(p.name[5:]) for p in root.iterdir() if p.is_dir())
    assert left == [40, 50, 90, 100]
    assert len(removed) == 6
    prune(root, keep_last=1, keep_every=None, keep_steps=[50])  # a sweep trunk's branch point stays
    assert sorted(int(p.name[5:]) for p in root.iterdir() if p.is_dir()) == [40, 50, 100]


def test_replayed_metrics_are_set_aside(tmp_path):
    from k2.launcher.training.metrics import REPLAYED_METRICS, set_aside_replayed_metrics

    m = tmp_path / "metrics.jsonl"
    m.write_text("".join(json.dumps({"step": s, "loss": float(s)}) + "\n" for s in range(1, 8)) + '{"step": 8, "lo')
    assert set_aside_replayed_metrics(tmp_path, 5) == 7
    assert [json.loads(x)["step"] for x in m.read_text().splitlines()] == [1, 2, 3, 4, 5]
    assert [json.loads(x)["step"] for x in (tmp_path / REPLAYED_METRICS).read_text().splitlines()] == [6, 7]
    assert set_aside_replayed_metrics(tmp_path, 5) == 5  # nothing more to move


def test_preemption_flag_from_signal_and_budget():
    from k2.launcher.training.preemption import Preemption

    seen = []
    p = Preemption(None, on_signal=seen.append).install()
    try:
        assert not p.agreed()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert p.agreed() and p.reason == "signal" and seen == ["SIGUSR1"]
    finally:
        p.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    q = Preemption(max_minutes=1e-6)
    time.sleep(0.01)
    assert q.agreed() and q.reason == "run.max_minutes"


@pytest.mark.parametrize(
    "step,overrides",
    [
        (300, []),  # the end of tiny_wsd: no phase holds the next step's first token
        (2, ["train.iters=2"]),  # train.iters reached, inside the schedule
    ],
)
def test_finished_run_run_again_is_nothing_to_do(tmp_path, capsys, monkeypatch, step, overrides):
    """k2-train on a run dir whose checkpoint is at the run's last step prints "nothing to do" and exits
    0 without starting a trainer; a trainer started directly (torchrun) finds the phase of that last
    step instead of failing on the phase after the schedule's end."""
    from types import SimpleNamespace

    from k2.launcher import train
    from k2.launcher.training import trainer

    run_dir = tmp_path / "run"
    ck = _fake_checkpoint(run_dir, step, [f"run.dir={run_dir}"], SINGLE)

    def no_trainer(*a, **k):
        raise AssertionError("a trainer was started for a finished run")

    monkeypatch.setattr(trainer, "run", no_trainer)
    assert train.main([f"run.dir={run_dir}", *overrides]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint {ck} is at step {step}, the run ends at step {step}" in out and "nothing to do" in out
    assert f"to start the run afresh, use a new run.dir (or delete {ck.parent}, the checkpoints of this one)" in out
    assert ("train on with a larger train.iters (the schedule runs to step 300)" in out) == (step < 300), out

    plan = _plan([f"run.dir={run_dir}", *overrides])
    t = trainer.Trainer.__new__(trainer.Trainer)
    t.plan = plan
    consumed = step * plan.tokens_per_step
    t.state = SimpleNamespace(step=step, consumed_tokens=consumed)
    assert t._phase_after_restore() is plan.schedule.step_phase(step)


def test_train_iters_that_stop_before_the_decay_are_said_at_the_start(tmp_path, capsys, monkeypatch):
    """train.iters=10 of tiny_wsd's 300 steps: the run stops in warmup, far from the decayed LR; k2-train
    says so in one line before training (a short test run may mean it). The whole schedule: no line."""
    from k2.launcher import train
    from k2.launcher.training import trainer

    monkeypatch.setattr(trainer, "run", lambda *a, **k: {})
    assert train.main([f"run.dir={tmp_path / 'run'}", "train.iters=10"]) == 0
    out = capsys.readouterr().out
    assert (
        "k2-train: note: train.iters=10 ends the run at step 10 of the 300 of schedule 'tiny_wsd', in phase "
        "'warmup', at LR 0.0015: the LR does not reach the schedule's end (0.000105)"
    ) in out, out
    assert _plan([f"run.dir={tmp_path / 'other'}"]).ends_before_decay is None


def test_k2_train_leaves_a_callers_process_group_as_it_was(megatron_world1, tmp_path, monkeypatch):
    """k2-train's entry called in a process that already has a process group and megatron's parallel state
    (a test's session world) tears down only what it created: a test that ran it in-process left the next
    tests of its worker without megatron's groups ("pipeline_model parallel group is not initialized")."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from k2.launcher import train
    from k2.launcher.training import trainer

    monkeypatch.setattr(trainer, "run", lambda *a, **k: {})
    assert train.main([f"run.dir={tmp_path / 'run'}", "train.iters=2"]) == 0
    assert dist.is_initialized() and ps.model_parallel_is_initialized()
