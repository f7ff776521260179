"""Checkpoint figures of ``k2-plan``: bytes per GPU and per node, the save stall and background write, the
Young/Daly save interval and the expected goodput.

* **Bytes**: a resumable checkpoint holds every parameter once in BF16 (2 B), its FP32 master (4 B) and the
  optimizer's FP32 states (Muon's momentum 4 B, AdamW's two moments 8 B); megatron's fully parallel
  dist-checkpointing spreads the writing over all ranks, so a GPU writes ``total / world`` and a node
  ``gpus_per_node`` times that (K2: 10.4 TB, ~40 GB per GPU on 256 GPUs).
* **Stall**: a synchronous save stops training while the node writes its bytes at
  ``cluster.checkpoint_write_gbps``; an asynchronous one (``checkpoint.async_save``, megatron-core's async
  dist-checkpointing) only while each GPU copies its bytes to host memory (the profile's host link), and
  the files are written in the background (the write time is reported; a save must finish before the
  next starts). The staged copy occupies host memory: ``k2-plan`` adds it to every phase's host bytes per
  node.
* **Interval and goodput**: with a mean time between failures ``M`` (``cluster.mtbf_hours``; null =
  Llama 3's rate, 419 interruptions in 54 days on 16,384 GPUs, arXiv 2407.21783 section 3.3.4, scaled to
  the cluster's GPUs) and a stall ``C``, the save interval that loses least is ``tau = sqrt(2 C M)``
  (Young 1974; Daly 2006, first order); the expected fraction lost is ``C / tau`` (stalls) ``+ (tau / 2 +
  R) / M`` (work since the last save, and the restart ``R``: reading the checkpoint back at the same
  rate), and goodput = 1 - that. The interval is at least the background write (async) and one step.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from k2.optim.registry import optimizer_spec

if TYPE_CHECKING:
    from k2.config.schema import K2Config

_LLAMA3_HOURS_PER_INTERRUPTION = 54 * 24 / 419  # 3.09 h on 16,384 GPUs (arXiv 2407.21783 section 3.3.4)
_LLAMA3_GPUS = 16384


def checkpoint_bytes(total_params: int, optimizer: str) -> int:
    """Bytes of one resumable checkpoint of ``total_params`` parameters (module docstring; the optimizer's
    FP32 state bytes per parameter come from its :class:`k2.optim.registry.OptimizerSpec`)."""
    return int(total_params) * (2 + 4 + optimizer_spec(str(optimizer)).main_update.state_bytes)


def async_save(cfg: K2Config) -> bool:
    """``checkpoint.async_save`` (default true where the config has no such key)."""
    return bool(OmegaConf.select(cfg, "checkpoint.async_save", default=True))


def mtbf_hours(cfg: K2Config, world: int) -> float:
    """``cluster.mtbf_hours``, or Llama 3's interruption rate for ``world`` GPUs."""
    m = OmegaConf.select(cfg, "cluster.mtbf_hours", default=None)
    return float(m) if m is not None else _LLAMA3_HOURS_PER_INTERRUPTION * _LLAMA3_GPUS / world


def staged_bytes_per_node(cfg: K2Config, total_params: int, world: int) -> float:
    """Host bytes per node an asynchronous save stages (0 when ``checkpoint.async_save`` is off)."""
    if not async_save(cfg):
        return 0.0
    return checkpoint_bytes(total_params, cfg.optim.name) / world * int(cfg.cluster.gpus_per_node)


def checkpoint_plan(cfg: K2Config, total_params: int, world: int, step_s: float, host_gbps: float) -> dict[str, Any]:
    """The checkpoint figures of one plan (JSON ``checkpoint``; bytes, seconds, hours).

    Args:
        total_params: the model's parameters.
        world: GPUs.
        step_s: the estimated step time (the interval is at least one step).
        host_gbps: the profile's device -> host GB/s per GPU (the async stall).
    """
    total = checkpoint_bytes(total_params, cfg.optim.name)
    gpn = int(cfg.cluster.gpus_per_node)
    per_gpu = total / world
    per_node = per_gpu * gpn
    write_s = per_node / (float(cfg.cluster.checkpoint_write_gbps) * 1e9)
    is_async = async_save(cfg)
    stall = per_gpu / (host_gbps * 1e9) if is_async else write_s
    mtbf_s = mtbf_hours(cfg, world) * 3600
    tau = max(math.sqrt(2 * stall * mtbf_s), write_s if is_async else 0.0, step_s)
    lost = stall / tau + (tau / 2 + write_s) / mtbf_s
    return {
        "bytes_total": total,
        "bytes_per_gpu": per_gpu,
        "bytes_per_node": per_node,
        "async_save": is_async,
        "stall_s": stall,
        "background_write_s": write_s if is_async else 0.0,
        "write_gbps_per_node": float(cfg.cluster.checkpoint_write_gbps),
        "mtbf_hours": mtbf_s / 3600,
        "save_interval_s": tau,
        "save_interval_steps": max(1, round(tau / step_s)),
        "restart_read_s": write_s,
        "expected_goodput": max(0.0, 1 - lost),
        "staged_host_bytes_per_node": per_node if is_async else 0.0,
    }


def format_checkpoint(c: dict[str, Any]) -> list[str]:
    """Text lines of :func:`checkpoint_plan`."""
    mode = "async" if c["async_save"] else "sync"
    return [
        f"  checkpoint: {c['bytes_total'] / 1e12:.3g} TB, {c['bytes_per_gpu'] / 1e9:.3g} GB per GPU, "
        f"{c['bytes_per_node'] / 1e9:.3g} GB per node; {mode} save stalls {c['stall_s']:.3g} s"
        + (
            f" (+ {c['background_write_s']:.3g} s written in the background at {c['write_gbps_per_node']:g} GB/s "
            f"per node, staged copy {c['staged_host_bytes_per_node'] / 2**30:.3g} GiB host memory per node"
            + (
                f", {c['staged_host_bytes_per_node_pinned'] / 2**30:.3g} GiB as pinned buffers)"
                if "staged_host_bytes_per_node_pinned" in c
                else ")"
            )
            if c["async_save"]
            else f" (written at {c['write_gbps_per_node']:g} GB/s per node)"
        ),
        f"  save every {c['save_interval_s'] / 60:.3g} min ({c['save_interval_steps']:,} steps; Young/Daly "
        f"sqrt(2 x stall x MTBF), MTBF {c['mtbf_hours']:.3g} h): expected goodput "
        f"{100 * c['expected_goodput']:.1f}%",
    ]
