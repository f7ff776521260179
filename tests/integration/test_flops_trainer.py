"""The trainer logs model TFLOP/s and MFU per step with the planner's formula (k2.model.flops)."""

from __future__ import annotations

import pytest

from k2.config.load import load_config
from support.flops import tiny_forward_by_hand


@pytest.mark.slow
def test_trainer_reports_mfu_per_step(tmp_path, stdlib_corpus):
    """k2-train's metrics.jsonl has model TFLOP/s per GPU and MFU, from the same formula k2-plan uses."""
    from support.distributed import run_trainer

    recs = run_trainer(
        [
            "train.iters=2",
            "train.eval_interval=0",
            "schedule.global_batch_tokens=1024",
            "cluster.cpu_peak_tflops=0.5",
            "checkpoint.save_at_end=false",
        ],
        1,
        tmp_path / "run",
    )
    tiny = load_config([]).model
    per_token = 3 * sum(tiny_forward_by_hand(tiny, 128).values())
    for r in recs:
        expected = per_token * 1024 / r["step_time_s"] / 1 / 1e12
        assert r["model_tflops_per_gpu"] == pytest.approx(expected, rel=1e-9)
        assert r["mfu"] == pytest.approx(expected / 0.5, rel=1e-9)
