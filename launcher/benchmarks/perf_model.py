"""``k2-bench bench=perf_model``: ``k2-plan``'s step-time model against measured ``parallel=single`` and
``parallel=pp2`` runs of the main job's model (``k2_tiny``), in one benchmark run.

1. This machine's profile is measured in the same run (:mod:`k2.launcher.benchmarks.hardware`), one per
   rank share of the CPU (``single``: all cores for its one rank; ``pp2``: half each), right before and
   right after each configuration's trainer run, and averaged (the machine's load during the run lies
   between); the per-operator cost on one MoE layer of the main job's model
   (:mod:`k2.launcher.benchmarks.operator_cost`), measured by as many processes at once as the
   configuration has ranks, each with the rank's threads (two trainer ranks contend for the cores);
   the gloo collectives between two processes.
2. Real ``k2-train`` runs of ``iters`` steps each (the first not timed), ``single`` then ``pp2``, for
   ``rounds`` rounds, each writing a ``pipeline.trace``.
3. ``k2-plan`` (:func:`k2.launcher.planning.cluster.plan_cluster`) predicts each configuration's main phase on
   its measured profile. Nothing is fitted to the trainer runs: the profile's numbers come from the
   measurements of step 1 alone.

Figures per configuration, predicted / measured (the fastest of the timed steps, as the profile's
figures are the fastest of their repeats: what the machine does least disturbed by the other jobs on
it; the median step is printed beside it; measured on the busiest rank, from the trace):
``forward_s`` (the F events of a step), ``backward_s`` (B and W), ``pass_s`` (the
forward-backward pass, bubble and PP sends included), ``after_pass_s`` (the rest of the step: DP
traffic, optimizer, the trainer's bookkeeping) and ``step_s`` (``metrics.jsonl``'s ``step_time_s``), with
their ratios, the model's largest term and the measured largest of forward / backward / after the pass;
``operators``: per part of the model (MoE layer, dense layer, embedding, loss, optimizer) the operators
counted on k2-train's modules and those the model charges, and each part's measured cost per operator;
``single_profiled``: one single-rank step under ``torch.profiler`` in a measuring process (no data
loading or logging), self CPU seconds of the GEMM operators and of everything else against the model's
``gemm`` and ``non_gemm`` + ``attention`` terms, and which is largest in each.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k2.config.load import load_config
from k2.launcher.benchmarks import pipeline as trainer_runs
from k2.launcher.benchmarks.common import bench_options, check_minimums
from k2.launcher.benchmarks.hardware import measure_collectives, measure_device, operator_profile_keys, write_profile
from k2.launcher.benchmarks.operator_cost import OperatorRanks
from k2.launcher.planning import KernelRates
from k2.schedules.pipeline import read_trace

if TYPE_CHECKING:
    from k2.config.schema import K2Config

_DEFAULTS = {
    "iters": 8,  # steps per trainer run (the first is not timed)
    "rounds": 1,  # single / pp2 pairs
    "repeats": 5,  # timed calls per hardware measurement
    "timeout": 1200,  # seconds per trainer run
}
_CONFIGS = {"single": 1, "pp2": 2}
_SHAPES = [(256, 128, 384), (256, 384, 128), (256, 128, 4096), (256, 128, 96), (256, 64, 128)]


def device_profile(
    nproc: int, threads: int, repeats: int, ranks: OperatorRanks, coll: dict, name: str = ""
) -> dict[str, Any]:
    """This machine's profile for ``nproc`` ranks of ``threads`` threads each, measured now: GEMM rates by
    shape, memory bandwidth and attention (one process), the per-operator cost of one MoE layer of the
    main job's model measured by ``nproc`` of ``ranks``' processes at once (they contend for the cores as
    that many trainer ranks do), and the links from ``coll`` (``collective_gbps``, ``p2p_gbps``,
    ``latency_us``: :func:`k2.launcher.benchmarks.hardware.measure_collectives`), inside and across nodes
    alike (``gpus_per_host`` = ``nproc``).

    Returns:
        ``{"profile": the keys of a hardware profile file, "operator_cost": the per-part figures}``.
    """
    dev = measure_device(threads, repeats, 512, _SHAPES, operators=False)
    rates = KernelRates(
        gemm_flops=dev["gemm_fp32_tflops"] * 1e12,
        attention_flops=min(dev["attention_tflops"], dev["gemm_fp32_tflops"]) * 1e12,
        memory_bytes=dev["memory_gbps"] * 1e9,
    )
    dev["operator_cost"] = ranks.measure(nproc, threads, rates, repeats)
    dev.update(operator_profile_keys(dev["operator_cost"]))
    dev["peak_bf16_tflops"] = dev["gemm_bf16_tflops"]
    prof = {k: v for k, v in dev.items() if k not in ("gemm_by_shape", "operator_cost")}
    prof.update(
        name=name or f"measured-{nproc}x{threads}",
        gpus_per_host=nproc,
        host_gbps=dev["memory_gbps"] / 2,
        nongemm_share=0.0,
        network_latency_us=coll["latency_us"],
        intra_latency_us=coll["latency_us"],
        sources={"measured": f"k2-bench, {threads} threads per rank, {nproc} ranks"},
    )
    for side in ("nvlink", "network"):
        prof.update(
            {
                f"{side}_gbps": coll["p2p_gbps"],
                f"{side}_alltoall_gbps": coll["collective_gbps"],
                f"{side}_collective_gbps": coll["collective_gbps"],
            }
        )
    return {"profile": prof, "operator_cost": dev["operator_cost"]}


def _device_profile(name: str, threads: int, repeats: int, ranks: OperatorRanks, coll: dict) -> dict[str, Any]:
    """One configuration's profile (:func:`device_profile`), named and sourced as this benchmark's."""
    out = device_profile(_CONFIGS[name], threads, repeats, ranks, coll, name=f"measured-{name}")
    out["profile"]["sources"] = {
        "measured": f"k2-bench bench=perf_model, {threads} threads per rank, the median "
        "of the measurements before and after its trainer runs"
    }
    return out


def median_measurement(items: list) -> Any:
    """The median of the measurements ``items``: numbers by value (two: their mean; integers stay integers,
    the lower middle one: a profile's counts are integer settings), mappings key by key, anything else from
    the first."""
    a = items[0]
    if isinstance(a, dict):
        return {k: median_measurement([x[k] for x in items]) for k in a}
    if all(isinstance(x, int) and not isinstance(x, bool) for x in items):
        return statistics.median_low(items)
    if isinstance(a, (int, float)) and not isinstance(a, bool) and all(x is not None for x in items):
        return statistics.median(items)
    return a


def _measured(run_dir: Path, recs: list[dict]) -> list[dict]:
    """Per timed step: forward / backward / pass seconds of the busiest rank and the step time."""
    by_rank = read_trace(str(run_dir / "trace"))
    out = []
    for rec in recs[1:]:
        per_rank = []
        for events in by_rank.values():
            ev = [e for e in events if e["step"] == rec["step"] and e["pass"] == "train"]
            f = sum(e["end"] - e["start"] for e in ev if e["kind"] == "F")
            b = sum(e["end"] - e["start"] for e in ev if e["kind"] in ("B", "W"))
            end = [e for e in ev if e["kind"] == "end"]
            per_rank.append((f + b, f, b, end[0]["end"] - end[0]["start"] if end else f + b))
        busy, f, b, pass_s = max(per_rank)
        out.append(
            {
                "forward_s": f,
                "backward_s": b,
                "pass_s": pass_s,
                "step_s": rec["step_time_s"],
                "after_pass_s": rec["step_time_s"] - pass_s,
            }
        )
    return out


_GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def profiled_single_step(case) -> dict[str, float]:
    """One ``parallel=single`` step of the main job (8 microbatches of 2 x 128 tokens, AdamW, the trainer's
    modules: :func:`k2.launcher.benchmarks.operator_cost.build_case`) under ``torch.profiler``, in the
    process holding ``case``: self CPU seconds of the GEMM operators, of the other aten operators and of everything else
    (framework code)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    old = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        case.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            case.step()
    finally:
        torch.set_num_threads(old)
    rows = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in rows) / 1e6
    gemm = sum(e.self_cpu_time_total for e in rows if e.key in _GEMM_OPS) / 1e6
    other = sum(e.self_cpu_time_total for e in rows if e.key.startswith("aten::") and e.key not in _GEMM_OPS) / 1e6
    return {"gemm_s": gemm, "other_operators_s": other, "framework_s": total - gemm - other, "total_s": total}


def _operator_rows(single: dict, pp2: dict) -> dict[str, dict]:
    """Per part: operators counted on k2-train's modules and charged by the model, and the part's
    measured cost per operator at each configuration's threads."""
    from k2.launcher.planning import modelled_operators

    model = load_config(["model=k2_tiny"]).model
    local = int(model.num_moe_experts)
    kinds = {
        "moe_layer": ("moe_layer", local),
        "dense_layer": ("dense_layer", 0),
        "embedding": ("embedding", 0),
        "head": ("loss", 0),
    }
    rows = {}
    for part, row in single.items():
        if part == "schedule":
            rows[part] = {f"{k}_single": v for k, v in row.items()} | {f"{k}_pp2": v for k, v in pp2[part].items()}
            continue
        out = {"counted_ops": row["forward_ops"] + row["backward_ops"]}
        if part in kinds:
            out["modelled_ops"] = sum(modelled_operators(model, *kinds[part]))
        out.update(
            per_op_us_single=row["per_op_us"], per_op_us_pp2=pp2[part]["per_op_us"], seconds_single=row["seconds"]
        )
        rows[part] = out
    return rows


def _predicted(name: str, profile: str) -> dict[str, Any]:
    from k2.launcher.planning import plan_cluster

    cfg = load_config(
        [
            f"parallel={name}",
            "model=k2_tiny",
            "cluster.nodes=1",
            f"cluster.gpus_per_node={_CONFIGS[name]}",
            f"plan.hardware={profile}",
        ]
    )
    p = plan_cluster(cfg).report
    b = p["step_time_breakdown_s"]
    after = sum(
        b[k] for k in ("dp_grad_reduce_scatter", "dp_param_all_gather", "optimizer", "muon_gather", "optimizer_offload")
    )
    compute = {k: b[k] for k in ("gemm", "attention", "non_gemm", "ep_comm", "recompute", "offload")}
    return {
        "step_s": p["step_time_s_estimated"],
        "after_pass_s": after,
        "pass_s": p["step_time_s_estimated"] - after,
        "breakdown": b,
        "largest_term": max(b, key=b.get),
        "compute": compute,
    }


def _config_row(pred: dict[str, Any], steps: list[dict]) -> dict[str, Any]:
    """One configuration's figures: the prediction (:func:`_predicted`) against its fastest timed step
    (:func:`_measured`; seconds), per part of the step, and the largest term of each."""
    fastest = min(steps, key=lambda s: s["step_s"])
    meas = {k: fastest[k] for k in steps[0]}
    row: dict[str, Any] = {
        "timed_steps": len(steps),
        "measured_step_median_s": statistics.median(s["step_s"] for s in steps),
    }
    for k in ("forward_s", "backward_s", "pass_s", "after_pass_s", "step_s"):
        if k in pred:
            row[f"predicted_{k}"] = pred[k]
        row[f"measured_{k}"] = meas[k]
        if k in pred and meas[k] > 0:
            row[f"{k[:-2]}_predicted_over_measured"] = pred[k] / meas[k]
    row["predicted_breakdown_s"] = pred["breakdown"]
    row["predicted_largest_term"] = pred["largest_term"]
    row["measured_largest"] = max(("forward", "backward", "after_pass"), key=lambda k: meas[f"{k}_s"])
    return row


def bench_perf_model(cfg: K2Config) -> dict[str, Any]:
    """Predicted / measured step time of ``parallel=single`` and ``parallel=pp2`` (module docstring).

    Raises:
        ConfigError: a bad option.
    """
    o = bench_options(cfg, _DEFAULTS)
    check_minimums(o, {"iters": 2, "rounds": 1, "repeats": 1, "timeout": 1})
    from k2.launcher.training.prepare import prepare_run

    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="k2-bench-perf-model-") as tmp_name:
        tmp = Path(tmp_name)
        run_cfg = load_config(["parallel=pp2", "model=k2_tiny", f"train.iters={o['iters']}", f"run.dir={tmp}/check"])
        prepare_run(run_cfg, 2)
        if run_cfg.data.path is None:
            from k2.launcher.datasets.corpus import prepare_stdlib_corpus

            prepare_stdlib_corpus(run_cfg.data, progress=False, verbose=False)
        cores = os.cpu_count() or 1
        coll = measure_collectives(2, max(1, cores // 2), o["repeats"])
        ranks = OperatorRanks(max(_CONFIGS.values()))
        try:
            measured: dict[str, list[dict]] = {n: [] for n in _CONFIGS}
            steps: dict[str, list[dict]] = {n: [] for n in _CONFIGS}
            for r in range(o["rounds"]):
                for name, nproc in _CONFIGS.items():
                    before = _device_profile(name, max(1, cores // nproc), o["repeats"], ranks, coll)
                    run = {
                        "parallel": name,
                        "model": "k2_tiny",
                        "nproc": nproc,
                        "iters": o["iters"],
                        "timeout": o["timeout"],
                    }
                    run_dir = tmp / f"{name}-r{r}"
                    recs = trainer_runs._run(run, False, run_dir, False)
                    steps[name] += _measured(run_dir, recs)
                    after = _device_profile(name, max(1, cores // nproc), o["repeats"], ranks, coll)
                    measured[name] += [before, after]
            traced = ranks.call(profiled_single_step)
        finally:
            ranks.close()
        profiles, ops = {}, {}
        for name in _CONFIGS:
            both = median_measurement(measured[name])
            profiles[name], ops[name] = str(tmp / f"{name}.yaml"), both["operator_cost"]
            write_profile(both["profile"], profiles[name])
        for name in _CONFIGS:
            figures[name] = _config_row(_predicted(name, profiles[name]), steps[name])
        figures["operators"] = _operator_rows(ops["single"], ops["pp2"])
        # the model's GEMM and non-GEMM terms against a profiler trace of one single-rank step
        b = figures["single"]["predicted_breakdown_s"]
        non_gemm = traced["other_operators_s"] + traced["framework_s"]
        figures["single_profiled"] = {
            **traced,
            "predicted_gemm_s": b["gemm"],
            "gemm_predicted_over_profiled": b["gemm"] / traced["gemm_s"],
            "predicted_non_gemm_s": b["non_gemm"] + b["attention"],
            "non_gemm_predicted_over_profiled": (b["non_gemm"] + b["attention"]) / non_gemm,
            "profiled_largest": "gemm" if traced["gemm_s"] > non_gemm else "non_gemm",
            "predicted_step_over_profiled": figures["single"]["predicted_step_s"] / traced["total_s"],
        }
        import yaml

        figures["profiles"] = {n: yaml.safe_load(Path(p).read_text()) for n, p in profiles.items()}
    return figures
