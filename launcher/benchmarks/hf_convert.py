"""``k2-bench bench=hf_convert``: host memory of ``k2-convert import`` and ``export`` against the largest
tensor group and the whole model, measured in one run.

A synthetic K2-family HF checkpoint (random FP32 weights, written shard by shard) of a model large
enough that the whole model (hundreds of MB) and its largest tensor group (a few MB) are far apart is
imported into a k2-launcher checkpoint (``.distcp`` files of at most ``shard_bytes``), which is then
exported back (safetensors shards of ``shard_bytes``); each direction runs in a fresh child process
that samples its resident set every 2 ms from after the imports of torch / megatron and the process
group to the end: the largest rise is what the conversion itself held (the child's ``ru_maxrss``
rise over the same span is reported too: exact, but blind below the start-up's own peak). Figures:
``model_bytes``, ``largest_group_bytes`` (a layer's attention + norms + router + shared expert, one
routed expert, the embedding or the head), ``largest_tensor_bytes`` (as stored), ``shard_bytes``, and
per direction ``peak_rss_bytes`` (the rise), ``maxrss_rise_bytes``, ``vs_model`` and
``vs_largest_group`` (ratios of the rise), ``seconds``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k2.launcher.benchmarks.common import bench_options

if TYPE_CHECKING:
    from k2.config.schema import K2Config

DEFAULTS = {
    "hidden_size": 512,
    "num_layers": 4,
    "num_moe_experts": 32,
    "moe_ffn_hidden_size": 512,
    "vocab_size": 4096,
    "shard_bytes": 16 << 20,
    "seed": 0,
}


def model_overrides(o: dict) -> list[str]:
    """The config overrides of the synthetic model (and ``convert.shard_bytes``) for the options ``o``
    (keys of :data:`DEFAULTS`)."""
    h, f = o["hidden_size"], o["moe_ffn_hidden_size"]
    return [
        f"model.hidden_size={h}",
        f"model.num_layers={o['num_layers']}",
        f"model.num_moe_experts={o['num_moe_experts']}",
        f"model.moe_ffn_hidden_size={f}",
        f"model.moe_shared_expert_intermediate_size={f}",
        f"model.ffn_hidden_size={3 * h}",
        f"model.vocab_size={o['vocab_size']}",
        f"data.vocab_size={o['vocab_size']}",
        f"convert.shard_bytes={o['shard_bytes']}",
    ]


def write_synthetic_hf(path: Path, m, shard_bytes: int, seed: int) -> tuple[int, int, int]:
    """A K2-family HF directory of random FP32 weights for the model config ``m``, written one shard at
    a time. Returns ``(model bytes, largest tensor group bytes, largest stored tensor bytes)`` (a
    ``[gate; up]`` pair is one stored tensor)."""
    import torch
    from safetensors.torch import save_file

    from k2.launcher.hf.hf_config import hf_config
    from k2.launcher.hf.mapping import numel, tensor_groups

    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    groups = tensor_groups(m)
    weight_map, shard, size, k, total, largest = {}, {}, 0, 0, 0, 0
    stored = max(numel(t.shape) * 4 * (2 if t.part else 1) for _, ts in groups for t in ts)

    def flush():
        nonlocal shard, size, k
        name = f"model-{k + 1:05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update({n: name for n in shard})
        shard, size, k = {}, 0, k + 1

    for _, ts in groups:
        b = sum(numel(t.shape) * 4 for t in ts)
        total, largest = total + b, max(largest, b)
        for t in ts:
            shard[t.hf] = torch.randn(t.shape, generator=g) * 0.02
        size += b
        if size >= shard_bytes:
            flush()
    if shard:
        flush()
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (path / "config.json").write_text(json.dumps(hf_config(m, "rope", "fp32")))
    return total, largest, stored


class _RssSampler:
    """The largest resident set of this process above its size at :meth:`start`, sampled every 2 ms by
    a thread (``ru_maxrss`` alone cannot tell: the start-up's imports may have peaked higher)."""

    def __init__(self):
        import psutil

        self.proc, self.peak, self.stop = psutil.Process(), 0, False

    def start(self):
        import threading

        self.base = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self):
        while not self.stop:
            self.peak = max(self.peak, self.proc.memory_info().rss - self.base)
            time.sleep(0.002)

    def finish(self) -> int:
        self.stop = True
        self.thread.join()
        return max(self.peak, self.proc.memory_info().rss - self.base)


def _child(verb: str, args: dict) -> None:
    """One conversion in this (child) process; prints ``{"peak_rss_bytes", "maxrss_rise_bytes",
    "seconds"}`` (``ru_maxrss`` is in KiB on Linux)."""
    import resource

    import megatron.core.dist_checkpointing  # noqa: F401  (the modules a conversion uses, imported before
    import safetensors.torch  # noqa: F401     the baseline: their code is not what it holds)

    import k2.launcher.hf.lazy_save
    import k2.parallel.dims  # noqa: F401
    from k2.config.load import load_config
    from k2.launcher.hf.dist import ensure_process_group
    from k2.launcher.hf.export import export_hf
    from k2.launcher.hf.importer import import_hf

    cfg = load_config(args["overrides"])
    ensure_process_group()
    maxrss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    sampler = _RssSampler().start()
    t0 = time.perf_counter()
    if verb == "import":
        import_hf(args["hf"], cfg, world_size=1)
    else:
        export_hf(args["checkpoint"], args["out"], shard_bytes=args["shard_bytes"])
    seconds = time.perf_counter() - t0
    maxrss_rise = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - maxrss0) * 1024
    print(json.dumps({"peak_rss_bytes": sampler.finish(), "maxrss_rise_bytes": maxrss_rise, "seconds": seconds}))


def convert_in_child(verb: str, args: dict) -> dict:
    """Run ``import`` (``args``: ``hf``, ``overrides``) or ``export`` (``checkpoint``, ``out``,
    ``overrides``, ``shard_bytes``) in a fresh Python process; its figures (:func:`_child`).

    Raises:
        RuntimeError: the conversion failed (with the end of its stderr).
    """
    proc = subprocess.run(
        [sys.executable, "-m", "k2.launcher.benchmarks.hf_convert", verb, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"k2-convert {verb} failed in the benchmark: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_hf_convert(cfg: K2Config) -> dict[str, Any]:
    """Peak host memory of import and export against the largest tensor group and the whole model."""
    from k2.config.load import load_config

    o = bench_options(cfg, DEFAULTS)
    with tempfile.TemporaryDirectory(prefix="k2_bench_hf_") as tmp:
        tmp = Path(tmp)
        overrides = [*model_overrides(o), f"run.dir={tmp / 'run'}"]
        m = load_config(overrides).model
        model_bytes, group_bytes, tensor_bytes = write_synthetic_hf(tmp / "hf", m, o["shard_bytes"], o["seed"])
        figures: dict[str, Any] = {
            "model_bytes": model_bytes,
            "largest_group_bytes": group_bytes,
            "largest_tensor_bytes": tensor_bytes,
            "shard_bytes": o["shard_bytes"],
        }
        imp = convert_in_child("import", {"hf": str(tmp / "hf"), "overrides": overrides})
        exp = convert_in_child(
            "export",
            {
                "checkpoint": str(tmp / "run" / "checkpoints" / "iter_0000000"),
                "out": str(tmp / "out"),
                "overrides": overrides,
                "shard_bytes": o["shard_bytes"],
            },
        )
        for name, r in (("import", imp), ("export", exp)):
            figures[name] = {
                "peak_rss_bytes": r["peak_rss_bytes"],
                "maxrss_rise_bytes": r["maxrss_rise_bytes"],
                "seconds": round(r["seconds"], 2),
                "vs_model": round(r["peak_rss_bytes"] / model_bytes, 3),
                "vs_largest_group": round(r["peak_rss_bytes"] / group_bytes, 2),
            }
    return figures


if __name__ == "__main__":
    _child(sys.argv[1], json.loads(sys.argv[2]))
