"""The cases of ``k2-bench bench=step`` (:mod:`k2.launcher.benchmarks.step`): the plain megatron-core
baseline and the K2 step with each feature toggled, built in one process, each with its synthetic batch,
a timed step, a metered step (saved-activation bytes) and a release that frees its memory.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

from k2.config.load import load_config
from k2.launcher.training.setup import setup
from k2.launcher.training.step import forward_step
from k2.model.activation_memory import MemoryOptions
from k2.model.attention import K2CoreAttention
from k2.model.build import layout_independent_init, transformer_config
from k2.parallel.dims import ParallelDims
from k2.schedules.resolve import resolve_schedule


def _batch(vocab: int, o: dict, device):
    import torch

    gen = torch.Generator().manual_seed(o["seed"])
    b, s = o["micro_batch_size"], o["seq_length"]
    tokens = torch.randint(0, vocab, (b, s + 1), generator=gen)
    return {
        "tokens": tokens[:, :-1].contiguous().to(device),
        "labels": tokens[:, 1:].contiguous().to(device),
        "loss_mask": torch.ones(b, s, device=device),
        "position_ids": torch.arange(s, device=device).unsqueeze(0).expand(b, s),
    }


def _seed(o: dict) -> None:
    import torch
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(o["seed"])
    model_parallel_cuda_manual_seed(o["seed"])


def _init(chunks: list, tcfg, o: dict) -> None:
    """Same weights in every case: on CPU the layout-independent init (``k2.model.build``); on CUDA
    megatron's own init on the device, from the same seed in every case (same parameters in the same
    order; the CPU-side init would take minutes at K2 widths)."""
    import torch

    if not torch.cuda.is_available():
        layout_independent_init(chunks, tcfg, o["seed"])


class Case:
    """One built case: ``step()`` runs one training step; ``metered_step(meter)`` one with the (first)
    forward inside ``meter.measure()``; ``release()`` drops its model and optimizer. ``optimizer_s``: the
    optimizer part (optimizer step + QK-Clip) of the last step, seconds."""

    def __init__(self, step: Callable[[Callable], None], unlink: Callable[[], None] | None = None):
        self._step = step
        self._unlink = unlink
        self.optimizer_s = 0.0
        self.features: dict | None = None  # K2 cases: built_features
        self.model: list | None = None  # K2 cases: the DDP-wrapped model chunks
        self.schedule: Callable[[int], None] | None = None  # K2 cases: n microbatches, no optimizer
        self.optimizer = None  # K2 cases: the optimizer

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
        self.model = self.optimizer = self.schedule = None


def build_baseline(o: dict, base: list[str], device) -> Case:
    """(a): megatron's local GPT layer specs, SDPA core attention, plain SGD."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.spec_utils import ModuleSpec

    cfg = load_config(base + ["memory=none"])
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, 1)
    tcfg = transformer_config(cfg, dims)
    _seed(o)
    block = get_gpt_decoder_block_spec(tcfg, use_transformer_engine=False, normalization=tcfg.normalization)
    for spec in block.layer_specs:  # the only swap: megatron's DotProductAttention rejects MLA's head dims
        spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
            module=K2CoreAttention, params={"record_max_logits": False, "backend": "sdpa"}
        )
    model = GPTModel(
        config=tcfg,
        transformer_layer_spec=block,
        vocab_size=cfg.model.vocab_size,
        max_sequence_length=cfg.model.max_position_embeddings,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="none",
    )
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
        sync(device.type == "cuda")
        t0 = time.perf_counter()
        opt.step()
        sync(device.type == "cuda")
        case.optimizer_s = time.perf_counter() - t0

    case = Case(step)
    return case


def build_k2(o: dict, base: list[str], overrides: list[str]) -> Case:
    """(b)/(c): the trainer's own pieces (:func:`k2.launcher.training.setup.setup`)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    cfg = load_config(base + overrides)
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, 1)
    _seed(o)
    parts = setup(
        cfg,
        dims,
        resolve_schedule(cfg),
        memory=MemoryOptions.from_config(cfg),
        init=lambda chunks, tcfg: _init(chunks, tcfg, o),
    )
    tcfg, chunks, model, optimizer = parts.tcfg, parts.chunks, parts.model, parts.optimizer
    clip = parts.qk_clip
    for g in optimizer.param_groups:
        g["lr"] = o["lr"]  # (no LR scheduler here)
    dev = next(chunks[0].parameters()).device
    batch = _batch(cfg.model.vocab_size, o, dev)

    class _Same:
        def __next__(self):
            return batch

    forward_backward = get_forward_backward_func()

    cuda = dev.type == "cuda"

    def step(meter):
        fwd = forward_step
        if meter is not None:
            first = [True]

            def fwd(it, m):
                if not first[0]:
                    return forward_step(it, m)
                first[0] = False
                with meter.measure():
                    return forward_step(it, m)

        for m in model:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(
            forward_step_func=fwd,
            data_iterator=[_Same()],
            model=model,
            num_microbatches=o["microbatches"],
            seq_length=o["seq_length"],
            micro_batch_size=o["micro_batch_size"],
            decoder_seq_length=o["seq_length"],
            forward_only=False,
        )
        sync(cuda)
        t0 = time.perf_counter()
        ok, _, _ = optimizer.step()
        clip.step(apply=bool(ok))
        sync(cuda)
        case.optimizer_s = time.perf_counter() - t0

    def schedule(num_microbatches: int) -> None:
        """``num_microbatches`` through megatron's schedule, gradients accumulated, no optimizer step."""
        forward_backward(
            forward_step_func=forward_step,
            data_iterator=[_Same()],
            model=model,
            num_microbatches=num_microbatches,
            seq_length=o["seq_length"],
            micro_batch_size=o["micro_batch_size"],
            decoder_seq_length=o["seq_length"],
            forward_only=False,
        )
        sync(cuda)

    case = Case(step, lambda: _unlink(chunks, tcfg))
    case.schedule = schedule
    case.features = built_features(chunks, optimizer, clip)
    case.model, case.optimizer = model, optimizer
    return case


def built_features(chunks: list, optimizer, clip) -> dict:
    """What a built K2 case really runs, read from the built objects (not from its overrides), so that a
    toggle that changed nothing shows: ``muon_elements`` (parameter elements updated by
    :class:`k2.optim.muon.K2Muon`), ``qk_clip`` (QK-Clip applies after the step: a tau is set),
    ``max_logit_recording`` (core-attention modules recording max logits), ``grouped_experts``
    (:class:`k2.model.grouped_mlp.K2GroupedMLP` modules). (The memory switches show in each case's
    measured saved-activation bytes.)"""
    from k2.model.grouped_mlp import K2GroupedMLP
    from k2.optim.build import leaf_optimizers
    from k2.optim.muon import K2Muon

    muon = 0
    for leaf in leaf_optimizers(optimizer):
        inner = leaf
        while not isinstance(inner, K2Muon) and getattr(inner, "optimizer", None) is not None:
            inner = inner.optimizer
        if isinstance(inner, K2Muon):
            muon += sum(p.numel() for g in inner.param_groups for p in g["params"])
    mods = [m for c in chunks for m in c.modules()]
    return {
        "muon_elements": int(muon),
        "qk_clip": clip.tau is not None,
        "max_logit_recording": sum(isinstance(m, K2CoreAttention) and bool(m.record_max_logits) for m in mods),
        "grouped_experts": sum(isinstance(m, K2GroupedMLP) for m in mods),
    }


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
            helpers = [
                v
                for v in vars(mod).values()
                if hasattr(v, "__dict__")
                and not isinstance(v, (torch.nn.Module, torch.Tensor, type))
                and not callable(v)
            ]
            for obj in (mod, *helpers):
                for key, value in list(vars(obj).items()):
                    if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                        setattr(obj, key, None)


def sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def free_case(cuda: bool) -> None:
    gc.collect()
    if cuda:
        import torch

        torch.cuda.empty_cache()
