"""Sparsity sweep: one command runs every point, a re-run finishes only the missing work, the
report compares FLOPs to a validation-loss target; bad sweeps are refused before anything runs."""

from __future__ import annotations

import pytest


def test_points_derive_experts_and_keep_gemm_flops_equal():
    from k2.config.load import load_config
    from k2.launcher.tools.sweep import gemm_flops_per_token, sweep_points
    from k2.model.flops import flops_per_token
    from k2.model.params import count_params

    cfg, points = sweep_points(["+experiment=sparsity_sweep", "sweep.sparsities=[2,4,8]"])
    assert [(p.sparsity, p.experts) for p in points] == [(2, 4), (4, 8), (8, 16)]
    assert len({p.run_dir for p in points}) == 3
    cfgs = [load_config(list(p.overrides)) for p in points]
    for c in cfgs:  # only the expert count differs from the base
        assert c.model.moe_ffn_hidden_size == cfg.model.moe_ffn_hidden_size
        assert c.model.moe_shared_expert_intermediate_size == cfg.model.moe_shared_expert_intermediate_size
        assert c.run.wandb.group == "sparsity_sweep"
    # activated parameters and GEMM FLOPs per token equal; total parameters and the router grow with E
    params = [count_params(c) for c in cfgs]
    assert len({p.active - p.router * p.moe_pattern.count(1) for p in params}) == 1, [p.as_dict() for p in params]
    assert params[0].total < params[1].total < params[2].total
    assert len({gemm_flops_per_token(c.model, 128) for c in cfgs}) == 1
    routers = [flops_per_token(c.model, 128).terms()["router"] for c in cfgs]
    assert routers[0] < routers[1] < routers[2]


@pytest.mark.parametrize("bad,named", [
    (["model.moe_router_topk=3", "sweep.sparsities=[1,2]"], "sparsity=1 (model.num_moe_experts=3"),  # EP=2
    (["sweep.sparsities=[2,2]"], "sweep.sparsities"),
    (["sweep.sparsities=[]"], "sweep.sparsities"),
])
def test_bad_sweep_is_refused_before_anything_runs(tmp_path, no_process_start, capsys, bad, named):
    from k2.launcher.train import main

    rc = main(["-m", "+experiment=sparsity_sweep", f"sweep.dir={tmp_path / 'sweep'}", *bad])
    err = capsys.readouterr().err
    assert rc == 2 and named in err and err.count("\n") == 1, err
    assert no_process_start == [] and not (tmp_path / "sweep").exists()


