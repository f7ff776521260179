"""k2-plan: parameter counts (meta-device megatron modules) and the pipeline layout.

The closed forms below are written from the model numbers alone (docs/k2_reference.md "Model"), independently of
model/params.py, and must equal its counts exactly.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
import time

import pytest

from k2.config.load import load_config
from k2.launcher.plan import main
from k2.model.params import classify_param, count_params
from support import REPO as ROOT
from support import free_port
from support.distributed import rank_launch_cmd, trainer_env

K2_OFFICIAL_TOTAL = 1_026_470_731_056  # docs/k2_reference.md: the official config sum incl. embeddings


def closed_form(
    *, hidden, layers, dense_layers, ffn, q_lora, kv_lora, qk, rope, v, heads, experts, moe_ffn, topk, shared_ffn, vocab
):
    """(total, active) parameters of a K2-family model (untied embeddings, RMSNorm weights only,
    no biases; MLA with RMSNorm on the q and kv latents; SwiGLU MLPs = 3 matrices)."""
    attention = (
        hidden  # input RMSNorm
        + hidden * q_lora
        + q_lora  # q down-projection + q-latent RMSNorm
        + q_lora * heads * (qk + rope)  # q up-projection (nope + rope parts)
        + hidden * (kv_lora + rope)
        + kv_lora  # kv down-projection (+ shared rope key) + kv-latent norm
        + kv_lora * heads * (qk + v)  # kv up-projection (k nope + v)
        + heads * v * hidden  # output projection
    )
    mlp_norm = hidden
    dense_mlp = 3 * hidden * ffn
    router = experts * hidden
    expert = 3 * hidden * moe_ffn
    shared = 3 * hidden * shared_ffn
    moe_layers = layers - dense_layers
    outer = 2 * vocab * hidden + hidden  # embedding + output head + final norm
    common = outer + layers * (attention + mlp_norm) + dense_layers * dense_mlp
    total = common + moe_layers * (router + experts * expert + shared)
    active = common + moe_layers * (router + topk * expert + shared)
    return total, active


K2 = dict(
    hidden=7168,
    layers=61,
    dense_layers=1,
    ffn=18432,
    q_lora=1536,
    kv_lora=512,
    qk=128,
    rope=64,
    v=128,
    heads=64,
    experts=384,
    moe_ffn=2048,
    topk=8,
    shared_ffn=2048,
    vocab=163840,
)
TINY = dict(
    hidden=128,
    layers=4,
    dense_layers=1,
    ffn=384,
    q_lora=64,
    kv_lora=32,
    qk=32,
    rope=16,
    v=32,
    heads=4,
    experts=8,
    moe_ffn=64,
    topk=2,
    shared_ffn=64,
    vocab=4096,
)


@pytest.fixture(scope="module")
def k2_counts():
    """kimi_k2 counts and the seconds the counting took (megatron already imported: the import alone
    costs several seconds on a cold, loaded machine and says nothing about the counting)."""
    import megatron.core.models.gpt.gpt_model  # noqa: F401

    cfg = load_config(["model=kimi_k2"])
    t0 = time.perf_counter()
    counts = count_params(cfg)
    return counts, time.perf_counter() - t0


def test_k2_counts_equal_closed_form(k2_counts):
    counts, seconds = k2_counts
    total, active = closed_form(**K2)
    assert counts.total == total == 1_026_408_209_408
    assert counts.active == active == 32_861_477_888
    assert counts.routed_expert == 3 * 7168 * 2048
    assert counts.routed_experts == 384 * counts.routed_expert
    assert counts.router == 384 * 7168
    assert counts.embedding == counts.output_head == 163840 * 7168
    assert abs(counts.total - K2_OFFICIAL_TOTAL) / K2_OFFICIAL_TOTAL < 0.005
    assert seconds < 20, f"counting kimi_k2 took {seconds:.1f} s"


def test_counting_creates_no_process_group(monkeypatch):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    def forbidden(*args, **kwargs):
        raise AssertionError("k2-plan must not create process groups")

    was_initialized = dist.is_initialized()
    for mod, fn in ((dist, "init_process_group"), (dist, "new_group"), (ps, "initialize_model_parallel")):
        monkeypatch.setattr(mod, fn, forbidden)
    counts = count_params(load_config(["model=kimi_k2"]))
    assert counts.total == closed_form(**K2)[0]
    assert dist.is_initialized() == was_initialized


def test_tiny_counts_equal_closed_form():
    counts = count_params(load_config(["model=k2_tiny"]))
    assert (counts.total, counts.active) == closed_form(**TINY)


def test_tied_embeddings_counted_once():
    untied = count_params(load_config(["model=k2_tiny"]))
    tied = count_params(load_config(["model=k2_tiny", "model.share_embeddings_and_output_weights=true"]))
    assert tied.output_head == 0
    assert tied.total == untied.total - 4096 * 128


def _run_cli(capsys, argv):
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_json_kimi_k2_256gpu(capsys):
    rc, out, _ = _run_cli(
        capsys, ["model=kimi_k2", "parallel=k2_256gpu", "cluster.nodes=32", "cluster.gpus_per_node=8", "output=json"]
    )
    assert rc == 0
    plan = json.loads(out)  # exactly one JSON object on stdout
    assert abs(plan["params_total"] - K2_OFFICIAL_TOTAL) / K2_OFFICIAL_TOTAL < 0.005
    assert 32.4e9 <= plan["params_active"] <= 33.0e9
    assert (plan["world_size"], plan["pp"], plan["vpp"], plan["ep"], plan["dp"]) == (256, 16, 2, 16, 16)
    layout = plan["layout"]
    assert len(layout) == 16 and all(len(stages) == 2 for stages in layout)
    flat = sorted(i for stages in layout for ids in stages for i in ids)
    assert flat == list(range(61))  # every layer exactly once
    # K2 layout "Et|(tt|)*30L": pipeline order vpp_stage * pp + pp_rank
    assert layout[0][0] == [0] and layout[1][0] == [1, 2] and layout[0][1] == [31, 32]
    assert layout[15][1] == []
    assert plan["embedding_stage"] == {"pp_rank": 0, "vpp_stage": 0}
    assert plan["loss_stage"] == {"pp_rank": 15, "vpp_stage": 1}
    # stage and rank tables add up to the model
    assert sum(s["params"] for s in plan["stages"]) == plan["params_total"]
    assert sum(r["params"] for r in plan["pp_ranks"]) == plan["params_total"]
    p = plan["params"]
    for r in plan["pp_ranks"]:  # routed experts split over ep=16, the rest replicated (tp=1)
        n_moe = sum(1 for i in r["layers"] if i >= 1)  # layer 0 is the dense one
        experts = n_moe * p["routed_experts_per_moe_layer"]
        assert r["params_per_gpu"] == r["params"] - experts + experts // 16
        assert r["bf16_param_bytes_per_gpu"] == 2 * r["params_per_gpu"]
    assert plan["param_and_grad_bytes_total"] == 6 * plan["params_total"]


def test_cli_text(capsys):
    rc, out, _ = _run_cli(capsys, ["model=k2_tiny", "parallel=cpu4", "cluster.nodes=1", "cluster.gpus_per_node=4"])
    assert rc == 0
    assert "params_total" in out and "params_active" in out and "pp rank" in out
    total, active = closed_form(**TINY)
    assert f"{total:,}" in out and f"{active:,}" in out


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["parallel=k2_256gpu", "cluster.nodes=3"], "parallel.pp=16"),
        (["parallel=k2_256gpu", "parallel.ep=7"], "parallel.ep=7"),
        (["parallel=k2_256gpu", "parallel.layout=Ett|L"], "parallel.layout"),
        (["cluster.nodes=0"], "cluster.nodes"),
        (["output=yaml"], "output"),
        (["cluster.gpus=4"], "cluster.gpus"),
        (["model.first_k_dense_replace=99"], "model.first_k_dense_replace"),
        (["parallel=k2_256gpu", "cluster.nodes=48"], "cluster.nodes=48"),
        (["cluster.peak_tflops=0"], "cluster.peak_tflops"),
        (["cluster.gpu_memory_gib=-80"], "cluster.gpu_memory_gib"),
        (["plan.step_time_s=0"], "plan.step_time_s"),
        (["plan.compute_efficiency=1.5"], "plan.compute_efficiency"),
        (["optim.offload_fraction=2"], "optim.offload_fraction"),
        (["memory.recompute=[attention]"], "memory.recompute"),
        (["output=csv"], "output"),
    ],
)
def test_bad_inputs_exit_2(capsys, overrides, named):
    rc, out, err = _run_cli(capsys, ["model=kimi_k2", *overrides])
    assert rc == 2
    assert out == ""
    assert err.startswith("k2-plan: error: ") and named in err


_REAL_BUILD = textwrap.dedent(
    """
    import json, os, sys, warnings
    warnings.simplefilter("ignore")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = sys.argv[1]
    from k2.config import load_config
    from k2.model.build import build_model_chunks, transformer_config
    from k2.parallel.dims import ParallelDims
    from k2.parallel.distributed import DistEnv, destroy_distributed, init_distributed

    cfg = load_config(["model=k2_tiny", "parallel=single"])
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, 1)
    init_distributed(DistEnv(0, 1, 0, False), dims, seed=1)
    chunks = build_model_chunks(cfg, dims, transformer_config(cfg, dims))
    sizes = {n: p.numel() for c in chunks for n, p in c.named_parameters()}
    destroy_distributed()
    print("SIZES=" + json.dumps(sizes))
    """
)


def test_tiny_meta_count_equals_real_single_rank_build():
    """The meta count equals the parameters of the k2_tiny model k2-train builds on one gloo rank,
    component by component."""
    proc = subprocess.run(
        rank_launch_cmd(1, ["-c", _REAL_BUILD], [str(free_port())]),
        cwd=ROOT,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(s for s in proc.stdout.splitlines() if s.startswith("SIZES="))
    sizes = json.loads(line[len("SIZES=") :])
    counts = count_params(load_config(["model=k2_tiny"]))
    assert sum(sizes.values()) == counts.total
    moe_layers = [i for i, k in enumerate(counts.moe_pattern) if k]
    per_comp: dict[str, int] = {}
    for name, n in sizes.items():
        comp, _ = classify_param(name, moe_layers)
        per_comp[comp] = per_comp.get(comp, 0) + n
    nd, nm, nl = counts.num_dense_layers, counts.num_moe_layers, counts.num_layers
    assert per_comp == {
        "embedding": counts.embedding,
        "output_head": counts.output_head,
        "final_norm": counts.final_norm,
        "attention": nl * counts.attention,
        "mlp_norm": nl * counts.mlp_norm,
        "dense_mlp": nd * counts.dense_mlp,
        "router": nm * counts.router,
        "routed_experts": nm * counts.routed_experts,
        "shared_experts": nm * counts.shared_experts,
    }


def test_plan_json_and_plot(capsys, tmp_path):
    """k2-plan schedule=k2_15t5: phases with nominal and landed token ranges, steps, LR at each boundary;
    lr_at_tokens for plan.query_tokens; plot= and plot_schedule= each write the PNG they name (closed forms in
    tests/unit/schedules/test_schedule.py)."""
    from support.k2_schedule import ANNEAL_END, K2_BATCH_TOKENS, T, ceil_div, k2_lr

    B = K2_BATCH_TOKENS
    png, schedule_png = tmp_path / "timeline.png", tmp_path / "lr.png"
    query = [0, 500 * B, 10 * T - B, 12_750 * 10**9, 15_500 * 10**9, 15_960 * 10**9, 16 * T]
    rc = main(
        [
            "schedule=k2_15t5",
            "output=json",
            f"plot={png}",
            f"plot_schedule={schedule_png}",
            f"plan.query_tokens=[{','.join(map(str, query))}]",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    plan = json.loads(captured.out)
    s = plan["schedule"]
    assert (s["global_batch_tokens"], s["total_steps"]) == (B, ceil_div(15_960 * 10**9, B))
    ends = [500 * B, 10 * T, 15_500 * 10**9, 15_900 * 10**9, 15_960 * 10**9, 15_960 * 10**9]
    assert [p["name"] for p in s["phases"]] == ["warmup", "stable", "decay", "anneal_4k", "anneal_32k", "yarn_128k"]
    start = 0
    for p, end in zip(s["phases"], ends):
        assert (p["start_tokens"], p["end_tokens"]) == (start, end)
        assert p["end_tokens_exact"] == ceil_div(end, B) * B  # where the boundary lands
        assert p["steps"] == ceil_div(end, B) - ceil_div(start, B)
        assert p["lr_at_start"] == pytest.approx(k2_lr(start), rel=1e-9, abs=1e-15)
        assert p["lr_at_end"] == pytest.approx(k2_lr(end), rel=1e-9)
        assert p["global_batch_size"] * p["seq_length"] == B
        start = end
    assert s["phases"][2]["first_step"] == 149_013
    assert plan["lr_at_tokens"] == pytest.approx([k2_lr(t) for t in query], rel=1e-9, abs=1e-15)
    assert plan["lr_at_tokens"][3] == pytest.approx(1.1e-4) and plan["lr_at_tokens"][-1] == ANNEAL_END
    import matplotlib.image as mpimg
    import numpy as np

    for picture in (png, schedule_png):  # each setting writes the file it names, nothing else
        head = picture.read_bytes()[:8]
        assert head == b"\x89PNG\r\n\x1a\n" and 10_000 < picture.stat().st_size < 300_000
    # decoded: the LR picture draws each phase in its own colour (schedules/plot.py's cycle)
    img = mpimg.imread(schedule_png)[..., :3]
    drawn = [
        c
        for c in ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")
        if np.all(np.abs(img - np.array([int(c[i : i + 2], 16) / 255 for i in (1, 3, 5)])) < 0.03, axis=-1).sum() > 30
    ]
    # stable, decay, anneal_4k, anneal_32k (warmup is 0.03% of the tokens, too thin to show; yarn_128k has
    # no tokens)
    assert {"#ff7f0e", "#2ca02c", "#d62728", "#9467bd"} <= set(drawn), drawn
    assert (mpimg.imread(png)[..., :3] < 0.9).any(axis=-1).mean() > 0.02  # the timeline has boxes in it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lr.png", "timeline.png"]
    assert png.read_bytes() != schedule_png.read_bytes()

    rc = main(["schedule=k2_15t5"])  # text: the exact landing token count of the 10T boundary
    assert rc == 0 and "10,000,026,042,368" in capsys.readouterr().out
    assert main(["schedule=k2_15t5", "plan.query_tokens=[-1]"]) == 2
    assert "plan.query_tokens[0]=-1" in capsys.readouterr().err


def test_node_count_rule(capsys):
    """K2's model-parallel group PP16 x EP16 = 256 GPUs = 32 nodes is reused for any multiple of 32 nodes;
    another node count is refused with the rule and the allowed counts."""
    rc, out, err = _run_cli(capsys, ["model=kimi_k2", "parallel=k2_256gpu", "cluster.nodes=48"])
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "multiple of 32" in err and "allowed cluster.nodes: 32, 64, 96" in err
    rc, out, _ = _run_cli(
        capsys, ["model=kimi_k2", "parallel=k2_256gpu", "cluster.nodes=64", "output=json", "train.micro_batch_size=1"]
    )
    assert rc == 0
    plan = json.loads(out)
    assert plan["model_parallel_group"] == {
        "gpus": 256,
        "nodes": 32.0,
        "replicas": 2,
        "shape": "TP1 x PP16 x EP16",
        "k2_train_runs": True,
    }
    assert (plan["dp"], plan["expert_dp"], plan["num_microbatches"]) == (32, 2, 512)


@pytest.fixture(scope="module")
def k2_plan():
    from k2.launcher.planning.cluster import plan_cluster

    cfg = load_config(
        [
            "model=kimi_k2",
            "parallel=k2_256gpu",
            "train.precision=bf16",
            "train.micro_batch_size=1",
            "memory=k2",
            "optim.offload_fraction=0.5",
            "plan.step_time_s=150",
        ]
    )
    return plan_cluster(cfg).report


def test_k2_plan_json_keys(k2_plan):
    """The keys the issue names, with K2's numbers."""
    from k2.model.flops import flops_per_token

    p = k2_plan
    for key in (
        "params_total",
        "params_active",
        "layout",
        "memory_per_gpu_bytes",
        "bubble_fraction",
        "flops_per_token",
        "global_batch_tokens",
        "fits",
    ):
        assert key in p, key
    mem = p["memory_per_gpu_bytes"]
    assert mem["total"] == pytest.approx(
        mem["params"] + mem["grads"] + mem["optimizer"] + mem["activations"] + mem["transient"] + mem["reserved"]
    )
    assert mem["optimizer"] == pytest.approx(mem["optimizer_offloaded_to_host"])  # half offloaded
    assert isinstance(p["fits"], bool) and p["fits"] == (mem["total"] <= 80 * 2**30)
    assert p["global_batch_tokens"] == 67_108_864 and p["num_microbatches"] == 1024
    assert p["flops_per_token"] == flops_per_token(load_config(["model=kimi_k2"]).model, 4096).training
    # (with the recipe's EP overlap the steady pairs are shorter, the fill and drain are not)
    assert 0 < p["bubble_fraction"] < 0.07
    # MFU of a measured 150 s step: 1.379e19 FLOPs / (150 s x 256 GPUs x 989.4 TFLOP/s, the H800 profile's)
    assert p["mfu"] == pytest.approx(p["flops_per_token"] * 67_108_864 / (150 * 256 * 989.4e12))
    assert p["model_tflops_per_gpu"] == pytest.approx(p["mfu"] * 989.4)
    # every PP rank: fullest DP rank's memory; the fullest GPU is their maximum
    assert max(r["memory_bytes"]["total"] for r in p["pp_ranks"]) == pytest.approx(mem["total"])
    # activations: more microbatches in flight on the first PP ranks (interleaved warm-up: 2 (p-r-1) + p + 1:
    # megatron's warm-up with the EP overlap's extra microbatch, the same peak as the plain 1F1B forward's)
    assert [r["memory_bytes"]["microbatches_in_flight"] for r in p["pp_ranks"]] == [
        2 * (16 - r - 1) + 16 + 1 for r in range(16)
    ]
    assert p["pipeline"]["peak_in_flight_per_rank"][0] == 47


def test_output_table(capsys):
    rc, out, _ = _run_cli(
        capsys, ["model=k2_tiny", "parallel=cpu4", "cluster.nodes=1", "cluster.gpus_per_node=4", "output=table"]
    )
    assert rc == 0
    for needle in ("memory per GPU, GiB", "bubble", "FLOPs per token", "fullest GPU", "model-parallel group"):
        assert needle in out, needle
    # the column of microbatches in flight is labelled as a count, not as GiB like its neighbours
    header = next(ln for ln in out.splitlines() if ln.strip().startswith("pp rank ") and "total" in ln)
    assert "mb in flight" in header and "a count" in out.split(header)[0].splitlines()[-1]


# a cluster of 0.05 GiB "GPUs" (k2_tiny's sizes): without the fixed GPU terms of plan.gpu_overheads (a
# CUDA context alone is 0.5 GiB), which a layout search does not change
NO_GPU_OVERHEADS = [
    f"plan.gpu_overheads.{k}=0"
    for k in ("cuda_context_gib", "nccl_gib_per_communicator", "workspace_gib", "fragmentation")
]


def test_search_small_cluster(capsys):
    """plan.search on 1 node x 4 GPUs (k2_tiny): every valid layout once, fitting ones first, each group
    by estimated step time; each row's layout is one k2-plan accepts."""
    from k2.launcher.planning.cluster import plan_cluster

    cfg = load_config(
        [
            "model=k2_tiny",
            "cluster.nodes=1",
            "cluster.gpus_per_node=4",
            "plan.search=true",
            "cluster.gpu_memory_gib=0.05",
            *NO_GPU_OVERHEADS,
        ]
    )
    rows = plan_cluster(cfg).report["search"]
    assert rows and [r["rank"] for r in rows] == list(range(1, len(rows) + 1))
    keys = {(r["pp"], r["vpp"], r["ep"]) for r in rows}
    assert len(keys) == len(rows)
    assert (1, 1, 1) in keys and (2, 2, 2) in keys and (4, 1, 1) in keys
    fits = [r["fits"] for r in rows]
    assert fits == sorted(fits, reverse=True) and any(fits) and not all(fits)
    for group in (True, False):
        times = [r["step_time_s_estimated"] for r in rows if r["fits"] == group]
        assert times == sorted(times)
    for r in rows:
        assert r["fits"] == (r["memory_per_gpu_bytes"] <= 0.05 * 2**30)
        rc, out, err = _run_cli(
            capsys,
            [
                "model=k2_tiny",
                "cluster.nodes=1",
                "cluster.gpus_per_node=4",
                *NO_GPU_OVERHEADS,
                f"parallel.pp={r['pp']}",
                f"parallel.vpp={r['vpp'] if r['vpp'] > 1 else 'null'}",
                f"parallel.ep={r['ep']}",
                f"parallel.layout={r['layout']}",
                "output=json",
            ],
        )
        assert rc == 0, err
        again = json.loads(out)
        assert again["memory_per_gpu_bytes"]["total"] == pytest.approx(r["memory_per_gpu_bytes"])
        assert again["bubble_fraction"] == pytest.approx(r["bubble_fraction"], rel=1e-9)


def test_search_kimi_k2_on_32_nodes_matches_the_readme():
    """docs/planning.md: ``k2-plan model=kimi_k2 parallel=k2_256gpu plan.search=true`` on 32 nodes lists
    111 valid (PP, VPP, EP) layouts, 6 of which fit every phase of K2's schedule (with the GPU's transient
    and reserved terms, launcher/planning/device_memory.py). With K2's EP overlap (the recipe's
    pipeline.ep_overlap, megatron's combined 1F1B where a layout has virtual stages) K2's own PP16 x VPP2 x
    EP16 ranks first (78.4 GiB on the fullest GPU, ~136 s per step on the H800 profile, the step-time
    model's figure: its all-to-alls hidden, their NCCL kernels' SMs taken from the compute beside them),
    ahead of the EP8 layout whose all-to-all stays inside a node: it has no virtual stages (VPP2 with EP8
    does not fit), so megatron cannot overlap it, and it stays at ~179 s (its 48 local experts' weight
    gradients, added into FP32 buffers, are memory-bound at 1 / 8 of the tokens per expert). Each fitting row fits
    both the GPU and the host (the search's verdict is the planner's)."""
    from k2.launcher.planning.cluster import plan_cluster

    cfg = load_config(["model=kimi_k2", "parallel=k2_256gpu", "plan.search=true"])
    rows = plan_cluster(cfg).report["search"]
    fit = [r for r in rows if r["fits"]]
    assert (len(rows), len(fit)) == (111, 6)
    assert rows[: len(fit)] == fit  # the fitting layouts first
    assert all(r["memory_per_gpu_bytes"] <= 80 * 2**30 for r in fit)
    k2 = [r for r in fit if (r["pp"], r["vpp"], r["ep"]) == (16, 2, 16)]
    assert len(k2) == 1 and k2[0]["ep_overlap"]
    assert round(k2[0]["memory_per_gpu_bytes"] / 2**30, 1) == 78.4
    assert round(k2[0]["step_time_s_estimated"]) == 136
    assert [(r["pp"], r["vpp"], r["ep"]) for r in fit[:3]] == [(16, 2, 16), (8, 2, 32), (8, 3, 32)]
    ep8 = [r for r in fit if r["ep"] == 8]
    assert [(r["pp"], r["vpp"]) for r in ep8] == [(32, 1)]
    assert all(not r["ep_overlap"] and 175 < r["step_time_s_estimated"] < 182 for r in ep8)
    assert not any(r["fits"] for r in rows if (r["pp"], r["vpp"], r["ep"]) == (16, 2, 8))
