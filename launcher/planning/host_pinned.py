"""Pinned host memory as torch's ``CachingHostAllocator`` hands it out: ``k2-plan``'s host bytes per node.

On a GPU every host buffer of this launcher that the device copies to or from is pinned (page-locked, so
the copies are asynchronous DMA): the offloaded optimizer states (``optim/offload.py``: one buffer per
state tensor), the offloaded activations (``model/saved_tensors.py``: one buffer per saved storage per
microbatch) and the staged copy of a background checkpoint save (megatron-core's ``preload_tensors``:
``tensor.to("cpu", non_blocking=True)`` allocates a pinned destination per tensor). torch 2.11's
``CachingHostAllocator`` (``ATen/core/CachingHostAllocator.h``, ``allocate``: ``roundSize =
c10::llvm::PowerOf2Ceil(size)``) rounds every such block up to a power of two and keeps it cached for
reuse after it is freed, so a 1.1 GiB tensor holds 2 GiB of page-locked memory for the rest of the run.
The planner sizes every pinned buffer by that rule (:func:`pinned_block_bytes`); raw bytes stay what the
device <-> host copies move. Where the planner's inventory lists a group of same-kind tensors as one entry
(``k2.launcher.planning.activation_bytes.Saved``), the group is rounded as one block: an estimate within the rule's
factor of 2.

Exception: the offloaded optimizer states that a background save snapshots are copied into pageable
memory (:mod:`k2.launcher.checkpointing.background`), exact bytes.
"""

from __future__ import annotations

__all__ = ["pinned_block_bytes"]


def pinned_block_bytes(nbytes: float) -> int:
    """Bytes of page-locked memory one pinned buffer of ``nbytes`` holds (module docstring): the next power
    of two >= ``nbytes`` (0 for an empty buffer, which allocates nothing). A fractional (expected) size is
    rounded up to whole bytes first."""
    n = int(-(-nbytes // 1))  # ceil without float error for integers
    return 0 if n <= 0 else 1 << (n - 1).bit_length()
