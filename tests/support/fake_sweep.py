"""A sparsity sweep grid written as the grid runner writes it (grid.json, per cell config.yaml,
metrics.jsonl, branch.json, cell.json), with made-up metrics and no training: what the tests of
``k2-sweep-report`` read. The final validation loss of each cell comes from a function of its training FLOPs
(computed here with :mod:`k2.model.flops`, as the report does), so a test can draw the results from known
power laws."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from omegaconf import OmegaConf

TOPK = 2
#: tokens per step and context length of the fake runs: every step at SEQ tokens per sequence
STEP_TOKENS, SEQ = 1024, 128
WARMUP_STEPS = 2


def model_config(experts: int):
    """k2_tiny's resolved config with ``experts`` routed experts at top-2 (the dense arm: experts = 2)."""
    from k2.config.load import load_config

    cfg = OmegaConf.create(OmegaConf.to_container(load_config(["model=k2_tiny"]), resolve=True))
    cfg.model.num_moe_experts = experts
    cfg.model.moe_router_topk = TOPK
    return cfg


def cell_name(arm: str, seed: int, budget: int) -> str:
    return f"{arm}/seed_{seed}/budget_{budget}"


def write_grid(
    sweep_dir: Path,
    sparsities: list[int],
    seeds: list[int],
    budget_steps: list[int],
    final_loss: Callable[[str, int, int, float], float],
    *,
    load: Callable | None = None,
    reference: str = "sparsity_1",
    collapsed_load: float = 2.0,
) -> dict:
    """Write a finished grid: arms ``sparsity_<S>`` (experts = S x 2), one trunk per (arm, seed), one branch
    per budget (``budget_steps`` steps of :data:`STEP_TOKENS`; the branch point at 80% of it).

    Args:
        final_loss: ``(arm, seed, budget_tokens, training FLOPs) -> the last val_loss``.
        load: ``(arm, seed, budget_tokens) -> moe_load_max_over_mean`` after warm-up (default 1.2).

    Returns:
        ``{cell name: {"flops", "loss", "run_dir"}}``.
    """
    from k2.model.flops import flops_per_token

    cells, out = [], {}
    for s in sparsities:
        arm, cfg = f"sparsity_{s}", model_config(s * TOPK)
        per_token, text = flops_per_token(cfg.model, SEQ).training, OmegaConf.to_yaml(cfg)
        for seed in seeds:
            for steps in budget_steps:
                budget = steps * STEP_TOKENS
                name, branch = cell_name(arm, seed, budget), int(steps * 0.8)
                flops = per_token * budget
                loss = final_loss(arm, seed, budget, flops)
                lv = load(arm, seed, budget) if load else 1.2
                write_cell(sweep_dir / name, text, steps, branch, loss, lv)
                cells.append(
                    {
                        "cell": name,
                        "arm": arm,
                        "sparsity": s,
                        "experts": s * TOPK,
                        "size": None,
                        "seed": seed,
                        "budget_tokens": budget,
                        "branch_step": branch,
                        "trunk_dir": f"{arm}/seed_{seed}/trunk",
                        "run_dir": name,
                    }
                )
                out[name] = {"flops": flops, "loss": loss, "run_dir": sweep_dir / name}
    grid = {
        "name": "fake_sweep",
        "topk": TOPK,
        "reference_arm": reference,
        "cooldown": {"style": "minus_sqrt", "fraction": 0.2},
        "collapsed_load": collapsed_load,
        "warmup_steps": WARMUP_STEPS,
        "cells": cells,
    }
    (sweep_dir / "grid.json").write_text(json.dumps(grid, indent=1))
    return out


def write_cell(
    run_dir: Path, cfg, steps: int, branch_step: int, final_loss: float, load: float, finished: bool = True
) -> None:
    """One cell's run dir: a step-0 evaluation, ``steps`` training records (val_loss every 4 steps, above
    the final loss as a constant-LR trunk is, and the final loss at the last step). ``cfg``: a config or
    its YAML text."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(cfg if isinstance(cfg, str) else OmegaConf.to_yaml(cfg))
    recs = [{"step": 0, "consumed_tokens": 0, "seq_length": SEQ, "val_loss": 8.3}]
    for i in range(1, steps + 1):
        rec = {
            "step": i,
            "consumed_tokens": i * STEP_TOKENS,
            "seq_length": SEQ,
            "lr": 1e-3,
            "loss": 6.0,
            "tokens_per_s": 1000.0 + i,
            "step_time_s": 1.0,
            "moe_load_max_over_mean": 3.9 if i <= WARMUP_STEPS else load,
        }
        if i % 4 == 0 or i == steps:
            rec["val_loss"] = final_loss if i == steps else final_loss + 0.05 * (steps - i) / steps + 0.02
        recs.append(rec)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run_dir / "branch.json").write_text(
        json.dumps(
            {
                "trunk_dir": "trunk",
                "trunk_step": branch_step,
                "budget_tokens": steps * STEP_TOKENS,
                "cooldown": {"style": "minus_sqrt", "fraction": 0.2},
            }
        )
    )
    if finished:
        (run_dir / "cell.json").write_text(
            json.dumps(
                {
                    "status": "finished",
                    "wall_clock_s": 10.0 * steps,
                    "trunk_wall_clock_s": 8.0 * steps,
                    "peak_rss_bytes": 2**30,
                    "final_val_loss": final_loss,
                    "tokens": steps * STEP_TOKENS,
                }
            )
        )


def fake_params(cfg) -> tuple[int, int]:
    """A stand-in for :func:`k2.model.params.count_params` (which imports megatron-core): (total, active)."""
    e = int(cfg.model.num_moe_experts)
    return 1_000_000 + 50_000 * e, 1_100_000
