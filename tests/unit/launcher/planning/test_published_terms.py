"""Terms of k2-plan's step-time model that model published runs' settings (plan.what_if.*, the published
recipes' recompute): each computed another way, and each shown to move the step when dropped. Pure Python."""

from __future__ import annotations

import pytest

from k2.launcher.planning import step_time as stm
from k2.launcher.planning.comm import fsdp_exposed


def test_fsdp_reduce_scatter_every_flush_is_exposed_and_gathers_hide_but_the_first_layer():
    """FSDP2 under torch's pipelining: each flush's reduce-scatter exposed in full; each flush's all-gather
    exposed for its first layer's share and for what exceeds the forward compute."""
    rs, ag = fsdp_exposed(0.5, 0.2, flushes=4, layers=16, forward_compute_s=10.0)
    assert rs == pytest.approx(4 * 0.5)
    assert ag == pytest.approx(4 * 0.2 / 16)
    # gathers longer than the forward compute: the excess is exposed too
    rs, ag = fsdp_exposed(0.5, 2.0, flushes=1, layers=10, forward_compute_s=1.0)
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


@pytest.fixture(scope="module")
def k2():
    """K2's config, parameter counts, FLOPs at 4K and the H800 profile."""
    from k2.config import load_config
    from k2.launcher.planning.analysis import cluster_profile
    from k2.model.flops import flops_per_token
    from k2.model.params import count_params

    cfg = load_config(["model=kimi_k2", "parallel=k2_256gpu"])
    return cfg, count_params(cfg), flops_per_token(cfg.model, 4096), cluster_profile(cfg)


def _step(k2, layout: str, what_if: dict):
    """K2 on 256 H800 at PP16 EP8 with ``layout`` and ``plan.what_if`` settings (128 microbatches)."""
    from omegaconf import OmegaConf

    from k2.parallel.dims import ParallelDims

    cfg, counts, fl, profile = k2
    c = OmegaConf.merge(
        cfg, {"parallel": {"pp": 16, "vpp": None, "ep": 8, "layout": layout}, "plan": {"what_if": what_if}}
    )
    dims = ParallelDims.from_config(c.parallel, c.model, 256)
    return stm.step_time(
        c, dims, counts, fl, tokens=4096, num_microbatches=128, recompute=[], profile=profile, max_microbatches=32
    ), dims


def test_mtp_module_adds_a_moe_block_the_projection_and_the_head_to_the_loss_stage(k2):
    """plan.what_if.mtp_layers=1: the stage holding the loss gains one MoE block, the [2h -> h] projection
    and the output head + loss again (arXiv 2412.19437 section 2.2); no other stage changes."""
    layout = "Et|(tttt|)*14ttttL"
    base, dims = _step(k2, layout, {})
    mtp, _ = _step(k2, layout, {"mtp_layers": 1})
    last = dims.pp - 1
    assert [f for i, f in enumerate(mtp.F) if i != last] == [f for i, f in enumerate(base.F) if i != last]
    # a stage of 4 MoE layers + the head: one more MoE layer, the head again and the projection (h = 7168)
    cfg, _, fl, _ = k2
    h = int(cfg.model.hidden_size)
    layer_f = base.F[1] / 4  # stage 1 holds 4 MoE layers and nothing else
    head_f = base.F[last] - 4 * layer_f
    proj_f = 2 * 4096 * 2 * h * h / 795e12  # the [T, 2h] x [2h, h] GEMM at the BF16 ceiling
    added = mtp.F[last] - base.F[last]
    assert added == pytest.approx(layer_f + head_f + proj_f, rel=0.05)
    assert mtp.B[last] - base.B[last] > 0.9 * (base.B[1] / 4)
    two, _ = _step(k2, layout, {"mtp_layers": 2})
    assert two.F[last] - base.F[last] == pytest.approx(2 * added)


def test_dualpipe_rank_runs_stage_r_and_its_mirror_half_the_microbatches_each(k2):
    """DualPipe (DualPipe's example: rank r holds full_modules[r] and full_modules[pp - 1 - r]): the
    busiest rank's busy time is the largest mean of a stage and its mirror, not the largest stage; with a
    layout whose first stage is light and last heavy, pairing them lowers the busy time."""
    layout = "Et|(tttt|)*14ttttL"
    st, dims = _step(k2, layout, {"dualpipe": True})
    period = [st.F[i] + st.B[i] + st.W[i] for i in range(dims.pp)]
    paired = max((period[r] + period[dims.pp - 1 - r]) / 2 for r in range(dims.pp))
    assert st.makespan - st.breakdown["bubble"] == pytest.approx(128 * paired, rel=1e-9)
    assert paired < max(period)  # the last stage alone (4 layers + the head) is the heaviest
    # (the token-count all-gather blocks the compute stream: it is in the passes' time)
    compute = sum(
        v for k, v in st.breakdown.items() if k in ("gemm", "attention", "non_gemm", "recompute", "ep_token_counts")
    )
    assert compute == pytest.approx(128 * paired, rel=1e-6)


def test_negative_mtp_layers_exits_2(capsys):
    """plan.what_if.mtp_layers below 0: one error line naming the setting and the allowed values, exit 2."""
    from k2.launcher.plan import main

    assert main(["plan.what_if.mtp_layers=-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "plan.what_if.mtp_layers=-1" in err[0] and "integer >= 0" in err[0]


def test_fp8_gemms_run_at_the_fp8_rate_after_quantising_their_operands(k2):
    """train.fp8_recipe: MLA's projections at the profile's FP8 rate, each GEMM's input quantised in the
    forward and its output gradient in the backward (4 1/16 bytes per element at the memory rate, one
    launch each: term ``quantize``); the output head (and the router) stay at the BF16 rate."""
    from k2.launcher.planning.kernels import elementwise_seconds, gemm_seconds
    from k2.launcher.planning.stage_model import FP8_QUANTIZE_BYTES, StageModel
    from k2.launcher.planning.tp_layout import attention_gemms
    from k2.launcher.planning.what_if import WhatIf

    cfg, _, fl, profile = k2
    T = 4096

    def model(fp8):
        return StageModel(
            cfg.model,
            fl,
            None,
            tokens=T,
            profile=profile,
            rates=profile.rates("bf16", fp8=fp8),
            act_bytes=2.0,
            grouped=True,
            what_if=WhatIf(),
            recompute=(),
            fp8_recipe="mxfp8" if fp8 else None,
            high_rates=profile.rates("bf16"),
        )

    fp8, bf16 = model(True), model(False)
    out = {"F": {}, "B": {}, "W": {}}
    fp8.attention_gemms(out)
    shapes = attention_gemms(fp8.s, T, 1)
    r8 = profile.rates("bf16", fp8=True)
    assert out["F"]["gemm"] == pytest.approx(sum(gemm_seconds(m, k, n, r8) for m, k, n in shapes))
    assert out["F"]["quantize"] == pytest.approx(
        sum(elementwise_seconds(FP8_QUANTIZE_BYTES * m * k, 1, r8) for m, k, _ in shapes)
    )
    assert out["B"]["quantize"] == pytest.approx(
        sum(elementwise_seconds(FP8_QUANTIZE_BYTES * m * n, 1, r8) for m, _, n in shapes)
    )
    assert FP8_QUANTIZE_BYTES == pytest.approx(2 + 2 * 33 / 32) and "quantize" not in out["W"]
    bf = {"F": {}, "B": {}, "W": {}}
    bf16.attention_gemms(bf)
    assert out["F"]["gemm"] < bf["F"]["gemm"] and "quantize" not in bf["F"]
    assert fp8.loss() == bf16.loss()  # the output head: not a Transformer Engine linear


def test_overlap_terms_keep_their_order_whatever_the_hash_seed():
    """The EP overlap's extrapolated terms come out in the order the schedule met them (the computed terms,
    then the pairs' own), not in a set's order, which changes with PYTHONHASHSEED from run to run: the
    published breakdown prints them in that order."""
    from types import SimpleNamespace

    from k2.launcher.planning.ep_overlap import extrapolate
    from k2.launcher.planning.two_streams import A2A_KINDS

    names = ["gemm", "attention", "non_gemm", "quantize", "recompute", "tp_comm", "ep_token_counts", "schedule"]
    step = SimpleNamespace(compute={k: 1.0 for k in names}, wire=dict.fromkeys(A2A_KINDS, 0.0))
    costs = SimpleNamespace(forward=lambda i: step, backward=lambda i: step)
    zeros = dict.fromkeys(A2A_KINDS, 0.0)
    rc = {
        "busy": 0.0,
        "terms": {"ep_comm_sms": 0.5, "ep_comm": 0.5},
        "pair_exposure": {"ep_comm": 0.1},
        "pair_exposed": zeros,
        "exposed": zeros,
        "wire": zeros,
        "by_part": {"steady": 0.0},
    }
    out = extrapolate(costs, rc, rank=0, pp=2, vpp=2, microbatches=3)
    assert list(out["terms"]) == [*names, "ep_comm_sms", "ep_comm"]


def test_published_table_columns_fit_the_longest_run_name():
    """Every row of the published table starts its figures at the same column, however long a run's name."""
    from k2.launcher.planning.published import format_published

    row = dict(
        gpus=8,
        predicted_step_s=1.0,
        published_step_s=1.0,
        error=0.0,
        predicted_tokens_per_s_per_gpu=1.0,
        published_tokens_per_s_per_gpu=1.0,
        mfu_bf16_peak=0.1,
        gemm_precision="bf16",
        what_if=[],
        breakdown_s={},
    )
    lines = format_published([dict(row, name="short"), dict(row, name="a_run_name_longer_than_the_column_was_x")])
    header, a, b = lines.splitlines()[1:4]
    assert header.index("GPUs") + 4 == a.index("8") + 1 == b.index("8") + 1
