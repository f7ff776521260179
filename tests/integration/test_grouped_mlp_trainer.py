"""Grouped-GEMM experts in the trainer: the same losses, gradients and parameters as megatron's sequential
experts on cpu4 (PP2 x VPP2 x EP2 x DP2, MuonClip).
"""

from __future__ import annotations

import pytest
import torch


@pytest.mark.slow
def test_trainer_grouped_equals_sequential_on_cpu4(three_step_runs):
    """The trainer on parallel=cpu4 (PP2 x VPP2, EP2, DP2, layer-wise ZeRO-1, alltoall dispatcher) with
    MuonClip: grouped experts give the sequential run's losses, gradient norms, every rank's gradients at
    every step and its parameters after 3 steps, to fp32 rounding (3 steps each, tests/support/distributed.py
    THREE_STEPS + MUONCLIP_FP32; the sequential run is shared with tests/integration/test_muonclip_parallel.py).
    The activation-memory switches with grouped experts:
    test_memory_switches_apply_as_in_the_sequential_module."""
    from support.distributed import MUONCLIP_FP32

    seq = three_step_runs(["parallel=cpu4", *MUONCLIP_FP32], 4, False)
    grp = three_step_runs(["parallel=cpu4", *MUONCLIP_FP32, "model.moe_grouped_gemm=true"], 4, False)
    assert len(seq["records"]) == len(grp["records"]) == 3
    for a, b in zip(seq["records"], grp["records"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    experts = 0
    for rank in range(4):
        (g_seq, p_seq), (g_grp, p_grp) = seq["dumps"][rank], grp["dumps"][rank]
        for a, b in zip(g_seq, g_grp):
            assert a.keys() == b.keys()
            for name in a:
                torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-6, msg=f"rank {rank} grad {name}")
                experts += ".local_experts." in name or ".global_experts." in name
        assert p_seq.keys() == p_grp.keys()
        for name in p_seq:
            torch.testing.assert_close(p_grp[name], p_seq[name], rtol=1e-4, atol=1e-6, msg=f"rank {rank} {name}")
    assert experts > 0  # the expert weights were compared
