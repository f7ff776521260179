"""``k2-bench bench=memory``: bytes saved for backward per microbatch and step time, for each activation
memory setting, on the CPU proxy under a parallel layout (default ``cpu4``: PP 2 x VPP 2, EP 2, DP 2).

Settings (``memory.*``, docs/k2_reference.md "Training system"; the lists are those of ``recipes/memory/k2.yaml``):

* ``none``: nothing; ``fp8``: ``fp8_store`` only; ``recompute``: ``recompute`` only; ``offload``: ``offload``
  only; ``all``: the three together (``memory=k2``).

Each rank builds one model per setting with the trainer's own builder
(:func:`k2.launcher.training.setup.setup`: ``k2.model.build``, megatron DDP, the optimizer of ``optim.name``),
runs megatron's interleaved 1F1B schedule with ``k2.launcher.training.step.forward_step``, same initial weights,
synthetic tokens; runs ``warmup`` untimed steps each, then ``steps`` timed steps
round-robin over the settings (median reported; a change of machine load hits all alike), then one step
each in which every microbatch forward runs inside a :class:`k2.model.saved_bytes_meter.SavedBytesMeter`: what
the saved-tensor hooks hold after each layer's forward (kept tensors by storage, FP8 tiles, host copies;
recomputed tensors count 0) -- measured, not estimated.

``saved_bytes`` = bytes kept on the device per microbatch of ``micro_batch_size`` sequences, summed over
the model's layers (all ranks of one pipeline; averaged over the DP replicas); ``host_bytes`` = bytes
offloaded to host memory; ``by_site`` splits ``saved_bytes`` over the sites of ``config/schema.py``
(``other`` = everything saved outside a site: embedding, router, dispatcher, output layer, ...).
On CPU the "host" is the same memory: the offload figure is what would leave the GPU.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import TYPE_CHECKING, Any

from k2.config.errors import ConfigError
from k2.config.load import load_config
from k2.launcher.benchmarks.common import bench_options
from k2.launcher.training.setup import setup
from k2.launcher.training.step import forward_step
from k2.model.activation_memory import MemoryOptions
from k2.model.saved_bytes_meter import SavedBytesMeter
from k2.parallel.dims import ParallelDims
from k2.parallel.distributed import destroy_distributed, dist_env, init_distributed
from k2.schedules.resolve import resolve_schedule

if TYPE_CHECKING:
    from k2.config.schema import K2Config

SETTINGS = ("none", "fp8", "recompute", "offload", "all")

DEFAULTS = {
    "parallel": "cpu4",
    "model": "k2_tiny",
    "precision": "fp32",
    "warmup": 1,
    "steps": 3,
    "seed": 0,
}


def memory_overrides(setting: str) -> list[str]:
    """Hydra overrides of one setting (the K2 lists of ``recipes/memory/k2.yaml``)."""
    k2 = load_config(["memory=k2"]).memory
    lists = {
        "none": {},
        "fp8": {"fp8_store": k2.fp8_store},
        "recompute": {"recompute": k2.recompute},
        "offload": {"offload": k2.offload},
        "all": {"fp8_store": k2.fp8_store, "recompute": k2.recompute, "offload": k2.offload},
    }[setting]
    return ["memory=none"] + [f"memory.{k}=[{','.join(v)}]" for k, v in lists.items()]


def _synthetic_iterators(vocab: int, phase, dp_rank: int, vpp: int, seed: int) -> list:
    """One iterator per model chunk (the same batches), batches as ``k2.launcher.datasets`` yields them."""
    import torch

    def batches():
        gen = torch.Generator().manual_seed(seed * 1000 + dp_rank)
        b, s = phase.micro_batch_size, phase.seq_length
        while True:
            tokens = torch.randint(0, vocab, (b, s + 1), generator=gen)
            yield {
                "tokens": tokens[:, :-1].contiguous(),
                "labels": tokens[:, 1:].contiguous(),
                "loss_mask": torch.ones(b, s),
                "position_ids": torch.arange(s).unsqueeze(0).expand(b, s),
            }

    return [batches() for _ in range(vpp)]


def _build_setting(setting: str, base: list[str], dims, phase, o: dict):
    """One setting on this rank: the model, its optimizer and data. Returns ``step(forward_step)``."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    cfg = load_config(base + memory_overrides(setting))
    sched = resolve_schedule(cfg, dims)
    parts = setup(
        cfg,
        dims,
        sched,
        rope_type=phase.rope_type,
        memory=MemoryOptions.from_config(cfg, attribute=True),
        init=o["seed"],
    )
    model, optimizer = parts.model, parts.optimizer
    for g in optimizer.param_groups:
        g["lr"] = 1e-4  # (no LR scheduler here)
    iters = _synthetic_iterators(cfg.model.vocab_size, phase, ps.get_data_parallel_rank(), dims.vpp, o["seed"])
    forward_backward = get_forward_backward_func()

    def step(forward_step):
        for m in model:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(
            forward_step_func=forward_step,
            data_iterator=iters,
            model=model,
            num_microbatches=phase.num_microbatches,
            seq_length=phase.seq_length,
            micro_batch_size=phase.micro_batch_size,
            decoder_seq_length=phase.seq_length,
            forward_only=False,
        )
        optimizer.step()

    return step


def _measure(base: list[str], dims, phase, o: dict) -> dict:
    """All settings on this rank: timed steps round-robin over the settings (so a change of machine load
    hits them alike), then one metered step each."""
    import torch.distributed as dist

    steps = {s: _build_setting(s, base, dims, phase, o) for s in SETTINGS}
    for _ in range(o["warmup"]):
        for s in SETTINGS:
            steps[s](forward_step)
    times: dict = {s: [] for s in SETTINGS}
    for _ in range(o["steps"]):
        for s in SETTINGS:
            dist.barrier()
            t0 = time.perf_counter()
            steps[s](forward_step)
            dist.barrier()
            times[s].append(time.perf_counter() - t0)
    out = {}
    for s in SETTINGS:
        meter = SavedBytesMeter()

        def metered(data_iterator, m, meter=meter):
            with meter.measure():
                return forward_step(data_iterator, m)

        steps[s](metered)
        out[s] = {
            "step_s": statistics.median(times[s]),
            "device": dict(meter.device_bytes),
            "host": dict(meter.host_bytes),
            "forwards": meter.forwards,
        }
    return out


def _worker(rank: int, world: int, port: int, base: list[str], o: dict, out_path: str) -> None:
    import json

    import torch
    import torch.distributed as dist

    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    torch.set_num_threads(1)
    import warnings

    warnings.simplefilter("ignore")

    cfg = load_config(base)
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, world)
    phase = resolve_schedule(cfg, dims).step_phase(1)
    init_distributed(dist_env(), dims, o["seed"])
    try:
        results = _measure(base, dims, phase, o)
        gathered = [None] * world
        dist.all_gather_object(gathered, results)
        if rank == 0:
            out = {
                "dp": dims.dp,
                "num_microbatches": phase.num_microbatches,
                "micro_batch_size": phase.micro_batch_size,
                "seq_length": phase.seq_length,
                "ranks": gathered,
            }
            with open(out_path, "w") as f:
                json.dump(out, f)
    finally:
        destroy_distributed()


def _summarise(raw: dict) -> dict[str, Any]:
    """Per setting: bytes per microbatch over the whole model (sum over ranks / (microbatches x DP))."""
    per_mb = raw["num_microbatches"] * raw["dp"]
    figures: dict[str, Any] = {}
    for s in SETTINGS:
        dev: dict[str, float] = {}
        host: dict[str, float] = {}
        for r in raw["ranks"]:
            for k, v in r[s]["device"].items():
                dev[k] = dev.get(k, 0) + v / per_mb
            for k, v in r[s]["host"].items():
                host[k] = host.get(k, 0) + v / per_mb
        figures[s] = {
            "saved_bytes": int(sum(dev.values())),
            "step_s": raw["ranks"][0][s]["step_s"],
            "host_bytes": int(sum(host.values())),
            "by_site": {k: int(v) for k, v in sorted(dev.items())},
        }
    none = figures["none"]
    fp8_sites = ("moe_fc1_input", "swiglu_input")
    before = sum(none["by_site"].get(k, 0) for k in fp8_sites)
    after = sum(figures["fp8"]["by_site"].get(k, 0) for k in fp8_sites)
    for s in SETTINGS:
        f = figures[s]
        f["saved_over_none"] = f["saved_bytes"] / none["saved_bytes"]
        f["step_over_none"] = f["step_s"] / none["step_s"]
    figures["fp8"]["fp8_sites_cut"] = 1.0 - after / before if before else None
    return figures


def bench_memory(cfg: K2Config) -> dict[str, Any]:
    """Saved bytes per microbatch and step time for memory none / fp8 / recompute / offload / all (CPU
    proxy, several ranks, one run).

    Figures: one object per setting (``none``, ``fp8``, ``recompute``, ``offload``, ``all``) with
    ``saved_bytes`` (per microbatch, on the device, whole model), ``step_s`` (median optimizer step,
    seconds), ``host_bytes``, ``by_site``, the ratios ``saved_over_none`` / ``step_over_none``; ``fp8`` also
    has ``fp8_sites_cut`` (fraction of the bytes at ``moe_fc1_input`` + ``swiglu_input`` that FP8 storage
    removes).

    Raises:
        ConfigError: a bad option.
    """
    import json
    import tempfile

    import torch.multiprocessing as mp

    from k2.parallel.processes import free_port

    o = bench_options(cfg, DEFAULTS)
    if o["precision"] not in ("fp32", "bf16"):
        raise ConfigError(f"bench.options.precision={o['precision']!r}; allowed: fp32, bf16")
    if o["steps"] < 1 or o["warmup"] < 0:
        raise ConfigError("bench.options.steps must be >= 1 and bench.options.warmup >= 0")
    base = [
        f"parallel={o['parallel']}",
        f"model={o['model']}",
        f"train.precision={o['precision']}",
        "run.wandb.mode=disabled",
    ]
    world = int(load_config(base).launch.nproc_per_node)

    checked = load_config(base + ["memory=k2"])  # the layout and the settings are valid
    resolve_schedule(checked, ParallelDims.from_config(checked.parallel, checked.model, world))
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "memory.json")
        mp.start_processes(
            _worker, args=(world, port, base, o, out_path), nprocs=world, join=True, start_method="spawn"
        )
        with open(out_path) as f:
            raw = json.load(f)
    return _summarise(raw)
