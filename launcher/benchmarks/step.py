"""``k2-bench bench=step``: one training step of the launcher's full K2 configuration against a plain
megatron-core baseline, with each K2 feature toggled off, in one process and one run.

Cases (same model widths, same tokens, one microbatch of ``micro_batch_size x seq_length`` tokens):

* ``baseline`` -- (a): megatron-core ``GPTModel`` from megatron's local layer specs (MLA, megatron's
  ``TopKRouter`` and ``SequentialMLP`` experts, megatron's ``MLP``), core attention on SDPA
  (:class:`k2.model.attention.K2CoreAttention` with ``backend=sdpa`` and no max-logit record: megatron's own
  ``DotProductAttention`` rejects MLA's qk/v head dims), parameters in the compute dtype, a plain
  ``torch.optim.SGD`` step; no DDP, no mixed-precision wrapper.
* ``k2`` -- (b): the launcher's step as ``k2-train`` runs it (``k2.model.build``, megatron DDP with FP32
  gradient buffers, ZeRO-1 distributed optimizer, megatron's schedule): MuonClip with QK-Clip
  (``tau = 100``), FP8 activation storage, selective recompute (``bench.options.memory``: ``memory=k2``
  without offload by default), grouped-GEMM experts, core attention ``bench.options.attention_backend``.
* ``k2_no_<feature>`` -- (c): ``k2`` with one feature off: ``qk_clip`` (no record, no clip),
  ``muon`` (AdamW; QK-Clip kept), ``fp8_store``, ``recompute``, ``offload`` (when on), ``grouped_gemm``
  (megatron's sequential expert loop).

Timing: ``warmup`` untimed steps per case, then ``repeats`` rounds, each round one step of every resident
case in turn (round-robin: a drift of the machine hits all alike); the median per case. On a GPU the
cases do not all fit in memory at once (each K2 case holds BF16 weights, FP32 gradients, FP32 main
weights and optimizer states): ``resident`` cases are alive at a time -- ``baseline`` and ``k2`` always,
plus one group of the toggled cases after another; the samples of ``baseline`` and ``k2`` are pooled over
the groups.

Figures per case: ``step_ms``, ``tokens_per_s``, ``model_tflops`` (``model/flops.py``, the planner's
formula: recompute is not model FLOPs), ``mfu`` (against ``gemm_peak_tflops``, a BF16 8192^3 matmul timed
in the same run on GPU, an FP32 1024^3 one on CPU), ``saved_activation_bytes`` (what autograd keeps for
backward over one forward, measured through the saved-tensor hooks:
:class:`k2.model.saved_bytes_meter.SavedBytesMeter`), on GPU ``peak_memory_bytes`` (the case's persistent bytes
-- weights, gradient buffers, optimizer states, measured as the allocation growth over its build and
warmup -- plus the growth of ``torch.cuda.max_memory_allocated`` over one step), and ``*_over_baseline``
ratios. Needs no data files, network or wandb.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

from k2.config.errors import ConfigError
from k2.config.load import load_config
from k2.launcher.benchmarks.common import bench_options, one_rank_world, system_info, time_calls
from k2.launcher.benchmarks.step_cases import Case, build_baseline, build_k2, free_case, sync
from k2.model.backends import ATTENTION_BACKENDS, check_backend_config
from k2.model.build import reset_moe_process_state
from k2.model.flops import step_flops
from k2.model.saved_bytes_meter import SavedBytesMeter
from k2.parallel import cpu_backend

if TYPE_CHECKING:
    from k2.config.schema import K2Config

DEFAULTS = {
    "size": "auto",  # auto (k2 on CUDA, tiny on CPU) | k2 | tiny
    "seq_length": 0,  # 0 = auto: 4096 (k2) / 128 (tiny)
    "micro_batch_size": 1,
    # microbatches per optimizer step (gradient accumulation): the optimizer step (Muon's Newton-Schulz
    # above all) is amortised over them as in training; 0 = auto: 8 on CUDA, 1 on CPU
    "microbatches": 0,
    "precision": "auto",  # auto (bf16 on CUDA, fp32 on CPU) | bf16 | fp32
    "memory": "k2_no_offload",  # k2_no_offload | k2 | none
    "attention_backend": "sdpa",  # core attention of the K2 cases: sdpa | eager | te | auto
    "warmup": 0,  # 0 = auto: 3 on CUDA, 1 on CPU
    "repeats": 0,  # 0 = auto: 10 on CUDA, 2 on CPU
    "resident": 0,  # cases alive at once (>= 3); 0 = auto: 3 on CUDA, all on CPU
    "qk_clip_tau": 100.0,
    "lr": 1.0e-5,
    "seed": 0,
    "json_out": "",  # also write the JSON record to this path
}


SIZES = ("auto", "k2", "tiny")
MEMORY = ("k2_no_offload", "k2", "none")
# K2 widths (recipes/model/kimi_k2.yaml) with 1 dense + 2 MoE layers, 16 experts, a 32k vocabulary
K2_SMALL = [
    "model=kimi_k2",
    "model.num_layers=3",
    "model.first_k_dense_replace=1",
    "model.num_moe_experts=16",
    "model.vocab_size=32768",
    "model.max_position_embeddings=4096",
]


TINY = ["model=k2_tiny", "model.num_layers=3", "model.first_k_dense_replace=1"]


def _options(cfg: K2Config) -> dict:
    import torch

    o = bench_options(cfg, DEFAULTS)
    cuda = torch.cuda.is_available()
    checks = [
        ("size", SIZES),
        ("precision", ("auto", "bf16", "fp32")),
        ("memory", MEMORY),
        ("attention_backend", ATTENTION_BACKENDS),
    ]
    for key, allowed in checks:
        if o[key] not in allowed:
            raise ConfigError(f"bench.options.{key}={o[key]!r}; allowed: {', '.join(allowed)}")
    for key, low in (
        ("seq_length", 0),
        ("micro_batch_size", 1),
        ("microbatches", 0),
        ("warmup", 0),
        ("repeats", 0),
        ("resident", 0),
    ):
        if o[key] < low:
            raise ConfigError(f"bench.options.{key}={o[key]}; allowed: an integer >= {low}")
    if 0 < o["resident"] < 3:
        raise ConfigError(
            f"bench.options.resident={o['resident']}; allowed: 0 (auto) or >= 3 (baseline, k2 "
            "and at least one toggled case)"
        )
    if o["json_out"]:
        parent = os.path.dirname(os.path.abspath(o["json_out"]))
        if not os.path.isdir(parent):
            raise ConfigError(f"bench.options.json_out={o['json_out']}: directory {parent} does not exist")
    size = o["size"] if o["size"] != "auto" else ("k2" if cuda else "tiny")
    o["size"] = size
    o["precision"] = o["precision"] if o["precision"] != "auto" else ("bf16" if cuda else "fp32")
    o["seq_length"] = o["seq_length"] or (4096 if size == "k2" else 128)
    o["microbatches"] = o["microbatches"] or (8 if cuda else 1)
    o["warmup"] = o["warmup"] or (3 if cuda else 1)
    o["repeats"] = o["repeats"] or (10 if cuda else 2)
    return o


def base_overrides(o: dict) -> list[str]:
    s = o["seq_length"]
    model = K2_SMALL if o["size"] == "k2" else TINY
    return [
        *model,
        f"train.precision={o['precision']}",
        "run.wandb.mode=disabled",
        "parallel=single",
        f"train.micro_batch_size={o['micro_batch_size']}",
        f"model.max_position_embeddings={max(s, 4096)}",
    ]


def case_overrides(o: dict) -> dict[str, list[str]]:
    """Hydra overrides of each K2 case (the ``baseline`` is built separately)."""
    k2mem = load_config(["memory=k2"]).memory
    mem = {
        "fp8_store": list(k2mem.fp8_store),
        "recompute": list(k2mem.recompute),
        "offload": list(k2mem.offload) if o["memory"] == "k2" else [],
    }
    if o["memory"] == "none":
        mem = {k: [] for k in mem}

    def memory(drop: str = "") -> list[str]:
        return [f"memory.{k}=[{','.join(v if k != drop else [])}]" for k, v in mem.items()]

    full = [
        "optim=muonclip",
        f"optim.qk_clip_tau={o['qk_clip_tau']}",
        "model.record_max_logits=true",
        "model.moe_grouped_gemm=true",
        f"model.attention_backend={o['attention_backend']}",
    ]
    cases = {"k2": full + memory()}
    cases["k2_no_qk_clip"] = full + ["optim.qk_clip_tau=null", "model.record_max_logits=false"] + memory()
    cases["k2_no_muon"] = [x if x != "optim=muonclip" else "optim=adamw" for x in full] + memory()
    for key in ("fp8_store", "recompute", "offload"):
        if mem[key]:
            cases[f"k2_no_{key}"] = full + memory(drop=key)
    cases["k2_no_grouped_gemm"] = [
        x if x != "model.moe_grouped_gemm=true" else "model.moe_grouped_gemm=false" for x in full
    ] + memory()
    return cases


def gemm_peak_tflops(cuda: bool, repeats: int = 10) -> dict:
    """Measured matmul throughput: BF16 8192^3 on CUDA, FP32 1024^3 on CPU (median of ``repeats``)."""
    import torch

    n, dtype = (8192, torch.bfloat16) if cuda else (1024, torch.float32)
    dev = "cuda" if cuda else "cpu"
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    ms = time_calls({"mm": lambda: torch.matmul(a, b)}, 3, repeats, cuda)["mm"]
    return {
        "gemm_n": n,
        "gemm_dtype": str(dtype).replace("torch.", ""),
        "gemm_ms": ms,
        "gemm_peak_tflops": 2 * n**3 / (ms / 1e3) / 1e12,
    }


def bench_step(cfg: K2Config) -> dict[str, Any]:
    """One K2 training step vs a plain megatron-core step, each K2 feature toggled off (one process).

    Figures: ``config`` (model widths, tokens, precision, memory setting), the measured GEMM peak,
    ``timing`` (warmup, repeats, resident cases), and per case (``baseline``, ``k2``, ``k2_no_*``):
    ``step_ms``, ``tokens_per_s``, ``model_tflops``, ``mfu``, ``saved_activation_bytes``, on GPU
    ``peak_memory_bytes``, and each one's ratio to ``baseline``. See the module docstring.

    Raises:
        ConfigError: a bad option.
    """
    import torch

    o = _options(cfg)
    cuda = torch.cuda.is_available()
    base = base_overrides(o)
    cases = case_overrides(o)
    for ov in cases.values():  # every case is valid before anything is built
        check_backend_config(load_config(base + ov))
    cpu_backend.enable()
    teardown = one_rank_world()
    model_cfg = load_config(base).model
    tokens = o["microbatches"] * o["micro_batch_size"] * o["seq_length"]
    flops = step_flops(model_cfg, o["seq_length"], tokens)
    names = ["baseline", *cases]
    resident = o["resident"] or (3 if cuda else len(names))
    run = _StepRuns(o, base, cases, cuda)
    try:
        peak = gemm_peak_tflops(cuda)
        run.time_cases(names, resident)
    finally:
        free_case(cuda)
        teardown()
    figures = {
        "config": {
            "size": o["size"],
            "hidden_size": model_cfg.hidden_size,
            "num_layers": model_cfg.num_layers,
            "num_moe_experts": model_cfg.num_moe_experts,
            "moe_router_topk": model_cfg.moe_router_topk,
            "vocab_size": model_cfg.vocab_size,
            "seq_length": o["seq_length"],
            "micro_batch_size": o["micro_batch_size"],
            "microbatches": o["microbatches"],
            "tokens_per_step": tokens,
            "precision": o["precision"],
            "memory": o["memory"],
            "attention_backend": o["attention_backend"],
            "model_flops_per_step": flops,
            "peak_memory": (
                "torch.cuda.max_memory_allocated growth over a step + persistent bytes"
                if cuda
                else "not measured on CPU; saved_activation_bytes is"
            ),
        },
        **peak,
        "timing": {
            "warmup": o["warmup"],
            "repeats": o["repeats"],
            "resident": resident,
            "order": "round-robin over the resident cases",
        },
        "cases": run.case_figures(names, tokens, flops, peak["gemm_peak_tflops"]),
    }
    if o["json_out"]:
        from omegaconf import OmegaConf

        record = {
            "bench": "step",
            "system": system_info(),
            "options": OmegaConf.to_container(cfg.bench.options) if cfg.bench.options is not None else None,
            "figures": figures,
        }
        with open(o["json_out"], "w") as fh:
            json.dump(record, fh, indent=1)

    reset_moe_process_state()  # leave no 3-layer MoE tracker / aux-loss scale to the rest of the process
    return figures


class _StepRuns:
    """The cases of :func:`bench_step` built, warmed up, metered and timed; what each measured."""

    def __init__(self, o: dict, base: list[str], cases: dict[str, list[str]], cuda: bool):
        import torch

        self.o, self.base, self.cases, self.cuda = o, base, cases, cuda
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.samples: dict[str, list[float]] = {}  # step seconds
        self.opt_samples: dict[str, list[float]] = {}  # optimizer seconds of those steps
        self.saved: dict[str, float] = {}  # saved activation bytes per forward
        self.persistent: dict[str, int] = {}  # GPU bytes held by a built, warmed-up case
        self.step_peak: dict[str, int] = {}  # GPU peak growth over one step
        self.features: dict[str, dict] = {}
        self.started = time.perf_counter()

    def progress(self, text: str) -> None:  # (stderr: a long GPU run shows how far it got)
        print(f"bench=step [{time.perf_counter() - self.started:.0f} s] {text}", file=sys.stderr, flush=True)

    def build(self, name: str) -> Case:
        """Build case ``name``, warm it up, measure its memory (GPU) and its saved activation bytes."""
        import torch

        o, cuda = self.o, self.cuda
        sync(cuda)
        before = torch.cuda.memory_allocated() if cuda else 0
        case = (
            build_baseline(o, self.base, self.device)
            if name == "baseline"
            else build_k2(o, self.base, self.cases[name])
        )
        for _ in range(o["warmup"]):  # (the optimizer states are created on the first step)
            case.step()
        sync(cuda)
        if cuda:
            self.persistent[name] = torch.cuda.memory_allocated() - before
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            case.step()
            sync(cuda)
            self.step_peak[name] = torch.cuda.max_memory_allocated() - start
        if case.features is not None:
            self.features[name] = case.features
        meter = SavedBytesMeter()
        case.metered_step(meter)
        self.saved[name] = meter.per_forward()["device_total"] + meter.per_forward()["host_total"]
        held = f", {self.persistent[name] / 2**30:.1f} GiB held" if cuda else ""
        self.progress(f"{name} built and warmed up{held}")
        return case

    def time_cases(self, names: list[str], resident: int) -> None:
        """Time every case round-robin: ``baseline`` and ``k2`` stay built, the toggled cases are built
        ``resident - 2`` at a time (GPU memory) and released after their group."""
        for n in names:
            self.samples[n], self.opt_samples[n] = [], []
        toggled = names[2:]
        per_group = max(1, resident - 2)
        groups = [toggled[i : i + per_group] for i in range(0, len(toggled), per_group)] or [[]]
        live = {n: self.build(n) for n in ("baseline", "k2")}
        for group in groups:
            for n in group:
                live[n] = self.build(n)
            for _ in range(self.o["repeats"]):
                for n, case in live.items():
                    sync(self.cuda)
                    t0 = time.perf_counter()
                    case.step()
                    sync(self.cuda)
                    self.samples[n].append(time.perf_counter() - t0)
                    self.opt_samples[n].append(case.optimizer_s)
            for n in group:
                live.pop(n).release()
            free_case(self.cuda)
            self.progress(f"timed {', '.join(live)} and {', '.join(group) or 'no toggled case'}")

    def case_figures(self, names: list[str], tokens: int, flops: float, peak_tflops: float) -> dict[str, dict]:
        """Per case: step and optimizer ms, tokens/s, model TFLOP/s, MFU, saved bytes (GPU: peak memory),
        and each one's ratio to ``baseline``."""
        out: dict[str, dict] = {}
        for n in names:
            step_s = statistics.median(self.samples[n])
            tflops = flops / step_s / 1e12
            f = {
                "step_ms": step_s * 1e3,
                "optimizer_ms": statistics.median(self.opt_samples[n]) * 1e3,
                "tokens_per_s": tokens / step_s,
                "model_tflops": tflops,
                "mfu": tflops / peak_tflops,
                "saved_activation_bytes": int(self.saved[n]),
                "timed_steps": len(self.samples[n]),
            }
            if n in self.features:
                f["features"] = self.features[n]
            if self.cuda:
                f["peak_memory_bytes"] = int(self.persistent[n] + self.step_peak[n])
                f["persistent_bytes"] = int(self.persistent[n])
            out[n] = f
        ref = out["baseline"]
        for f in out.values():
            for key in (
                "tokens_per_s",
                "model_tflops",
                "mfu",
                "step_ms",
                "saved_activation_bytes",
                "peak_memory_bytes",
            ):
                if key in f:
                    f[f"{key}_over_baseline"] = f[key] / ref[key] if ref[key] else None
        return out
