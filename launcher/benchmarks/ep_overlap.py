"""``k2-bench bench=ep_overlap``: K2's communication overlap (``pipeline.ep_overlap``) measured on a shaped
link, against ``k2-plan``'s prediction for that link, in one benchmark run.

1. Two "nodes": network namespaces joined by a veth pair shaped with ``tc tbf``
   (:class:`k2.launcher.benchmarks.shaped_link.ShapedLink`; needs root). One ``k2-train`` rank per node,
   EP across the two (``parallel=single parallel.ep=2``: PP1, EP2, DP2), the main job's model
   (``k2_tiny``, fp32, one OpenMP thread per rank) with K2's proportions (experts 16x wider, 1,024: the
   expert nodes then take ~60% of a layer's time in the trainer's own trace, where K2's experts are ~70%
   of its layer FLOPs at 4K tokens; at 256 wide they took 37%, the attention nodes the rest; decoupled
   weight gradients, as K2 trains), so every dispatch and combine crosses the link.
2. The link rates: with ``rates=[]`` (auto), an unshaped calibration run (overlap off, traced) gives the
   forward-backward pass's compute and the all-to-all bytes per step; each rate is the one at which the
   all-to-alls of a step take ``balance`` times that compute on the wire (``balance`` 1: the all-to-all
   costs about as much as the compute that can hide it), at the link's measured efficiency. A list of
   Mbit/s values sets them instead.
3. Per rate: an unshaped calibration run (overlap off) right before the rate's runs (the first rate's is
   the run that chose the rates): predicted as ``unshaped_*``, the model's compute against this run's
   where the link costs little, and ``compute_scale``, the factor on the profile's compute at which the
   model's step equals this run's (its communication terms kept); one per rate, since the machine's speed
   drifts over the minutes a rate takes. Then the link's gloo all-to-all and all-reduce are measured, and
   ``rounds`` pairs of runs with the overlap off and on (alternating, ``iters`` steps each, the first not
   timed; each writes a ``pipeline.trace``); the figures pool the timed steps of all rounds.
4. ``k2-plan``'s step-time model predicts both settings on this machine's profile measured in the same
   run (``k2.launcher.benchmarks.perf_model.device_profile``: the two ranks' share of the CPU), before and
   after all runs and taken as the median of the two (as ``bench=perf_model`` does: on a shared machine
   the speed drifts over the minutes the runs take), with the link's measured figures (its all-to-all and
   all-reduce rates, its latency, the latency of a small all-gather while all-to-alls are on the wire: the
   profile's ``network_loaded_latency_us``, what megatron's token-count all-gather before each dispatch
   takes when it queues behind the other microbatch's all-to-all; and the share of a core the host's
   work on an all-to-all takes while it is on the wire: the profile's ``alltoall_host_cpu_share``, which
   slows the compute beside an overlapped all-to-all).

Figures per rate: ``step_off_s`` / ``step_on_s`` (median ``step_time_s`` of the timed steps) and
``speedup`` (off / on); ``exposed_a2a_off_s`` / ``exposed_a2a_on_s`` (per step, the rank's main thread's
time in all-to-alls it waited for: without the overlap every all-to-all is run by that thread, with it the
``wait`` events on communication nodes; the larger rank, median over steps) and ``exposed_cut``
(1 - on / off); ``predicted_off_s`` / ``predicted_on_s`` with ``predicted_over_measured_*`` on the profile
as measured, and the same on that profile with its compute scaled by the rate's ``compute_scale``
(``calibrated_*``: what the link and the schedule add is then predicted, the compute is the calibration
run's own; ``calibrated_predicted_ep_comm_host_on_s``: the seconds the all-to-alls' host work adds to the
compute beside them, from ``link_host_cpu_share``; ``calibrated_predicted_ep_token_counts_on_s``: the
token-count all-gathers, from ``link_latency_us`` and ``link_loaded_latency_us``; the all-to-alls' longer time
on the wire beside the host's compute, ``link_beside_compute_slowdown``; each all-to-all's wait for the other
rank's call, ``link_peer_wait_us``: :mod:`k2.launcher.benchmarks.ep_overlap_prediction` says where it comes
from) and the goals (:data:`GOALS`).

**What the model can and cannot predict here.** Without the overlap the exposed all-to-all is the link's rate
and latency plus the wait for the other rank's call, from the probe and the calibration run:
``exposed_off_prediction``, the calibrated prediction within 15% of the measured one. With the overlap on, the
replay of a traced step on two streams with its mean durations reproduces its exposure within 20% (the
schedule's order and the streams are the model's), but the durations are not the model's: on a 2-core host
shared with other jobs the rank's compute with the overlap running is slower than the calibration run's
(overlap off), and its dispatches and combines longer on the communication thread than the link and the wait
make them (megatron's dispatcher runs a second, small all-to-all per dispatch), which neither the calibration
nor the probe (a process doing nothing else) measures. So the prediction with the overlap on is a bound, not
an estimate: ``exposed_on_bound``, predicted / measured exposed all-to-all at most 1, and ``speedup_bound``,
predicted / measured speed-up at least 1; the bench reports both ratios (how loose the bounds are). The
measured ``speedup`` and ``exposed_cut`` are reported, not judged (the link rate chosen sets them).

The run writes its results file itself (``bench.options.results_dir``; :mod:`k2.launcher.benchmarks.results`):
the options, the machine, per rate every timed step of every run (``raw``: step, pass, exposed and compute
seconds, all-to-all bytes and counts, losses; the link's probe), the profiles predicted with, and the figures
above; the table and the JSON record carry the figures and the file's path.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k2.config.errors import ConfigError
from k2.config.load import load_config
from k2.config.recipes import repo_root
from k2.launcher.benchmarks.common import bench_options, check_minimums
from k2.launcher.benchmarks.ep_overlap_prediction import (
    calibrated,
    link_profile,
    model_settings,
    peer_wait_us,
    predicted,
    unshaped_case,
    write_link_profile,
)
from k2.launcher.benchmarks.ep_overlap_trace import (
    a2a_bytes,
    a2a_count,
    a2a_excess,
    a2a_nodes,
    exposed,
    pass_seconds,
    peer_wait,
)
from k2.launcher.benchmarks.shaped_link import ShapedLink, check_can_shape, measure_link
from k2.parallel.processes import child_env
from k2.schedules.pipeline_trace import read_trace

if TYPE_CHECKING:
    from k2.config.schema import K2Config

_DEFAULTS = {
    "model": "k2_tiny",
    "rates": [],  # link rates in Mbit/s; [] = auto (module docstring)
    "balance": [1.0, 0.7],  # rates=[]: all-to-all time on the wire / compute per step, one rate each
    # tokens per step: enough that the all-to-alls outweigh the data-parallel gradient reduction, which
    # crosses the same link once per step (the embedding and output layer dominate it)
    # and that the step's fixed costs (the gradient reduction, the optimizer: ~1% of K2's step) and the
    # schedule's warm-up and cool-down, which nothing hides, are a small share of it
    "global_batch_tokens": 16384,
    "micro_batch_size": 2,  # sequences per microbatch: 32 microbatches per DP rank, 31 overlapped pairs
    # K2's proportions: its routed experts are most of a layer's compute (k2_tiny's 64-wide experts are a
    # small share of it), and K2 decouples the weight gradients, which run under the dispatches too
    "moe_ffn_hidden_size": 1024,
    # more MoE layers per microbatch than k2_tiny's 3 (of 4): the embedding and the loss of each microbatch,
    # which nothing hides, are a smaller share of the step, as in K2's 61 layers
    "num_layers": 8,
    "decouple_wgrad": True,
    "iters": 5,  # steps per run (the first is not timed)
    # off/on pairs per rate, alternating, their steps pooled: the machine's speed drifts between runs (a run
    # whose compute was 45% slower than its neighbours' was seen), so that no one slow run sets a median
    "rounds": 3,
    "repeats": 5,  # timed calls per hardware / link measurement
    "timeout": 900,  # seconds per trainer run
    "number": 0,  # picks the namespaces' names and subnet (k2.launcher.benchmarks.shaped_link)
    # where the run writes its results file (k2.launcher.benchmarks.results); "" = benchmarks/results of this
    # checkout, "none" = no file
    "results_dir": "",
}
#: the goals, per rate, each the model's prediction (its compute calibrated only by the rate's unshaped
#: overlap-off run) against the measurement: ``exposed_off_prediction``: the exposed all-to-all without the
#: overlap (the all-to-alls' wire time and their wait for the other rank's call, what the overlap has to
#: hide) within this share of the measured one; with the overlap on the prediction is a bound, not an
#: estimate (module docstring): ``exposed_on_bound``, predicted / measured exposed all-to-all at most this,
#: and ``speedup_bound``, predicted / measured speed-up at least this. The measured ``speedup`` and
#: ``exposed_cut`` are reported, not judged: they are what the link rate chosen makes them.
GOALS = {"exposed_off_prediction": 0.15, "exposed_on_bound": 1.0, "speedup_bound": 1.0}


def _overrides(o: dict, run_dir: Path, overlap: bool) -> list[str]:
    return [
        *model_settings(o),
        f"train.iters={o['iters']}",
        "train.eval_interval=0",
        "schedule.phases.0.steps=0",
        "checkpoint.save_at_end=false",
        "run.wandb.mode=disabled",
        "train.progress=false",
        "resume=never",
        f"run.dir={run_dir}",
        f"pipeline.ep_overlap={str(overlap).lower()}",
        f"pipeline.trace={run_dir / 'trace'}",
    ]


def _train(link: ShapedLink, o: dict, run_dir: Path, overlap: bool) -> dict[str, Any]:
    """One 2-rank ``k2-train`` run on the link; its timed steps' figures (module docstring)."""
    env = child_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    link.run_pair(
        [sys.executable, "-m", "k2.launcher.train", *_overrides(o, run_dir, overlap)], env, repo_root(), o["timeout"]
    )
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r["step"] > 1]
    traces = read_trace(str(run_dir / "trace"))
    steps = [r["step"] for r in recs]
    return {
        "step_s": [r["step_time_s"] for r in recs],
        "loss": [r["loss"] for r in recs],
        "pass_s": [max(pass_seconds(ev, s) for ev in traces.values()) for s in steps],
        "exposed_s": [max(exposed(ev, s) for ev in traces.values()) for s in steps],
        "compute_s": [max(pass_seconds(ev, s) - exposed(ev, s) for ev in traces.values()) for s in steps],
        "a2a_bytes": [max(a2a_bytes(ev, s) for ev in traces.values()) for s in steps],
        "a2a_count": [max(a2a_count(ev, s) for ev in traces.values()) for s in steps],
        "peer_wait_s": [peer_wait(traces, s) for s in steps],
        "a2a_nodes": [max(a2a_nodes(ev, s) for ev in traces.values()) for s in steps],
        "a2a_excess_bytes": [max(a2a_excess(ev, s) for ev in traces.values()) for s in steps],
    }


def _auto_rates(link: ShapedLink, o: dict, tmp: Path) -> tuple[list[float], dict, dict]:
    """Link rates (Mbit/s) at which a step's all-to-alls take ``balance`` x its compute (module docstring);
    also the calibration's figures and the unshaped run itself (``{"run", "link"}``, predicted at the end)."""
    unshaped = _unshaped_run(link, o, tmp / "calibration")
    cal = unshaped["run"]
    compute = statistics.median(cal["compute_s"])
    remote_bytes = statistics.median(cal["a2a_bytes"]) / 2  # half of each all-to-all goes to the other rank
    n = statistics.median(cal["a2a_count"])
    probe_rate = 100.0
    link.set_rate(probe_rate)
    eff = measure_link(link, o["repeats"], repo_root(), _a2a_bytes_per_rank(o))
    efficiency = eff["alltoall_gbps"] * 8e3 / probe_rate  # achieved / nominal
    rates = []
    for b in o["balance"]:
        wire = max(b * compute - n * eff["latency_us"] * 1e-6, 1e-3)
        rates.append(round(remote_bytes * 8 / wire / 1e6 / efficiency, 1))
    return (
        rates,
        {
            "calibration_compute_s": compute,
            "calibration_a2a_remote_bytes": remote_bytes,
            "calibration_a2a_count": n,
            "link_efficiency": efficiency,
        },
        unshaped,
    )


def _a2a_bytes_per_rank(o: dict) -> int:
    """Bytes one rank puts into one dispatch all-to-all of the benchmarked run: a microbatch's tokens,
    each sent to its top-k experts, in fp32 (``micro_batch_size x seq_length x topk x hidden x 4``)."""
    cfg = load_config(model_settings(o))
    from k2.parallel.dims import ParallelDims
    from k2.schedules.resolve import resolve_schedule

    phase = resolve_schedule(cfg, ParallelDims.from_config(cfg.parallel, cfg.model, 2)).step_phase(1)
    m = cfg.model
    return int(phase.micro_batch_size * phase.seq_length * int(m.moe_router_topk) * int(m.hidden_size) * 4)


def _unshaped_run(link: ShapedLink, o: dict, run_dir: Path) -> dict[str, Any]:
    """A calibration run: overlap off, the link not shaped (``{"run", "link"}``, :func:`unshaped_case`)."""
    link.set_rate(None)
    run = _train(link, o, run_dir, False)
    lf = {**measure_link(link, o["repeats"], repo_root(), _a2a_bytes_per_rank(o)), "rate_mbit": None}
    nodes = statistics.median(run["a2a_nodes"])
    wait = statistics.median(run["peer_wait_s"]) / nodes if nodes else 0.0
    excess = statistics.median(run["a2a_excess_bytes"])
    # the wait less what the busier direction's extra bytes took on this link: the ranks' compute skew
    skew = max(0.0, wait - excess / (lf["alltoall_gbps"] * 1e9))
    return {
        "run": run,
        "link": {**lf, "peer_wait_us": wait * 1e6, "compute_skew_us": skew * 1e6, "a2a_excess_bytes": excess},
    }


def _rate_runs(link: ShapedLink, o: dict, rate: float, tmp: Path, unshaped: dict | None = None) -> dict[str, Any]:
    """At ``rate``: a calibration run right before (``unshaped``: the one just run, else a new one: the
    machine's speed drifts over the minutes a rate takes), the link's figures, then ``rounds`` pairs of runs
    with the overlap off and on."""
    unshaped = unshaped or _unshaped_run(link, o, tmp / f"calibration-{rate:g}")
    link.set_rate(rate)
    lf = {**measure_link(link, o["repeats"], repo_root(), _a2a_bytes_per_rank(o)), "rate_mbit": rate}
    lf["peer_wait_us"] = peer_wait_us(unshaped["link"], lf["alltoall_gbps"])
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for r in range(o["rounds"]):
        for overlap in (False, True):
            runs[overlap].append(_train(link, o, tmp / f"{rate:g}-r{r}-{'on' if overlap else 'off'}", overlap))
    return {"link": lf, "runs": runs, "unshaped": unshaped}


def _rate_case(o: dict, measured: dict, device: dict, tmp: Path) -> dict[str, Any]:
    """One rate's figures (module docstring): its runs (:func:`_rate_runs`) against the prediction on the
    profile as measured and on the one calibrated by the rate's unshaped run (:func:`unshaped_case`)."""
    lf, runs = measured["link"], measured["runs"]
    rate = lf["rate_mbit"]
    unshaped = unshaped_case(o, measured["unshaped"], device, tmp / f"unshaped-{rate:g}")
    calibrated_device = calibrated(device, unshaped["compute_scale"])
    med = {
        ov: {k: statistics.median([x for run in runs[ov] for x in run[k]]) for k in ("step_s", "exposed_s", "pass_s")}
        for ov in runs
    }
    p = predicted(o, write_link_profile(lf, device, tmp / f"profile-{rate:g}.yaml"))
    pred = {False: p["off"], True: p["on"]}
    off, on = med[False], med[True]
    out = {
        "rate_mbit": rate,
        "link_alltoall_gbps": lf["alltoall_gbps"],
        "link_latency_us": lf["latency_us"],
        "link_loaded_latency_us": lf["loaded_latency_us"],
        "link_host_cpu_share": lf["host_cpu_share"],
        "link_beside_compute_slowdown": lf.get("beside_compute_slowdown", 1.0),
        "link_peer_wait_us": lf.get("peer_wait_us", 0.0),
        # the wait per dispatch or combine for the other rank's call, as it happened in the runs
        "peer_wait_off_us": _per_node_us(runs[False]),
        "peer_wait_on_us": _per_node_us(runs[True]),
        **unshaped,
        "step_off_s": off["step_s"],
        "step_on_s": on["step_s"],
        "speedup": off["step_s"] / on["step_s"],
        "exposed_a2a_off_s": off["exposed_s"],
        "exposed_a2a_on_s": on["exposed_s"],
        "exposed_cut": 1 - on["exposed_s"] / off["exposed_s"] if off["exposed_s"] > 0 else 0.0,
        "predicted_off_s": pred[False]["step_s"],
        "predicted_on_s": pred[True]["step_s"],
        "predicted_exposed_a2a_off_s": pred[False]["exposed_a2a_s"],
        "predicted_exposed_a2a_on_s": pred[True]["exposed_a2a_s"],
        # the forward-backward pass alone (the rest of a step: the DP gradient reduction over the same link,
        # the optimizer, the trainer's bookkeeping)
        "pass_off_s": off["pass_s"],
        "pass_on_s": on["pass_s"],
        "predicted_pass_off_s": pred[False]["pass_s"],
        "predicted_pass_on_s": pred[True]["pass_s"],
        "predicted_over_measured_off": pred[False]["step_s"] / off["step_s"],
        "predicted_over_measured_on": pred[True]["step_s"] / on["step_s"],
        "same_losses": all(a.get("loss") == b.get("loss") for a, b in zip(runs[False], runs[True])),
    }
    c = predicted(o, write_link_profile(lf, calibrated_device, tmp / f"profile-{rate:g}-calibrated.yaml"))
    out.update(
        calibrated_predicted_off_s=c["off"]["step_s"],
        calibrated_predicted_on_s=c["on"]["step_s"],
        calibrated_predicted_speedup=c["speedup"],
        calibrated_predicted_exposed_a2a_on_s=c["on"]["exposed_a2a_s"],
        calibrated_predicted_exposed_a2a_off_s=c["off"]["exposed_a2a_s"],
        calibrated_predicted_over_measured_exposed_off=(
            c["off"]["exposed_a2a_s"] / off["exposed_s"] if off["exposed_s"] > 0 else float("inf")
        ),
        calibrated_predicted_ep_comm_host_on_s=c["on"]["breakdown_s"].get("ep_comm_host", 0.0),
        calibrated_predicted_ep_token_counts_on_s=c["on"]["breakdown_s"].get("ep_token_counts", 0.0),
        calibrated_predicted_over_measured_off=c["off"]["step_s"] / off["step_s"],
        calibrated_predicted_over_measured_on=c["on"]["step_s"] / on["step_s"],
        calibrated_predicted_over_measured_speedup=c["speedup"] / out["speedup"],
        calibrated_predicted_over_measured_exposed_on=(
            c["on"]["exposed_a2a_s"] / on["exposed_s"] if on["exposed_s"] > 0 else float("inf")
        ),
    )
    out["goals"] = goals_met(out)
    out["goals_met"] = all(out["goals"].values())
    # what the figures come from: the profiles predicted with, every timed step of every run, the link's probe
    out["profile"] = link_profile(lf, device)
    out["calibrated_profile"] = link_profile(lf, calibrated_device)
    out["raw"] = {"link": lf, "off_runs": runs[False], "on_runs": runs[True], "unshaped": measured["unshaped"]}
    return out


def _per_node_us(runs: list[dict]) -> float:
    """The runs' median wait per dispatch or combine for the other rank's call, us."""
    return statistics.median(w / n for run in runs for w, n in zip(run["peer_wait_s"], run["a2a_nodes"])) * 1e6


def goals_met(case: dict) -> dict[str, bool]:
    """Each of :data:`GOALS` for one rate's figures (:func:`_rate_case`)."""
    return {
        "exposed_off_prediction": abs(case["calibrated_predicted_over_measured_exposed_off"] - 1)
        <= GOALS["exposed_off_prediction"],
        "exposed_on_bound": case["calibrated_predicted_over_measured_exposed_on"] <= GOALS["exposed_on_bound"],
        "speedup_bound": case["calibrated_predicted_over_measured_speedup"] >= GOALS["speedup_bound"],
    }


def _device(ranks, o: dict) -> dict:
    """This machine's profile for the two ranks now (:func:`k2.launcher.benchmarks.perf_model.device_profile`;
    the link's measured figures replace its collectives)."""
    from k2.launcher.benchmarks.perf_model import device_profile

    return device_profile(2, 1, o["repeats"], ranks, {"collective_gbps": 1.0, "p2p_gbps": 1.0, "latency_us": 0.0})[
        "profile"
    ]


def _check_options(o: dict) -> None:
    """Refuses a bad option (:class:`ConfigError` naming it and the allowed values) before any run."""
    check_minimums(
        o,
        {
            "iters": 2,
            "rounds": 1,
            "repeats": 1,
            "timeout": 1,
            "micro_batch_size": 1,
            "global_batch_tokens": 1,
            "moe_ffn_hidden_size": 1,
            "num_layers": 2,
        },
    )
    if not all(isinstance(r, (int, float)) and not isinstance(r, bool) and r > 0 for r in o["rates"]):
        raise ConfigError(
            f"bench.options.rates={o['rates']!r}; allowed: [] (auto), or a list of link rates in Mbit/s > 0"
        )
    if not (
        isinstance(o["balance"], (list, tuple))
        and o["balance"]
        and all(isinstance(b, (int, float)) and b > 0 for b in o["balance"])
    ):
        raise ConfigError(
            f"bench.options.balance={o['balance']!r}; allowed: a list of numbers > 0 (all-to-all "
            "time on the wire over compute, one link rate each)"
        )


def bench_ep_overlap(cfg: K2Config) -> dict[str, Any]:
    """Step time and exposed all-to-all time with ``pipeline.ep_overlap`` off and on across a shaped link,
    and k2-plan's prediction of both (module docstring).

    Raises:
        ConfigError: a bad option, or no root / ``ip`` / ``tc`` (one line saying so).
    """
    o = bench_options(cfg, _DEFAULTS)
    _check_options(o)
    check_can_shape()
    from k2.launcher.benchmarks.operator_cost import OperatorRanks
    from k2.launcher.benchmarks.perf_model import median_measurement
    from k2.launcher.training.prepare import prepare_run

    with tempfile.TemporaryDirectory(prefix="k2-bench-ep-overlap-") as tmp_name:
        tmp = Path(tmp_name)
        run_cfg = load_config(_overrides(o, tmp / "check", True))
        prepare_run(run_cfg, 2)  # a bad setting fails here, before any namespace exists
        if run_cfg.data.path is None:
            from k2.launcher.datasets.corpus import prepare_stdlib_corpus

            prepare_stdlib_corpus(run_cfg.data, progress=False, verbose=False)
        shape = [f"model.num_layers={o['num_layers']}", f"model.moe_ffn_hidden_size={o['moe_ffn_hidden_size']}"]
        with ShapedLink(o["number"]) as link, OperatorRanks(2, shape) as ranks:
            # the operators measured on this benchmark's model before and after the runs (their median: the
            # machine's speed drifts over the minutes the runs take), the links' figures per rate
            before = _device(ranks, o)
            calibration: dict = {}
            unshaped = None
            rates = [float(r) for r in o["rates"]]
            if not rates:
                rates, calibration, unshaped = _auto_rates(link, o, tmp)
            measured = [
                _rate_runs(link, o, float(rate), tmp, unshaped if i == 0 else None) for i, rate in enumerate(rates)
            ]
            device = median_measurement([before, _device(ranks, o)])
        cases = [_rate_case(o, m, device, tmp) for m in measured]
    figures = {
        "model": o["model"],
        "layout": "PP1 x EP2 x DP2, one rank per node",
        "rates_mbit": rates,
        **calibration,
        "goals": GOALS,
        "cases": cases,
        "device_profile": device,
        "all_goals_met": all(c["goals_met"] for c in cases),
    }
    path = write_record(o, figures)
    # the table and the JSON record: the derived figures (the raw timings and the profiles are in the file)
    brief = {k: v for k, v in figures.items() if k not in ("cases", "device_profile")}
    brief["cases"] = [{k: v for k, v in c.items() if k not in _FILE_ONLY} for c in cases]
    return {**brief, "results_file": str(path) if path else None}


#: a rate's entries that only the results file holds (every timed step, the profiles)
_FILE_ONLY = ("raw", "profile", "calibrated_profile")


def write_record(o: dict, figures: dict) -> Path | None:
    """The run's results file (:mod:`k2.launcher.benchmarks.results`: written only now, the run complete) in
    ``bench.options.results_dir`` ("" = ``benchmarks/results``; ``none``: no file). Returns its path."""
    from k2.launcher.benchmarks.results import RESULTS_DIR, results_record, write_results

    if o["results_dir"] == "none":
        return None
    options = {k: v for k, v in o.items() if k != "results_dir"}
    return write_results(results_record("ep_overlap", options, figures), o["results_dir"] or RESULTS_DIR)
