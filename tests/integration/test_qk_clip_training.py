"""QK-Clip in training: with a tiny tau every head is clipped every step and the model still learns."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_training_with_tiny_tau_clips_and_still_learns(tmp_path, stdlib_corpus):
    """The real trainer (MuonClip, one rank) with tau below the initial max logits (~0.14): QK-Clip fires
    every step, the max logit is held near tau, and the loss still falls."""
    from support.distributed import run_trainer

    tau = 0.1
    recs = run_trainer(
        [
            "optim=muonclip",
            f"optim.qk_clip_tau={tau}",
            "train.iters=6",
            "train.eval_interval=0",
            "schedule.phases.0.steps=0",
            "checkpoint.save_at_end=false",
        ],
        1,
        tmp_path,
    )
    assert [r["step"] for r in recs] == list(range(1, 7))
    assert all(r["qk_clipped_heads"] > 0 for r in recs), [r["qk_clipped_heads"] for r in recs]
    assert recs[0]["max_attn_logit"] > tau
    # after a clip the next forward starts at <= tau; one update moves it only a little
    assert all(r["max_attn_logit"] < 1.5 * tau for r in recs[1:]), [r["max_attn_logit"] for r in recs]
    assert len(recs[0]["max_attn_logit_per_layer"]) == 4
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.2, [r["loss"] for r in recs]
