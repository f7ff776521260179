"""Terms of k2-plan's step-time model that model published runs' settings (plan.what_if.*, the published
recipes' recompute): each computed another way, and each shown to move the step when dropped. Pure Python."""

from __future__ import annotations

import pytest

from k2.launcher.planning import step_time as stm


def test_fsdp_reduce_scatter_every_flush_is_exposed_and_gathers_hide_but_the_first_layer():
    """FSDP2 under torch's pipelining: each flush's reduce-scatter exposed in full; each flush's all-gather
    exposed for its first layer's share and for what exceeds the forward compute."""
    rs, ag = stm.fsdp_exposed(0.5, 0.2, flushes=4, layers=16, forward_compute_s=10.0)
    assert rs == pytest.approx(4 * 0.5)
    assert ag == pytest.approx(4 * 0.2 / 16)
    # gathers longer than the forward compute: the excess is exposed too
    rs, ag = stm.fsdp_exposed(0.5, 2.0, flushes=1, layers=10, forward_compute_s=1.0)
    assert ag == pytest.approx(0.2 + (1.8 - 1.0))


def test_automodel_runs_recompute_whole_layers():
    """The AutoModel benchmark recipes of the publication wrap every block in activation checkpointing:
    the runs state memory.recompute=[layer], which re-runs each layer's forward (all-to-alls included) in
    the backward: without it the 1,024-GPU run's step is shorter by that recompute term."""
    from k2.launcher.planning.published import compare_run, published_runs

    run = next(r for r in published_runs() if r["name"] == "deepseek_v3_1024_h100_automodel_bf16")
    assert "memory.recompute=[layer]" in run["overrides"]
    with_ac = compare_run(run)
    without = compare_run(run, ["memory.recompute=[]"])
    b = with_ac["breakdown_s"]
    # whole-layer recompute: about the forward's share (a third) of compute and all-to-all
    fwd_share = b["recompute"] / (b["gemm"] + b["attention"] + b["non_gemm"] + b["ep_comm"])
    assert 0.3 < fwd_share < 0.45
    assert without["breakdown_s"]["recompute"] == 0
    assert with_ac["step_s"] - without["step_s"] > 0.9 * b["recompute"]
