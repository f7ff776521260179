"""``k2-bench``: micro-benchmarks of the launcher's own components, on CPU and (when present) CUDA.

Usage::

    k2-bench                                   # bench=none: list the benchmarks
    k2-bench bench=attention                   # figures as a table
    k2-bench bench=attention output=json       # one JSON object on stdout
    k2-bench bench=attention bench.options.seq_length=512
    k2-bench bench=optimizer                   # MuonClip vs AdamW optimizer step, CPU proxy
    k2-bench bench=pipeline                    # decoupled wgrad on vs off: step time, cpu4
    k2-bench bench=memory                      # saved bytes / step time: memory none|fp8|recompute|offload|all
    k2-bench bench=step                        # full K2 step vs plain megatron-core, each feature toggled

``bench=<name>`` picks a recipe in ``recipes/bench/`` whose ``name`` selects a function of
:data:`BENCHMARKS` (name -> ``function(cfg) -> dict of figures``); ``bench.options.*`` are that
benchmark's options (defaults in the recipe and in the function; an unknown option or a bad value is a
:class:`launcher.config.ConfigError`: ``k2-bench: error: ...``, exit status 2).

JSON output: ``{"bench": name, "system": {...}, "options": {...}, "figures": {...}}`` with ``system`` =
torch and megatron-core versions, Python, device name, CPU count, torch threads, CUDA/cuDNN versions.
Times are milliseconds (median of ``repeats`` timed calls after ``warmup`` untimed ones; CUDA timed with
``torch.cuda.synchronize`` around each call).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from typing import Any, Callable

from launcher.bench_memory import bench_memory
from launcher.config import ConfigError, load_config

_OUTPUTS = ("text", "json")
_DTYPES = ("fp32", "bf16")


# ---------------------------------------------------------------------- shared helpers


def bench_options(cfg, defaults: dict[str, Any]) -> dict[str, Any]:
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
            raise ConfigError(
                f"bench.options.{key}={value!r} must be of type {kind.__name__}"
            ) from None
    return out


def system_info() -> dict[str, Any]:
    """Versions and hardware of this process (for the JSON record)."""
    import torch
    from importlib.metadata import PackageNotFoundError, version

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
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            samples[name].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in samples.items()}


# ---------------------------------------------------------------------- bench=attention


def reference_attention(q, k, v, scale: float):
    """Plain-torch causal attention, the reference for ``K2CoreAttention``.

    ``out = softmax(q k^T * scale + M) v`` with ``M[i, j] = -inf`` for ``j > i`` (softmax in at least
    fp32).

    Args:
        q: ``[s, b, h, dk]`` (megatron's layout), k: ``[s, b, h, dk]``, v: ``[s, b, h, dv]``.
        scale: softmax scale.

    Returns:
        ``(out [s, b, h * dv], per_head_max_logit [h] fp32)``; the max is over batch and unmasked
        positions of ``q k^T * scale``.
    """
    import torch

    s, b, h, _ = q.shape
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, d]
    scores = torch.matmul(qb, kb.transpose(-1, -2)) * scale
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(causal, float("-inf"))
    acc = torch.promote_types(scores.dtype, torch.float32)  # fp32 softmax for bf16, fp64 stays fp64
    probs = torch.softmax(scores.to(acc), dim=-1).to(v.dtype)
    out = torch.matmul(probs, vb)  # [b, h, s, dv]
    return out.permute(2, 0, 1, 3).reshape(s, b, -1), scores.float().amax(dim=(0, 2, 3))


_ATTENTION_DEFAULTS = {
    "batch": 2,
    "heads": 4,
    "seq_length": 256,
    "qk_head_dim": 48,
    "v_head_dim": 32,
    "dtype": "fp32",
    "cuda_batch": 1,
    "cuda_heads": 64,
    "cuda_seq_length": 4096,
    "cuda_qk_head_dim": 192,
    "cuda_v_head_dim": 128,
    "cuda_dtype": "bf16",
    "devices": "auto",
    "warmup": 2,
    "repeats": 10,
    "seed": 0,
}


def _attention_case(device: str, b: int, h: int, s: int, dk: int, dv: int, dtype_name: str,
                    warmup: int, repeats: int, seed: int) -> dict[str, Any]:
    import torch
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from model.attention import K2CoreAttention

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q, k = (torch.randn(s, b, h, dk, generator=gen) for _ in range(2))
    v = torch.randn(s, b, h, dv, generator=gen)
    q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
    tcfg = TransformerConfig(
        num_layers=1, hidden_size=h * dk, num_attention_heads=h, kv_channels=dk,
        attention_dropout=0.0, hidden_dropout=0.0, params_dtype=dtype,
    )

    def make(record: bool, max_logit_kernel: str = "torch"):
        m = K2CoreAttention(tcfg, 1, AttnMaskType.causal, "self", k_channels=dk, v_channels=dv,
                            record_max_logits=record, max_logit_kernel=max_logit_kernel)
        return m.to(device).train()  # max logits are recorded in training forwards

    from model.max_logit_kernel import available as triton_max_logit_available

    k2_rec, k2_plain = make(True), make(False)
    # the Triton max-logit kernel (model.max_logit_kernel=triton) where it runs: CUDA
    k2_tri = make(True, "triton") if device == "cuda" and triton_max_logit_available(q.device) else None
    scale = k2_rec.softmax_scale  # 1 / sqrt(dk)
    with torch.no_grad():
        out_k2 = k2_rec(q, k, v, None)
        out_ref, ref_max = reference_attention(q, k, v, scale)
        figures: dict[str, Any] = {
            "device": device,
            "dtype": dtype_name,
            "shape_sbhd": [s, b, h, dk],
            "v_head_dim": dv,
            "max_abs_diff": (out_k2.float() - out_ref.float()).abs().max().item(),
            "max_logit_abs_diff": (k2_rec.max_logits - ref_max).abs().max().item(),
        }
        calls = {
            "k2_record": lambda: k2_rec(q, k, v, None),
            "k2_no_record": lambda: k2_plain(q, k, v, None),
            "reference": lambda: reference_attention(q, k, v, scale),
        }
        if k2_tri is not None:
            k2_tri(q, k, v, None)
            figures["max_logit_abs_diff_triton"] = (k2_tri.max_logits - ref_max).abs().max().item()
            calls["k2_record_triton"] = lambda: k2_tri(q, k, v, None)
        if dtype != torch.float32:  # how far each is from the fp32 answer on the same inputs
            out_32, _ = reference_attention(q.float(), k.float(), v.float(), scale)
            figures["k2_max_abs_diff_vs_fp32"] = (out_k2.float() - out_32).abs().max().item()
            figures["reference_max_abs_diff_vs_fp32"] = (out_ref.float() - out_32).abs().max().item()
            del out_32
        times = time_calls(calls, warmup, repeats, cuda=device == "cuda")
    flops = 2 * b * h * s * s * (dk + dv)  # q k^T and p v over the full square (no causal skipping)
    figures.update(
        time_k2_ms=times["k2_record"],
        time_k2_no_record_ms=times["k2_no_record"],
        time_reference_ms=times["reference"],
        k2_over_reference=times["k2_record"] / times["reference"],
        max_logit_overhead=times["k2_record"] / times["k2_no_record"] - 1.0,
        k2_tflops=flops / (times["k2_record"] * 1e-3) / 1e12,
    )
    if "k2_record_triton" in times:
        figures.update(time_k2_triton_ms=times["k2_record_triton"],
                       max_logit_overhead_triton=times["k2_record_triton"] / times["k2_no_record"] - 1.0)
    return figures


def bench_attention(cfg) -> dict[str, Any]:
    """K2CoreAttention vs a plain-torch reference: max |diff|, times, max-logit recording overhead.

    Per case (``cpu`` always unless ``devices=cuda``; ``cuda`` when a GPU is present, with K2's
    shape: 64 heads, qk 192 / v 128, s 4096, bf16) the figures are

    * ``max_abs_diff``: max over elements of ``|K2CoreAttention - reference|`` (outputs ``[s, b, h*dv]``,
      same inputs, same dtype); ``max_logit_abs_diff``: ``|recorded - reference|`` per-head max logit;
    * with bf16 also each one's max |diff| against the fp32 reference on the same (bf16) inputs;
    * ``time_k2_ms`` (record_max_logits=True), ``time_k2_no_record_ms``, ``time_reference_ms``: forward,
      training mode, no autograd graph; ``k2_over_reference`` = time ratio;
      ``max_logit_overhead`` = ``time_k2 / time_k2_no_record - 1`` (fraction); on CUDA with Triton also
      ``time_k2_triton_ms``, ``max_logit_overhead_triton`` and ``max_logit_abs_diff_triton`` for
      ``max_logit_kernel=triton`` (model/max_logit_kernel.py);
      ``k2_tflops`` = ``2 b h s^2 (dk + dv)`` / time (dense square count).

    Raises:
        ConfigError: a bad option (unknown, wrong type, dtype not fp32/bf16, devices=cuda without GPU).
    """
    import torch

    o = bench_options(cfg, _ATTENTION_DEFAULTS)
    for key in ("dtype", "cuda_dtype"):
        if o[key] not in _DTYPES:
            raise ConfigError(f"bench.options.{key}={o[key]!r}; allowed: {', '.join(_DTYPES)}")
    if o["devices"] not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"bench.options.devices={o['devices']!r}; allowed: auto, cpu, cuda")
    if o["devices"] == "cuda" and not torch.cuda.is_available():
        raise ConfigError("bench.options.devices=cuda but no CUDA device is available; allowed: auto, cpu")
    for key in ("batch", "heads", "seq_length", "qk_head_dim", "v_head_dim", "cuda_batch",
                "cuda_heads", "cuda_seq_length", "cuda_qk_head_dim", "cuda_v_head_dim", "repeats"):
        if o[key] < 1:
            raise ConfigError(f"bench.options.{key}={o[key]} must be >= 1")
    if o["warmup"] < 0:
        raise ConfigError(f"bench.options.warmup={o['warmup']} must be >= 0")

    figures: dict[str, Any] = {}
    if o["devices"] in ("auto", "cpu"):
        figures["cpu"] = _attention_case(
            "cpu", o["batch"], o["heads"], o["seq_length"], o["qk_head_dim"], o["v_head_dim"],
            o["dtype"], o["warmup"], o["repeats"], o["seed"],
        )
    if o["devices"] in ("auto", "cuda") and torch.cuda.is_available():
        figures["cuda"] = _attention_case(
            "cuda", o["cuda_batch"], o["cuda_heads"], o["cuda_seq_length"], o["cuda_qk_head_dim"],
            o["cuda_v_head_dim"], o["cuda_dtype"], o["warmup"], o["repeats"], o["seed"],
        )
    return figures


# ---------------------------------------------------------------------- bench=optimizer


_OPTIMIZER_DEFAULTS = {
    "model": "k2_tiny",
    "precision": "fp32",
    "muon_fp32_matmul_prec": "medium",
    "warmup": 2,
    "repeats": 10,
    "seed": 0,
}


def _one_rank_world():
    """A one-rank process group + megatron parallel state (gloo on CPU); returns a teardown function
    (a no-op when the caller already had a world, e.g. the test session's)."""
    import socket

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    made_dist = made_ps = False
    if not dist.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
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


def _optimizer_case(name: str, o: dict):
    """(optimizer, QKClip, chunks) for ``optim=name`` on the proxy model, with random gradients in
    megatron's grad buffers (ZeRO-1 on, one rank)."""
    import torch

    from model.build import build_model_chunks, layout_independent_init, transformer_config
    from optim.build import build_optimizer, uses_layer_wise, uses_muon
    from optim.params import tag_parameters
    from optim.qk_clip import QKClip
    from parallel.dims import ParallelDims
    from parallel.distributed import wrap_model

    cfg = load_config([f"optim={name}", f"model={o['model']}", f"train.precision={o['precision']}",
                       f"optim.muon_fp32_matmul_prec={o['muon_fp32_matmul_prec']}"])
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, 1)
    tcfg = transformer_config(cfg, dims)
    chunks = build_model_chunks(cfg, dims, tcfg)
    layout_independent_init(chunks, tcfg, o["seed"])
    tag_parameters(chunks, tcfg, muon=uses_muon(cfg), layer_wise=uses_layer_wise(cfg))
    model = wrap_model(chunks, tcfg, True, layer_wise=uses_layer_wise(cfg))
    optimizer = build_optimizer(cfg, model, tcfg)
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

    Both optimizers are built by the trainer's code (``optim.build``) for ``bench.options.model``
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
    if o["precision"] not in _DTYPES:
        raise ConfigError(f"bench.options.precision={o['precision']!r}; allowed: {', '.join(_DTYPES)}")
    if o["muon_fp32_matmul_prec"] not in ("medium", "high", "highest"):
        raise ConfigError(f"bench.options.muon_fp32_matmul_prec={o['muon_fp32_matmul_prec']!r}; "
                          "allowed: medium (Newton-Schulz in bf16), high, highest")
    if o["repeats"] < 1 or o["warmup"] < 0:
        raise ConfigError("bench.options.repeats must be >= 1 and bench.options.warmup >= 0")
    from parallel import cpu_backend

    cpu_backend.enable()
    teardown = _one_rank_world()
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
        from optim.params import ROUTE_ATTR

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


def bench_step(cfg) -> dict[str, Any]:
    """One K2 training step vs a plain megatron-core step, each K2 feature toggled off (one process)."""
    from launcher.bench_step import bench_step as run  # issue 10

    return run(cfg)


def bench_pipeline(cfg) -> dict[str, Any]:
    """Step time with decoupled weight gradients (pipeline.decouple_wgrad) on vs off, in one run."""
    from launcher.bench_pipeline import bench_pipeline as run  # issue 8

    return run(cfg)


#: name -> function(cfg) -> dict of figures (nested dicts = one section per case).
BENCHMARKS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "attention": bench_attention,
    "optimizer": bench_optimizer,
    "pipeline": bench_pipeline,  # launcher/bench_pipeline.py (issue 8)
    "memory": bench_memory,
    "step": bench_step,  # launcher/bench_step.py (issue 10)
}


def describe(fn: Callable) -> str:
    """First line of a benchmark's docstring."""
    return (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else ""


# ---------------------------------------------------------------------- output


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


# ---------------------------------------------------------------------- entry points


def run_bench(cfg) -> dict[str, Any]:
    """The JSON record of ``cfg.bench.name`` (``none``: the list of benchmarks).

    Raises:
        ConfigError: unknown benchmark name or a bad option.
    """
    name = cfg.bench.name
    if name == "none":
        return {"bench": "none", "available": {k: describe(fn) for k, fn in BENCHMARKS.items()}}
    if name not in BENCHMARKS:
        raise ConfigError(f"bench.name={name!r}; available: none, {', '.join(BENCHMARKS)}")
    with warnings.catch_warnings():  # importing megatron warns about the missing TE/Apex
        warnings.simplefilter("ignore")
        figures = BENCHMARKS[name](cfg)
    options = cfg.bench.options
    from omegaconf import OmegaConf

    return {
        "bench": name,
        "system": system_info(),
        "options": OmegaConf.to_container(options) if options is not None else None,
        "figures": figures,
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``k2-bench`` (Hydra overrides in ``argv``). Returns the exit status."""
    overrides = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_config(overrides)
        if cfg.output not in _OUTPUTS:
            raise ConfigError(f"output={cfg.output!r}; allowed: {', '.join(_OUTPUTS)}")
        record = run_bench(cfg)
    except ConfigError as e:
        print(f"k2-bench: error: {e}", file=sys.stderr)
        return 2
    if cfg.output == "json":
        print(json.dumps(record))
    elif record["bench"] == "none":
        print("k2-bench: available benchmarks (run with bench=<name>):")
        for name, text in record["available"].items():
            print(f"  {name:<12} {text}")
    else:
        print(format_table(record))
    return 0


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
