"""Everything on (memory=k2: FP8 storage, the four recomputes, offload) trains on cpu4 (PP2 x VPP2 x EP2
x DP2, interleaved 1F1B, distributed optimizer) like memory=none.

Step 1's forward is the same computation (FP8 storage and offload change only what backward reads; recompute
only when it is computed), so its loss and MoE metrics must agree; the next steps carry the FP8 gradient error
(<= 2^-4 per parameter, tests/unit/model/test_activation_memory.py), so they agree closely. The 200-step
validation-loss comparison is benchmarks/memory_convergence.sh.

A schedule phase that changes the memory settings switches them at its boundary: whole-layer recompute,
and FP8 storage + offload + the op recomputes together, each against a run with those settings from the
start (the latter: restarted from a checkpoint at the boundary).
"""

from __future__ import annotations

import pytest
import torch

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


# stable ends after 2 steps (4,096 tokens): step 3 runs in the decay phase; the saved-bytes metric on (the
# phase-boundary tests of both switches)
TWO_THEN_DECAY = ["parallel=cpu4", "schedule.phases.1.until_tokens=4096", "train.measure_saved_bytes=true"]


def _planned_rank0_bytes(layer_recompute: bool, **sites) -> float:
    """The planner's bytes per microbatch kept by the layers of PP rank 0 (both its model chunks) of cpu4
    (k2_tiny, FP32, 2 x 128 tokens, CPU kernels) with the ``memory.*`` site lists ``sites`` (default:
    layernorm recompute), device plus host: launcher/planning/activation_bytes.py."""
    from k2.config.load import load_config
    from k2.launcher.planning.activation_bytes import apply_switches, layer_recompute_saved, layer_saved
    from k2.model.build import moe_layer_pattern
    from k2.parallel.dims import ParallelDims

    cfg = load_config(["parallel=cpu4"])
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, 4)
    pattern = moe_layer_pattern(cfg.model)
    layers = [i for v in range(dims.vpp) for i in dims.stage_layers[0][v]]
    if layer_recompute:
        return len(layers) * sum(apply_switches(layer_recompute_saved(cfg.model, 128, 2, "fp32")))
    sites = sites or {"recompute": ["layernorm"]}
    return sum(
        sum(apply_switches(layer_saved(cfg.model, bool(pattern[i]), 128, 2, "fp32", False), **sites)) for i in layers
    )


def test_layer_recompute_switched_at_a_phase_boundary_on_cpu4(three_step_runs):
    """Whole-layer recompute on PP2 x VPP2 x EP2 x DP2 with decoupled weight gradients: a run that turns it
    on at the decay phase (schedule.phases.2.memory) equals, step for step, one that has it from the start,
    within FP32 rounding, and both equal memory=none for the steps before (same LR: the plain cpu4 run).
    The bytes rank 0's layers keep per microbatch drop at the boundary to what the planner predicts."""
    switched = three_step_runs(
        [*TWO_THEN_DECAY, "memory.recompute=[layernorm]", "schedule.phases.2.memory.recompute=[layernorm,layer]"],
        4,
        True,
    )["records"]
    always = three_step_runs([*TWO_THEN_DECAY, "memory.recompute=[layernorm,layer]"], 4, True)["records"]
    # memory=none: the plain cpu4 run of the other tests here (and of test_pipeline_wgrad.py); the split
    # changes no number (test_pipeline_wgrad.py), so the run without it serves
    plain = three_step_runs(["parallel=cpu4"], 4, False)["records"]
    assert [r["layer_recompute"] for r in switched] == [False, False, True]
    assert [r["layer_recompute"] for r in always] == [True, True, True]
    assert [r["phase"] for r in switched] == ["stable", "stable", "decay"]
    for a, b in zip(switched, always):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["max_attn_logit"] == pytest.approx(b["max_attn_logit"], rel=1e-5)
    for a, b in zip(always[:2], plain[:2]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["moe_load_max_over_mean"] == pytest.approx(b["moe_load_max_over_mean"], rel=1e-6)
    # measured on the first step of each phase (steps 1 and 3)
    before, after = switched[0]["saved_bytes_per_microbatch"], switched[2]["saved_bytes_per_microbatch"]
    assert "saved_bytes_per_microbatch" not in switched[1]
    assert after == pytest.approx(_planned_rank0_bytes(True), rel=1e-6)  # the layer inputs, exactly
    assert after == always[0]["saved_bytes_per_microbatch"]
    assert before == pytest.approx(_planned_rank0_bytes(False), rel=0.10)
    assert after < 0.2 * before


def test_fp8_offload_and_op_recompute_switched_at_a_phase_boundary_on_cpu4(three_step_runs):
    """memory=none, then memory=k2's sites (FP8 storage, the four op recomputes, offload) from the decay
    phase (schedule.phases.2.memory, from step 3) on PP2 x VPP2 x EP2 x DP2: the step after the boundary
    equals, bitwise (loss, gradient norm, every rank's gradients and final parameters), that of a run
    restarted from the checkpoint at the boundary (step 2) with memory=k2 (built with it); before the
    boundary, and in the first forward after it, the run is memory=none's. The bytes rank 0's layers keep
    per microbatch drop at the boundary as the planner predicts (within 10%), to the restarted run's figure
    exactly."""
    from k2.launcher.checkpointing.paths import checkpoints_dir, iter_name

    k2 = load_config(["memory=k2"]).memory
    sites = {key: list(k2[key]) for key in ("fp8_store", "recompute", "offload")}
    switch = [*TWO_THEN_DECAY, *(f"schedule.phases.2.memory.{key}=[{','.join(v)}]" for key, v in sites.items())]
    run = three_step_runs([*switch, "train.save_interval=2"], 4, False)  # (one checkpoint: the boundary's)
    ckpt = checkpoints_dir(run["dump_dir"].parent / "run") / iter_name(2)
    restarted = three_step_runs([*switch, "memory=k2", f"resume.from={ckpt}"], 4, False)
    plain = three_step_runs(["parallel=cpu4"], 4, False)["records"]  # shared with the test above
    switched, again = run["records"], restarted["records"]
    assert [r["phase"] for r in switched] == ["stable", "stable", "decay"]
    assert [r["step"] for r in again] == [3]
    for a, b in zip(switched[2:], again, strict=True):
        for key in ("loss", "grad_norm", "max_attn_logit", "moe_aux_loss"):
            assert a[key] == b[key], (a["step"], key)
    for rank, (grads, params) in run["dumps"].items():
        grads_again, params_again = restarted["dumps"][rank]
        for got, ref in zip(grads[2:], grads_again, strict=True):  # step 3
            assert all(torch.equal(got[n], ref[n]) for n in ref), rank
        assert all(torch.equal(params[n], params_again[n]) for n in params_again), rank
    # steps 1-2 are memory=none's; step 3's forward too (same weights and LR so far), up to FP32 rounding
    # (with moe_down_proj the routed experts multiply by the router probability after fc2, model/mlp.py);
    # its backward is not
    for step in (0, 1):
        assert (switched[step]["loss"], switched[step]["grad_norm"]) == (plain[step]["loss"], plain[step]["grad_norm"])
    assert switched[2]["loss"] == pytest.approx(plain[2]["loss"], rel=1e-6)
    assert switched[2]["grad_norm"] != pytest.approx(plain[2]["grad_norm"], rel=1e-5)  # FP8-stored inputs
    # measured on the first step of each phase (steps 1 and 3)
    before, after = switched[0]["saved_bytes_per_microbatch"], switched[2]["saved_bytes_per_microbatch"]
    assert "saved_bytes_per_microbatch" not in switched[1]
    assert after == again[0]["saved_bytes_per_microbatch"]
    assert before == pytest.approx(_planned_rank0_bytes(False, recompute=[]), rel=0.10)
    assert after == pytest.approx(_planned_rank0_bytes(False, **sites), rel=0.10)
    assert after < 0.5 * before
