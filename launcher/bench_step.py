"""``k2-bench bench=step``: one training step of the launcher's full K2 configuration against a plain
megatron-core baseline, with each K2 feature toggled off, in one process and one run (issue 10).

Cases (same model widths, same tokens, one microbatch of ``micro_batch_size x seq_length`` tokens):

* ``baseline`` -- (a): megatron-core ``GPTModel`` from megatron's local layer specs (MLA, megatron's
  ``TopKRouter`` and ``SequentialMLP`` experts, megatron's ``MLP``), core attention on SDPA
  (:class:`model.attention.K2CoreAttention` with ``backend=sdpa`` and no max-logit record: megatron's own
  ``DotProductAttention`` rejects MLA's qk/v head dims), parameters in the compute dtype, a plain
  ``torch.optim.SGD`` step; no DDP, no mixed-precision wrapper.
* ``k2`` -- (b): the launcher's step as ``k2-train`` runs it (``model.build``, megatron DDP with FP32
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
:class:`model.saved_tensors.SavedBytesMeter`), on GPU ``peak_memory_bytes`` (the case's persistent bytes
-- weights, gradient buffers, optimizer states, measured as the allocation growth over its build and
warmup -- plus the growth of ``torch.cuda.max_memory_allocated`` over one step), and ``*_over_baseline``
ratios. Needs no data files, network or wandb.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

from launcher.config import ConfigError, load_config

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
K2_SMALL = ["model=kimi_k2", "model.num_layers=3", "model.first_k_dense_replace=1", "model.num_moe_experts=16",
            "model.vocab_size=32768", "model.max_position_embeddings=4096"]
TINY = ["model=k2_tiny", "model.num_layers=3", "model.first_k_dense_replace=1"]


def _options(cfg) -> dict:
    import torch

    from launcher.bench import bench_options
    from model.backends import ATTENTION_BACKENDS

    o = bench_options(cfg, DEFAULTS)
    cuda = torch.cuda.is_available()
    checks = [("size", SIZES), ("precision", ("auto", "bf16", "fp32")), ("memory", MEMORY),
              ("attention_backend", ATTENTION_BACKENDS)]
    for key, allowed in checks:
        if o[key] not in allowed:
            raise ConfigError(f"bench.options.{key}={o[key]!r}; allowed: {', '.join(allowed)}")
    for key, low in (("seq_length", 0), ("micro_batch_size", 1), ("microbatches", 0), ("warmup", 0),
                     ("repeats", 0), ("resident", 0)):
        if o[key] < low:
            raise ConfigError(f"bench.options.{key}={o[key]}; allowed: an integer >= {low}")
    if 0 < o["resident"] < 3:
        raise ConfigError(f"bench.options.resident={o['resident']}; allowed: 0 (auto) or >= 3 (baseline, k2 "
                          "and at least one toggled case)")
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


def _base_overrides(o: dict) -> list[str]:
    s = o["seq_length"]
    model = K2_SMALL if o["size"] == "k2" else TINY
    return [*model, f"train.precision={o['precision']}", "run.wandb.mode=disabled", "parallel=single",
            f"train.micro_batch_size={o['micro_batch_size']}", f"model.max_position_embeddings={max(s, 4096)}"]


def case_overrides(o: dict) -> dict[str, list[str]]:
    """Hydra overrides of each K2 case (the ``baseline`` is built separately)."""
    k2mem = load_config(["memory=k2"]).memory
    mem = {"fp8_store": list(k2mem.fp8_store), "recompute": list(k2mem.recompute),
           "offload": list(k2mem.offload) if o["memory"] == "k2" else []}
    if o["memory"] == "none":
        mem = {k: [] for k in mem}

    def memory(drop: str = "") -> list[str]:
        return [f"memory.{k}=[{','.join(v if k != drop else [])}]" for k, v in mem.items()]

    full = [f"optim=muonclip", f"optim.qk_clip_tau={o['qk_clip_tau']}", "model.record_max_logits=true",
            "model.moe_grouped_gemm=true", f"model.attention_backend={o['attention_backend']}"]
    cases = {"k2": full + memory()}
    cases["k2_no_qk_clip"] = full + ["optim.qk_clip_tau=null", "model.record_max_logits=false"] + memory()
    cases["k2_no_muon"] = [x if x != "optim=muonclip" else "optim=adamw" for x in full] + memory()
    for key in ("fp8_store", "recompute", "offload"):
        if mem[key]:
            cases[f"k2_no_{key}"] = full + memory(drop=key)
    cases["k2_no_grouped_gemm"] = [x if x != "model.moe_grouped_gemm=true" else "model.moe_grouped_gemm=false"
                                   for x in full] + memory()
    return cases


def _batch(vocab: int, o: dict, device):
    import torch

    gen = torch.Generator().manual_seed(o["seed"])
    b, s = o["micro_batch_size"], o["seq_length"]
    tokens = torch.randint(0, vocab, (b, s + 1), generator=gen)
    return {"tokens": tokens[:, :-1].contiguous().to(device), "labels": tokens[:, 1:].contiguous().to(device),
            "loss_mask": torch.ones(b, s, device=device),
            "position_ids": torch.arange(s, device=device).unsqueeze(0).expand(b, s)}


def _seed(o: dict) -> None:
    import torch
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(o["seed"])
    model_parallel_cuda_manual_seed(o["seed"])


def _init(chunks: list, tcfg, o: dict) -> None:
    """Same weights in every case: on CPU the layout-independent init (``model.build``); on CUDA
    megatron's own init on the device, from the same seed in every case (same parameters in the same
    order; the CPU-side init would take minutes at K2 widths)."""
    import torch

    from model.build import layout_independent_init

    if not torch.cuda.is_available():
        layout_independent_init(chunks, tcfg, o["seed"])


class _Case:
    """One built case: ``step()`` runs one training step; ``metered_step(meter)`` one with the (first)
    forward inside ``meter.measure()``; ``release()`` drops its model and optimizer. ``optimizer_s``: the
    optimizer part (optimizer step + QK-Clip) of the last step, seconds."""

    def __init__(self, step: Callable[[Callable], None], unlink: Optional[Callable[[], None]] = None):
        self._step = step
        self._unlink = unlink
        self.optimizer_s = 0.0

    def step(self) -> None:
        self.metered_step(None)

    def metered_step(self, meter) -> None:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        # megatron's process-wide aux-loss gradient scale: each step sets its own (a scalar left by an
        # earlier plain backward would not take the schedule's [1]-shaped copy)
        MoEAuxLossAutoScaler.main_loss_backward_scale = None
        self._step(meter)

    def release(self) -> None:
        if self._unlink is not None:
            self._unlink()
        self._step = self._unlink = None


def _build_baseline(o: dict, base: list[str], device) -> _Case:
    """(a): megatron's local GPT layer specs, SDPA core attention, plain SGD."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.spec_utils import ModuleSpec

    from model.attention import K2CoreAttention
    from model.build import layout_independent_init, transformer_config
    from parallel.dims import ParallelDims

    cfg = load_config(base + ["memory=none"])
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, 1)
    tcfg = transformer_config(cfg, dims)
    _seed(o)
    block = get_gpt_decoder_block_spec(tcfg, use_transformer_engine=False, normalization=tcfg.normalization)
    for spec in block.layer_specs:  # the only swap: megatron's DotProductAttention rejects MLA's head dims
        spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
            module=K2CoreAttention, params={"record_max_logits": False, "backend": "sdpa"})
    model = GPTModel(config=tcfg, transformer_layer_spec=block, vocab_size=cfg.model.vocab_size,
                     max_sequence_length=cfg.model.max_position_embeddings, pre_process=True, post_process=True,
                     share_embeddings_and_output_weights=False, position_embedding_type="none")
    _init([model], tcfg, o)
    # all parameters in the compute dtype, as megatron's mixed-precision wrapper would leave them: megatron
    # creates its linears in params_dtype, but torch's RMSNorm modules (megatron's WrappedTorchNorm) are
    # created in fp32, which in bf16 sends every norm to torch's unfused mixed-dtype rms_norm
    model.to(device=device, dtype=tcfg.params_dtype)
    opt = torch.optim.SGD(model.parameters(), lr=o["lr"])
    batch = _batch(cfg.model.vocab_size, o, device)

    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    n_mb = o["microbatches"]

    def step(meter):
        opt.zero_grad(set_to_none=True)
        # the aux-loss gradient scale megatron's schedule sets (shape [1], as there)
        MoEAuxLossAutoScaler.set_loss_scale(torch.full((1,), 1.0 / n_mb, device=device))
        for i in range(n_mb):
            if meter is not None and i == 0:
                with meter.measure():
                    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
            else:
                out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
            loss = (out.float() * batch["loss_mask"]).sum() / batch["loss_mask"].sum() / n_mb
            loss.backward()
        _sync(device.type == "cuda")
        t0 = time.perf_counter()
        opt.step()
        _sync(device.type == "cuda")
        case.optimizer_s = time.perf_counter() - t0

    case = _Case(step)
    return case


def _build_k2(o: dict, base: list[str], overrides: list[str]) -> _Case:
    """(b)/(c): the trainer's own pieces (as ``launcher.train.run`` and ``bench=memory`` use them)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from launcher.train import _forward_step
    from model.build import build_model_chunks, layout_independent_init, transformer_config
    from model.memory import MemoryOptions
    from optim.build import build_optimizer, uses_layer_wise, uses_muon
    from optim.params import tag_parameters
    from optim.qk_clip import QKClip
    from parallel.dims import ParallelDims
    from parallel.distributed import wrap_model

    cfg = load_config(base + overrides)
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, 1)
    tcfg = transformer_config(cfg, dims)
    _seed(o)
    chunks = build_model_chunks(cfg, dims, tcfg, MemoryOptions.from_config(cfg))
    _init(chunks, tcfg, o)
    tag_parameters(chunks, tcfg, muon=uses_muon(cfg), layer_wise=uses_layer_wise(cfg))
    model = wrap_model(chunks, tcfg, cfg.parallel.use_distributed_optimizer, layer_wise=uses_layer_wise(cfg))
    optimizer = build_optimizer(cfg, model, tcfg)
    for g in optimizer.param_groups:
        g["lr"] = o["lr"]  # (no LR scheduler here)
    clip = QKClip(model, optimizer, cfg.optim.qk_clip_tau, cfg.model.num_layers)
    tcfg.finalize_model_grads_func = finalize_model_grads
    tcfg.grad_scale_func = optimizer.scale_loss
    dev = next(chunks[0].parameters()).device
    batch = _batch(cfg.model.vocab_size, o, dev)

    class _Same:
        def __next__(self):
            return batch

    forward_backward = get_forward_backward_func()

    cuda = dev.type == "cuda"

    def step(meter):
        fwd = _forward_step
        if meter is not None:
            first = [True]

            def fwd(it, m):
                if not first[0]:
                    return _forward_step(it, m)
                first[0] = False
                with meter.measure():
                    return _forward_step(it, m)
        for m in model:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(forward_step_func=fwd, data_iterator=[_Same()], model=model,
                         num_microbatches=o["microbatches"], seq_length=o["seq_length"],
                         micro_batch_size=o["micro_batch_size"], decoder_seq_length=o["seq_length"],
                         forward_only=False)
        _sync(cuda)
        t0 = time.perf_counter()
        ok, _, _ = optimizer.step()
        clip.step(apply=bool(ok))
        _sync(cuda)
        case.optimizer_s = time.perf_counter() - t0

    case = _Case(step, lambda: _unlink(chunks, tcfg))
    return case


def _unlink(chunks: list, tcfg) -> None:
    """Break the reference cycles of a released K2 case that Python's garbage collector cannot see, so
    that its model, gradient buffers and optimizer states are freed (on a GPU the next group of cases
    would not fit otherwise). Each runs through autograd's C++ graph nodes into megatron DDP's gradient
    hooks, whose closures hold the DDP module: tensors that keep an autograd graph as attributes of the
    model's modules or their helper objects (megatron's token dispatcher keeps the routing probabilities
    of the last forward), and the model config's link to the optimizer (``grad_scale_func``; megatron's
    fp32 distributed optimizer holds its parameter shards as autograd views of the parameters)."""
    import torch

    tcfg.grad_scale_func = None
    tcfg.finalize_model_grads_func = None
    for chunk in chunks:
        for mod in chunk.modules():
            helpers = [v for v in vars(mod).values()
                       if hasattr(v, "__dict__") and not isinstance(v, (torch.nn.Module, torch.Tensor, type))
                       and not callable(v)]
            for obj in (mod, *helpers):
                for key, value in list(vars(obj).items()):
                    if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                        setattr(obj, key, None)


def gemm_peak_tflops(cuda: bool, repeats: int = 10) -> dict:
    """Measured matmul throughput: BF16 8192^3 on CUDA, FP32 1024^3 on CPU (median of ``repeats``)."""
    import torch

    from launcher.bench import time_calls

    n, dtype = (8192, torch.bfloat16) if cuda else (1024, torch.float32)
    dev = "cuda" if cuda else "cpu"
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    ms = time_calls({"mm": lambda: torch.matmul(a, b)}, 3, repeats, cuda)["mm"]
    return {"gemm_n": n, "gemm_dtype": str(dtype).replace("torch.", ""), "gemm_ms": ms,
            "gemm_peak_tflops": 2 * n ** 3 / (ms / 1e3) / 1e12}


def _sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def _free(cuda: bool) -> None:
    gc.collect()
    if cuda:
        import torch

        torch.cuda.empty_cache()


def bench_step(cfg) -> dict[str, Any]:
    """One K2 training step vs a plain megatron-core step, each K2 feature toggled off (one process).

    Figures: ``config`` (model widths, tokens, precision, memory setting), the measured GEMM peak,
    ``timing`` (warmup, repeats, resident cases), and per case (``baseline``, ``k2``, ``k2_no_*``):
    ``step_ms``, ``tokens_per_s``, ``model_tflops``, ``mfu``, ``saved_activation_bytes``, on GPU
    ``peak_memory_bytes``, and each one's ratio to ``baseline``. See the module docstring.

    Raises:
        ConfigError: a bad option.
    """
    import torch

    from launcher.bench import _one_rank_world, system_info
    from model.flops import step_flops
    from model.saved_tensors import SavedBytesMeter
    from parallel import cpu_backend

    o = _options(cfg)
    cuda = torch.cuda.is_available()
    base = _base_overrides(o)
    cases = case_overrides(o)
    from model.backends import check_backend_config

    for ov in cases.values():  # every case is valid before anything is built
        check_backend_config(load_config(base + ov))
    cpu_backend.enable()
    teardown = _one_rank_world()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    model_cfg = load_config(base).model
    tokens = o["microbatches"] * o["micro_batch_size"] * o["seq_length"]
    flops = step_flops(model_cfg, o["seq_length"], tokens)
    names = ["baseline", *cases]
    resident = o["resident"] or (3 if cuda else len(names))
    toggled = names[2:]
    per_group = max(1, resident - 2)
    groups = [toggled[i:i + per_group] for i in range(0, len(toggled), per_group)] or [[]]
    samples: dict[str, list[float]] = {n: [] for n in names}
    opt_samples: dict[str, list[float]] = {n: [] for n in names}
    saved: dict[str, float] = {}
    persistent: dict[str, int] = {}
    step_peak: dict[str, int] = {}

    def build(name: str) -> _Case:
        _sync(cuda)
        before = torch.cuda.memory_allocated() if cuda else 0
        case = _build_baseline(o, base, device) if name == "baseline" else _build_k2(o, base, cases[name])
        for _ in range(o["warmup"]):  # (the optimizer states are created on the first step)
            case.step()
        _sync(cuda)
        if cuda:
            persistent[name] = torch.cuda.memory_allocated() - before
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            case.step()
            _sync(cuda)
            step_peak[name] = torch.cuda.max_memory_allocated() - start
        meter = SavedBytesMeter()
        case.metered_step(meter)
        saved[name] = meter.per_forward()["device_total"] + meter.per_forward()["host_total"]
        progress(f"{name} built and warmed up" + (f", {persistent[name] / 2**30:.1f} GiB held" if cuda else ""))
        return case

    started = time.perf_counter()

    def progress(text: str) -> None:  # (stderr: a long GPU run shows how far it got)
        print(f"bench=step [{time.perf_counter() - started:.0f} s] {text}", file=sys.stderr, flush=True)

    try:
        peak = gemm_peak_tflops(cuda)
        live = {n: build(n) for n in ("baseline", "k2")}
        for group in groups:
            for n in group:
                live[n] = build(n)
            for _ in range(o["repeats"]):
                for n, case in live.items():
                    _sync(cuda)
                    t0 = time.perf_counter()
                    case.step()
                    _sync(cuda)
                    samples[n].append(time.perf_counter() - t0)
                    opt_samples[n].append(case.optimizer_s)
            for n in group:
                live.pop(n).release()
            _free(cuda)
            progress(f"timed {', '.join(live)} and {', '.join(group) or 'no toggled case'}")
    finally:
        live = {}
        _free(cuda)
        teardown()

    out_cases: dict[str, dict] = {}
    for n in names:
        step_s = statistics.median(samples[n])
        tflops = flops / step_s / 1e12
        f = {"step_ms": step_s * 1e3, "optimizer_ms": statistics.median(opt_samples[n]) * 1e3,
             "tokens_per_s": tokens / step_s, "model_tflops": tflops,
             "mfu": tflops / peak["gemm_peak_tflops"], "saved_activation_bytes": int(saved[n]),
             "timed_steps": len(samples[n])}
        if cuda:
            f["peak_memory_bytes"] = int(persistent[n] + step_peak[n])
            f["persistent_bytes"] = int(persistent[n])
        out_cases[n] = f
    ref = out_cases["baseline"]
    for f in out_cases.values():
        for key in ("tokens_per_s", "model_tflops", "mfu", "step_ms", "saved_activation_bytes",
                    "peak_memory_bytes"):
            if key in f:
                f[f"{key}_over_baseline"] = f[key] / ref[key] if ref[key] else None
    figures = {
        "config": {"size": o["size"], "hidden_size": model_cfg.hidden_size, "num_layers": model_cfg.num_layers,
                   "num_moe_experts": model_cfg.num_moe_experts, "moe_router_topk": model_cfg.moe_router_topk,
                   "vocab_size": model_cfg.vocab_size, "seq_length": o["seq_length"],
                   "micro_batch_size": o["micro_batch_size"], "microbatches": o["microbatches"],
                   "tokens_per_step": tokens,
                   "precision": o["precision"], "memory": o["memory"],
                   "attention_backend": o["attention_backend"], "model_flops_per_step": flops,
                   "peak_memory": ("torch.cuda.max_memory_allocated growth over a step + persistent bytes"
                                   if cuda else "not measured on CPU; saved_activation_bytes is")},
        **peak,
        "timing": {"warmup": o["warmup"], "repeats": o["repeats"], "resident": resident,
                   "order": "round-robin over the resident cases"},
        "cases": out_cases,
    }
    if o["json_out"]:
        from omegaconf import OmegaConf

        record = {"bench": "step", "system": system_info(),
                  "options": OmegaConf.to_container(cfg.bench.options) if cfg.bench.options is not None else None,
                  "figures": figures}
        with open(o["json_out"], "w") as fh:
            json.dump(record, fh, indent=1)
    from model.build import reset_moe_process_state

    reset_moe_process_state()  # leave no 3-layer MoE tracker / aux-loss scale to the rest of the process
    return figures
