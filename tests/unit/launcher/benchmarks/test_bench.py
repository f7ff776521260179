"""k2-bench: registry, output formats, and the attention benchmark's accuracy figure."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from k2.launcher.bench import main
from k2.launcher.benchmarks.attention import reference_attention
from k2.launcher.benchmarks.registry import BENCHMARKS, benchmark
from support.helpers import run_tool


def test_none_lists_benchmarks(capsys):
    rc, out, _ = run_tool(capsys, main, [])
    assert rc == 0
    assert "attention" in out
    rc, out, _ = run_tool(capsys, main, ["bench=none", "output=json"])
    assert rc == 0
    available = json.loads(out)["available"]
    assert set(available) == set(BENCHMARKS)
    for name, text in available.items():  # whole sentences: the docstring's first one, not its first line
        doc = " ".join(benchmark(name).__doc__.split())
        assert doc.startswith(text) and text.endswith((".", ")")) and text.count("(") == text.count(")"), text


def test_attention_json_fp32_matches_reference(capsys):
    rc, out, _ = run_tool(capsys, main, ["bench=attention", "output=json"])
    assert rc == 0
    record = json.loads(out)  # exactly one JSON object on stdout
    assert record["bench"] == "attention"
    for key in ("torch", "megatron_core", "device", "cpu_count"):
        assert record["system"][key]
    cpu = record["figures"]["cpu"]
    assert cpu["dtype"] == "fp32" and cpu["shape_sbhd"] == [256, 2, 4, 48] and cpu["v_head_dim"] == 32
    assert cpu["max_abs_diff"] < 1e-5
    assert cpu["max_logit_abs_diff"] < 1e-5
    for key in ("time_k2_ms", "time_k2_no_record_ms", "time_reference_ms", "k2_over_reference"):
        assert cpu[key] > 0
    assert "max_logit_overhead" in cpu
    if torch.cuda.is_available():  # K2 shape in bf16 on the GPU
        cuda = record["figures"]["cuda"]
        assert cuda["shape_sbhd"] == [4096, 1, 64, 192] and cuda["v_head_dim"] == 128
        assert cuda["k2_max_abs_diff_vs_fp32"] <= 2 * cuda["reference_max_abs_diff_vs_fp32"] + 1e-2
        assert cuda["max_logit_abs_diff"] < 0.1


def test_attention_text_and_options(capsys):
    rc, out, _ = run_tool(
        capsys,
        main,
        ["bench=attention", "bench.options.seq_length=64", "bench.options.repeats=2", "bench.options.devices=cpu"],
    )
    assert rc == 0
    assert "max_abs_diff" in out and "[64, 2, 4, 48]" in out and "megatron-core" in out


def test_optimizer_bench_times_both_in_one_run(capsys):
    """bench=optimizer: MuonClip vs AdamW optimizer step on the CPU proxy (numbers, not speed, checked)."""
    rc, out, _ = run_tool(
        capsys,
        main,
        [
            "bench=optimizer",
            "output=json",
            "bench.options.repeats=1",
            "bench.options.warmup=0",
            "bench.options.dp2=false",
        ],
    )
    assert rc == 0
    fig = json.loads(out)["figures"]
    assert fig["model"] == "k2_tiny" and fig["newton_schulz"] == "bf16"
    assert fig["muon_elements"] > 0 and fig["adamw_elements"] > 0
    assert min(fig["time_adamw_ms"], fig["time_muon_step_ms"], fig["time_qk_clip_ms"]) > 0
    assert fig["muonclip_over_adamw"] == pytest.approx(
        (fig["time_muon_step_ms"] + fig["time_qk_clip_ms"]) / fig["time_adamw_ms"]
    )


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["+bench.options.seq_len=64"], "bench.options.seq_len"),
        (["bench.options.dtype=fp16"], "bench.options.dtype"),
        (["bench.options.seq_length=abc"], "bench.options.seq_length"),
        (["bench.options.repeats=0"], "bench.options.repeats"),
        (["output=yaml"], "output"),
        (["bench=optimizer", "bench.options.precision=fp16"], "bench.options.precision"),
        (["bench=optimizer", "bench.options.muon_fp32_matmul_prec=low"], "bench.options.muon_fp32_matmul_prec"),
    ],
)
def test_bad_options_exit_2(capsys, overrides, named):
    rc, out, err = run_tool(capsys, main, ["bench=attention", *overrides])
    assert rc == 2 and out == ""
    assert err.startswith("k2-bench: error: ") and named in err


def test_unknown_bench_exit_2(capsys):
    rc, _, err = run_tool(capsys, main, ["bench=nope"])
    assert rc == 2 and "bench" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_requested_without_gpu(capsys):
    rc, _, err = run_tool(capsys, main, ["bench=attention", "bench.options.devices=cuda"])
    assert rc == 2 and "bench.options.devices" in err


def test_reference_attention_matches_sdpa_fp64():
    """The benchmark's reference against torch's own causal SDPA, in fp64."""
    g = torch.Generator().manual_seed(1)
    s, b, h, dk, dv = 33, 2, 3, 8, 5
    q, k = (torch.randn(s, b, h, dk, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(s, b, h, dv, generator=g, dtype=torch.float64)
    scale = dk**-0.5
    out, max_logit = reference_attention(q, k, v, scale)
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    want = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
    torch.testing.assert_close(out.double(), want.permute(2, 0, 1, 3).reshape(s, b, h * dv))
    logits = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    logits = logits.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(max_logit.double(), logits.amax(dim=(0, 2, 3)), rtol=1e-6, atol=1e-6)


# --- bench=pipeline ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["bench.options.devices=tpu"], "bench.options.devices"),
        (["bench.options.iters=1"], "bench.options.iters"),
        (["bench.options.parallel=cpu4", "bench.options.nproc=3"], "parallel.pp"),  # the run itself is checked
    ],
)
def test_pipeline_bench_bad_options_exit_2(capsys, overrides, named, no_process_start):
    rc, out, err = run_tool(capsys, main, ["bench=pipeline", *overrides])
    assert rc == 2 and out == ""
    assert err.startswith("k2-bench: error: ") and named in err


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["bench.options.iters=18", "bench.options.save_interval=4"], "bench.options.iters"),  # not a multiple
        (["bench.options.iters=12", "bench.options.save_interval=4"], "bench.options.iters"),  # two timed saves
        (["bench.options.moe_experts=0"], "bench.options.moe_experts"),
        (["bench.options.sync=1"], "bench.options.sync"),
    ],
)
def test_checkpoint_bench_bad_options_exit_2(capsys, overrides, named, no_process_start):
    rc, out, err = run_tool(capsys, main, ["bench=checkpoint", *overrides])
    assert rc == 2 and out == ""
    assert err.startswith("k2-bench: error: ") and named in err


def test_checkpoint_bench_charges_each_save_its_staging_and_its_later_commit():
    from k2.launcher.benchmarks.checkpoint import per_save_stalls

    # saves at steps 2, 4, 6; a step's record is logged before its save, so save 2's staging (0.5 s)
    # shows at step 3, its commit (0.25 s) at step 4's; save 4: 0.5 + 0.125; the save at the last step
    # (6) is not timed
    cum = [0.0, 0.0, 0.5, 0.75, 1.25, 1.375]
    recs = [{"step": i + 1, "time_checkpoint_s": c} for i, c in enumerate(cum)]
    assert per_save_stalls(recs, 2, 6) == [0.75, 0.625]


# --- bench=step ----------------------------------------------------------------------------------


def test_step_bench_cases_figures_and_ratios(capsys, tmp_path):
    """bench=step on CPU (tiny config): the baseline, the full K2 step and each toggled case, with
    consistent figures and ratios; the JSON written to json_out is the printed record."""
    out_path = tmp_path / "step.json"
    rc, out, err = run_tool(
        capsys,
        main,
        [
            "bench=step",
            "output=json",
            "bench.options.repeats=1",
            "bench.options.seq_length=64",
            f"bench.options.json_out={out_path}",
        ],
    )
    assert rc == 0, err
    record = json.loads(out)
    assert json.loads(out_path.read_text())["figures"] == record["figures"]
    fig = record["figures"]
    cases = fig["cases"]
    assert list(cases) == [
        "baseline",
        "k2",
        "k2_no_qk_clip",
        "k2_no_muon",
        "k2_no_fp8_store",
        "k2_no_recompute",
        "k2_no_grouped_gemm",
    ]
    assert fig["config"]["tokens_per_step"] == 64 and fig["gemm_peak_tflops"] > 0
    base = cases["baseline"]
    for c in cases.values():
        assert c["timed_steps"] == 1 and c["step_ms"] > 0
        assert c["tokens_per_s"] == pytest.approx(64 / (c["step_ms"] / 1e3))
        assert c["model_tflops"] == pytest.approx(fig["config"]["model_flops_per_step"] / (c["step_ms"] / 1e3) / 1e12)
        assert c["mfu"] == pytest.approx(c["model_tflops"] / fig["gemm_peak_tflops"])
        assert c["tokens_per_s_over_baseline"] == pytest.approx(base["step_ms"] / c["step_ms"])
        assert c["saved_activation_bytes_over_baseline"] == pytest.approx(
            c["saved_activation_bytes"] / base["saved_activation_bytes"]
        )
    # each toggle turns off what it names and nothing else (read from the built objects)
    on = cases["k2"]["features"]
    assert on["muon_elements"] > 0 and on["qk_clip"] and on["max_logit_recording"] > 0 and on["grouped_experts"] > 0
    off = {
        "k2_no_qk_clip": {"qk_clip": False, "max_logit_recording": 0},
        "k2_no_muon": {"muon_elements": 0, "qk_clip": True},  # QK-Clip still clips (after AdamW)
        "k2_no_grouped_gemm": {"grouped_experts": 0},
        "k2_no_fp8_store": {},
        "k2_no_recompute": {},
    }
    for name, changed in off.items():
        assert cases[name]["features"] == {**on, **changed}, name
    assert "features" not in base  # (the megatron baseline is not a K2 build)
    assert all(c["mfu"] < 1 for c in cases.values())  # the measured GEMM peak bounds every step
    # the memory features show in the measured saved bytes
    k2 = cases["k2"]["saved_activation_bytes"]
    assert k2 < cases["k2_no_fp8_store"]["saved_activation_bytes"]
    assert k2 < cases["k2_no_recompute"]["saved_activation_bytes"]
    assert k2 < base["saved_activation_bytes"]


def test_step_bench_memory_k2_adds_a_no_offload_case_that_drops_only_offload():
    """bench.options.memory=k2 (the documented GPU run): the cases gain ``k2_no_offload``, whose overrides
    differ from ``k2``'s in ``memory.offload`` alone (emptied); with the default (``k2_no_offload``)
    offload is never on, so there is no such case."""
    from k2.config.load import load_config
    from k2.launcher.benchmarks.step import case_overrides

    k2mem = load_config(["memory=k2"]).memory
    assert list(k2mem.offload)  # memory=k2 offloads something
    with_offload = case_overrides({"memory": "k2", "qk_clip_tau": 100.0, "attention_backend": "torch"})
    assert "k2_no_offload" in with_offload
    full, no_off = with_offload["k2"], with_offload["k2_no_offload"]
    diff = sorted(set(full) ^ set(no_off))
    assert diff == sorted([f"memory.offload=[{','.join(k2mem.offload)}]", "memory.offload=[]"]), diff
    default = case_overrides({"memory": "k2_no_offload", "qk_clip_tau": 100.0, "attention_backend": "torch"})
    assert "k2_no_offload" not in default and "k2_no_fp8_store" in default


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["bench.options.size=huge"], "bench.options.size"),
        (["bench.options.memory=all"], "bench.options.memory"),
        (["bench.options.precision=fp16"], "bench.options.precision"),
        (["bench.options.resident=2"], "bench.options.resident"),
        (["bench.options.repeats=-1"], "bench.options.repeats"),
        (["bench.options.attention_backend=flash"], "bench.options.attention_backend"),
        (["bench.options.json_out=/nonexistent/dir/step.json"], "bench.options.json_out"),
        (["+bench.options.steps=3"], "bench.options.steps"),
    ],
)
def test_step_bench_bad_options_exit_2(capsys, overrides, named):
    rc, out, err = run_tool(capsys, main, ["bench=step", *overrides])
    assert rc == 2 and out == ""
    assert err.startswith("k2-bench: error: ") and named in err


def test_data_bench_peak_rss_is_k2_datas_own(tmp_path):
    """The peak RSS of the bench's k2-data child is that process's own: Linux carries ``ru_maxrss`` across
    exec, so from this test process (torch imported, hundreds of MB resident) ``wait4`` would report at
    least this process's memory. It also shows that ``k2-data prepare`` imports no torch (alone ~300 MB
    here)."""
    from k2.launcher.benchmarks import data_prepare as D
    from k2.launcher.datasets.tokenizer import train_byte_level_bpe

    docs = D.stdlib_docstrings(300)
    train_byte_level_bpe(docs, 512).save(str(tmp_path / "tokenizer.json"))
    D.write_jsonl_corpus(tmp_path / "c.jsonl", 0.3, docs)
    with open("/proc/self/status") as f:
        own_mb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    peak_mb, code = D._peak_rss_mb(
        D._prepare_args(tmp_path / "c.jsonl", tmp_path / "out" / "c", tmp_path / "tokenizer.json", 1, 256, 512)
    )
    assert code == 0 and (tmp_path / "out" / "c.manifest.json").is_file()
    assert own_mb > 400 and 30 < peak_mb < 200, (own_mb, peak_mb)


@pytest.mark.parametrize("option", ["repeats=0", "workers=0", "corpus_mb=0", "chunk_documents=-1"])
def test_data_bench_bad_options_exit_2(capsys, option):
    rc, out, err = run_tool(capsys, main, ["bench=data", f"bench.options.{option}"])
    assert rc == 2 and out == ""
    assert err.startswith("k2-bench: error: ") and f"bench.options.{option.split('=')[0]}=" in err


def test_data_bench_reports_both_throughputs(capsys):
    """bench=data: k2-data prepare with 1 and 2 workers and the raw encode_batch / encode_batch_fast over
    the same tokens in one run, each timed once per round (numbers present and consistent, not their
    speed). The peak-RSS pair (two k2-data processes, each importing torch) is left out here (rss_mb=0) to
    keep the suite's time; k2-bench runs it."""
    rc, out, _ = run_tool(
        capsys,
        main,
        [
            "bench=data",
            "output=json",
            "bench.options.corpus_mb=0.5",
            "bench.options.chunk_documents=256",
            "bench.options.repeats=2",
            "bench.options.rss_mb=0",
            "bench.options.vocab_size=512",
            "bench.options.array_tasks=0",
        ],
    )
    assert rc == 0
    f = json.loads(out)["figures"]
    assert f["tokens"] > 0 and f["documents"] > 0 and f["repeats"] == 2
    for side in ("raw_encode_batch", "raw_encode_batch_fast", "k2_data_workers1", "k2_data_workers2"):
        times = f[f"{side}_s"]
        assert len(times) == 2 and min(times) > 0
        # a figure is the median of its rounds
        assert f[f"{side}_tokens_per_s"] == pytest.approx(f["tokens"] / statistics.median(times), rel=0.01)
    for w in (1, 2):
        ratio = f[f"k2_data_workers{w}_over_raw"]
        assert ratio > 0
        assert f[f"k2_data_workers{w}_tokens_per_s"] == pytest.approx(ratio * f["raw_encode_batch_tokens_per_s"])
        assert f[f"k2_data_workers{w}_tokens_per_s"] == pytest.approx(
            f[f"k2_data_workers{w}_over_raw_fast"] * f["raw_encode_batch_fast_tokens_per_s"]
        )
        cpu_ratio = f[f"k2_data_workers{w}_cpu_over_raw"]
        assert f[f"k2_data_workers{w}_tokens_per_cpu_s"] == pytest.approx(
            cpu_ratio * f["raw_encode_batch_tokens_per_cpu_s"]
        )
        assert 0 < cpu_ratio < 3, cpu_ratio
    # the workers' CPU is counted: without it k2-data with 2 workers (its main process only reads) would
    # look several times cheaper per token than with 1 (this process doing the same work). (It costs
    # more here, not less: the two forks of this large test process are a fixed cost.)
    cpu_2_over_1 = f["k2_data_workers1_tokens_per_cpu_s"] / f["k2_data_workers2_tokens_per_cpu_s"]
    assert cpu_2_over_1 > 0.6, cpu_2_over_1
    assert "rss" not in f and "memory_limited" not in f


def test_data_bench_times_the_array_against_one_process(capsys):
    """bench=data's array build: 2 task processes at once and the same build in one process, over the same
    tokens, their ratio and each task's peak RSS (a k2-data process without torch: under 250 MB)."""
    rc, out, _ = run_tool(
        capsys,
        main,
        [
            "bench=data",
            "output=json",
            "bench.options.corpus_mb=0.3",
            "bench.options.chunk_documents=256",
            "bench.options.repeats=1",
            "bench.options.rss_mb=0",
            "bench.options.vocab_size=512",
            "bench.options.workers=1",
            "bench.options.array_tasks=2",
        ],
    )
    assert rc == 0
    f = json.loads(out)["figures"]
    assert f["array_tasks"] == 2 and len(f["array_one_process_s"]) == len(f["array_2_tasks_s"]) == 1
    # (the raw times are written rounded to 0.1 ms, the ratios computed from the unrounded ones)
    assert f["array_2_tasks_speedup"] == pytest.approx(f["array_one_process_s"][0] / f["array_2_tasks_s"][0], rel=1e-3)
    assert f["array_one_process_tokens_per_s"] == pytest.approx(f["tokens"] / f["array_one_process_s"][0], rel=1e-3)
    rss = f["array_task_peak_rss_mb"]
    assert len(rss) == 2 and all(30 < r < 250 for r in rss), rss


def test_hardware_bench_writes_a_profile_k2_plan_reads(capsys, tmp_path):
    """bench=hardware (one rank: no collective processes; small GEMMs) writes a profile whose measured
    numbers are positive and that k2-plan plans with (plan.hardware=PATH); its per-operator cost is the
    one measured on the main job's MoE layer, whose operators (and the other parts', counted with torch's
    dispatch mode on k2-train's modules) are those the step-time model charges."""
    from k2.config import load_config
    from k2.launcher.plan import main as plan_main
    from k2.launcher.planning.hardware import load_profile
    from k2.launcher.planning.operator_counts import modelled_operators
    from k2.launcher.planning.optimizer_time import unfused_operators

    out = tmp_path / "this_machine.yaml"
    rc = main(
        [
            "bench=hardware",
            "bench.options.ranks=1",
            "bench.options.repeats=3",
            "bench.options.gemm_size=64",
            f"bench.options.out={out}",
            "output=json",
        ]
    )
    assert rc == 0
    rec = json.loads(capsys.readouterr().out)["figures"]
    assert all(v > 0 for v in rec["gemm_by_shape_tflops"].values())
    p = load_profile(str(out))
    assert p.gemm_fp32_tflops > 0 and p.memory_gbps > 0 and p.kernel_launch_us > 0 and p.gemm_tile == 1
    ops = rec["operator_cost"]
    assert p.kernel_launch_us == pytest.approx(ops["moe_layer"]["per_op_us"])
    assert p.operator_us == pytest.approx(
        {
            "embedding": ops["embedding"]["per_op_us"],
            "loss": ops["head"]["per_op_us"],
            "optimizer": ops["optimizer"]["per_op_us"],
        }
    )
    model = load_config(["model=k2_tiny"]).model
    for part, kind, experts in (
        ("moe_layer", "moe_layer", 8),
        ("dense_layer", "dense_layer", 0),
        ("embedding", "embedding", 0),
        ("head", "loss", 0),
    ):
        counted = (ops[part]["forward_ops"], ops[part]["backward_ops"])
        assert counted == modelled_operators(model, kind, experts), part
        assert ops[part]["seconds"] > 0
    # a microbatch through megatron's schedule runs the parts' operators (3 MoE layers, 1 dense, embedding,
    # head) and little else: the model's count per microbatch is the trainer's
    runs = {"moe_layer": 3, "dense_layer": 1, "embedding": 1, "head": 1}
    per_mb = sum(n * (ops[part]["forward_ops"] + ops[part]["backward_ops"]) for part, n in runs.items())
    sched = (ops["schedule_3"]["forward_ops"] - ops["schedule_1"]["forward_ops"]) / 2
    assert sched == pytest.approx(per_mb, rel=0.03)
    assert p.microbatch_overhead_us >= 0 and p.step_overhead_us >= 0
    # k2_tiny's 98 parameter tensors; 2 operators fewer per tensor when the gradient norm is below the clip
    assert ops["optimizer"]["forward_ops"] in (unfused_operators(98), unfused_operators(98) - 2 * 98)
    rc = plan_main(["model=k2_tiny", "cluster.gpus_per_node=1", f"plan.hardware={out}", "output=json"])
    plan = json.loads(capsys.readouterr().out)
    assert rc == 0 and plan["hardware"] == p.name and plan["step_time_s_estimated"] > 0
