"""The loss-spike guard's decision rule, its checkpointed window and its settings (single process, no
process group); the multi-rank skip: tests/integration/test_spike_guard.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from k2.config import ConfigError, load_config
from k2.launcher.training.spike import SpikeGuard
from k2.launcher.training.step import TrainingDiverged


class _Optimizer:
    """Stands in for megatron's optimizer: step() calls prepare_grads() first, as MegatronOptimizer.step
    does, and updates only when it returns False."""

    def __init__(self, grad_norm):
        self.grad_norm, self.updates = grad_norm, 0

    def prepare_grads(self):
        return False

    def get_grad_norm(self):
        return self.grad_norm

    def step(self):
        if self.prepare_grads():
            return False, None, None
        self.updates += 1
        return True, self.grad_norm, 0


def _cfg(**kw):
    return SimpleNamespace(**{"window": 8, "sigma": 3.0, "action": "log", "max_consecutive_skips": 2, **kw})


def _feed(guard, values, grad_norm=1.0):
    out = []
    for i, v in enumerate(values, 1):
        opt = _Optimizer(grad_norm)
        ok, _, spike = guard.optimizer_step(i, opt, v)
        rec = {}
        guard.finish_step(i, rec, lambda _: None, lambda: None)
        out.append((spike, opt.updates, rec))
    return out


def test_rule_matches_a_numpy_reference_and_spikes_stay_out_of_the_window():
    rng = np.random.default_rng(0)
    values = list(2.0 + 0.01 * rng.standard_normal(30))
    values[12] = 2.5  # far above
    values[20] = 1.0  # far below: not a spike (one-sided)
    got = [s for s, _, _ in _feed(SpikeGuard(_cfg()), values)]
    window, want = [], []
    for v in values:  # the rule restated with numpy
        spike = len(window) >= 4 and v > np.mean(window[-8:]) + 3.0 * np.std(window[-8:])
        want.append(spike)
        if not spike:
            window.append(v)
    assert got == want and got[12] and not got[20]


def test_log_updates_skip_does_not_and_too_many_skips_stop():
    vals = [1.0, 1.01, 0.99, 1.0, 1.02, 50.0]
    log = _feed(SpikeGuard(_cfg(action="log")), vals)
    assert log[-1][0] and log[-1][1] == 1 and log[-1][2]["spike_action"] == "log"
    skip = _feed(SpikeGuard(_cfg(action="skip")), vals)
    assert skip[-1][0] and skip[-1][1] == 0 and skip[-1][2]["spike_on"] == ["loss"]
    assert [u for _, u, _ in skip[:-1]] == [1] * 5
    guard = SpikeGuard(_cfg(action="skip", max_consecutive_skips=2))
    _feed(guard, vals[:-1])
    for step in (6, 7):
        guard.optimizer_step(step, _Optimizer(1.0), 50.0)
        guard.finish_step(step, {}, lambda _: None, lambda: None)
    guard.optimizer_step(8, _Optimizer(1.0), 50.0)
    with pytest.raises(TrainingDiverged, match="3 loss spikes in a row up to step 8"):
        guard.finish_step(8, {}, lambda _: None, lambda: None)
    stop = SpikeGuard(_cfg(action="stop"))
    _feed(stop, vals[:-1])
    stop.optimizer_step(6, _Optimizer(1.0), 50.0)
    with pytest.raises(TrainingDiverged, match="loss spike at step 6"):
        stop.finish_step(6, {}, lambda _: None, lambda: "ckpt")


def test_window_round_trips_through_the_checkpoint_json():
    vals = [1.0 + 1e-3 * i**1.5 for i in range(20)]
    a = SpikeGuard(_cfg())
    _feed(a, vals[:10])
    b = SpikeGuard(_cfg())
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.state_dict() == a.state_dict()
    assert [r for _, _, r in _feed(a, vals[10:])] == [r for _, _, r in _feed(b, vals[10:])]


def test_default_is_log_and_bad_settings_name_the_key():
    assert load_config([]).train.spike.action == "log"
    for override, words in (
        ("train.spike.action=rollback", "log, skip, stop"),
        ("train.spike.window=2", "train.spike.window"),
        ("train.spike.sigma=0", "train.spike.sigma"),
    ):
        with pytest.raises(ConfigError, match=words):
            load_config([override])
