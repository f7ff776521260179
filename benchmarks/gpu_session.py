"""The steps of ``benchmarks/gpu_session.sh``: k2-train itself on one GPU (or, with ``TINY=1``, the same
steps on the CPU with k2_tiny's sizes), each step one call of this script that writes ``$OUT/<step>.json``.

Usage: ``python benchmarks/gpu_session.py STEP [ARG]`` with ``$OUT`` set; ``$TINY=1`` for the CPU mode.

Steps:

* ``env``: versions, the device, whether the CPU backend stayed off, cuDNN attention at MLA's head dims.
* ``train async`` / ``train sync`` / ``train resume``: one k2-train process (NCCL with world size 1 on a
  GPU; BF16, SDPA with cuDNN first and the Triton max-logit kernel, grouped experts, FP8 storage,
  recompute and activation offload (``memory=k2``), optimizer offload, MuonClip with a QK-Clip threshold
  that clips, the loss-spike guard skipping a spike injected at step 3 (``K2_TEST_SPIKE``)), saving every 2
  steps; ``async`` in the background with the writer of step 2's checkpoint held until step 4 has started
  (tests/support/scripts/fault_train.py), ``sync`` synchronously, ``resume`` from ``async``'s step-2
  checkpoint (through the spike again). Each records the metrics and, on a GPU, peak memory (allocated,
  reserved, the context outside torch's allocator, pinned host memory).
* ``compare``: ``async``'s and ``sync``'s checkpoints tensor by tensor (bitwise on CPU; on a GPU the
  largest relative difference, which atomics make non-zero), and ``resume``'s losses against ``async``'s.
  (At this one rank the comparison also passed with the snapshot code from before pinned buffers were
  copied: the written optimizer tensors did not alias the offload buffers here. The leak itself is shown
  by tests/integration/test_checkpoint.py on cpu4 with shared-memory buffers.)
* ``watchdog``: a run whose second save's writer stops (``SIGSTOP``: no bytes written, no CPU, as on a
  dead file system): the hang watchdog ends it with 42, names ``save 2`` and leaves the requeue marker.
* ``ep_overlap``: ``pipeline.ep_overlap`` on one device (:func:`step_ep_overlap`): megatron's combined
  1F1B with the communication stream, the layer scopes across its nodes and the deferred wgrads, against
  the plain schedule; one device has no EP peer, so nothing is hidden or timed.
* ``plan``: k2-plan for the same configuration on one GPU (and, on CPU, for the GPU mode's configuration:
  a check that it is valid before a device runs it).
* ``summary``: every step's figures and the checks, ``$OUT/summary.json``, and one line per check.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = Path(os.environ.get("OUT", "/tmp/gpu_session"))
TINY = os.environ.get("TINY") == "1"
# the runs' directories (checkpoints: GBs on a GPU) stay out of $OUT, which the device tool sends back
RUNS = Path(os.environ.get("RUNS") or (OUT / "runs" if TINY else Path(tempfile.gettempdir()) / "k2-gpu-session"))
SPIKE_STEP, ITERS, HELD = 3, 4, 2  # injected spike; steps per run; the checkpoint whose writer is held
HUNG = 2  # the watchdog run saves every step: its second save (the first has the start-up allowance) stops

# the GPU mode's model: k2_tiny's layers at widths where the GPU paths matter (MLA's 192 / 128 head dims
# for cuDNN attention, 16 experts of 512 for the grouped GEMM), 1,024-token sequences
GPU_SIZE = [
    "model.hidden_size=1024",
    "model.num_attention_heads=16",
    "model.ffn_hidden_size=2816",
    "model.num_moe_experts=16",
    "model.moe_ffn_hidden_size=512",
    "model.moe_shared_expert_intermediate_size=512",
    "model.q_lora_rank=512",
    "model.kv_lora_rank=256",
    "model.qk_head_dim=128",
    "model.qk_pos_emb_head_dim=64",
    "model.v_head_dim=128",
    "schedule.phases.0.seq_length=1024",
    "schedule.global_batch_tokens=16384",
]
# what both modes run
COMMON = [
    "model=k2_tiny",
    "optim=muonclip",
    "optim.qk_clip_tau=0.1",
    "memory=k2",
    "optim.offload_fraction=0.5",
    f"train.iters={ITERS}",
    "train.save_interval=2",
    "checkpoint.keep_last=10",
    "checkpoint.save_at_end=false",
    "train.eval_interval=0",
    "schedule.phases.0.steps=0",
    "train.spike.action=skip",
    "train.spike.window=4",
    "train.spike.sigma=1000",
    "run.seed=7",
    "run.wandb.mode=disabled",
    "train.progress=false",
]
GPU_ONLY = ["train.precision=bf16", "run.deterministic=true"]
# CPU: the sdpa path (torch's CPU SDPA + the chunked max-logit pass) and grouped experts, not the defaults
TINY_ONLY = ["train.precision=fp32", "model.attention_backend=sdpa", "model.moe_grouped_gemm=true"]


def corpus_overrides() -> list[str]:
    """The embedded corpus already built in ``data_cache/`` (carried to the GPU machine with the checkout)."""
    found = sorted(REPO.glob("data_cache/stdlib-*-v4096/train.bin"))
    if not found:
        return []  # (k2-train builds it)
    d = found[-1].parent
    return [f"data.path={d / 'train'}", f"data.valid_path={d / 'valid'}", f"data.tokenizer={d / 'tokenizer.json'}"]


def overrides(tiny: bool = TINY) -> list[str]:
    """The trainer's settings of this mode (without ``run.dir``); on a GPU the Triton max-logit kernel
    when the ``env`` step ran it (else the torch pass, so that a node without Triton's compiler still runs
    the rest)."""
    if tiny:
        return [*COMMON, *TINY_ONLY, *corpus_overrides()]
    kernel = "triton" if _load("env").get("triton_max_logit") is True else "torch"
    return [*COMMON, *GPU_ONLY, f"model.max_logit_kernel={kernel}", *GPU_SIZE, *corpus_overrides()]


def _child() -> list[str]:
    """The interpreter of this script's own child runs (``watchdog``, ``ep_overlap``): with ``TINY=1``
    gpu_session.sh's ``$PYTHON`` when set (the session's interpreter for every step; the CPU test passes one
    that forks from a process with torch already imported), else this process's."""
    return [(os.environ.get("PYTHON") if TINY else None) or sys.executable, __file__]


def run_dir(name: str) -> Path:
    return RUNS / name


def _write(name: str, data: dict) -> None:
    (OUT / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))
    print(json.dumps(data, default=str)[:2000])


def _metrics(d: Path) -> list[dict]:
    p = d / "metrics.jsonl"
    recs = [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []
    return [r for r in recs if r.get("step", 0) >= 1 and "loss" in r]


def step_env() -> None:
    """Versions, the device, the CPU backend (must stay off on a GPU) and cuDNN attention at K2's head dims."""
    import torch

    from k2.parallel import cpu_backend

    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "cpu_backend_enabled": cpu_backend.enable(),
        "tiny": TINY,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    }
    if torch.cuda.is_available():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        info.update(gpu=torch.cuda.get_device_name(0), nccl=".".join(map(str, torch.cuda.nccl.version())))
        q, k = (torch.randn(1, 64, 1024, 192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        v = torch.randn(1, 64, 1024, 128, device="cuda", dtype=torch.bfloat16)
        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            info["cudnn_attention_qk192_v128"] = True
        except RuntimeError as e:
            info["cudnn_attention_qk192_v128"] = f"no: {str(e).splitlines()[0]}"
        info["triton_max_logit"] = _triton_max_logit(q, k)
    _write("env", info)


def _triton_max_logit(q, k):
    """True when the Triton max-logit kernel compiles here and agrees with the torch pass (BF16
    tolerance), else why not."""
    try:
        from k2.model.attention import per_head_max_logit
        from k2.model.max_logit_kernel import per_head_max_logit_triton

        got = per_head_max_logit_triton(q, k, 0.07, True)
        want = per_head_max_logit(q, k, 0.07, True)
        return (
            bool((got.float() - want.float()).abs().max() <= 0.02 * want.float().abs().max())
            or f"no: differs from the torch pass by {float((got.float() - want.float()).abs().max()):.3g}"
        )
    except Exception as e:
        return f"no: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _memory_stats() -> dict:
    """Peak memory of this process's run: torch's allocator, the device as a whole, pinned host memory."""
    import torch

    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    out = {
        "max_allocated": torch.cuda.max_memory_allocated(),
        "max_reserved": torch.cuda.max_memory_reserved(),
        "reserved_now": torch.cuda.memory_reserved(),
        "device_used_now": total - free,
        "device_total": total,
    }
    try:
        host = torch.cuda.memory.host_memory_stats()
        out["pinned_host_peak"] = host.get("reserved_bytes.peak", host.get("allocated_bytes.peak"))
    except (AttributeError, RuntimeError):
        pass
    return out


def step_train(kind: str) -> None:
    """One k2-train run in this process (``kind``: async, sync, resume, watchdog; module docstring)."""
    args = [*overrides(), f"run.dir={run_dir(kind)}"]
    env = {
        "K2_FAULT": "none:0:0",
        "K2_TEST_SPIKE": f"{SPIKE_STEP}:1e6",
        "K2_TEST_OUT": str(OUT),
        # CPU: the offloaded optimizer states in shared memory, which a forked writer shares as it
        # shares the pinned buffers they live in on a GPU (a fork alone would snapshot pageable ones)
        "K2_SHARED_OFFLOAD": "1" if TINY else "0",
    }
    if kind == "async":
        env["K2_HOLD_WRITER"] = f"{HELD}:0"
    if kind in ("async", "watchdog"):
        args.append("checkpoint.async_save=true")
    else:
        args.append("checkpoint.async_save=false")
    if kind == "resume":
        args.append(f"resume.from={run_dir('async') / 'checkpoints' / f'iter_{HELD:07d}'}")
    if kind == "watchdog":  # the held writer is never released: the end-of-run wait for it is a hang
        args += [f"train.iters={HUNG}", "train.save_interval=1", "run.hang_timeout_s=10"]
    os.environ.update(env)
    import runpy

    seams = runpy.run_path(str(REPO / "tests/support/scripts/fault_train.py"), run_name="k2_fault_seams")
    from k2.launcher import train

    if kind == "watchdog":  # the writer of save HUNG stops (SIGSTOP): no bytes, no CPU, as on a dead file system
        import signal

        import k2.launcher.checkpointing.background as background

        counted = seams["run_microbatches"].__globals__  # (run_path returns a copy of the seams' globals)

        def stop_writer():  # (in the forked writer; the seams count this process's training steps)
            if counted["train_steps"] == HUNG:
                os.kill(os.getpid(), signal.SIGSTOP)

        background._writer_started = stop_writer

    t0 = time.time()
    rc = train.main(args)
    _write(
        f"train_{kind}",
        {
            "rc": rc,
            "seconds": time.time() - t0,
            "overrides": args,
            "memory": _memory_stats(),
            "metrics": _metrics(run_dir(kind)),
        },
    )
    sys.exit(rc)


def step_watchdog() -> None:
    """The held save of ``train watchdog``, in a child process (the watchdog ends it with ``os._exit``)."""
    t0 = time.time()
    p = subprocess.run([*_child(), "train", "watchdog"], capture_output=True, text=True)
    marker = run_dir("watchdog") / "requeue"
    hang_lines = [x for x in (p.stdout + p.stderr).splitlines() if "hang" in x.lower()][-3:]
    _write(
        "watchdog",
        {
            "rc": p.returncode,
            "seconds": time.time() - t0,
            "hang_lines": hang_lines,
            "requeue_marker": marker.read_text().strip() if marker.exists() else None,
        },
    )


def step_train_overlap(mode: str) -> None:
    """One k2-train run of ``ep_overlap`` (``mode``: on / off) in this process: megatron's combined-1F1B
    schedule forced on with EP = 1 (its rule, and ours, want EP >= 2; with one rank megatron's all-to-all
    returns its input), so that the schedule's nodes, the communication CUDA stream and its events, the
    layer scopes across nodes (FP8 storage, offload on their own streams) and the deferred wgrads at the
    nodes' ``backward_dw`` run on the device; ``pipeline.trace`` records its pairs."""
    from k2.config import validate
    from k2.launcher import train

    if mode == "on":
        from megatron.core.models.common import utils as plan_utils

        validate.check_ep_overlap = lambda cfg: None  # (the EP >= 2 rule: one GPU holds one EP rank)
        # megatron frees a dispatch node's input once its all-to-all has copied it; with EP = 1 the all-to-all
        # returns its input, which the free would empty under the experts: keep the inputs (memory only)
        plan_utils.should_free_input = lambda *args, **kwargs: False
    d = run_dir(f"overlap_{mode}")
    args = [
        *overrides(),
        "train.iters=3",
        "train.save_interval=null",
        "train.spike.action=log",
        "optim.offload_fraction=0",
        "pipeline.decouple_wgrad=true",
        f"pipeline.ep_overlap={str(mode == 'on').lower()}",
        f"pipeline.trace={d / 'trace'}",
        f"run.dir={d}",
    ]
    rc = train.main(args)
    _write(f"train_overlap_{mode}", {"rc": rc, "overrides": args, "metrics": _metrics(d)})
    sys.exit(rc)


def step_ep_overlap() -> None:
    """``pipeline.ep_overlap`` on one device (:func:`step_train_overlap`, each run a child process): both
    runs finish, the overlapped one ran megatron's 1F1B pairs, and their losses agree (bitwise on CPU).
    What one device cannot run: an all-to-all between EP ranks (NCCL needs a GPU per rank), so nothing is
    hidden here and no overlap is timed; ``k2-bench bench=ep_overlap`` measures it on CPU over a shaped
    link."""
    runs = {}
    for mode in ("off", "on"):
        p = subprocess.run([*_child(), "train_overlap", mode], capture_output=True, text=True)
        runs[mode] = {**_load(f"train_overlap_{mode}"), "child_rc": p.returncode}
    from k2.schedules.pipeline_trace import read_trace

    trace = run_dir("overlap_on") / "trace"
    pairs = (
        sum(1 for evs in read_trace(str(trace)).values() for e in evs if e["kind"] == "pair" and e["f"] and e["b"])
        if trace.is_dir()
        else 0
    )
    losses = {m: [r["loss"] for r in runs[m].get("metrics", [])] for m in runs}
    _write(
        "ep_overlap",
        {
            "rc": [runs[m]["child_rc"] for m in runs],
            "pairs": pairs,
            "losses": losses,
            "max_relative_difference": max((abs(a - b) / abs(a) for a, b in zip(*losses.values())), default=None),
        },
    )


def _checkpoint_tensors(ckpt: Path) -> dict:
    """Every tensor of a torch_dist checkpoint but the RNG states, read without a process group."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = RUNS / f"{ckpt.parent.parent.name}-{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    sd = torch.load(out, weights_only=False)
    out.unlink()
    return {k: v for k, v in sd.items() if torch.is_tensor(v) and "rng" not in k}


def _relative_difference(a, b) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    if a.numel() == 0 or bool((a == b).all()):
        return 0.0
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def step_compare() -> None:
    """Background vs synchronous checkpoints, tensor by tensor; the resumed run's losses vs the async run's."""
    ckpts = {}
    for name in (f"iter_{s:07d}" for s in range(2, ITERS + 1, 2)):
        a = _checkpoint_tensors(run_dir("async") / "checkpoints" / name)
        s = _checkpoint_tensors(run_dir("sync") / "checkpoints" / name)
        diffs = {k: _relative_difference(a[k], s[k]) for k in s if k in a}
        worst = max(diffs, key=diffs.get) if diffs else None
        ckpts[name] = {
            "tensors": len(s),
            "same_keys": a.keys() == s.keys(),
            "bitwise_equal": sum(d == 0.0 for d in diffs.values()),
            "max_relative_difference": diffs.get(worst, 0.0),
            "worst_tensor": worst,
            "optimizer_tensors": sum("optimizer" in k for k in s),
        }
    ref = {r["step"]: r for r in _metrics(run_dir("async"))}
    resumed = {r["step"]: r for r in _metrics(run_dir("resume"))}
    resume = {s: {"loss": r["loss"], "reference": ref.get(s, {}).get("loss")} for s, r in resumed.items()}
    _write("compare", {"checkpoints": ckpts, "resume": resume})


def step_plan() -> None:
    """k2-plan of this mode's configuration on one GPU (and the GPU mode's, on CPU: valid before it runs)."""
    from k2.config import load_config
    from k2.launcher.planning import plan_cluster

    out = {}
    for label, tiny in [("tiny", True), ("gpu", False)] if TINY else [("gpu", False)]:
        cfg = load_config(
            [*overrides(tiny), "cluster.nodes=1", "cluster.gpus_per_node=1", "checkpoint.async_save=true"]
        )
        r = plan_cluster(cfg).report
        out[label] = {
            "memory_per_gpu_bytes": r["memory_per_gpu_bytes"],
            "fits": r["fits"],
            "host_bytes_per_gpu_peak": max(p["host_bytes_per_gpu_peak"] for p in r["phases"]),
        }
    _write("plan", out)


def _load(name: str) -> dict:
    try:
        return json.loads((OUT / f"{name}.json").read_text())
    except (OSError, ValueError):
        return {}


def _checks() -> dict:
    """Each check of the session: True, False, or None when its step left no figures."""
    asy, syn, res = _load("train_async"), _load("train_sync"), _load("train_resume")
    recs = {r["step"]: r for r in asy.get("metrics", [])}
    cmp_, wd, ov = _load("compare"), _load("watchdog"), _load("ep_overlap")
    tol = 0.0 if TINY else 1e-2  # CPU: bitwise; GPU: atomics make repeated runs differ a little
    ck = cmp_.get("checkpoints") or {}
    resume = cmp_.get("resume") or {}
    return {
        "runs_finished": (asy.get("rc"), syn.get("rc"), res.get("rc")) == (0, 0, 0) if asy else None,
        "losses_finite": all(math.isfinite(r["loss"]) for r in recs.values()) if recs else None,
        "qk_clip_clipped": any(r.get("qk_clipped_heads", 0) > 0 for r in recs.values()) if recs else None,
        "spike_skipped": (recs[SPIKE_STEP].get("spike") and recs[SPIKE_STEP].get("update_successful") is False)
        if SPIKE_STEP in recs
        else None,
        "async_equals_sync": all(
            c["same_keys"] and c["optimizer_tensors"] and c["max_relative_difference"] <= tol for c in ck.values()
        )
        if ck
        else None,
        "resume_matches": all(
            v["reference"] is not None and abs(v["loss"] - v["reference"]) <= tol * abs(v["reference"])
            for v in resume.values()
        )
        if resume
        else None,
        "ep_overlap_same_losses": (
            ov.get("rc") == [0, 0]
            and ov.get("pairs", 0) > 0
            and len(ov["losses"]["on"]) == 3
            and ov["max_relative_difference"] <= tol
        )
        if ov
        else None,
        "watchdog_requeue_42": (
            wd.get("rc") == 42
            and str(wd.get("requeue_marker", "")).startswith("hang")
            and any(f"save {HUNG}" in x for x in wd.get("hang_lines", []))
        )
        if wd
        else None,
    }


def step_summary() -> None:
    """``$OUT/summary.json``: every step's record, the checks, measured-over-planned memory; one line each."""
    plan = _load("plan").get("tiny" if TINY else "gpu", {})
    mem = _load("train_async").get("memory") or {}
    planned = plan.get("memory_per_gpu_bytes") or {}
    ratios = {}
    if mem and planned:
        ratios = {
            "allocated_measured_over_planned": mem["max_allocated"] / planned["allocated"],
            "device_measured_over_planned": (mem["max_reserved"] + mem["device_used_now"] - mem["reserved_now"])
            / planned["total"],
            "reserved_over_allocated": mem["max_reserved"] / max(mem["max_allocated"], 1),
            "context_and_libraries_gib": (mem["device_used_now"] - mem["reserved_now"]) / 2**30,
        }
        if mem.get("pinned_host_peak") is not None and plan.get("host_bytes_per_gpu_peak"):
            ratios["pinned_host_measured_over_planned"] = mem["pinned_host_peak"] / plan["host_bytes_per_gpu_peak"]
    steps = {
        n: _load(n)
        for n in (
            "env",
            "train_async",
            "train_sync",
            "train_resume",
            "compare",
            "watchdog",
            "ep_overlap",
            "plan",
            "bench_attention",
            "bench_hardware",
            "bench_step",
        )
    }
    checks = _checks()
    summary = {
        "tiny": TINY,
        "checks": checks,
        "memory": ratios,
        "steps": {k: {kk: vv for kk, vv in v.items() if kk != "metrics"} for k, v in steps.items()},
    }
    (OUT / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    for name, ok in checks.items():
        print(f"check {name}: {'pass' if ok else ('no figures' if ok is None else 'FAIL')}")
    for name, v in ratios.items():
        print(f"memory {name}: {v:.3f}")
    _print_benches(steps)
    sys.exit(0 if all(checks.values()) else 1)


def _print_benches(steps: dict) -> None:
    """The benchmark figures worth a line: attention on CUDA, each bench=step case against the baseline."""
    att = (steps.get("bench_attention") or {}).get("figures", {}).get("cuda")
    if att:
        print(
            "attention:",
            {
                k: att.get(k)
                for k in (
                    "time_k2_ms",
                    "max_logit_overhead",
                    "time_k2_triton_ms",
                    "max_logit_overhead_triton",
                    "max_logit_abs_diff_triton",
                )
            },
        )
    for case, c in ((steps.get("bench_step") or {}).get("figures", {}).get("cases") or {}).items():
        print(
            f"step {case:<20} {c['step_ms']:9.1f} ms  x{c['tokens_per_s_over_baseline']:.3f} tokens/s  "
            f"MFU {c['mfu'] or 0:.3f}  peak {c.get('peak_memory_bytes', 0) / 2**30:.1f} GiB"
        )


def main(argv: list[str]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    sys.path[:0] = [str(REPO)]
    steps = {
        "env": step_env,
        "train": lambda: step_train(argv[1]),
        "watchdog": step_watchdog,
        "train_overlap": lambda: step_train_overlap(argv[1]),
        "ep_overlap": step_ep_overlap,
        "compare": step_compare,
        "plan": step_plan,
        "summary": step_summary,
    }
    if not argv or argv[0] not in steps:
        sys.exit(f"usage: gpu_session.py {{{'|'.join(steps)}}} [async|sync|resume|watchdog]")
    steps[argv[0]]()


if __name__ == "__main__":
    main(sys.argv[1:])
