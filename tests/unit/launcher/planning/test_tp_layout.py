"""megatron's TP layout in k2-plan (launcher/planning/tp_layout.py, stage_model.py, stage_terms.py,
stage_activations.py), the NVLink domain's placement, and megatron's module recompute sites: a TP2 layer's
collectives, parameters and activations against hand-computed figures on k2_tiny; an NVL72 rack keeping EP on
NVLink; k2-train refusing what only k2-plan plans. Pure Python: no process group."""

from __future__ import annotations

import pytest

from k2.config import ConfigError, load_config
from k2.launcher.planning.comm import crosses_nodes, ep_alltoall
from k2.launcher.planning.hardware import load_profile
from k2.parallel.dims import ParallelDims

T = 4096  # tokens of one microbatch
#: k2_tiny's TP-sharded weights (shapes from its representative model): MLA's q and kv up-projections and
#: output projection, and its dense MLP's fc1 / fc2 or a MoE layer's shared expert's
TINY_ATTENTION_SHARDED = 192 * 64 + 256 * 32 + 128 * 128
TINY_DENSE_MLP = 768 * 128 + 128 * 384
TINY_SHARED_EXPERT = 128 * 128 + 128 * 64


def _tiny(tp: int, world: int = 8, ep: int = 2, recompute=()):
    """k2_tiny's stage model on H100 (NVLink collectives 360 GB/s, no intra-node latency) at TP ``tp``."""
    from k2.launcher.planning.stage_terms import stage_model
    from k2.launcher.planning.what_if import WhatIf
    from k2.model.flops import flops_per_token

    cfg = load_config(["model=k2_tiny", "train.precision=bf16", f"parallel.tp={tp}", f"parallel.ep={ep}"])
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, world, tp_supported=True)
    return stage_model(
        cfg,
        dims,
        flops_per_token(cfg.model, T),
        tokens=T,
        device=load_profile("h100"),
        what_if=WhatIf(),
        recompute=list(recompute),
    )


def _ring2(elements: float) -> float:
    """One all-gather or reduce-scatter of ``elements`` BF16 elements over 2 NVLink ranks on H100: each rank
    moves half of the buffer at 360 GB/s."""
    return elements * 2 / 2 / 360e9


def test_a_tp2_layers_collectives_are_the_hand_computed_rings():
    """TP2 with sequence parallelism: the attention all-gathers the q / kv latents and the rope key (T x
    (64 + 32 + 16)) and reduce-scatters the output projection (T x 128); the dense MLP gathers and scatters
    T x 128; the backward gathers each column-parallel input again: 2 AG + RS."""
    nodes = _tiny(2).layer_nodes(0)  # (k2_tiny's layer 0 is dense)
    ag_attn, rs = T * (64 + 32 + 16), T * 128
    assert nodes["attn"]["F"]["tp_comm"] == pytest.approx(_ring2(ag_attn) + _ring2(rs))
    assert nodes["attn"]["B"]["tp_comm"] == pytest.approx(2 * _ring2(ag_attn) + _ring2(rs))
    assert nodes["mlp"]["F"]["tp_comm"] == pytest.approx(2 * _ring2(T * 128))
    assert nodes["mlp"]["B"]["tp_comm"] == pytest.approx(3 * _ring2(T * 128))
    assert "tp_comm" not in _tiny(1).layer_nodes(0)["attn"]["F"]


def test_tp2_halves_the_sharded_gemms_core_attention_and_the_rank_s_tokens():
    """Per GPU at TP2: the sharded GEMMs half as wide, core attention on half the heads, the MoE layer's
    router and all-to-alls on the rank's half of the tokens (expert TP 1: the experts at full width)."""
    from k2.launcher.planning.operator_counts import ATTENTION_KERNELS

    one, two = _tiny(1), _tiny(2)
    a1, a2 = one.layer_nodes(0)["attn"], two.layer_nodes(0)["attn"]
    launches = ATTENTION_KERNELS[0] * one.rates.launch_s  # (the same kernels, each half the work)
    assert a2["F"]["attention"] - launches == pytest.approx((a1["F"]["attention"] - launches) / 2)
    assert two._ep_alltoalls()[0] == pytest.approx(one._ep_alltoalls()[0] / 2, rel=1e-6)
    assert two.token_counts_s() == one.token_counts_s()  # (the EP group's, expert TP 1)
    from k2.launcher.planning.tp_layout import attention_gemms

    assert attention_gemms(two.s, T, 2) == [(T / 2, 128, 64), (T, 64, 96), (T / 2, 128, 48), (T, 32, 128), (T, 64, 128)]


def test_tp2_parameters_and_activations_per_gpu_against_hand_counts():
    """Parameters per GPU: a dense layer less half of its sharded weights, a MoE layer's routed experts whole
    (expert TP 1) over EP; activations per GPU halved (sequence parallelism)."""
    from k2.launcher.planning.stage_activations import stage_activations
    from k2.model.params import count_params

    cfg = load_config(["model=k2_tiny"])
    c = count_params(cfg)
    assert c.stage([0], False, False, tp=2) == c.dense_layer - (TINY_ATTENTION_SHARDED + TINY_DENSE_MLP) // 2
    assert c.stage([1], False, False, ep=2, tp=2) == (
        c.moe_layer - c.routed_experts // 2 - (TINY_ATTENTION_SHARDED + TINY_SHARED_EXPERT) // 2
    )
    acts = {}
    for tp in (1, 2):
        c2 = load_config(["model=k2_tiny", f"parallel.tp={tp}"])
        dims = ParallelDims.from_config(c2.parallel, c2.model, 8, tp_supported=True)
        acts[tp] = stage_activations(c2.model, dims, seq_length=T, micro_batch_size=1, precision="bf16")
    assert acts[2][0].gpu == pytest.approx(acts[1][0].gpu / 2)


def test_the_planner_lays_out_tp_with_ep_over_tp_x_dp_and_k2_train_refuses_tp():
    """Expert TP 1: EP may span the TP x DP ranks (8 GPUs, TP2: DP4, EP8, one replica of each expert);
    k2-train refuses TP > 1 in one line saying k2-plan plans it."""
    cfg = load_config(["model=k2_tiny", "parallel.tp=2", "parallel.ep=8"])
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, 8, tp_supported=True)
    assert (dims.tp, dims.dp, dims.ep, dims.expert_dp) == (2, 4, 8, 1)
    with pytest.raises(ConfigError) as e:
        ParallelDims.from_config(cfg.parallel, cfg.model, 8)
    assert "\n" not in str(e.value) and "k2-train" in str(e.value) and "allowed parallel.tp: 1" in str(e.value)


def test_an_nvl72_rack_keeps_ep64_on_nvlink_where_an_hgx_node_does_not():
    """EP64 on GB200 NVL72: every EP rank in the 72-GPU NVLink domain, no byte on the network; on B200 nodes
    (8 per NVLink domain) 56/64 of the copies cross the network. A 64-rank group stays in the rack."""
    gb, b = load_profile("gb200_nvl72"), load_profile("b200")
    rack = ep_alltoall(T, 8, 7168, 64, gb, bytes_per_element=2)
    hgx = ep_alltoall(T, 8, 7168, 64, b, bytes_per_element=2)
    assert rack.inter_bytes == 0 and rack.intra_bytes == pytest.approx(T * 8 * 63 / 64 * 7168 * 2)
    assert hgx.inter_bytes == pytest.approx(T * 8 * 56 / 64 * 7168 * 2)
    assert rack.seconds == pytest.approx(rack.intra_bytes / 720e9) and rack.seconds < hgx.seconds / 5
    assert not crosses_nodes(64, gb) and crosses_nodes(64, b) and crosses_nodes(73, gb)


def test_megatron_module_recompute_sites_add_their_forward_to_the_backward():
    """core_attn re-runs core attention's forward; mlp a dense layer's MLP forward (its TP collectives too);
    moe a MoE layer's forward, all-to-alls included."""
    base, attn, mlp, moe = (_tiny(2, recompute=r) for r in ((), ("core_attn",), ("mlp",), ("moe",)))
    dense0 = base.layer_nodes(0)
    assert attn.layer_nodes(0)["attn"]["B"]["recompute"] == pytest.approx(dense0["attn"]["F"]["attention"])
    assert mlp.layer_nodes(0)["mlp"]["B"]["recompute"] == pytest.approx(
        sum(v for k, v in dense0["mlp"]["F"].items()), rel=0.05
    )  # (the non-GEMM floor apart)
    moe1 = moe.layer_nodes(1)
    a2a = sum(moe1[n]["F"]["ep_comm"] for n in ("dispatch", "combine"))
    assert moe1["mlp"]["B"]["recompute"] > a2a + moe1["mlp"]["F"]["gemm"]


def test_k2_train_refuses_the_module_recompute_sites_in_one_line():
    from k2.model.backends import check_recompute_sites

    for overrides in (["memory.recompute=[layernorm,moe]"], ["schedule.phases.1.memory.recompute=[core_attn]"]):
        with pytest.raises(ConfigError) as e:
            check_recompute_sites(load_config(overrides))
        msg = str(e.value)
        assert "\n" not in msg and "k2-train does not run yet" in msg and "allowed for k2-train" in msg
    check_recompute_sites(load_config(["memory.recompute=[layernorm,mla_up_proj]"]))
