"""``k2-bench bench=hardware``: measure this machine's hardware profile for ``k2-plan``'s step-time model and
write it as a profile file (``plan.hardware=PATH.yaml``; the keys of ``recipes/hardware/*.yaml``).

Measured, each the fastest of ``repeats`` timed calls after a warm-up (the capability, least disturbed by
other load on a shared machine), on the device the trainer would use
(CUDA when present, else the CPU with ``threads`` threads, what one k2-train rank gets):

* GEMM rate by shape (``[m, k] x [k, n]``, the compute dtype: BF16 on CUDA, FP32 on the CPU): a large
  square one (the ceiling: ``gemm_bf16_tflops`` on CUDA) and the shapes of the main job's model (on a CPU
  ``gemm_fp32_tflops`` is the rate of one microbatch's own GEMMs run alone, below; their median without
  it: a CPU's rate varies with the shape in ways tiles do not model);
* batched GEMMs at core attention's shapes (``attention_tflops``);
* memory bandwidth: a copy of a large tensor, bytes read + written (``memory_gbps``, efficiency 1);
* the cost one operator adds (``kernel_launch_us``): on a CPU, forward + backward of one MoE transformer
  layer of the main job's model as ``k2-train`` builds it, its time beyond its GEMMs over its operators
  counted with torch's dispatch mode (:mod:`k2.launcher.benchmarks.operator_cost`; the word embedding, the
  loss and the optimizer step are measured alike: ``operator_us``; and one and two microbatches through
  megatron's schedule: the schedule's own cost per microbatch and per step); on CUDA a chain of small
  element-wise operators under autograd (the launch and its bookkeeping);
* the collective bandwidths of the backend in use between ``ranks`` local processes (gloo on a CPU, NCCL
  with as many GPUs): all-gather, reduce-scatter (ring bus bandwidth), point-to-point send and its
  small-message latency; all of one machine, so the intra-node and the network figures are the same.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k2.launcher.benchmarks.common import bench_options, best_time, check_minimums

if TYPE_CHECKING:
    from k2.config.schema import K2Config

_DEFAULTS = {
    "threads": 0,  # CPU threads of the measurements; 0 = os.cpu_count() // ranks (what a k2-train rank gets)
    "ranks": 2,  # processes of the collective measurements (>= 2); 1 = skip them
    "repeats": 7,
    "out": "",  # write the profile here (YAML); "" = print it only
    "name": "",  # the profile's name; "" = derived from the device
    "gemm_size": 0,  # edge of the square ceiling GEMM; 0 = auto: 8192 on CUDA, 1024 on the CPU
    "operators": True,  # CPU: the per-operator cost on the main job's MoE layer (false: a bare autograd chain)
}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_device(
    threads: int, repeats: int, gemm_size: int = 0, shapes=(), *, operators: bool = True
) -> dict[str, Any]:
    """The single-device figures (module docstring) with ``threads`` CPU threads. Returns the profile
    keys it sets, ``gemm_by_shape`` (TFLOP/s per ``"m x k x n"``) and on a CPU ``operator_cost``
    (:func:`k2.launcher.benchmarks.operator_cost.measure_operator_cost`; ``operators=False``: the
    element-wise chain instead, no model built)."""
    import torch

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    old = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    try:

        def gemm_rate(m, k, n, batch=1):
            a = torch.randn(batch, m, k, device=dev, dtype=dtype)
            b = torch.randn(batch, k, n, device=dev, dtype=dtype)
            t = best_time(lambda: torch.bmm(a, b) if batch > 1 else torch.mm(a[0], b[0]), repeats, sync)
            return 2 * batch * m * k * n / t / 1e12

        size = gemm_size or (8192 if cuda else 1024)
        ceiling = gemm_rate(size, size, size)
        by_shape = {f"{m}x{k}x{n}": gemm_rate(m, k, n) for m, k, n in shapes}
        by_shape[f"{size}x{size}x{size}"] = ceiling
        heads, s, d = (64, 4096, 192) if cuda else (8, 128, 48)
        attention = gemm_rate(s, d, s, batch=heads)
        n = (1 << 28) if cuda else (1 << 24)
        x = torch.empty(n, device=dev, dtype=torch.float32)
        y = torch.empty_like(x)
        copy = best_time(lambda: y.copy_(x), repeats, sync)
        memory_gbps = 2 * 4 * n / copy / 1e9
        # one operator's cost on the training path: 200 small element-wise ops, forward + backward
        w = torch.randn(64, device=dev, requires_grad=True)

        def chain():
            z = w
            for _ in range(100):
                z = z * 1.0001
                z = z + 0.0001
            z.sum().backward()

        # 200 operators forward, each with its backward node (~1.5 kernels): 2.5 kernels share the cost
        launch_us = best_time(chain, repeats, sync) / 200 / 2.5 * 1e6
        # a CPU's GEMM rate depends on the shape through its blocking, which the kernel model does not
        # describe (no tiles): the rate at the job's own shapes (their median) is the profile's
        rate = statistics.median(v for k, v in by_shape.items() if k != f"{size}x{size}x{size}") if shapes else ceiling
        ops = None
        if operators and not cuda:
            from k2.launcher.benchmarks.operator_cost import measure_operator_cost
            from k2.launcher.planning import KernelRates

            rates = KernelRates(
                gemm_flops=rate * 1e12, attention_flops=min(attention, rate) * 1e12, memory_bytes=memory_gbps * 1e9
            )
            ops = measure_operator_cost(rates, repeats)
    finally:
        torch.set_num_threads(old)
    name = torch.cuda.get_device_name(0) if cuda else _cpu_name()
    out = {
        "gpu": name,
        "kernel_launch_us": launch_us,
        "memory_gbps": memory_gbps,
        "memory_efficiency": 1.0,
        "attention_tflops": attention,
        "gemm_by_shape": by_shape,
    }
    if cuda:
        out.update(gemm_bf16_tflops=ceiling)
    else:
        out.update(
            gemm_fp32_tflops=rate, gemm_bf16_tflops=rate, gemm_ceiling_tflops=ceiling, gemm_tile=1, compute_units=None
        )
    if ops is not None:
        out["operator_cost"] = ops
        out.update(operator_profile_keys(ops))
    return out


def operator_us(ops: dict[str, Any]) -> dict[str, float]:
    """The profile's ``operator_us`` (per part, microseconds) from the measured operator figures
    (:func:`k2.launcher.benchmarks.operator_cost.measure_operator_cost`)."""
    return {
        "embedding": ops["embedding"]["per_op_us"],
        "loss": ops["head"]["per_op_us"],
        "optimizer": ops["optimizer"]["per_op_us"],
    }


def operator_profile_keys(ops: dict[str, Any]) -> dict[str, Any]:
    """The profile keys the measured operator figures set: ``kernel_launch_us`` (one MoE layer's cost per
    operator), ``operator_us``, the schedule's ``microbatch_overhead_us`` / ``step_overhead_us`` and the
    GEMM rate of one microbatch's own GEMMs run alone (``gemm_fp32_tflops`` / ``gemm_bf16_tflops``)."""
    moe, sched = ops["moe_layer"], ops["schedule"]
    weights = {"moe_layer": sched["moe_layers"], "dense_layer": sched["dense_layers"], "embedding": 1, "head": 1}
    rate = (
        sum(n * ops[p]["gemm_flops"] for p, n in weights.items())
        / sum(n * ops[p]["gemm_s"] for p, n in weights.items())
        / 1e12
    )
    return {
        "kernel_launch_us": moe["per_op_us"],
        "operator_us": operator_us(ops),
        "gemm_fp32_tflops": rate,
        "gemm_bf16_tflops": rate,
        "microbatch_overhead_us": sched["microbatch_us"],
        "step_overhead_us": sched["step_us"],
    }


def _collective_worker(rank: int, world: int, port: int, threads: int, repeats: int, q) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, threads))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    dev = f"cuda:{rank}" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    nbytes = (256 << 20) if cuda else (8 << 20)
    x = torch.ones(nbytes // 4, device=dev)
    parts = [torch.empty_like(x) for _ in range(world)]
    ag = best_time(lambda: (dist.all_gather(parts, x), dist.barrier()), repeats, sync)
    rs_out = torch.empty(nbytes // 4 // world, device=dev)
    rs = best_time(lambda: dist.reduce_scatter_tensor(rs_out, x) if cuda else dist.all_reduce(x), repeats, sync)

    def ping(t):
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
            dist.send(t, 0)

    small = torch.ones(1, device=dev)
    lat = best_time(lambda: ping(small), repeats * 3, sync) / 2
    big = torch.ones((4 << 20) // 4, device=dev)
    p2p = best_time(lambda: ping(big), repeats, sync) / 2
    dist.destroy_process_group()
    if rank == 0:
        n = world
        # ring bus bandwidth: each rank moves (n - 1) / n of the whole buffer; gloo has no reduce-scatter:
        # its all-reduce (reduce-scatter + all-gather, 2 (n - 1) / n) stands in
        q.put(
            {
                "collective_gbps": statistics.mean(
                    [nbytes * n * (n - 1) / n / ag / 1e9, nbytes * (2 if not cuda else 1) * (n - 1) / n / rs / 1e9]
                ),
                "p2p_gbps": (4 << 20) / max(p2p - lat, 1e-9) / 1e9,
                "latency_us": lat * 1e6,
                "backend": "nccl" if cuda else "gloo",
            }
        )


def measure_collectives(ranks: int, threads: int, repeats: int) -> dict[str, Any]:
    """Collective figures between ``ranks`` local processes (module docstring)."""
    import torch.multiprocessing as mp

    from k2.parallel.processes import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_collective_worker, args=(r, ranks, port, threads, repeats, q)) for r in range(ranks)]
    for p in procs:
        p.start()
    try:
        res = q.get(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return res


def measure_profile(
    threads: int, ranks: int, repeats: int, *, name: str = "", gemm_size: int = 0, shapes=(), operators: bool = True
) -> dict[str, Any]:
    """A whole profile (the keys of ``recipes/hardware/*.yaml``) measured on this machine; with the
    per-part operator figures (``operator_cost``) where measured."""
    dev = measure_device(threads, repeats, gemm_size, shapes, operators=operators)
    coll = measure_collectives(ranks, threads, repeats) if ranks >= 2 else None
    when = datetime.date.today().isoformat()
    prof = {k: v for k, v in dev.items() if k not in ("gemm_by_shape", "operator_cost")}
    prof.update(
        name=name or ("measured-" + ("cuda" if dev["gemm_bf16_tflops"] > 50 else "cpu")),
        gpus_per_host=max(ranks, 1),
        peak_bf16_tflops=dev["gemm_bf16_tflops"],
        peak_fp8_tflops=2 * dev["gemm_bf16_tflops"],
        host_gbps=dev["memory_gbps"] / 2,
        nongemm_share=0.0,
    )
    c = coll or {"collective_gbps": dev["memory_gbps"] / 2, "p2p_gbps": dev["memory_gbps"] / 2, "latency_us": 0.0}
    for side in ("nvlink", "network"):
        prof.update(
            {
                f"{side}_gbps": c["p2p_gbps"],
                f"{side}_alltoall_gbps": c["collective_gbps"],
                f"{side}_collective_gbps": c["collective_gbps"],
            }
        )
    prof.update(network_latency_us=c["latency_us"], intra_latency_us=c["latency_us"])
    prof["sources"] = {
        "measured": f"k2-bench bench=hardware on {dev['gpu']}, {when}, "
        f"{threads or os.cpu_count()} threads per rank, {ranks} ranks" + (f" ({coll['backend']})" if coll else "")
    }
    res = {"profile": prof, "gemm_by_shape_tflops": dev["gemm_by_shape"]}
    if "operator_cost" in dev:
        res["operator_cost"] = dev["operator_cost"]
    return res


def write_profile(profile: dict[str, Any], path: str) -> None:
    """Write ``profile`` as a YAML profile file (every measured number under the ``sources`` note)."""
    import yaml

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    head = (
        "# Hardware profile measured by k2-bench bench=hardware (launcher/benchmarks/hardware.py); every "
        "number is a measurement of this machine (sources.measured)\n"
    )
    Path(path).write_text(head + yaml.safe_dump(profile, sort_keys=False))


def bench_hardware(cfg: K2Config) -> dict[str, Any]:
    """This machine's hardware profile (module docstring); with ``bench.options.out`` also written there.

    Raises:
        ConfigError: a bad option.
    """
    o = bench_options(cfg, _DEFAULTS)
    check_minimums(o, {"threads": 0, "ranks": 1, "repeats": 1, "gemm_size": 0})
    threads = o["threads"] or max(1, (os.cpu_count() or 1) // max(o["ranks"], 1))
    res = measure_profile(
        threads,
        o["ranks"],
        o["repeats"],
        name=o["name"],
        gemm_size=o["gemm_size"],
        shapes=[(256, 128, 384), (256, 384, 128), (256, 128, 4096), (128, 128, 128)],
        operators=bool(o["operators"]),
    )
    if o["out"]:
        write_profile(res["profile"], o["out"])
        res["written"] = o["out"]
    return res
