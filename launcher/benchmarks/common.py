"""What every benchmark shares: its options over defaults, the system record, round-robin timing, a
one-rank megatron world, the text table of a record.
"""

from __future__ import annotations

import math
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from k2.config.errors import ConfigError

if TYPE_CHECKING:
    from k2.config.schema import K2Config

DTYPES = ("fp32", "bf16")


def bench_options(cfg: K2Config, defaults: dict[str, Any]) -> dict[str, Any]:
    """``cfg.bench.options`` over ``defaults``, each value converted to its default's type.

    Raises:
        ConfigError: an option not in ``defaults`` or a value of the wrong type.
    """
    given = cfg.bench.options
    given = {} if given is None else dict(given)
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ConfigError(
            f"unknown bench.options.{unknown[0]} for bench={cfg.bench.name}; allowed options: "
            + ", ".join(sorted(defaults))
        )
    out = dict(defaults)
    for key, value in given.items():
        kind = type(defaults[key])
        try:
            if kind is int and (isinstance(value, bool) or float(value) != int(value)):
                raise ValueError
            out[key] = kind(value)
        except (TypeError, ValueError):
            raise ConfigError(f"bench.options.{key}={value!r} must be of type {kind.__name__}") from None
    return out


def check_minimums(o: dict[str, Any], minimums: dict[str, int]) -> None:
    """Each ``bench.options.<key>`` at least its minimum.

    Raises:
        ConfigError: naming the option, its value and the minimum.
    """
    for key, low in minimums.items():
        if o[key] < low:
            raise ConfigError(f"bench.options.{key}={o[key]} must be >= {low}")


def system_info() -> dict[str, Any]:
    """Versions and hardware of this process (for the JSON record)."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        mcore = version("megatron-core")
    except PackageNotFoundError:
        mcore = None
    cpu_name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "megatron_core": mcore,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_name,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda_available": cuda,
        "device": torch.cuda.get_device_name(0) if cuda else cpu_name,
        "cuda": torch.version.cuda if cuda else None,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
    }


def best_time(fn: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    """Seconds of the fastest of ``repeats`` timed calls of ``fn`` after one untimed call, each timed up to
    ``sync()`` returning (a device synchronisation, or nothing on a CPU): the fastest call is the
    machine's capability, the least disturbed by other load."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return min(times)


def time_calls(fns: dict[str, Callable[[], Any]], warmup: int, repeats: int, cuda: bool) -> dict[str, float]:
    """Median wall time in ms of each function; calls are interleaved round-robin so that drifts in
    clock/thermal state hit every function alike."""
    import torch

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync()
    return {k: statistics.median(v) * 1e3 for k, v in interleaved_samples(fns, repeats, sync).items()}


def interleaved_samples(
    fns: dict[str, Callable[[], Any]], repeats: int, sync: Callable[[], None]
) -> dict[str, list[float]]:
    """Seconds of ``repeats`` calls of each function, the calls interleaved round-robin in the order of
    ``fns`` (a drift of the machine's load or clocks hits every function alike), each timed from a
    ``sync()`` to one after it (a device synchronisation, or nothing on a CPU)."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            samples[name].append(time.perf_counter() - t0)
    return samples


def one_rank_world():
    """A one-rank process group + megatron parallel state (gloo on CPU); returns a teardown function
    (a no-op when the caller already had a world, e.g. the test session's)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from k2.parallel.processes import free_port

    made_dist = made_ps = False
    if not dist.is_initialized():
        port = free_port()
        dist.init_process_group(
            "nccl" if torch.cuda.is_available() else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
        )
        made_dist = True
    if dist.get_world_size() != 1:
        raise ConfigError("bench=optimizer runs on one rank; run k2-bench without torchrun")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(0)
        made_ps = True

    def teardown():
        if made_ps:
            ps.destroy_model_parallel()
        if made_dist:
            dist.destroy_process_group()

    return teardown


def describe(fn: Callable) -> str:
    """The first sentence of a benchmark's docstring, on one line (its first paragraph when that has no
    sentence end): what ``k2-bench`` lists, never cut mid-sentence."""
    paragraph = " ".join((fn.__doc__ or "").strip().split("\n\n")[0].split())
    m = re.search(r"(?<=[.!?])\s+(?=[A-Z(`])", paragraph)
    return paragraph[: m.start()] if m else paragraph


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value == 0 or math.isinf(value) or math.isnan(value):
            return str(value)
        if abs(value) < 1e-3 or abs(value) >= 1e6:
            return f"{value:.3e}"
        return f"{value:.4g}"
    return str(value)


def format_table(record: dict[str, Any]) -> str:
    """Text rendering of the JSON record: system line, then ``figure  value`` rows (a section per case)."""
    sysinfo = record["system"]
    lines = [
        f"k2-bench bench={record['bench']}",
        f"  torch {sysinfo['torch']}, megatron-core {sysinfo['megatron_core']}, python "
        f"{sysinfo['python']}; device: {sysinfo['device']}; {sysinfo['cpu_count']} CPUs "
        f"({sysinfo['torch_threads']} torch threads)"
        + (f"; CUDA {sysinfo['cuda']}, cuDNN {sysinfo['cudnn']}" if sysinfo["cuda_available"] else ""),
    ]

    def rows(d: dict[str, Any], indent: str) -> None:
        width = max((len(k) for k in d), default=0)
        for key, value in d.items():
            if isinstance(value, dict):
                lines.append(f"{indent}[{key}]")
                rows(value, indent + "  ")
            else:
                lines.append(f"{indent}{key:<{width}}  {_fmt(value)}")

    rows(record["figures"], "  ")
    return "\n".join(lines)
