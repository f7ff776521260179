"""QK-Clip (optim/qk_clip.py): per-head clip factors, the MLA and MHA/GQA weight rules, master copies."""

from __future__ import annotations

import math

import pytest
import torch

from k2.optim.qk_clip import QKClip, clip_factors, mla_row_scales, qkv_row_scales
from support.helpers import build_one_rank


def test_clip_factors_leave_small_negative_and_empty_heads_alone():
    s = torch.tensor([-5.0, 0.0, float("-inf"), 50.0, 100.0, 200.0, 400.0])
    g = clip_factors(s, 100.0)
    assert g.tolist() == [1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.25]
    assert not torch.isnan(clip_factors(torch.tensor([float("nan"), -1e30]), 100.0)).any()


def _attn(chunk, layer: int):
    return chunk.decoder.layers[layer].self_attention


def _forward(model, tokens):
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        model[0](tokens, pos, None)


def test_mla_clip_brings_clipped_heads_to_tau_and_leaves_others(megatron_world1):
    """One layer (a clipped layer changes the input of the layers after it): re-running the batch gives
    max logit tau for every clipped head and the same logits for the others."""
    cfg, chunks, model, optimizer = build_one_rank(["optim=muonclip"], layers=1)
    model[0].train()
    a = _attn(chunks[0], 0)
    a.linear_q_up_proj.weight.data.mul_(40.0)  # large logits
    a.linear_kv_up_proj.weight.data.mul_(40.0)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    _forward(model, tokens)
    before = a.core_attention.max_logits.clone()
    tau = float(before.sort().values[1])  # heads above the second-smallest are clipped
    kv_down = a.linear_kv_down_proj.weight.detach().clone()
    stats = QKClip(model, optimizer, tau, num_layers=1).step()
    clipped = before > tau
    assert stats["qk_clipped_heads"] == int(clipped.sum()) > 0
    assert stats["max_attn_logit"] == pytest.approx(before.max().item())
    assert stats["max_attn_logit_per_layer"] == pytest.approx([before.max().item()])
    assert torch.isinf(a.core_attention.max_logits).all()  # window reset
    _forward(model, tokens)  # the same batch again
    after = a.core_attention.max_logits.clone()
    assert (after[clipped] <= tau + 1e-3).all(), (after[clipped], tau)
    torch.testing.assert_close(after[clipped], torch.full_like(after[clipped], tau), rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(after[~clipped], before[~clipped], rtol=1e-5, atol=1e-5)
    assert torch.equal(a.linear_kv_down_proj.weight, kv_down)  # shared k_R untouched


def test_mla_rule_per_row_and_negative_head_untouched(megatron_world1):
    """Injected max logits [-5, 0, 150, 50], tau 100: only head 2 changes, by sqrt(g) on q_nope/k_nope
    rows and g on q_rope rows (g = 2/3); value rows, kv_down and the other heads are bit-identical."""
    cfg, chunks, model, optimizer = build_one_rank(["optim=muonclip"])
    m = cfg.model
    a = _attn(chunks[0], 1)
    q0, kv0 = a.linear_q_up_proj.weight.detach().clone(), a.linear_kv_up_proj.weight.detach().clone()
    a.core_attention.max_logits.copy_(torch.tensor([-5.0, 0.0, 150.0, 50.0]))
    stats = QKClip(model, optimizer, 100.0, num_layers=2).step()
    assert stats["qk_clipped_heads"] == 1 and stats["max_attn_logit_per_layer"][0] is None
    g = 100.0 / 150.0
    qh, kvh = m.qk_head_dim + m.qk_pos_emb_head_dim, m.qk_head_dim + m.v_head_dim
    q1, kv1 = a.linear_q_up_proj.weight.detach(), a.linear_kv_up_proj.weight.detach()
    assert not torch.isnan(q1).any() and not torch.isnan(kv1).any()
    for h in (0, 1, 3):
        assert torch.equal(q1[h * qh : (h + 1) * qh], q0[h * qh : (h + 1) * qh])
        assert torch.equal(kv1[h * kvh : (h + 1) * kvh], kv0[h * kvh : (h + 1) * kvh])
    q_nope = slice(2 * qh, 2 * qh + m.qk_head_dim)
    q_rope = slice(2 * qh + m.qk_head_dim, 3 * qh)
    torch.testing.assert_close(q1[q_nope], q0[q_nope] * math.sqrt(g))
    torch.testing.assert_close(q1[q_rope], q0[q_rope] * g)
    k_nope, v_rows = slice(2 * kvh, 2 * kvh + m.qk_head_dim), slice(2 * kvh + m.qk_head_dim, 3 * kvh)
    torch.testing.assert_close(kv1[k_nope], kv0[k_nope] * math.sqrt(g))
    assert torch.equal(kv1[v_rows], kv0[v_rows])


@pytest.mark.parametrize("optim,zero1", [("muonclip", "byte_range"), ("muonclip", "layer_wise"), ("adamw", "-")])
def test_master_copies_scaled_too(megatron_world1, optim, zero1):
    """bf16 weights: the fp32 master copy the optimizer steps is scaled with the weight -- whole copies
    (MuonClip, layer-wise ZeRO-1) and the distributed optimizer's flat shard (AdamW, byte-range MuonClip)."""
    extra = [f"optim.muon_zero1={zero1}"] if optim == "muonclip" else []
    cfg, chunks, model, optimizer = build_one_rank([f"optim={optim}", "train.precision=bf16", *extra])
    a = _attn(chunks[0], 0)
    w = a.linear_kv_up_proj.weight
    main = w.main_param
    assert main is not None and main.dtype == torch.float32 and main.data_ptr() != w.data_ptr()
    assert getattr(w, "main_param_sharded", False) == (zero1 != "layer_wise")
    w0, main0 = w.detach().float().clone(), main.detach().clone()
    a.core_attention.max_logits.copy_(torch.tensor([400.0, 1.0, 1.0, 1.0]))
    QKClip(model, optimizer, 100.0, num_layers=2).step()
    _, rows = mla_row_scales(
        torch.tensor([0.25, 1.0, 1.0, 1.0]), cfg.model.qk_head_dim, cfg.model.qk_pos_emb_head_dim, cfg.model.v_head_dim
    )
    want = w0 * rows.view(-1, 1)
    torch.testing.assert_close(main.view(-1), want.view(-1)[: main.numel()], rtol=1e-6, atol=0)
    torch.testing.assert_close(w.detach().float(), want.to(torch.bfloat16).float())
    assert not torch.equal(main0, main.detach())


def _gqa_logits(x, w_qkv, groups, heads, d):
    """Plain-torch per-head max of q.k / sqrt(d) for megatron's fused linear_qkv layout."""
    r = heads // groups
    qkv = (x @ w_qkv.T).view(x.shape[0], groups, r + 2, d)
    q = qkv[:, :, :r].reshape(x.shape[0], heads, d)
    k = qkv[:, :, r].repeat_interleave(r, dim=1)
    return torch.einsum("ihd,jhd->hij", q, k).amax(dim=(1, 2)) / math.sqrt(d)


@pytest.mark.parametrize("groups", [4, 2], ids=["mha", "gqa"])
def test_mha_gqa_rule_brings_each_head_to_tau(groups):
    heads, d, hidden = 4, 8, 16
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(32, hidden, generator=gen)
    w = torch.randn(groups * (heads // groups + 2) * d, hidden, generator=gen)
    before = _gqa_logits(x, w, groups, heads, d)
    tau = float(before.sort().values[1])  # heads above the second-smallest are clipped
    rows = qkv_row_scales(clip_factors(before, tau), groups, d)
    after = _gqa_logits(x, w * rows.view(-1, 1), groups, heads, d)
    clipped = before > tau
    torch.testing.assert_close(after[clipped], torch.full_like(after[clipped], tau), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(after[~clipped], before[~clipped], rtol=1e-5, atol=1e-5)
    if groups == heads:  # MHA: K2's rule, sqrt(gamma) on W_q and W_k of the head
        g = clip_factors(before, tau).sqrt()
        per = rows.view(heads, 3, d)
        torch.testing.assert_close(per[:, 0, 0], g)
        torch.testing.assert_close(per[:, 1, 0], g)
        assert torch.equal(per[:, 2], torch.ones(heads, d))


def test_k2_routing_and_matrix_splits(megatron_world1):
    """Which parameter goes where (optim/params.py) on k2_tiny with MoE layers, and the fused-weight split
    reaching the fp32 master copy that megatron's bf16 optimizer actually steps."""
    from k2.optim.muon import SPLIT_ATTR, MatrixSplit
    from k2.optim.params import ROUTE_ATTR

    cfg, chunks, model, optimizer = build_one_rank(
        ["optim=muonclip", "train.precision=bf16", "model.first_k_dense_replace=1"]
    )
    params = dict(chunks[0].named_parameters())
    route = {n: getattr(p, ROUTE_ATTR) for n, p in params.items()}
    adamw = {n for n, r in route.items() if r == "adamw"}
    assert {
        "embedding.word_embeddings.weight",
        "output_layer.weight",
        "decoder.final_layernorm.weight",
        "decoder.layers.0.self_attention.q_layernorm.weight",
    } <= adamw
    assert route["decoder.layers.1.mlp.router.weight"] == "muon"  # Moonlight's rule (optim.router_optimizer)
    assert all(params[n].dim() == 1 for n in adamw if "embedding" not in n and "output" not in n)
    for n in ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"):
        assert route[f"decoder.layers.0.self_attention.{n}.weight"] == "muon"
        assert not hasattr(params[f"decoder.layers.0.self_attention.{n}.weight"], SPLIT_ATTR)  # one matrix
    ffn = cfg.model.moe_ffn_hidden_size
    for e in range(cfg.model.num_moe_experts):  # each expert its own parameters, gate/up split
        fc1 = params[f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.weight"]
        assert route[f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.weight"] == "muon"
        assert getattr(fc1, SPLIT_ATTR) == MatrixSplit(1, (ffn, ffn))
        assert fc1.main_param is not fc1 and getattr(fc1.main_param, SPLIT_ATTR) == MatrixSplit(1, (ffn, ffn))
    dense = params["decoder.layers.0.mlp.linear_fc1.weight"]
    half = cfg.model.ffn_hidden_size
    assert getattr(dense.main_param, SPLIT_ATTR) == MatrixSplit(1, (half, half))
