"""``k2-bench bench=optimizer``: one MuonClip optimizer step against one AdamW step on the CPU proxy, and,
on DP=2 (two local ranks, spawned), MuonClip's ZeRO-1 variants against each other: byte-range Distributed
Muon (``optim.muon_zero1=byte_range``, with the gathers of the matrices a shard boundary cuts), the same
with ``optim.offload_fraction=1``, and megatron's layer-wise optimizer (``optim.muon_zero1=layer_wise``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from k2.config.errors import ConfigError
from k2.config.load import load_config
from k2.launcher.benchmarks.common import DTYPES, bench_options, one_rank_world, time_calls
from k2.launcher.training.setup import setup
from k2.optim.qk_clip import QKClip
from k2.parallel import cpu_backend
from k2.parallel.dims import ParallelDims
from k2.schedules.resolve import resolve_schedule

if TYPE_CHECKING:
    from k2.config.schema import K2Config

_OPTIMIZER_DEFAULTS = {
    "model": "k2_tiny",
    "precision": "fp32",
    "muon_fp32_matmul_prec": "medium",
    "warmup": 2,
    "repeats": 10,
    "seed": 0,
    "dp2": True,  # the DP=2 ZeRO-1 comparison (two forked ranks)
}


def _optimizer_case(name: str, o: dict, extra: tuple = (), world: int = 1):
    """(optimizer, QKClip, chunks, cfg) for ``optim=name`` (+ ``extra`` overrides) on the proxy model, with
    random gradients in megatron's grad buffers (ZeRO-1 on, ``world`` ranks of DP)."""
    import torch

    cfg = load_config(
        [
            f"optim={name}",
            f"model={o['model']}",
            f"train.precision={o['precision']}",
            f"optim.muon_fp32_matmul_prec={o['muon_fp32_matmul_prec']}",
            *extra,
        ]
    )
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, world)
    parts = setup(cfg, dims, resolve_schedule(cfg), init=o["seed"])
    chunks, model, optimizer = parts.chunks, parts.model, parts.optimizer
    for g in optimizer.param_groups:
        g["lr"] = 1e-3  # no LR scheduler here
    gen = torch.Generator(device="cpu").manual_seed(o["seed"])
    for ddp in model:
        for buf in ddp.buffers + ddp.expert_parallel_buffers:
            buf.grad_data.copy_(torch.randn(buf.grad_data.shape, generator=gen) * 1e-3)
    clip = QKClip(model, optimizer, 100.0, cfg.model.num_layers)
    return optimizer, clip, chunks, cfg


#: the DP=2 cases: name -> overrides of optim=muonclip
_ZERO1_CASES = {
    "byte_range": ("optim.muon_zero1=byte_range",),
    "byte_range_offload": ("optim.muon_zero1=byte_range", "optim.offload_fraction=1"),
    "layer_wise": ("optim.muon_zero1=layer_wise",),
}


def _zero1_rank(rank: int, o: dict, port: int, out: str) -> None:
    """One of the two DP ranks of the ZeRO-1 comparison (spawned by :func:`_zero1_figures`): builds every
    case of :data:`_ZERO1_CASES`, times their ``optimizer.step()`` round-robin; rank 0 writes the medians
    and the number of Muon matrices that straddle a shard boundary to ``out`` (JSON)."""
    import json
    import os

    import torch

    from k2.optim.build import leaf_optimizers
    from k2.parallel.distributed import DistEnv, destroy_distributed, init_distributed

    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
        }
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    cfg = load_config([f"model={o['model']}"])
    init_distributed(DistEnv(rank, 2, rank, True), ParallelDims.from_config(cfg.parallel, cfg.model, 2), o["seed"])
    try:
        steps, straddlers = {}, 0
        for case, extra in _ZERO1_CASES.items():
            opt, _, _, _ = _optimizer_case("muonclip", o, extra, world=2)
            steps[case] = opt.step
            if case == "byte_range":
                straddlers = sum(len(getattr(x, "straddlers", [])) for x in leaf_optimizers(opt))

        def synced(fn):
            def call():
                fn()
                torch.distributed.barrier()

            return call

        times = time_calls(
            {k: synced(v) for k, v in steps.items()}, o["warmup"], o["repeats"], cuda=torch.cuda.is_available()
        )
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"times": times, "straddlers": straddlers}, f)
    finally:
        destroy_distributed()


def _zero1_figures(o: dict) -> dict[str, Any]:
    """The DP=2 ZeRO-1 comparison on two spawned local ranks (gloo on CPU, NCCL with two GPUs): figures of
    :func:`bench_optimizer`. Spawned, not forked: the calling process may hold a process group already."""
    import json
    import tempfile

    import torch
    import torch.multiprocessing as mp

    from k2.parallel.processes import free_port

    if 0 < torch.cuda.device_count() < 2:
        return {"dp2": f"skipped: {torch.cuda.device_count()} CUDA device, 2 needed for the DP=2 cases"}
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/zero1.json"
        mp.start_processes(_zero1_rank, args=(o, port, out), nprocs=2, join=True, start_method="spawn")
        with open(out) as f:
            res = json.load(f)
    t = res["times"]
    return {
        "dp2_straddling_muon_matrices": res["straddlers"],
        "time_dp2_byte_range_ms": t["byte_range"],
        "time_dp2_byte_range_offload_ms": t["byte_range_offload"],
        "time_dp2_layer_wise_ms": t["layer_wise"],
        "byte_range_over_layer_wise": t["byte_range"] / t["layer_wise"],
        "offload_over_no_offload": t["byte_range_offload"] / t["byte_range"],
        "gpu": (
            "the DP=2 figures ran on two CUDA devices"
            if torch.cuda.device_count() >= 2
            else "no GPU was lent to this run: CPU figures only"
        ),
    }


def bench_optimizer(cfg: K2Config) -> dict[str, Any]:
    """Optimizer step of optim=muonclip vs optim=adamw on the CPU proxy (one rank, ZeRO-1 on).

    Both optimizers are built by the trainer's code (``k2.optim.build``) for ``bench.options.model``
    (default ``k2_tiny``), gradients are random and fixed, and each call is one ``optimizer.step()``
    (grad norm, clipping, update; for MuonClip also megatron's layer-wise param sync). Calls alternate
    round-robin in one process. Figures:

    * ``time_adamw_ms``, ``time_muon_step_ms`` (MuonClip's ``optimizer.step()``: Muon for the matrices +
      AdamW for the rest), ``time_qk_clip_ms`` (``QKClip.step()`` with every head above tau, so every
      q/k weight is rescaled: the worst case);
    * ``muonclip_over_adamw`` = ``(time_muon_step + time_qk_clip) / time_adamw``;
    * ``muon_elements`` / ``adamw_elements``: parameter elements per optimizer under MuonClip;
    * on DP=2 (two spawned local ranks, gloo on CPU; ``bench.options.dp2=false`` skips them), MuonClip's
      ``optimizer.step()`` per ZeRO-1 variant, timed round-robin with a barrier after each call:
      ``time_dp2_byte_range_ms`` (Distributed Muon with ``dp2_straddling_muon_matrices`` gathered per
      step), ``time_dp2_byte_range_offload_ms`` (``optim.offload_fraction=1``), ``time_dp2_layer_wise_ms``,
      and ``byte_range_over_layer_wise``, ``offload_over_no_offload``; ``gpu`` says whether a GPU ran them.

    Raises:
        ConfigError: a bad option.
    """
    import torch

    o = bench_options(cfg, _OPTIMIZER_DEFAULTS)
    if o["precision"] not in DTYPES:
        raise ConfigError(f"bench.options.precision={o['precision']!r}; allowed: {', '.join(DTYPES)}")
    if o["muon_fp32_matmul_prec"] not in ("medium", "high", "highest"):
        raise ConfigError(
            f"bench.options.muon_fp32_matmul_prec={o['muon_fp32_matmul_prec']!r}; "
            "allowed: medium (Newton-Schulz in bf16), high, highest"
        )
    if o["repeats"] < 1 or o["warmup"] < 0:
        raise ConfigError("bench.options.repeats must be >= 1 and bench.options.warmup >= 0")

    cpu_backend.enable()
    teardown = one_rank_world()
    try:
        adam, _, _, _ = _optimizer_case("adamw", o)
        muon, clip, chunks, mcfg = _optimizer_case("muonclip", o)
        cores = [m.core_attention for c in chunks for m in c.modules() if hasattr(m, "core_attention")]

        def qk_clip():
            for core in cores:  # every head at 2 tau: every q/k weight rescaled
                core.max_logits.fill_(200.0)
            clip.step()

        times = time_calls(
            {"adamw": adam.step, "muon_step": muon.step, "qk_clip": qk_clip},
            o["warmup"],
            o["repeats"],
            cuda=torch.cuda.is_available(),
        )
        from k2.optim.params import ROUTE_ATTR

        counts = {"muon": 0, "adamw": 0}
        for c in chunks:
            for p in c.parameters():
                counts[getattr(p, ROUTE_ATTR)] += p.numel()
    finally:
        teardown()
    zero1 = _zero1_figures(o) if o["dp2"] else {}
    return {
        "model": o["model"],
        "precision": o["precision"],
        "newton_schulz": "bf16" if o["muon_fp32_matmul_prec"] == "medium" else "fp32",
        "muon_elements": counts["muon"],
        "adamw_elements": counts["adamw"],
        "time_adamw_ms": times["adamw"],
        "time_muon_step_ms": times["muon_step"],
        "time_qk_clip_ms": times["qk_clip"],
        "muonclip_over_adamw": (times["muon_step"] + times["qk_clip"]) / times["adamw"],
        **zero1,
    }
