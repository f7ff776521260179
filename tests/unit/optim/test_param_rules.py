"""Moonshot's parameter rules (optim/params.py, optim/build.py), read from the optimizer megatron built.

Reference (Moonlight ``examples/toy_train.py``; "Muon is Scalable", arXiv 2502.16982, appendix D): every
parameter with ndim >= 2 except the token embedding and the output head is trained by Muon -- the MoE
router weight included -- and every parameter gets decoupled weight decay, RMSNorm weights included.
The settings ``optim.router_optimizer=adamw`` / ``optim.decay_all_params=false`` give the other rule
(megatron's default weight-decay skip), so each assertion is checked against its counter-case.
"""

from __future__ import annotations

import pytest

from k2.optim.build import leaf_optimizers
from k2.optim.muon import K2Muon
from k2.optim.params import format_route_table, route_table, tag_parameters
from k2.schedules.lr import TokenLRScheduler
from k2.schedules.resolve import resolve_schedule
from support.helpers import build_one_rank

ROUTER = "decoder.layers.1.mlp.router.weight"
NORMS = (
    "decoder.final_layernorm.weight",
    "decoder.layers.0.input_layernorm.weight",
    "decoder.layers.1.self_attention.kv_layernorm.weight",
)


def _groups_of(optimizer, chunks) -> dict:
    """Parameter name -> (torch optimizer stepping it, its param group), found by identity in the param
    groups of every leaf optimizer (a parameter, or the fp32 master copy megatron made of it)."""
    where = {}
    for leaf in leaf_optimizers(optimizer):
        for group in leaf.optimizer.param_groups:
            for q in group["params"]:
                where[id(q)] = (leaf.optimizer, group)
    out = {}
    for name, p in chunks[0].named_parameters():
        main = getattr(p, "main_param", None)
        hit = where.get(id(main)) if main is not None else None
        out[name] = hit or where.get(id(p))
    return out


@pytest.mark.parametrize("k2_rules", [True, False])
def test_router_to_muon_and_every_parameter_decayed(megatron_world1, k2_rules):
    """K2 default: the router weight sits in K2Muon's groups, and after the scheduler has set the step's
    weight decay every group holding a norm weight decays by schedule.weight_decay. Counter-case: the
    router in AdamW (torch's), norm weights with wd 0 (megatron's default)."""
    extra = [] if k2_rules else ["optim.router_optimizer=adamw", "optim.decay_all_params=false"]
    cfg, chunks, _, optimizer = build_one_rank(
        ["optim=muonclip", "train.precision=bf16", "model.first_k_dense_replace=1", *extra]
    )
    TokenLRScheduler(resolve_schedule(cfg), optimizer)  # sets lr and weight_decay as the trainer does
    wd = resolve_schedule(cfg).weight_decay
    assert wd > 0
    groups = _groups_of(optimizer, chunks)
    assert all(g is not None for g in groups.values())  # every trainable parameter is in some group
    router_opt, _ = groups[ROUTER]
    assert isinstance(router_opt, K2Muon) is k2_rules
    for name in NORMS:
        opt, group = groups[name]
        assert not isinstance(opt, K2Muon)
        assert group["weight_decay"] == pytest.approx(wd if k2_rules else 0.0), name
    if k2_rules:  # every parameter decayed, Muon and AdamW groups alike
        assert {round(g["weight_decay"], 12) for _, g in groups.values()} == {round(wd, 12)}


def test_optimizer_table_shows_both_rules(megatron_world1):
    """optimizer_params.txt's text (format_route_table): the router row says muon, norm rows wd yes."""
    cfg, chunks, _, _ = build_one_rank(["optim=muonclip", "model.first_k_dense_replace=1"])
    from k2.model.build import transformer_config
    from k2.parallel.dims import ParallelDims

    tcfg = transformer_config(cfg, ParallelDims.from_config(cfg.parallel, cfg.model, 1))
    rows = route_table(tag_parameters(chunks, tcfg, muon=True, zero1_muon=True))
    by = {r["params"]: r for r in rows}
    router = by["decoder.layers.*.mlp.router.weight"]
    assert (router["optimizer"], router["rule"], router["weight_decay"]) == ("muon", "router", True)
    assert by["decoder.final_layernorm.weight"]["weight_decay"] is True
    text = format_route_table(rows).splitlines()
    line = next(x for x in text if x.startswith("decoder.layers.*.mlp.router.weight"))
    assert line.split()[3] == "muon" and line.split()[-1] == "yes"
    norm = next(x for x in text if x.startswith("decoder.final_layernorm.weight"))
    assert norm.split()[3] == "adamw" and norm.split()[-1] == "yes"
    off = route_table(
        tag_parameters(chunks, tcfg, muon=True, zero1_muon=True, router_optimizer="adamw", decay_all_params=False)
    )
    by_off = {r["params"]: r for r in off}
    assert by_off["decoder.layers.*.mlp.router.weight"]["optimizer"] == "adamw"
    assert by_off["decoder.final_layernorm.weight"]["weight_decay"] is False


def test_megatron_builds_torch_adamw_even_where_transformer_engine_is_installed(megatron_world1, monkeypatch):
    """With Transformer Engine or Apex installed, megatron-core 0.19.2 sets its Adam to their ``FusedAdam``
    at import (``USING_PYTORCH_OPTIMIZER = False``; the distributed optimizer's ``HAVE_APEX_OR_TE``), which
    our checkpoint handling was not written for. Seam: those module settings as the import leaves them
    with TE, and a stand-in ``FusedAdam``: the optimizer built is still torch's AdamW, on megatron's torch
    path, for AdamW and for MuonClip's AdamW part."""
    import megatron.core.optimizer as mcore_optimizer
    import torch
    from megatron.core.optimizer import distrib_optimizer

    class FusedAdam(torch.optim.Optimizer):  # TE's signature: adam_w_mode instead of a class per mode
        def __init__(self, params, lr, weight_decay, betas, eps, capturable=False, adam_w_mode=True):
            super().__init__(params, dict(lr=lr, weight_decay=weight_decay))

    monkeypatch.setattr(mcore_optimizer, "Adam", FusedAdam)
    monkeypatch.setattr(mcore_optimizer, "USING_PYTORCH_OPTIMIZER", False)
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
    monkeypatch.setattr(distrib_optimizer, "USING_TE_OPTIMIZER", True)
    for optim in ("adamw", "muonclip"):
        _, _, _, optimizer = build_one_rank([f"optim={optim}"])
        inner = {type(leaf.optimizer) for leaf in leaf_optimizers(optimizer)}
        assert torch.optim.AdamW in inner and FusedAdam not in inner, (optim, inner)
        assert distrib_optimizer.HAVE_APEX_OR_TE is False
