"""Parallel equivalence: the same seed and global batch give the same loss on 1 rank and under
PP/VPP/EP/DP (megatron's real schedules, all-to-all and distributed optimizer on gloo).

Acceptance (issue 2): 1 rank vs cpu4 (PP2 x VPP2 x EP2 x DP2) and vs PP2 without VPP agree on the first 3
steps within 1e-4 relative (fp32). Weights are updated from step 1 (no warmup), so steps 2 and 3 check
the backward pass, gradient reduction, clipping and the ZeRO-1 update too, not just the forward.
"""

from __future__ import annotations

import pytest

from distributed import run_trainer

pytestmark = pytest.mark.slow

# schedule.phases.0.steps=0 skips tiny_wsd's warmup: the stable LR 3e-3 from step 1 (no warmup)
COMMON = ["train.iters=3", "train.eval_interval=0", "schedule.phases.0.steps=0", "run.seed=7"]


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory, stdlib_corpus):
    return run_trainer(COMMON, 1, tmp_path_factory.mktemp("single"))


def _assert_same(ref: list[dict], got: list[dict]):
    assert [r["step"] for r in got] == [1, 2, 3]
    for r, g in zip(ref, got):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-4), (r, g)
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4), (r, g)
        assert g["consumed_tokens"] == r["consumed_tokens"]
    # the model learns from step to step, so a broken backward would show up in steps 2-3
    assert ref[2]["loss"] < ref[0]["loss"]


def test_cpu4_matches_single_rank(tmp_path, single_rank):
    got = run_trainer(["parallel=cpu4", *COMMON], 4, tmp_path)
    _assert_same(single_rank, got)


def test_pp2_without_vpp_matches_single_rank(tmp_path, single_rank):
    got = run_trainer(["parallel=pp2", *COMMON], 2, tmp_path)
    _assert_same(single_rank, got)
