"""What keeps the training loop's wait for a save short, for the synchronous and the background path
alike (:func:`k2.launcher.checkpointing.store.begin_save`): megatron's sharding-integrity check only when
the structure changed, and megatron's save plans reused while it is unchanged (:func:`save_strategy`).
(The garbage collector is paused while a save is planned or committed, :func:`k2.launcher.gc_pause.gc_paused`;
the background path's own part, leaving view copies to the forked writer, is in
:mod:`k2.launcher.checkpointing.background`.)"""

from __future__ import annotations

from k2.parallel.distributed import all_reduce_int

__all__ = ["VALIDATED_STRUCTURE", "needs_validation", "save_strategy"]

#: the structure of this process's last save whose sharding was validated (a one-element list)
VALIDATED_STRUCTURE: list = []
#: megatron's save strategy of this process, holding its cached save plans (a one-element list)
_STRATEGY: list = []


def needs_validation(sd) -> bool:
    """Collective: whether megatron's sharding-integrity check (every tensor covered exactly once across
    ranks: an all-gather of every shard's metadata and a check of it, about a fifth of the staging time
    of a background save) must run for this sharded state dict: on the first save of the process and
    whenever any rank's structure (keys, shapes, offsets, replica ids) differs from the last validated
    one (dtypes included). The check depends on nothing else, so repeating it for an unchanged structure
    finds nothing."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    def shape(x):
        return tuple(x) if x is not None else ()

    structure = hash(
        tuple(
            sorted(
                (
                    str(v.key),
                    shape(getattr(v, "global_shape", None)),
                    shape(getattr(v, "global_offset", None)),
                    str(getattr(v, "replica_id", "")),
                    shape(getattr(getattr(v, "data", None), "shape", None)),
                    str(getattr(getattr(v, "data", None), "dtype", "")),
                )
                for v in nested_values(sd)
                if hasattr(v, "key")
            )
        )
    )
    if all_reduce_int(int(VALIDATED_STRUCTURE != [structure]), "max"):
        VALIDATED_STRUCTURE[:] = [structure]
        return True
    return False


def save_strategy(structure_changed: bool):
    """megatron-core 0.19.2's ``TorchDistSaveShardedStrategy`` with ``cached_metadata=True``, one per
    process, replaced by a fresh one whenever ``structure_changed`` (:func:`needs_validation`'s answer,
    agreed by every rank).

    The cache skips what is a cost per tensor and repeats itself from save to save: once two
    consecutive saves made the same global plan (megatron compares them), later saves reuse the local
    and global plans and the global metadata instead of creating, gathering and merging every rank's
    plan again, about a third of a background save's staging with ~2,000 tensors per rank. The plans
    hold only what is written where (keys, shapes, offsets, file names), never tensor data, which is
    resolved from the state dict of each save, and the byte offsets in the files come from each save's
    own write results. What makes a cached plan stale is a different structure on any rank; megatron's
    own guard would only notice that when it next re-plans, so the strategy and its cache are dropped as
    soon as the structure fingerprint changes. (The stale-copy fault reported by peers, NeMo-RL #3312,
    came from caching the data to write, nvidia-resiliency-ext's ``use_cached_data_structure``; the
    "mcore" async strategy used here has no such cache.)"""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    if structure_changed or not _STRATEGY:
        _STRATEGY[:] = [TorchDistSaveShardedStrategy(cached_metadata=True)]
    return _STRATEGY[0]
