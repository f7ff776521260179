"""``k2-bench bench=optimizer``: one MuonClip optimizer step against one AdamW step on the CPU proxy.
"""

from __future__ import annotations

from typing import Any

from k2.config.errors import ConfigError
from k2.config.load import load_config
from k2.launcher.benchmarks.common import DTYPES, bench_options, one_rank_world, time_calls
from k2.model.build import build_model_chunks, layout_independent_init, transformer_config
from k2.optim.build import build_optimizer, uses_layer_wise, uses_muon, uses_zero1_muon
from k2.optim.params import param_rules, tag_parameters
from k2.optim.qk_clip import QKClip
from k2.parallel import cpu_backend
from k2.parallel.dims import ParallelDims
from k2.parallel.distributed import wrap_model
from k2.schedules.resolve import resolve_schedule

_OPTIMIZER_DEFAULTS = {
    "model": "k2_tiny",
    "precision": "fp32",
    "muon_fp32_matmul_prec": "medium",
    "warmup": 2,
    "repeats": 10,
    "seed": 0,
}


def _optimizer_case(name: str, o: dict):
    """(optimizer, QKClip, chunks) for ``optim=name`` on the proxy model, with random gradients in
    megatron's grad buffers (ZeRO-1 on, one rank)."""
    import torch


    cfg = load_config([f"optim={name}", f"model={o['model']}", f"train.precision={o['precision']}",
                       f"optim.muon_fp32_matmul_prec={o['muon_fp32_matmul_prec']}"])
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, 1)
    tcfg = transformer_config(cfg, dims)
    chunks = build_model_chunks(cfg, dims, tcfg)
    layout_independent_init(chunks, tcfg, o["seed"])
    tag_parameters(chunks, tcfg, muon=uses_muon(cfg.optim),
                   zero1_muon=uses_zero1_muon(cfg.optim, cfg.parallel.use_distributed_optimizer),
                   **param_rules(cfg.optim))
    model = wrap_model(chunks, tcfg, True, layer_wise=uses_layer_wise(cfg.optim, cfg.parallel.use_distributed_optimizer))
    optimizer = build_optimizer(cfg.optim, model, tcfg, resolve_schedule(cfg), True)
    for g in optimizer.param_groups:
        g["lr"] = 1e-3  # no LR scheduler here
    gen = torch.Generator(device="cpu").manual_seed(o["seed"])
    for ddp in model:
        for buf in ddp.buffers + ddp.expert_parallel_buffers:
            buf.grad_data.copy_(torch.randn(buf.grad_data.shape, generator=gen) * 1e-3)
    clip = QKClip(model, optimizer, 100.0, cfg.model.num_layers)
    return optimizer, clip, chunks, cfg


def bench_optimizer(cfg) -> dict[str, Any]:
    """Optimizer step of optim=muonclip vs optim=adamw on the CPU proxy (one rank, ZeRO-1 on).

    Both optimizers are built by the trainer's code (``k2.optim.build``) for ``bench.options.model``
    (default ``k2_tiny``), gradients are random and fixed, and each call is one ``optimizer.step()``
    (grad norm, clipping, update; for MuonClip also megatron's layer-wise param sync). Calls alternate
    round-robin in one process. Figures:

    * ``time_adamw_ms``, ``time_muon_step_ms`` (MuonClip's ``optimizer.step()``: Muon for the matrices +
      AdamW for the rest), ``time_qk_clip_ms`` (``QKClip.step()`` with every head above tau, so every
      q/k weight is rescaled: the worst case);
    * ``muonclip_over_adamw`` = ``(time_muon_step + time_qk_clip) / time_adamw``;
    * ``muon_elements`` / ``adamw_elements``: parameter elements per optimizer under MuonClip.

    Raises:
        ConfigError: a bad option.
    """
    import torch

    o = bench_options(cfg, _OPTIMIZER_DEFAULTS)
    if o["precision"] not in DTYPES:
        raise ConfigError(f"bench.options.precision={o['precision']!r}; allowed: {', '.join(DTYPES)}")
    if o["muon_fp32_matmul_prec"] not in ("medium", "high", "highest"):
        raise ConfigError(f"bench.options.muon_fp32_matmul_prec={o['muon_fp32_matmul_prec']!r}; "
                          "allowed: medium (Newton-Schulz in bf16), high, highest")
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

        times = time_calls({"adamw": adam.step, "muon_step": muon.step, "qk_clip": qk_clip},
                           o["warmup"], o["repeats"], cuda=torch.cuda.is_available())
        from k2.optim.params import ROUTE_ATTR

        counts = {"muon": 0, "adamw": 0}
        for c in chunks:
            for p in c.parameters():
                counts[getattr(p, ROUTE_ATTR)] += p.numel()
    finally:
        teardown()
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
    }
