"""``k2-bench bench=host_cost``: the host's own time per operator of megatron-core's layer code, forward and
backward apart, for ``k2-plan``'s ``host`` term (:mod:`k2.launcher.planning.host_bound`).

On a GPU host every operator of an eager PyTorch step costs the CPU its Python module code (megatron-core's
and the trainer's), torch's dispatcher, autograd's bookkeeping and the allocator, and then the CUDA launch
call; the GPU runs the kernel later, asynchronously. This benchmark measures the first part on this CPU
with the same Python, dispatcher and module code: the main job's MoE and dense layers as ``k2-train``
builds them (:func:`k2.launcher.benchmarks.operator_cost.build_case`: ``k2_tiny``, FP32, megatron's
sequential experts), run forward and backward at a few token counts so small that the CPU's arithmetic
is a small part of the time, and extrapolated to no tokens at all (the least-squares line through the
sizes' fastest runs: what is left is the host's fixed cost of issuing the operators). It
leaves out what only a GPU host pays: the CUDA launch call of each kernel-launching operator (the
model adds the profile's ``kernel_launch_us`` for it).

Figures, per part (``moe_layer``, ``dense_layer``) and pass: operators (aten operators reaching the
dispatcher, counted with torch's dispatch mode as :mod:`k2.launcher.planning.operator_counts` counts them),
of those the ones that are not views (each launches a kernel on a GPU), seconds at each token count (the
fastest of ``repeats``, the runs interleaved) and the extrapolated seconds and microseconds per operator;
and over both layers, weighted by operators, ``forward_us`` / ``backward_us`` per operator and the
kernel-launching share of the operators. One thread (the host thread that issues a GPU's work is one).
The record is written to ``benchmarks/results/`` by the benchmark itself
(:mod:`k2.launcher.benchmarks.results`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from k2.launcher.benchmarks.common import bench_options, check_minimums, interleaved_samples

if TYPE_CHECKING:
    from k2.config.schema import K2Config

_DEFAULTS = {
    "repeats": 25,
    "tokens": [8, 16, 32, 64],  # sequence lengths of the one-sequence microbatches measured (the line)
    "write": True,  # write the record to benchmarks/results/
    "results_dir": "",  # "" = benchmarks/results/
}
_PARTS = ("moe_layer", "dense_layer")


def _count(fwd) -> dict[str, int]:
    """Operators of one forward and its backward, and of those the non-views (kernel launches on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = self.kernels = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            self.kernels += 0 if func.is_view else 1
            return func(*args, **(kwargs or {}))

    c = Count()
    with c:
        loss = fwd()
    f = (c.ops, c.kernels)
    with c:
        loss.backward()
    return {
        "forward_ops": f[0],
        "forward_kernels": f[1],
        "backward_ops": c.ops - f[0],
        "backward_kernels": c.kernels - f[1],
    }


def _extrapolate(tokens: list[int], seconds: list[float]) -> float:
    """Seconds at no tokens: the least-squares line through the sizes' fastest runs at zero tokens, within
    ``[0, the smallest size's]`` (a shared machine's noise can tilt the line either way)."""
    import numpy as np

    slope, intercept = np.polyfit(np.asarray(tokens, float), np.asarray(seconds, float), 1)
    return float(min(max(intercept, 0.0), min(seconds)))


def _timed_passes(fwd: Callable[[], Any]) -> tuple[Callable[[], None], Callable[[], None]]:
    """A forward that keeps its loss and a backward of that loss: the two passes, timed apart."""
    held: dict[str, Any] = {}

    def forward() -> None:
        held["loss"] = fwd()

    def backward() -> None:
        held.pop("loss").backward()

    return forward, backward


def measure_host_cost(repeats: int, tokens: list[int]) -> dict[str, Any]:
    """The figures of the module docstring, measured in this process with one thread."""
    import torch

    from k2.launcher.benchmarks.operator_cost import _parts, build_case

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    case, teardown = build_case()
    try:
        out: dict[str, Any] = {}
        turn: dict[str, Callable[[], Any]] = {}
        for n in tokens:
            parts = _parts(case, n, 1)
            for name in _PARTS:
                fwd = parts[name][0]
                fwd().backward()  # warm-up
                if name not in out:
                    out[name] = _count(fwd)
                turn[f"{name}/{n}/F"], turn[f"{name}/{n}/B"] = _timed_passes(fwd)
        samples = interleaved_samples(turn, repeats, lambda: None)
        for name in _PARTS:
            row = out[name]
            for ph, pass_name in (("F", "forward"), ("B", "backward")):
                secs = [min(samples[f"{name}/{n}/{ph}"]) for n in tokens]
                row[f"{pass_name}_s_by_tokens"] = dict(zip(map(str, tokens), secs))
                row[f"{pass_name}_s"] = _extrapolate(tokens, secs)
                row[f"{pass_name}_us_per_op"] = row[f"{pass_name}_s"] / row[f"{pass_name}_ops"] * 1e6
        total = {}
        for pass_name in ("forward", "backward"):
            ops = sum(out[p][f"{pass_name}_ops"] for p in _PARTS)
            total[f"{pass_name}_us"] = sum(out[p][f"{pass_name}_s"] for p in _PARTS) / ops * 1e6
            total[f"{pass_name}_kernel_share"] = sum(out[p][f"{pass_name}_kernels"] for p in _PARTS) / ops
        out["per_operator"] = total
    finally:
        case.release()
        teardown()
        torch.set_num_threads(old)
    return out


def bench_host_cost(cfg: K2Config) -> dict[str, Any]:
    """The host's time per operator of the main job's layers on this CPU (module docstring); the record
    written to ``benchmarks/results/`` unless ``bench.options.write`` is false.

    Raises:
        ConfigError: a bad option (``tokens``: at least two distinct sequence lengths >= 1).
    """
    from k2.config.errors import ConfigError

    o = bench_options(cfg, _DEFAULTS)
    check_minimums(o, {"repeats": 1})
    tokens = [int(t) for t in o["tokens"]]
    if len(set(tokens)) < 2 or min(tokens) < 1:
        raise ConfigError(f"bench.options.tokens={tokens}: at least two distinct sequence lengths >= 1")
    figures = measure_host_cost(int(o["repeats"]), tokens)
    if o["write"]:
        from k2.launcher.benchmarks.results import RESULTS_DIR, results_record, write_results

        options = {k: o[k] for k in ("repeats", "tokens")}
        path = write_results(results_record("host_cost", options, figures), o["results_dir"] or RESULTS_DIR)
        figures["written"] = str(path)
    return figures
