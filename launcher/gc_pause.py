"""Python's cyclic garbage collector paused around a burst of allocations that would otherwise trigger
full collections over a large heap: a checkpoint save's planning and commit
(:mod:`k2.launcher.checkpointing`), and the heavy imports of a process that forks ranks
(:mod:`k2.launcher.training.fork_ranks`). It imports nothing of k2-launcher and nothing heavy, so the
imports it pauses for can start after it."""

from __future__ import annotations

import contextlib
import gc

__all__ = ["gc_paused"]


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off for the block, restored after it (also after an error; a
    caller's own pause is left alone). Planning a save allocates ~10^5 small objects (shard metadata,
    write items, pickled plans), which in a trainer's large heap triggered full collections costing about
    a quarter of a background save's staging (megatron's writer pauses it the same way,
    ``filesystem_async._disable_gc``)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
