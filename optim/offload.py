"""Optimizer-state offload (``optim.offload_fraction``; K2 report "Training system": on 32 nodes part of the
optimizer states lives in CPU memory).

Between optimizer steps -- through the forward and backward passes, where the activations make the
memory peak -- ``optim.offload_fraction`` of the optimizer's state tensors lives in host memory (pinned
when CUDA is there, so the copies are asynchronous DMA): the FP32 master weights the distributed optimizer
keeps for BF16 parameters (FP32 parameters are their own master copy, part of the model, and stay) and
the states (AdamW's two moments, Muon's momentum). The fraction is taken in elements, whole tensors in
the optimizers' parameter order. For the step they are copied to the device, the update runs there
(Muon's Newton-Schulz of hundreds of expert matrices per GPU would take minutes on a CPU), and they are
copied back. Values are moved, never recomputed, so a run with offload gives bitwise the same losses and
weights as one without.

Why ours: megatron-core's ``HybridDeviceOptimizer`` (``optimizer_cpu_offload``) runs the offloaded part of
the *update* on the CPU, with torch's or DeepSpeed's CPU Adam; it has no Muon and would put Newton-Schulz on
the CPU. Here every update runs on the device and only the storage moves. The master weights and states
move for the whole optimizer phase (one host-to-device copy before the gradients are copied in, one
device-to-host copy after the step), not bucket by bucket overlapped with the next bucket's copy:
the device needs room for them during the optimizer step (no activations are alive then).

0-dim state tensors (torch AdamW's ``step`` counter) are left where torch keeps them (on the host when
the optimizer is not capturable) and are counted as host bytes.
"""

from __future__ import annotations

import torch
from megatron.core.optimizer import ChainedOptimizer


def host_buffer(shape, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """The host buffer of one offloaded tensor: pinned when ``pin`` (CUDA: the copies are asynchronous
    DMA). Pinned memory is shared with a forked child, not copied on write
    (:mod:`k2.launcher.checkpointing.background` copies it before a background save forks); tests replace
    this function to give the buffers shared memory, which behaves so on CPU."""
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class StateOffload:
    """Moves a fraction of the state tensors of megatron ``DistributedOptimizer`` s to host memory and back.

    Args:
        leaves: megatron ``DistributedOptimizer`` instances (their ``optimizer`` is the torch optimizer
            over the master shards; ``shard_fp32_from_float16_groups`` are the master copies of BF16
            parameters).
        fraction: ``optim.offload_fraction`` in ``[0, 1]``.

    Raises:
        ValueError: ``fraction`` outside ``[0, 1]``.
    """

    def __init__(self, leaves: list, fraction: float) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"optim.offload_fraction={fraction}; allowed: 0 <= value <= 1")
        self.fraction = float(fraction)
        self.pin = torch.cuda.is_available()
        entries = []  # (torch optimizer, master shard, whether the master itself moves)
        for leaf in leaves:
            own = {id(p) for g in getattr(leaf, "shard_fp32_from_float16_groups", []) for p in g}
            for group in leaf.optimizer.param_groups:
                for p in group["params"]:
                    entries.append((leaf.optimizer, p, id(p) in own))
        total = sum(p.numel() for _, p, _ in entries)
        self.entries, done = [], 0
        for opt, p, own in entries:
            if done >= self.fraction * total or self.fraction == 0.0:
                break
            self.entries.append((opt, p, own))
            done += p.numel()
        # (id(master shard), "master" or state name) -> its host buffer; the master shard objects live as
        # long as the optimizer (the state tensors may be replaced, e.g. by a checkpoint load)
        self._host: dict[tuple, torch.Tensor] = {}
        self.to_host()

    def _tensors(self):
        """``(key, tensor)`` for each offloaded master shard and state tensor."""
        for opt, p, own in self.entries:
            if own:
                yield (id(p), "master"), p
            for name, v in opt.state.get(p, {}).items():
                if torch.is_tensor(v) and v.dim() > 0:
                    yield (id(p), name), v

    @torch.no_grad()
    def to_host(self) -> None:
        """Copy the offloaded tensors into their (pinned) host buffers and free their device memory."""
        for _opt, p, own in self.entries:
            if own:
                p.grad = None  # a view of DDP's gradient buffer, on the device; set again next step
        for key, t in self._tensors():
            host = self._host.get(key)
            if host is None or host.shape != t.shape or host.dtype != t.dtype:
                host = host_buffer(t.shape, t.dtype, self.pin)
                self._host[key] = host
            if t.data.data_ptr() != host.data_ptr():
                host.copy_(t.data)
                t.data = host

    @torch.no_grad()
    def to_device(self) -> None:
        """Copy the offloaded tensors to the device for the step (a fresh device tensor each step)."""
        dev = _device()
        for _, t in self._tensors():
            t.data = t.data.to(dev, non_blocking=self.pin, copy=True)

    def host_storages(self) -> set:
        """``data_ptr`` of every storage this offload keeps in host memory (0-dim states included)."""
        out = {h.untyped_storage().data_ptr() for h in self._host.values()}
        for opt, p, _ in self.entries:
            for v in opt.state.get(p, {}).values():
                if torch.is_tensor(v) and v.dim() == 0:
                    out.add(v.untyped_storage().data_ptr())
        return out


class OffloadedOptimizer(ChainedOptimizer):
    """megatron's ``ChainedOptimizer`` whose :meth:`step` brings a :class:`StateOffload` 's tensors to the
    device before the step (before megatron copies the gradients onto the master shards) and back after.

    Args:
        optimizers: the chained optimizers (megatron's).
        offload: the :class:`StateOffload` over their distributed optimizers.
    """

    def __init__(self, optimizers: list, offload: StateOffload) -> None:
        super().__init__(optimizers)
        self.offload = offload

    @torch.no_grad()
    def step(self):
        """megatron's step between :meth:`StateOffload.to_device` and :meth:`StateOffload.to_host`."""
        self.offload.to_device()
        try:
            return super().step()
        finally:
            self.offload.to_host()
