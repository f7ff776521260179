"""The text tables of ``k2-plan`` (``output=text``) from the plan's JSON record."""

from __future__ import annotations

from typing import Any

from k2.launcher.planning.checkpoint import format_checkpoint
from k2.launcher.planning.ep_overlap import NOT_REQUESTED


def _human(n: float, unit: str = "") -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B" if not unit else "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}"


def _gib(nbytes: float) -> str:
    g = nbytes / 2**30
    return f"{g:.1f}" if g >= 10 or g == 0 else f"{g:.3g}"


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
    lines = [*(format_verdict(plan) if "verdict" in plan else format_summary(plan)), ""]
    if plan["cluster"].get("gpu_memory_assumed"):
        lines += [
            f"note: plan.hardware={plan['hardware']} gives no gpu_memory_gib: planned with "
            f"{plan['cluster']['gpu_memory_gib']:g} GiB per GPU (set cluster.gpu_memory_gib)",
            "",
        ]
    lines += [
        f"k2-plan: model={plan['model']} parallel={plan['parallel']} on {plan['nodes']} "
        f"node{'s' if plan['nodes'] != 1 else ''} x "
        f"{plan['gpus_per_node']} GPUs = {plan['world_size']} ranks{_domain_note(plan)}",
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
        (f"routed expert (x{p['num_experts']} per MoE layer)", p["routed_expert_each"], nm * p["num_experts"]),
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
        + f"{'params (stage)':>19}{'params/GPU':>19}{'bf16 GiB/GPU':>14}{'fp32 grad GiB':>16}",
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
            f"  {r:<8}" + "".join(cells) + f"{rank['params']:>19,}{rank['params_per_gpu']:>19,}"
            f"{_gib(rank['bf16_param_bytes_per_gpu']):>14}{_gib(rank['fp32_grad_bytes_per_gpu']):>16}"
        )
    lines += [
        "  (E = embedding, L = final norm + output head + loss; layers are global 0-based indices; "
        "params/GPU divides routed experts over ep)",
        "",
        f"  bf16 params {_human(plan['bf16_param_bytes_total'], 'B')}; bf16 params + fp32 grads "
        f"{_human(plan['param_and_grad_bytes_total'], 'B')} over {plan['world_size']} ranks",
        "",
        *format_cluster(plan),
        "",
        *format_schedule(plan["schedule"]),
    ]
    if "lr_at_tokens" in plan:
        lines += ["", "  lr_at_tokens: " + ", ".join(f"{x:.6g}" for x in plan["lr_at_tokens"])]
    if "search" in plan:
        lines += ["", *format_search(plan["search"], plan["gpu_memory_bytes"])]
    return "\n".join(lines)


def format_cluster(plan: dict[str, Any]) -> list[str]:
    """Cluster, FLOPs, pipeline bubble and memory per GPU of :func:`make_plan`'s dict, as text."""
    c, g, f = plan["cluster"], plan["model_parallel_group"], plan["flops"]
    terms = f["forward_terms_per_token"]
    names = {
        "mla_projections": "MLA proj",
        "core_attention": "core attn",
        "dense_mlp": "dense FFN",
        "router": "router",
        "routed_experts": "routed experts",
        "shared_experts": "shared expert",
        "lm_head": "LM head",
    }
    pipe = plan["pipeline"]
    lines = [
        f"  cluster: {c['nodes']} node{'s' if c['nodes'] != 1 else ''} x {c['gpus_per_node']} GPUs, "
        f"{c['gpu_memory_gib']:g} GiB and "
        f"{c['peak_tflops']:g} TFLOP/s (BF16 peak) each; model-parallel group {g['shape']} = {g['gpus']} GPUs "
        f"= {g['nodes']:g} node{'s' if g['nodes'] != 1 else ''}, "
        f"{g['replicas']} replica{'s' if g['replicas'] != 1 else ''} (DP {plan['dp']}); "
        f"the group is reused for any node count that is a multiple of {g['nodes']:g}",
        f"  FLOPs per token (phase {f['phase']}, {f['seq_length']:,}-token sequences): forward "
        f"{_human(f['forward_per_token'])} = "
        + " + ".join(f"{names[k]} {_human(v)}" for k, v in terms.items() if v)
        + f"; training (3x) {_human(plan['flops_per_token'])}; one step of {plan['global_batch_tokens']:,} "
        f"tokens = {f['step_flops']:.4g} FLOPs",
        f"  pipeline ({'interleaved ' if plan['vpp'] > 1 else ''}1F1B{', B/W split' if pipe['decouple_wgrad'] else ''}"
        f"{', EP overlap: combined 1F1B' if plan.get('ep_overlap') else ''},"
        f" phase {pipe['phase']}): pp {plan['pp']} x vpp {plan['vpp']}, {plan['num_microbatches']:,} microbatches "
        f"of {plan['micro_batch_size']} x {plan['seq_length']:,} tokens per DP rank: bubble "
        f"{100 * plan['bubble_fraction']:.2f}% (idle / busy over the PP ranks)",
        *format_step_time(plan),
    ]
    if "mfu" in plan:
        lines.append(
            f"  measured step {plan['step_time_s']:g} s: {plan['model_tflops_per_gpu']:.1f} model TFLOP/s "
            f"per GPU, MFU {100 * plan['mfu']:.1f}%"
        )
    m = plan["memory_per_gpu_bytes"]
    lines += [
        "",
        f"  memory per GPU, GiB (phase {m['phase']}, {m['seq_length']:,}-token sequences: the fullest; "
        "the fullest DP rank of each PP rank; + host = offloaded to CPU memory; mb in flight = the number "
        "of microbatches whose activations are held at the peak, a count; transient = the largest "
        "short-lived buffer of a layer: the max-logit pass's score block or the grouped GEMM's stacked "
        "expert weights; reserved = CUDA context, NCCL buffers, workspaces and allocator fragmentation, "
        "plan.gpu_overheads)",
        f"  {'pp rank':<8}{'params':>9}{'grads':>9}{'optimizer':>11}{'+ host':>9}{'activations':>13}"
        f"{'+ host':>9}{'mb in flight':>14}{'transient':>11}{'reserved':>10}{'total':>9}",
    ]
    for r in plan["pp_ranks"]:
        x = r["memory_bytes"]
        lines.append(
            f"  {r['pp_rank']:<8}{_gib(x['params']):>9}{_gib(x['grads']):>9}{_gib(x['optimizer']):>11}"
            f"{_gib(x['optimizer_offloaded_to_host']):>9}{_gib(x['activations']):>13}"
            f"{_gib(x['activations_offloaded_to_host_peak']):>9}{x['microbatches_in_flight']:>14}"
            f"{_gib(x['transient']):>11}{_gib(x['reserved']):>10}{_gib(x['total']):>9}"
        )
    lines.append(f"  fullest GPU (pp rank {m['pp_rank']}): {_gib(m['total'])} GiB of {c['gpu_memory_gib']:g} GiB")
    if "cuda_alloc_conf" in plan:
        conf = plan["cuda_alloc_conf"]
        lines.append(
            f"  allocator: PYTORCH_CUDA_ALLOC_CONF={conf} (launch.cuda_alloc_conf; k2-train sets it)"
            if conf
            else "  allocator: launch.cuda_alloc_conf=null: the environment's PYTORCH_CUDA_ALLOC_CONF"
        )
    lines += ["", *format_phases(plan)]
    if "gpu_hours_estimated" in plan:
        lines.append(f"  the whole schedule: {plan['gpu_hours_estimated']:,.0f} GPU-hours at the estimated step times")
    if "checkpoint" in plan:
        lines += ["", *format_checkpoint(plan["checkpoint"])]
    return lines


def format_step_time(plan: dict[str, Any]) -> list[str]:
    """The step-time model's estimate and its breakdown (seconds per step on the busiest PP rank)."""
    b = plan["step_time_breakdown_s"]
    step = plan["step_time_s_estimated"]
    what_if = f", what-if: {', '.join(plan['what_if'])}" if plan.get("what_if") else ""
    lines = [
        f"  estimated step {step:.4g} s on {plan['hardware']} (step-time model{what_if}): "
        f"{plan['tokens_per_s_per_gpu_estimated']:,.0f} tokens/s per GPU, MFU {100 * plan['mfu_estimated']:.1f}%; "
        f"FLOPs-only estimate {plan['step_time_s_flops_only']:.4g} s ({100 * plan['compute_efficiency']:g}% of "
        "peak, no communication)"
    ]
    cells = [f"{k} {v:.3g} s ({100 * v / step:.1f}%)" for k, v in sorted(b.items(), key=lambda kv: -kv[1]) if v > 0]
    for i in range(0, len(cells), 4):
        lines.append(("  breakdown: " if i == 0 else "             ") + ", ".join(cells[i : i + 4]))
    if plan.get("ep_comm_s"):
        lines += format_ep_comm(plan["ep_comm_s"], plan.get("ep_overlap", False), plan.get("ep_overlap_note", ""))
    return lines


_A2A_NAMES = {
    "dispatch_fwd": "dispatch fwd",
    "combine_fwd": "combine fwd",
    "dispatch_bwd": "dispatch bwd",
    "combine_bwd": "combine bwd",
    "other": "other",
}


def format_ep_comm(ep: dict[str, Any], overlap: bool, note: str) -> list[str]:
    """The EP all-to-alls of the busiest rank's step: exposed and hidden, by kind and (with the overlap) by
    part of the schedule (:func:`k2.launcher.planning.ep_overlap.ep_summary`)."""
    how = "EP overlap on" if overlap else (note or "EP overlap off")
    kinds = ", ".join(f"{_A2A_NAMES[k]} {v['exposed_s']:.3g} of {v['total_s']:.3g}" for k, v in ep["by_kind"].items())
    lines = [
        f"  EP all-to-all ({how}): {ep['total_s']:.3g} s, exposed {ep['exposed_s']:.3g} s, hidden "
        f"{ep['hidden_s']:.3g} s; exposed by kind (s): {kinds}"
    ]
    if "by_part" in ep:
        b = ep["by_part"]
        lines.append(
            f"    exposed in the warm-up forwards {b['warmup']:.3g} s, "
            f"the steady 1F1B pairs {b['steady']:.3g} s, "
            f"the cool-down backwards {b['cooldown']:.3g} s"
        )
    return lines


def format_phases(plan: dict[str, Any]) -> list[str]:
    """Every phase that runs: its fullest GPU and the host memory of its fullest node, against the
    cluster's; the verdict of the plan (every phase fits both)."""
    c = plan["cluster"]
    lines = [
        f"  per phase: fullest GPU (of {c['gpu_memory_gib']:g} GiB) and host memory of the fullest node "
        f"(of {c['host_memory_gib']:g} GiB: offloads and an async save's staged copy as pinned buffers, "
        "each rounded up to a power of two by torch's CachingHostAllocator); recompute = what the "
        "memory.recompute sites add to the step",
        f"  {'phase':<14}{'ctx':>8}{'mb x n':>11}{'GPU GiB':>9}{'pp rank':>9}{'host GiB/node':>15}"
        f"{'step s':>9}{'recompute s':>13}{'EP overlap':>12}  fits  recompute sites",
    ]
    for p in plan["phases"]:
        verdict = "yes" if p["fits"] else ("NO (GPU)" if not p["fits_gpu"] else "NO (host)")
        lines.append(
            f"  {p['phase']:<14}{p['seq_length']:>8,}"
            f"{str(p['micro_batch_size']) + ' x ' + str(p['num_microbatches']):>11}"
            f"{_gib(p['device_peak_bytes']):>9}{p['device_pp_rank']:>9}{_gib(p['host_bytes_per_node']):>15}"
            f"{p['step_time_s_estimated']:>9.4g}{p['recompute_time_s_estimated']:>13.3g}"
            f"{_overlap_cell(p):>12}  {verdict:<5} {','.join(p['memory']['recompute']) or '-'}"
        )
    lines += [
        f"  EP overlap off in phase {p['phase']}: {p['ep_overlap_note']}"
        for p in plan["phases"]
        if not p.get("ep_overlap") and plan.get("ep_overlap_requested") and p.get("ep_overlap_note")
    ]
    lines.append(
        f"  the plan {'fits' if plan['fits'] else 'does NOT fit'}: "
        + (
            "every phase fits the GPU and the host memory"
            if plan["fits"]
            else "phases " + ", ".join(p["phase"] for p in plan["phases"] if not p["fits"]) + " do not"
        )
    )
    return lines


def _overlap_cell(p: dict[str, Any]) -> str:
    """``on``, ``off`` (asked for, not run: the note says why) or ``-`` (not asked for)."""
    return "on" if p.get("ep_overlap") else ("-" if p.get("ep_overlap_note") == NOT_REQUESTED else "off")


def _limits(v: dict[str, Any]) -> str:
    """The verdict's memory line's tail where the layout does not fit: which limit fails (host memory per
    node names its figures; the GPU's are on the line already)."""
    if v["fits"]:
        return ""
    failed = ([] if v.get("fits_gpu", True) else ["GPU memory"]) + (
        []
        if v.get("fits_host", True)
        else [f"host memory: {_gib(v['host_bytes_per_node'])} of {_gib(v['host_memory_bytes_per_node'])} GiB per node"]
    )
    return f" (over: {'; '.join(failed)})" if failed else ""


def _domain_note(plan: dict[str, Any]) -> str:
    """Where the NVLink domain spans nodes (an NVL72 rack): the job's GPUs per domain, which decide what
    crosses the network; empty where it is one node."""
    d, gpn = plan.get("nvlink_domain_gpus"), plan["gpus_per_node"]
    if not d or d <= gpn:
        return ""
    return f"; {d // gpn} nodes = {d} GPUs per NVLink domain: cluster.segment_nodes"


def _where(plan: dict[str, Any], what: str) -> str:
    """``<what> on <GPUs> x <profile> (<nodes> x <per node>[; the NVLink domain])``."""
    nodes = f"{plan['nodes']} node{'s' if plan['nodes'] != 1 else ''}"
    return (
        f"{what} on {plan['world_size']} x {plan['hardware']} ({nodes} x {plan['gpus_per_node']}{_domain_note(plan)})"
    )


def format_summary(plan: dict[str, Any]) -> list[str]:
    """The first lines of a plan of the given layout (no ``plan.search``): whether it fits (and which limit
    fails in which phases), its step, MFU and the two largest terms."""
    where = _where(plan, f"{plan['model']} parallel={plan['parallel']}")
    terms = sorted(plan["step_time_breakdown_s"].items(), key=lambda kv: -kv[1])[:2]
    over = {
        limit: [p["phase"] for p in plan["phases"] if not p[key]]
        for limit, key in (("GPU memory", "fits_gpu"), ("host memory", "fits_host"))
    }
    why = "; ".join(f"{limit} in {', '.join(names)}" for limit, names in over.items() if names)
    return [
        f"plan: {where}: {'FITS' if plan['fits'] else 'does NOT fit (' + why + '; plan.search=true finds a layout)'}",
        f"  step {plan['step_time_s_estimated']:.4g} s (MFU {100 * plan['mfu_estimated']:.1f}%), dominated by "
        + ", ".join(f"{k} {s:.3g} s" for k, s in terms)
        + f"; {_gib(plan['memory_per_gpu_bytes']['total'])} of {_gib(plan['gpu_memory_bytes'])} GiB per GPU",
    ]


def format_verdict(plan: dict[str, Any]) -> list[str]:
    """``plan.search``'s verdict, the first lines k2-plan prints (:mod:`k2.launcher.planning.verdict`)."""
    v, world = plan["verdict"], plan["world_size"]
    best = v["recommended"]
    where = _where(plan, plan["model"])
    if best is None:
        return [
            f"verdict: {where}: no layout can run the schedule (the global batch does not split into whole "
            "microbatches on any DP size of this GPU count: set schedule.global_batch_tokens)"
        ]
    shape = (
        (f"TP{best['tp']} " if best.get("tp", 1) > 1 else "")
        + f"PP{best['pp']}"
        + (f" VPP{best['vpp']}" if best["vpp"] > 1 else "")
        + f" EP{best['ep']} DP{best['dp']}"
    )
    dom = ", ".join(f"{k} {s:.3g} s" for k, s in v["dominant"])
    settings = (
        f"parallel.tp={best.get('tp', 1)} parallel.pp={best['pp']} "
        f"parallel.vpp={best['vpp'] if best['vpp'] > 1 else 'null'} parallel.ep={best['ep']} "
        f"parallel.layout='{best['layout']}'"
    )
    lines = [
        f"verdict: {where}: {'FITS' if v['fits'] else 'does NOT fit'}; "
        f"{'recommended' if v['fits'] else 'closest (the least memory per GPU)'} layout {shape}"
        + ("" if best.get("k2_train_runs", True) else " (k2-train runs TP 1 only)"),
        f"  step {v['step_time_s_estimated']:.4g} s (MFU {100 * v['mfu_estimated']:.1f}%), dominated by {dom}; "
        f"{_gib(v['memory_per_gpu_bytes'])} of {_gib(v['gpu_memory_bytes'])} GiB per GPU" + _limits(v),
        f"  {settings}",
    ]
    if r := v.get("global_batch_rounded"):
        lines.append(
            f"  global batch rounded: schedule.global_batch_tokens={r['to']:,} (was {r['from']:,}, which no layout "
            f"of {world} GPUs splits into whole microbatches in every phase)"
        )
    if not v["fits"]:
        n = v["smallest_fitting_gpus"]
        lines.append(
            f"  smallest GPU count that fits: {n} ({n // plan['gpus_per_node']} nodes; "
            f"{v['smallest_fitting_searched']})"
            if n
            else f"  nothing fits up to {64 * world} GPUs of this kind ({v['smallest_fitting_searched']})"
        )
    elif v["unneeded_memory_settings"]:
        step = v["step_time_s_estimated"]
        for u in v["unneeded_memory_settings"]:
            change = u["step_time_s"] / step - 1
            after = f"{u['step_time_s']:.4g} s, {100 * change:+.1f}%)" if abs(change) >= 5e-4 else "unchanged)"
            lines.append(f"  not needed on this GPU: {u['setting']} ({u['off']}: it still fits; step {after}")
        if fast := v.get("faster_memory_settings"):
            lines.append(
                f"  fastest that fits: {' '.join(fast['overrides'])} (step {fast['step_time_s']:.4g} s, "
                f"{100 * (fast['step_time_s'] / step - 1):+.1f}%)"
            )
    elif v["memory_settings_set"]:
        lines.append("  every memory setting is needed to fit: " + ", ".join(v["memory_settings_set"]))
    return lines


def format_search(rows: list[dict[str, Any]], capacity: float) -> list[str]:
    """Text table of ``plan.search``'s ranked layouts."""
    tp = any(r.get("tp", 1) > 1 for r in rows)  # (a TP column only when the search tried TP: parallel.tp > 1)
    lines = [
        f"  layouts of this cluster ({len(rows)} valid): those that fit first, each group by estimated "
        "step time ('>' = at least: parameters and gradients alone exceed the GPU"
        + ("; TP > 1: k2-plan plans it, k2-train does not run it" if tp else "")
        + ")",
        f"  {'rank':<6}{'tp' if tp else '':>{4 if tp else 0}}{'pp':>4}{'vpp':>5}{'ep':>5}{'dp':>6}"
        f"{'microbatches':>14}{'bubble %':>10}{'step s':>9}{'GiB/GPU':>9}{'EP overlap':>12}  fits  layout",
    ]
    for r in rows:
        tp_cell = f"{r.get('tp', 1):>4}" if tp else ""
        lines.append(
            f"  {r['rank']:<6}{tp_cell}{r['pp']:>4}{r['vpp']:>5}{r['ep']:>5}{r['dp']:>6}{r['num_microbatches']:>14,}"
            f"{100 * r['bubble_fraction']:>10.2f}{r['step_time_s_estimated']:>9.2f}"
            f"{('>' if r['memory_lower_bound'] else '') + _gib(r['memory_per_gpu_bytes']):>9}{_overlap_cell(r):>12}  "
            f"{'yes ' if r['fits'] else 'NO  '}  {r['layout']}"
        )
    return lines


def format_schedule(s: dict[str, Any]) -> list[str]:
    """Text table of :meth:`k2.schedules.wsd.Schedule.as_dict`."""
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
    lines.append(
        "  (a step belongs to the phase holding its first token: a boundary at T tokens lands after "
        "step ceil(T / tokens per step); LR of step s = LR at s x tokens per step)"
    )
    return lines
