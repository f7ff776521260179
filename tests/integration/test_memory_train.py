"""Everything on (memory=k2: FP8 storage, the four recomputes, offload) trains on cpu4 (PP2 x VPP2 x EP2
x DP2, interleaved 1F1B, distributed optimizer) like memory=none.

Step 1's forward is the same computation (FP8 storage and offload change only what backward reads;
recompute only when it is computed), so its loss and MoE metrics must agree; the next steps carry the
FP8 gradient error (<= 2^-4 per parameter, tests/unit/model/test_activation_memory.py), so they agree closely. The 200-step
validation-loss comparison is benchmarks/memory_convergence.sh.
"""

from __future__ import annotations

import pytest

from k2.config.load import load_config

pytestmark = pytest.mark.slow


def test_everything_on_trains_like_baseline_on_cpu4(three_step_runs):
    # the same runs as tests/integration/test_pipeline_wgrad.py's cpu4 layouts with the split off (once per session)
    base = three_step_runs(["parallel=cpu4"], 4, False)["records"]  # memory=none (the default)
    k2 = three_step_runs(["parallel=cpu4", "memory=k2"], 4, False)["records"]
    assert [r["step"] for r in k2] == [1, 2, 3]
    first, first_ref = k2[0], base[0]
    assert first["loss"] == pytest.approx(first_ref["loss"], rel=1e-6)
    # router metrics of the same forward: recorded once (a recompute must not double them): every MoE
    # layer routed each of the step's tokens to exactly top-k experts, with and without the recomputes
    topk = load_config(["parallel=cpu4"]).model.moe_router_topk
    for rec in (first, first_ref):
        assert rec["moe_routed_tokens"] == rec["consumed_tokens"] * topk, rec
    assert first["moe_load_max_over_mean"] == first_ref["moe_load_max_over_mean"]
    assert first["moe_aux_loss"] == pytest.approx(first_ref["moe_aux_loss"], rel=1e-6)
    assert first["grad_norm"] == pytest.approx(first_ref["grad_norm"], rel=0.02)
    for r, r_ref in zip(k2[1:], base[1:]):
        assert r["loss"] == pytest.approx(r_ref["loss"], rel=2e-3)
    assert k2[-1]["loss"] < k2[0]["loss"]  # it learns
