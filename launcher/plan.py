"""``k2-plan``: parameter counts and pipeline layout of a model on a cluster, without a GPU or a process group.

Example::

    k2-plan model=kimi_k2 parallel=k2_256gpu cluster.nodes=32 cluster.gpus_per_node=8 output=json

World size = ``cluster.nodes * cluster.gpus_per_node``. The layout (which global 0-based decoder layers
each ``[pp_rank][vpp_stage]`` builds, which stage holds the embedding / the loss) comes from
:class:`parallel.dims.ParallelDims` (megatron-core 0.19.2's placement, checked in ``tests/test_dims.py``).
Parameter counts come from :func:`model.params.count_params`: the real megatron modules of ``k2-train``
built on the meta device (one dense + one MoE layer at full width, multiplied by the layer counts); its
docstring lists exactly what is counted.

Output (``output=json``: one JSON object on stdout; ``output=text``, the default: the same as tables):

* ``params_total``, ``params_active`` (per token), ``params`` (per component, see ``ModelParams.as_dict``);
* ``world_size``, ``nodes``, ``gpus_per_node``, ``tp``, ``pp``, ``vpp``, ``ep``, ``dp``, ``expert_dp``;
* ``layout[pp_rank][vpp_stage]`` = list of global layer indices; ``embedding_stage`` / ``loss_stage``;
* ``stages``: per virtual stage (pipeline order ``vpp_stage * pp + pp_rank``) its layers and parameters
  (all experts of the stage, i.e. summed over its EP group);
* ``pp_ranks``: per PP rank its layers, ``params`` (all experts), ``params_per_gpu`` (routed experts
  divided over EP, TP = 1), ``bf16_param_bytes_per_gpu`` (2 B/param) and ``fp32_grad_bytes_per_gpu``
  (4 B/param, megatron's fp32 gradient-accumulation buffer);
* ``bf16_param_bytes_total`` and ``param_and_grad_bytes_total`` (bf16 params + fp32 grads = 6 B/param;
  REFERENCE.md "Training system": ~6 TB for K2 over 256 GPUs);
* ``schedule``: the training schedule (``schedule=...``, :meth:`schedules.wsd.Schedule.as_dict`): per
  phase its nominal token range, the steps it runs and the exact token counts its boundaries land on
  (rounding rule in ``schedules/wsd.py``), the LR at each boundary, seq_length, global batch in sequences
  and microbatches per DP rank on this cluster;
* ``lr_at_tokens`` (only with ``plan.query_tokens=[t1,t2,...]``): the LR after each of those token counts,
  in order.

``plot=PATH.png`` also writes a picture of the schedule (LR and context length over tokens, phase
boundaries; :func:`schedules.plot.plot_schedule`).

Errors: an invalid setting (``ConfigError``: unknown key, world size not divisible by ``parallel.pp``,
experts not divisible by ``parallel.ep``, a bad ``parallel.layout``, ...) prints ``k2-plan: error: ...``
to stderr and exits with status 2.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from launcher.config import ConfigError, load_config

_WORLD_FROM = "cluster.nodes x cluster.gpus_per_node"
_OUTPUTS = ("text", "json")


def _world_size(cfg) -> int:
    nodes, gpn = cfg.cluster.nodes, cfg.cluster.gpus_per_node
    for key, value in (("cluster.nodes", nodes), ("cluster.gpus_per_node", gpn)):
        if value < 1:
            raise ConfigError(f"{key}={value} must be an integer >= 1")
    return nodes * gpn


def _query_tokens(cfg) -> list | None:
    from omegaconf import ListConfig, OmegaConf

    q = cfg.plan.query_tokens
    if q is None:
        return None
    return OmegaConf.to_container(q) if isinstance(q, ListConfig) else [q]


def make_plan(cfg) -> dict[str, Any]:
    """The plan of ``cfg`` as a JSON-ready dict (keys listed in the module docstring).

    Raises:
        ConfigError: invalid cluster / parallel / model / schedule settings, naming the setting.
    """
    from parallel.dims import ParallelDims
    from schedules.wsd import lr_at_tokens, resolve_schedule

    world = _world_size(cfg)
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, world, world_size_from=_WORLD_FROM)
    schedule = resolve_schedule(cfg, dims)
    query = _query_tokens(cfg)
    from model.params import count_params

    try:
        counts = count_params(cfg)
    except ValueError as e:  # e.g. model.first_k_dense_replace out of range
        raise ConfigError(str(e)) from None

    stages = []
    for v in range(dims.vpp):
        for r in range(dims.pp):
            layers = dims.layers(r, v)
            emb, loss = dims.stage_has_embedding(r, v), dims.stage_has_loss(r, v)
            stages.append(
                {
                    "virtual_stage": dims.virtual_stage(r, v),
                    "pp_rank": r,
                    "vpp_stage": v,
                    "layers": layers,
                    "num_moe_layers": sum(counts.moe_pattern[i] for i in layers),
                    "has_embedding": emb,
                    "has_loss": loss,
                    "params": counts.stage(layers, emb, loss),
                }
            )
    pp_ranks = []
    for r in range(dims.pp):
        layers = [i for v in range(dims.vpp) for i in dims.layout[r][v]]
        emb = any(dims.stage_has_embedding(r, v) for v in range(dims.vpp))
        loss = any(dims.stage_has_loss(r, v) for v in range(dims.vpp))
        per_gpu = counts.stage(layers, emb, loss, ep=dims.ep)
        pp_ranks.append(
            {
                "pp_rank": r,
                "layers": layers,
                "num_layers": len(layers),
                "has_embedding": emb,
                "has_loss": loss,
                "params": counts.stage(layers, emb, loss),
                "params_per_gpu": per_gpu,
                "bf16_param_bytes_per_gpu": 2 * per_gpu,
                "fp32_grad_bytes_per_gpu": 4 * per_gpu,
            }
        )
    last_v = dims.vpp - 1
    return {
        "model": cfg.model.name,
        "parallel": cfg.parallel.name,
        "world_size": dims.world_size,
        "nodes": cfg.cluster.nodes,
        "gpus_per_node": cfg.cluster.gpus_per_node,
        "tp": dims.tp,
        "pp": dims.pp,
        "vpp": dims.vpp,
        "ep": dims.ep,
        "dp": dims.dp,
        "expert_dp": dims.expert_dp,
        "num_layers": dims.num_layers,
        "params_total": counts.total,
        "params_active": counts.active,
        "params": counts.as_dict(),
        "megatron_layout": dims.megatron_layout,
        "layout": dims.layout,
        "embedding_stage": {"pp_rank": 0, "vpp_stage": 0},
        "loss_stage": {"pp_rank": dims.pp - 1, "vpp_stage": last_v},
        "stages": stages,
        "pp_ranks": pp_ranks,
        "max_params_per_gpu": max(p["params_per_gpu"] for p in pp_ranks),
        "bf16_param_bytes_total": 2 * counts.total,
        "param_and_grad_bytes_total": 6 * counts.total,
        "schedule": schedule.as_dict(),
        **({"lr_at_tokens": lr_at_tokens(schedule, query)} if query is not None else {}),
        "_schedule": schedule,  # for plot=; dropped from the JSON
    }


# ---------------------------------------------------------------------- text output


def _human(n: float, unit: str = "") -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B" if not unit else "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}"


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f}"


def _ranges(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out, start = [], None
    for k, i in enumerate(ids):
        if start is None:
            start = i
        if k + 1 == len(ids) or ids[k + 1] != i + 1:
            out.append(str(start) if start == i else f"{start}-{i}")
            start = None
    return ",".join(out)


def format_text(plan: dict[str, Any]) -> str:
    """Readable tables of :func:`make_plan`'s dict."""
    p = plan["params"]
    lines = [
        f"k2-plan: model={plan['model']} parallel={plan['parallel']} on {plan['nodes']} "
        f"node{'s' if plan['nodes'] != 1 else ''} x "
        f"{plan['gpus_per_node']} GPUs = {plan['world_size']} ranks",
        f"  tp {plan['tp']} x pp {plan['pp']} x dp {plan['dp']} (ep {plan['ep']} x expert-dp "
        f"{plan['expert_dp']}); vpp {plan['vpp']}; {plan['num_layers']} layers ({p['num_dense_layers']} "
        f"dense, {p['num_moe_layers']} MoE); layout {plan['megatron_layout'] or '(megatron default)'}",
        "",
        f"  params_total  {plan['params_total']:>20,}  ({_human(plan['params_total'])})",
        f"  params_active {plan['params_active']:>20,}  ({_human(plan['params_active'])} per token)",
        "",
        f"  {'component':<34}{'params each':>18}{'x count':>9}{'total':>20}",
    ]
    nd, nm = p["num_dense_layers"], p["num_moe_layers"]
    rows = [
        ("embedding", p["embedding"], 1),
        ("attention + input norm (per layer)", p["attention_per_layer"], plan["num_layers"]),
        ("pre-MLP norm (per layer)", p["mlp_norm_per_layer"], plan["num_layers"]),
        ("dense MLP (per dense layer)", p["dense_mlp_per_layer"], nd),
        ("router (per MoE layer)", p["router_per_moe_layer"], nm),
        (f"routed expert (x{p['num_experts']} per MoE layer)", p["routed_expert_each"],
         nm * p["num_experts"]),
        ("shared expert(s) (per MoE layer)", p["shared_experts_per_moe_layer"], nm),
        ("final norm", p["final_norm"], 1),
        ("output head", p["output_head"], 1),
    ]
    for name, each, count in rows:
        if count and (each or name in ("output head",)):
            lines.append(f"  {name:<34}{each:>18,}{count:>9,}{each * count:>20,}")
    lines += [
        "",
        f"  {'pp rank':<8}"
        + "".join(f"{'vpp ' + str(v):<14}" for v in range(plan["vpp"]))
        + f"{'params (stage)':>18}{'params/GPU':>16}{'bf16 GiB/GPU':>14}{'fp32 grad GiB':>16}",
    ]
    for r, rank in enumerate(plan["pp_ranks"]):
        cells = []
        for v in range(plan["vpp"]):
            ids = plan["layout"][r][v]
            parts = (["E"] if (r, v) == (0, 0) else []) + ([_ranges(ids)] if ids else [])
            if (r, v) == (plan["pp"] - 1, plan["vpp"] - 1):
                parts.append("L")
            cells.append(f"{' '.join(parts) or '-':<14}")
        lines.append(
            f"  {r:<8}" + "".join(cells) + f"{rank['params']:>18,}{rank['params_per_gpu']:>16,}"
            f"{_gib(rank['bf16_param_bytes_per_gpu']):>14}{_gib(rank['fp32_grad_bytes_per_gpu']):>16}"
        )
    lines += [
        "  (E = embedding, L = final norm + output head + loss; layers are global 0-based indices; "
        "params/GPU divides routed experts over ep)",
        "",
        f"  bf16 params {_human(plan['bf16_param_bytes_total'], 'B')}; bf16 params + fp32 grads "
        f"{_human(plan['param_and_grad_bytes_total'], 'B')} over {plan['world_size']} ranks",
        "",
        *format_schedule(plan["schedule"]),
    ]
    if "lr_at_tokens" in plan:
        lines += ["", "  lr_at_tokens: " + ", ".join(f"{x:.6g}" for x in plan["lr_at_tokens"])]
    return "\n".join(lines)


def format_schedule(s: dict[str, Any]) -> list[str]:
    """Text table of :meth:`schedules.wsd.Schedule.as_dict`."""
    B = s["global_batch_tokens"]
    lines = [
        f"  schedule {s['name']}: {s['total_steps']:,} steps x {B:,} tokens = {s['total_tokens_exact']:,} "
        f"tokens (nominal {s['total_tokens']:,}); weight decay {s['weight_decay']:g}",
        f"  {'phase':<14}{'style':<12}{'steps':>17}{'nominal tokens':>38}{'lands at (exact)':>38}"
        f"{'LR start -> end':>22}{'ctx':>8}{'seqs':>8}{'mb x n':>10}  rope",
    ]
    for p in s["phases"]:
        steps = f"{p['first_step']:,}-{p['last_step']:,}" if p["steps"] else "skipped"
        nmb = f"{p['micro_batch_size']} x {p['num_microbatches']}" if p["num_microbatches"] else "-"
        lines.append(
            f"  {p['name']:<14}{p['lr_style']:<12}{steps:>17}"
            f"{p['start_tokens']:>19,}{p['end_tokens']:>19,}"
            f"{p['start_tokens_exact']:>19,}{p['end_tokens_exact']:>19,}"
            f"{p['lr_at_start']:>11.3g}{p['lr_at_end']:>11.3g}{p['seq_length']:>8,}"
            f"{p['global_batch_size']:>8,}{nmb:>10}  {p['rope_type']}"
        )
    lines.append("  (a step belongs to the phase holding its first token: a boundary at T tokens lands after "
                 "step ceil(T / tokens per step); LR of step s = LR at s x tokens per step)")
    return lines


# ---------------------------------------------------------------------- entry points


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``k2-plan`` (Hydra overrides in ``argv``). Returns the exit status."""
    overrides = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(overrides)
        if cfg.output not in _OUTPUTS:
            raise ConfigError(f"output={cfg.output!r}; allowed: {', '.join(_OUTPUTS)}")
        plan = make_plan(cfg)
        schedule = plan.pop("_schedule")
        if cfg.plot:
            from schedules.plot import plot_schedule

            try:
                plot_schedule(schedule, cfg.plot)
            except OSError as e:
                raise ConfigError(f"plot={cfg.plot!r}: cannot write the picture ({e})") from None
            print(f"k2-plan: wrote {cfg.plot}", file=sys.stderr)
    except ConfigError as e:
        print(f"k2-plan: error: {e}", file=sys.stderr)
        return 2
    if cfg.output == "json":
        print(json.dumps(plan))
    else:
        print(format_text(plan))
    return 0


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
