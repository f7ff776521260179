"""What keeps the training loop's wait for a save short, for the synchronous and the background path
alike (:func:`k2.launcher.checkpointing.store.begin_save`): megatron's sharding-integrity check only when
the structure changed, and no garbage collection while the save is planned. (The background path's
own part, leaving view copies to the forked writer, is in :mod:`k2.launcher.checkpointing.background`.)"""

from __future__ import annotations

import contextlib
import gc

from k2.parallel.distributed import all_reduce_int

__all__ = ["VALIDATED_STRUCTURE", "gc_paused", "needs_validation"]

#: the structure of this process's last save whose sharding was validated (a one-element list)
VALIDATED_STRUCTURE: list = []


def needs_validation(sd) -> bool:
    """Collective: whether megatron's sharding-integrity check (every tensor covered exactly once across
    ranks: an all-gather of every shard's metadata and a check of it, about a fifth of the staging time
    of a background save) must run for this sharded state dict: on the first save of the process and
    whenever any rank's structure (keys, shapes, offsets, replica ids) differs from the last validated
    one. The check depends on nothing else, so repeating it for an unchanged structure finds nothing."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    def shape(x):
        return tuple(x) if x is not None else ()

    structure = hash(tuple(sorted(
        (str(v.key), shape(getattr(v, "global_shape", None)), shape(getattr(v, "global_offset", None)),
         str(getattr(v, "replica_id", "")), shape(getattr(getattr(v, "data", None), "shape", None)))
        for v in nested_values(sd) if hasattr(v, "key"))))
    if all_reduce_int(int(VALIDATED_STRUCTURE != [structure]), "max"):
        VALIDATED_STRUCTURE[:] = [structure]
        return True
    return False


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off for the block: planning a save allocates ~10^5 small
    objects (shard metadata, write items, pickled plans), which in a trainer's large heap triggered full
    collections costing about a quarter of a background save's staging (megatron's writer pauses it the
    same way, ``filesystem_async._disable_gc``)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
