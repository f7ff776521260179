"""K2's communication overlap (``pipeline.ep_overlap``: megatron-core's combined-1F1B EP overlap; K2 report
"Training system") through the real trainer on gloo ranks, as K2 trains: ``memory=k2`` (FP8 storage,
selective recompute, offload), ``optim=muonclip`` (QK-Clip), ``pipeline.decouple_wgrad``.

* Same numbers: on ``cpu4`` (PP2 x VPP2 x EP2 x DP2, ZeRO-1, 4 ranks; megatron's interleaved schedule) and on
  PP1 x EP2 x DP2 (2 ranks; its schedule without pipelining), 3 steps with the overlap on and off: every
  step's loss, gradient norm and max logits, every rank's accumulated gradients at every step and every
  parameter after the last step are bitwise equal.
* A resume of an overlap run (from its step-2 checkpoint, one step) is bitwise equal to the uninterrupted run.
* The trace shows the overlap: on every rank, in every steady-state 1F1B step, each dispatch and combine
  all-to-all of each MoE layer ran on the communication thread, posted before and waited for after compute
  (F, B or W) of the other microbatch of the pair, most of them at the same time as that compute; with the
  overlap off every one ran inline on the compute thread, beside nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from support.distributed import run_trainer

pytestmark = pytest.mark.slow

#: the runs' length, and the step whose checkpoint the resume test starts from (steps 2-3 see updated
#: weights and optimizer states; the resume runs the last step)
STEPS, SAVED_STEP = 3, 2
RUN = [
    "memory=k2",
    "optim=muonclip",
    "pipeline.decouple_wgrad=true",
    f"train.iters={STEPS}",
    "train.eval_interval=0",
    "schedule.phases.0.steps=0",
    "run.seed=7",
    f"train.save_interval={SAVED_STEP}",
    "checkpoint.save_at_end=false",
]
#: {layout: (overrides, ranks)}
LAYOUTS = {
    "cpu4": (["parallel=cpu4"], 4),
    # without pipelining (megatron's combined_1f1b_schedule_for_no_pipelining): the rank count is not what
    # this layout tests, so 2 ranks (4 microbatches of 2 sequences per DP rank, 3 pairs per step)
    "pp1_ep2": (["parallel=single", "parallel.ep=2", "launch.nproc_per_node=2"], 2),
}
METRICS = (
    "loss",
    "grad_norm",
    "max_attn_logit",
    "max_attn_logit_per_layer",
    "qk_clipped_heads",
    "moe_load_max_over_mean",
)


def _run(root: Path, layout: str, overlap: bool, extra: tuple = ()) -> dict:
    tag = "-" + "-".join(e.split("=")[0] for e in extra) if extra else ""
    out = root / f"{layout}-{'on' if overlap else 'off'}{tag}"
    overrides, nproc = LAYOUTS[layout]
    records = run_trainer(
        [
            *overrides,
            *RUN,
            f"pipeline.ep_overlap={str(overlap).lower()}",
            f"pipeline.trace={out / 'trace'}",
            *extra,
        ],
        nproc,
        out / "run",
        script="dump_params_train.py",
        env={"K2_TEST_OUT": str(out / "dump"), "K2_DUMP_GRADS": "1"},
    )
    traces = {}
    for path in sorted((out / "trace").glob("rank*.jsonl")):
        events = [json.loads(line) for line in path.read_text().splitlines()]
        traces[events[0]["rank"]] = events
    dumps = {
        r: (torch.load(out / "dump" / f"grads_rank{r}.pt"), torch.load(out / "dump" / f"params_rank{r}.pt"))
        for r in range(nproc)
    }
    return {"records": records, "traces": traces, "dumps": dumps, "run": out / "run"}


# what reads a checkpoint: the resume test, of cpu4 with the overlap on; the other three runs write none
# (~1.4 CPU-s per save of a 4-rank run), so their numbers are compared with a run that saved
NO_SAVES = ("train.save_interval=null",)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, stdlib_corpus):
    root = tmp_path_factory.mktemp("ep_overlap")
    return {
        (layout, overlap): _run(root, layout, overlap, () if (layout, overlap) == ("cpu4", True) else NO_SAVES)
        for layout in LAYOUTS
        for overlap in (False, True)
    }


def _assert_bitwise(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what} {name}: max |diff| {(a[name] - b[name]).abs().max()}"


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_same_numbers_with_the_overlap_on_and_off(runs, layout):
    off, on = runs[(layout, False)], runs[(layout, True)]
    assert [r["step"] for r in on["records"]] == list(range(1, STEPS + 1))
    for a, b in zip(off["records"], on["records"]):
        for key in METRICS:
            assert a[key] == b[key], (layout, a["step"], key, a[key], b[key])
    for rank in range(LAYOUTS[layout][1]):
        (g_off, p_off), (g_on, p_on) = off["dumps"][rank], on["dumps"][rank]
        assert len(g_off) == len(g_on) == STEPS
        for step, (x, y) in enumerate(zip(g_off, g_on), start=1):
            _assert_bitwise(x, y, f"{layout} rank {rank} step {step} grad")
        _assert_bitwise(p_off, p_on, f"{layout} rank {rank} param")
    # expert weights on both EP ranks are among them
    names = {n for r in on["dumps"] for n in on["dumps"][r][1] if ".global_experts." in n}
    assert len({n.split(".global_experts.")[1].split(".")[0] for n in names}) == 8


def test_resume_of_an_overlap_run_is_bitwise_the_uninterrupted_run(runs, tmp_path):
    on = runs[("cpu4", True)]
    ckpt = on["run"] / "checkpoints" / f"iter_{SAVED_STEP:07d}"
    assert ckpt.is_dir()
    resumed = _run(tmp_path, "cpu4", True, (f"resume.from={ckpt}",))
    assert [r["step"] for r in resumed["records"]] == list(range(SAVED_STEP + 1, STEPS + 1))
    for a, b in zip(on["records"][SAVED_STEP:], resumed["records"]):
        for key in METRICS:
            assert a[key] == b[key], (a["step"], key)
    for rank in range(4):
        _assert_bitwise(on["dumps"][rank][1], resumed["dumps"][rank][1], f"resumed rank {rank} param")


# --- the trace ------------------------------------------------------------------------------------------


def _steady_pairs(pp: int, vpp: int, m: int, pp_rank: int) -> list[tuple[tuple, tuple]]:
    """megatron's steady-state 1F1B pairs of a PP rank with the overlap's extra warm-up microbatch:
    ``[((forward chunk, microbatch), (backward chunk, microbatch))]``
    (``pipeline_parallel/schedules.py`` ``get_pp_rank_microbatches`` / ``get_schedule_table``;
    ``combined_1f1b_schedule_for_no_pipelining`` without PP)."""
    if pp == 1:
        return [((0, i + 1), (0, i)) for i in range(m - 1)]
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    table = get_schedule_table(m, vpp, pp)
    warmup = min(len(table), (pp - pp_rank - 1) * 2 + (vpp - 1) * pp + 1)
    return [
        ((table[warmup + k][1], table[warmup + k][0]), (vpp - 1 - table[k][1], table[k][0]))
        for k in range(len(table) - warmup)
    ]


def _moe_layers(layout: str) -> dict:
    """{(pp_rank, chunk): [1-based MoE layer numbers]} of k2_tiny (layer 1 dense) on ``layout``."""
    from k2.config.load import load_config
    from k2.parallel.dims import ParallelDims

    overrides, nproc = LAYOUTS[layout]
    cfg = load_config(overrides)
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, nproc)
    k = int(cfg.model.first_k_dense_replace)
    return {(r, v): [i + 1 for i in dims.stage_layers[r][v] if i >= k] for r in range(dims.pp) for v in range(dims.vpp)}


def unhidden_all_to_alls(traces: dict, layout: str) -> tuple[int, list]:
    """Check every dispatch / combine of every steady-state pair (module docstring).

    Returns:
        ``(number checked, failures, how many ran at the same time as the other microbatch's compute)``: a
        failure is ``(rank, step, (chunk, microbatch), what, direction, layer, why)``.
    """
    moe = _moe_layers(layout)
    pp = 1 + max(r for r, _ in moe)
    vpp = 1 + max(v for _, v in moe)
    checked, failures, overlapped = 0, [], 0
    for rank, events in traces.items():
        pp_rank = events[0]["pp_rank"]
        steps = {}
        for e in events:
            if e["pass"] == "train":
                steps.setdefault(e["step"], []).append(e)
        for step, evs in steps.items():
            m = _microbatches(evs)
            for f, b in _steady_pairs(pp, vpp, m, pp_rank):
                todo = [
                    (f, b, what, "forward", layer) for layer in moe[(pp_rank, f[0])] for what in ("dispatch", "combine")
                ]
                todo += [
                    (b, f, what, "backward", layer)
                    for layer in moe[(pp_rank, b[0])]
                    for what in ("dispatch", "combine")
                ]
                for mine, other, what, direction, layer in todo:
                    checked += 1
                    why = _hidden(evs, mine, other, what, direction, layer)
                    if why:
                        failures.append((rank, step, mine, what, direction, layer, why))
                    overlapped += overlapped_in_time(evs, mine, other, what, direction, layer)
    return checked, failures, overlapped


def _microbatches(evs: list) -> int:
    return len({e["microbatch"] for e in evs if e["kind"] == "F" and e["chunk"] == 0})


def _hidden(evs: list, mine: tuple, other: tuple, what: str, direction: str, layer: int) -> str:
    """'' when the all-to-all's first post and last wait enclose compute of ``other`` and the collective
    ran on the communication thread; else why not (``overlapped in time`` is counted apart:
    :func:`overlapped_in_time`)."""
    ours = [
        e
        for e in evs
        if e.get("what") == what
        and e.get("direction") == direction
        and e.get("layer") == layer
        and (e["chunk"], e["microbatch"]) == mine
    ]
    posts = [e["seq"] for e in ours if e["kind"] == "post"]
    waits = [e["seq"] for e in ours if e["kind"] == "wait"]
    if not posts or not waits:
        return f"not in the trace ({len(posts)} posts, {len(waits)} waits)"
    threads = {e.get("thread") for e in ours if e["kind"] == "a2a"}
    if not threads or "MainThread" in threads:
        return f"ran on {sorted(map(str, threads))}, not the communication thread"
    lo, hi = min(posts), max(waits)
    for e in evs:
        if lo < e["seq"] < hi and e["kind"] in ("F", "B", "W") and other in _tags(e):
            return ""
    return "no compute of the other microbatch between post and wait"


def _tags(e: dict) -> list:
    return [tuple(t) for t in e.get("tags") or [] if t] or [(e["chunk"], e["microbatch"])]


def overlapped_in_time(evs: list, mine: tuple, other: tuple, what: str, direction: str, layer: int) -> bool:
    """The all-to-all's collective (its ``a2a`` event's start and end) and a compute node of ``other`` ran at
    the same time."""
    a2a = [
        e
        for e in evs
        if e["kind"] == "a2a"
        and e.get("what") == what
        and e.get("direction") == direction
        and e.get("layer") == layer
        and (e["chunk"], e["microbatch"]) == mine
    ]
    compute = [e for e in evs if e["kind"] in ("F", "B", "W") and other in _tags(e)]
    return any(min(a["end"], c["end"]) > max(a["start"], c["start"]) for a in a2a for c in compute)


def test_trace_shows_each_all_to_all_hidden_under_the_other_microbatch(runs):
    for layout in LAYOUTS:
        on, off = runs[(layout, True)], runs[(layout, False)]
        checked, failures, overlapped = unhidden_all_to_alls(on["traces"], layout)
        assert checked >= len(on["traces"]) * STEPS * 4 and not failures, (layout, checked, failures[:5])
        # each ran on the communication thread (a failure above otherwise), and they ran while the other
        # microbatch computed: most of them in time too (k2_tiny's all-to-alls on loopback take tens of
        # microseconds, so one may finish before the other microbatch's node starts)
        assert overlapped >= checked // 2, (layout, overlapped, checked)
        # the pairs megatron ran are the ones the check expects
        pairs = {
            (e["rank"], e["step"], tuple(e["f"]), tuple(e["b"]))
            for t in on["traces"].values()
            for e in t
            if e["kind"] == "pair" and e["f"] and e["b"] and e["pass"] == "train"
        }
        moe = _moe_layers(layout)
        pp, vpp = 1 + max(r for r, _ in moe), 1 + max(v for _, v in moe)
        for rank, events in on["traces"].items():
            for step in range(1, STEPS + 1):
                m = _microbatches([e for e in events if e["step"] == step and e["pass"] == "train"])
                expect = _steady_pairs(pp, vpp, m, events[0]["pp_rank"])
                assert m == 4 and {(f, b) for r, s, f, b in pairs if r == rank and s == step} == set(expect), (
                    rank,
                    step,
                    m,
                )
        # without the overlap every one of them is posted and waited for with nothing in between
        # without the overlap every one of them runs inline on the compute thread, with nothing beside it
        checked_off, failures_off, overlapped_off = unhidden_all_to_alls(off["traces"], layout)
        assert checked_off == checked and len(failures_off) == checked_off, (layout, checked_off, len(failures_off))
        assert all(f[-1].startswith("ran on ['MainThread']") for f in failures_off)
        assert overlapped_off == 0
