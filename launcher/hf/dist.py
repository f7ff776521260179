"""The process group megatron-core's dist-checkpointing needs, for a converter that runs in one process.

megatron's ``dist_checkpointing.save`` / ``load`` run collectives on the default group; the converter is
a single process, so it starts a one-rank gloo group over an in-memory store (no port, no environment
variables) unless a group exists already; on a machine without CUDA the project's CPU backend of
megatron-core is switched on first (:mod:`k2.parallel.cpu_backend`: megatron's writer synchronises CUDA).
"""

from __future__ import annotations


def ensure_process_group() -> None:
    """Start a world-of-one gloo process group when torch.distributed has none (idempotent)."""
    import torch.distributed as dist

    from k2.parallel import cpu_backend

    cpu_backend.enable()
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
