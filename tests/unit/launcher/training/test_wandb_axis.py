"""wandb's x-axis is the optimizer step (docs/configuration.md): the logger declares ``step`` as the step metric
of every chart and logs each record with its own ``step`` value, never through wandb's internal step
counter (which restarts at 0 in a resumed process and would put a resumed run's points at the wrong x).
A stand-in wandb module records the calls."""

from __future__ import annotations

import sys
import types

from omegaconf import OmegaConf


class _Run:
    id = "run42"

    def __init__(self):
        self.calls = []

    def define_metric(self, *args, **kwargs):
        self.calls.append(("define_metric", args, kwargs))

    def log(self, *args, **kwargs):
        self.calls.append(("log", args, kwargs))

    def finish(self, *args, **kwargs):
        self.calls.append(("finish", args, kwargs))


def test_every_chart_uses_the_step_metric_as_x_axis(tmp_path, monkeypatch):
    from k2.launcher.training.metrics import MetricsLogger

    run = _Run()
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: run
    fake.finish = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = OmegaConf.create({"mode": "offline", "project": "p", "entity": None, "name": None, "group": None})
    logger = MetricsLogger(tmp_path, enabled=True).open(
        total_steps=12, wandb_cfg=cfg, progress=False, start_step=10, wandb_run_id="run42"
    )
    logger.log_before_training({"step": 10, "val_loss": 3.0})
    for step in (11, 12):
        logger.log({"step": step, "loss": 2.0})
    defined = [(a, k) for kind, a, k in run.calls if kind == "define_metric"]
    assert (("step",), {}) in defined and (("*",), {"step_metric": "step"}) in defined
    logs = [(a, k) for kind, a, k in run.calls if kind == "log"]
    assert [a[0]["step"] for a, _ in logs] == [10, 11, 12]
    assert all("step" not in k and len(a) == 1 for a, k in logs)  # not wandb's own step counter
