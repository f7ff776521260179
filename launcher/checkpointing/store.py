"""Saving checkpoints with megatron-core dist-checkpointing (``torch_dist``), and their retention; the sharded
state dict a save writes and a load reads (:func:`sharded_state_dict`; loading and the verification on resume:
:mod:`k2.launcher.checkpointing.loading`). The visibility protocol and what a checkpoint holds:
:mod:`k2.launcher.checkpointing`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Collection
from pathlib import Path

from k2.launcher.checkpointing.manifest import checkpoint_files, file_entries, write_manifest
from k2.launcher.checkpointing.paths import (
    CONFIG_FILE,
    LATEST,
    PARTIAL_SUFFIX,
    STATE_FILE,
    checkpoints_dir,
    iter_name,
    saved_checkpoint_names,
)
from k2.launcher.checkpointing.rng import rng_state
from k2.launcher.checkpointing.staging import needs_validation, save_strategy
from k2.launcher.gc_pause import gc_paused
from k2.launcher.progress import measured
from k2.optim.build import leaf_optimizers

#: megatron ``DistributedOptimizer`` format: each rank saves its own flat shards; reshards over DP.
OPTIM_SHARDING = "dp_reshardable"


@contextlib.contextmanager
def _fp32_params_visible_to_checkpointing(optimizer):
    """Let megatron's mixed-precision optimizer wrapper checkpoint fp32 model parameters.

    ``Float16OptimizerWithFloat16Params.sharded_state_dict`` (megatron-core 0.19.2) maps optimizer state to
    model tensors through its ``float16_groups`` only; parameters that are fp32 in the model sit in
    ``fp32_from_fp32_groups`` and fail with "Param id 0 does not match any model sharded param". The
    MuonClip path always uses that wrapper, also for an fp32 model (optim/build.py: megatron's
    layer-wise optimizer needs it), so for a wrapper that holds no 16-bit parameter at all the fp32 groups
    -- the same tensors, in the same order as its inner optimizer's parameters -- stand in for the
    float16 groups while the state dict is built.
    """
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    swapped = []
    for opt in leaf_optimizers(optimizer):
        if (
            isinstance(opt, Float16OptimizerWithFloat16Params)
            and not any(opt.float16_groups)
            and any(opt.fp32_from_fp32_groups)
        ):
            swapped.append((opt, opt.float16_groups))
            opt.float16_groups = opt.fp32_from_fp32_groups
    try:
        yield
    finally:
        for opt, groups in swapped:
            opt.float16_groups = groups


def sharded_state_dict(model: list, optimizer, is_loading: bool, with_rng: bool) -> dict:
    """What a save writes and a load (:mod:`k2.launcher.checkpointing.loading`) reads, in Megatron-LM's
    checkpoint structure: ``model`` (one chunk) or ``model0..``, ``optimizer``, and one
    ``rng_state`` object per global rank."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    sd: dict = {}
    if len(model) == 1:
        sd["model"] = model[0].module.sharded_state_dict()
    else:
        for i, chunk in enumerate(model):
            sd[f"model{i}"] = chunk.module.sharded_state_dict()
    # the optimizer finds its parameters in the model tensors of ALL chunks (as Megatron-LM passes its
    # whole state dict); a flat merge would lose chunk 0's entries to chunk 1's equal local names
    model_sd = dict(sd)
    with _fp32_params_visible_to_checkpointing(optimizer):
        sd["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": OPTIM_SHARDING}
        )
    if with_rng:
        world, rank = dist.get_world_size(), dist.get_rank()
        sd["rng_state"] = ShardedObject(
            "rng_state", rng_state() if not is_loading else None, (world,), (rank,), replica_id=0
        )
    return sd


def use_in_process_write_results() -> None:
    """Make megatron's torch_dist writer report its write results through an in-process queue.

    megatron-core 0.19.2 (``filesystem_async.get_write_results_queue``) hands the writer's results back
    through a ``multiprocessing`` Manager queue, i.e. a helper process started with ``spawn`` on the first
    save of every rank. For a synchronous save (ours) the writer runs in the rank's own threads, so a
    plain ``queue.Queue`` carries the same results. The helper process is harmful here: Slurm sends
    SIGTERM to every process of a job step on requeue/preemption, which kills it and with it the very
    save the signal asked for (found by tests/integration/test_slurm_real.py); it also costs a Python start per rank
    and makes any script that wraps the trainer need an ``if __name__ == "__main__"`` guard.
    """
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _before_commit(step: int) -> None:
    """Runs on every rank after its tensors are written and before the checkpoint is made visible. A
    no-op; tests replace it to kill a rank mid-save (tests/support/scripts/fault_train.py)."""


def _zero_optimizer_padding(sd: dict) -> None:
    """Zero the padding tensors of megatron's ``dp_reshardable`` optimizer state (megatron-core 0.19.2
    ``sharded_param_state_dp_reshardable`` fills the gaps between parameters with ``torch.empty``,
    marked ``padding``), so that a checkpoint's bytes depend only on the training state: two saves of
    the same state (e.g. with and without ``checkpoint.async_save``) are equal file for file."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    def walk(node) -> None:
        if isinstance(node, dict):
            pad = node.get("padding")
            if isinstance(pad, LocalNonpersistentObject) and pad.unwrap() is True:
                for v in node.values():
                    if isinstance(v, ShardedTensor):
                        v.data.zero_()
            for v in node.values():
                walk(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)

    walk(sd)


def agree(what: str, fn):
    """Collective: run ``fn()`` on every rank; when it raises on any rank, raise
    :class:`CheckpointSaveError` on every rank with the first failing rank's one-line reason (so that
    a read-only file system or a full disk ends the run with one line, not a traceback per rank and
    "connection closed" on the others). ``what`` names the step (and directory) for the message."""
    import torch.distributed as dist

    try:
        out, err = fn(), None
    except Exception as e:
        out, err = None, f"{what} failed on rank {dist.get_rank()}: {type(e).__name__}: {e}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, err)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointSaveError(first)
    return out


def begin_save(run_dir, step: int, model: list, optimizer, results_queue=None, writer_class=None):
    """Collective, first half of a save: create ``iter_<step>.partial`` and plan megatron's write of
    the model, optimizer and RNG tensors into it (``dist_checkpointing.save(...,
    async_sharded_save=True, async_strategy="mcore")``: the same request serves a synchronous save,
    :meth:`AsyncRequest.execute_sync`, and one written in the background).

    ``results_queue``: where megatron's writer puts its write results (default: an in-process queue,
    :func:`use_in_process_write_results`); a writer in another process needs one that crosses it.
    ``writer_class``: a subclass of megatron's ``FileSystemWriterAsync`` to plan with (default: megatron's).

    Returns:
        ``(partial, final, request)``: the directories and megatron's ``AsyncRequest`` (its
        ``async_fn`` writes this rank's shards, None when it has none; its finalize functions write
        megatron's metadata once every rank's shards are written).

    Raises:
        CheckpointSaveError: on every rank, naming the directory and the failing rank.
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    root = checkpoints_dir(run_dir)
    final = root / iter_name(step)
    partial = root / (iter_name(step) + PARTIAL_SUFFIX)

    def mkdir() -> None:
        if dist.get_rank() == 0:
            if partial.exists():
                shutil.rmtree(partial)
            partial.mkdir(parents=True)

    agree(f"saving checkpoint step {step} into {partial}", mkdir)
    use_in_process_write_results()

    def plan():
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        sd = sharded_state_dict(model, optimizer, is_loading=False, with_rng=True)
        _zero_optimizer_padding(sd)
        # megatron looks both up in this module when it plans (strategies/torch.py, _import_mcore_async)
        shared, writer = filesystem_async._results_queue, filesystem_async.FileSystemWriterAsync
        if results_queue is not None:
            filesystem_async._results_queue = results_queue
        if writer_class is not None:
            filesystem_async.FileSystemWriterAsync = writer_class
        try:
            changed = needs_validation(sd)
            return dist_checkpointing.save(
                sd,
                str(partial),
                sharded_strategy=save_strategy(changed),
                validate_access_integrity=changed,
                async_sharded_save=True,
                async_strategy="mcore",
            )
        finally:
            filesystem_async._results_queue, filesystem_async.FileSystemWriterAsync = shared, writer

    with gc_paused():
        request = agree(f"saving checkpoint step {step} into {partial}", plan)
    return partial, final, request


def commit_save(
    partial: Path,
    final: Path,
    step: int,
    entries: dict,
    state: dict,
    config_yaml: str,
    keep_last: int,
    keep_every: int | None,
    keep_steps: Collection[int] = (),
) -> Path:
    """Collective, second half of a save (every shard and megatron's metadata written): rank 0 gets
    every rank's manifest ``entries`` (its shards' sizes and checksums), writes ``k2_state.json``,
    ``config.yaml`` and the manifest, renames ``partial`` to ``final``, points ``latest`` at it and
    prunes (:func:`prune`). Returns ``final``.

    Raises:
        CheckpointSaveError: on every rank, naming the directory and the failing rank.
    """
    import torch.distributed as dist

    _before_commit(step)
    dist.barrier()  # every rank's shards are on disk
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(entries, gathered, dst=0)

    def publish() -> None:
        if dist.get_rank() != 0:
            return
        shards = {k: v for part in gathered for k, v in part.items()}
        (partial / STATE_FILE).write_text(json.dumps({**state, "manifest": True}, indent=1, sort_keys=True) + "\n")
        (partial / CONFIG_FILE).write_text(config_yaml)
        rest = [n for n in checkpoint_files(partial) if n not in shards]  # megatron's metadata, ours
        write_manifest(partial, {**shards, **file_entries(partial, rest)})  # last: marks it complete
        if final.exists():  # re-save of the same step (e.g. after a resume that replayed it)
            shutil.rmtree(final)
        os.replace(partial, final)
        root = final.parent
        tmp = root / (LATEST + ".tmp")
        tmp.write_text(final.name + "\n")
        os.replace(tmp, root / LATEST)
        prune(root, keep_last, keep_every, keep_steps)

    agree(f"committing checkpoint step {step} in {partial}", publish)
    return final


def shard_entries(partial: Path, write_buckets) -> dict:
    """Manifest entries (:func:`k2.launcher.checkpointing.manifest.file_entries`) of the shard files
    in megatron's ``write_buckets`` (``(file_name, storage_key, data)`` tuples): what this rank wrote."""
    names = sorted({Path(b[0]).name for b in write_buckets or ()})
    return file_entries(partial, names)


def save_checkpoint(
    run_dir,
    step: int,
    model: list,
    optimizer,
    state: dict,
    config_yaml: str,
    keep_last: int,
    keep_every: int | None,
    keep_steps: Collection[int] = (),
) -> Path:
    """Write checkpoint ``iter_<step>`` on every rank and make it ``latest`` once all ranks are done
    (synchronously; in the background: :mod:`k2.launcher.checkpointing.background`).

    Args:
        run_dir: ``run.dir``.
        step: the optimizer step just completed (1-based).
        model: the DDP-wrapped model chunks; optimizer: the megatron optimizer.
        state: JSON-able run state for ``k2_state.json`` (rank 0's value is written).
        config_yaml: the resolved config.
        keep_last / keep_every / keep_steps: retention (see :func:`prune`).

    Returns:
        The path of the complete checkpoint.

    Raises:
        CheckpointSaveError: on every rank (one line naming the directory and the rank); ``latest``
            still names the previous checkpoint.

    Collective: every rank must call it at the same step.
    """
    partial, final, request = begin_save(run_dir, step, model, optimizer)
    what = f"saving checkpoint step {step} into {partial}"

    def write() -> dict:
        buckets = request.async_fn_args[1] if request.async_fn is not None else ()
        files = [Path(b[0]) for b in buckets]
        with measured(lambda: sum(f.stat().st_size for f in files if f.exists())):  # (the hang watchdog)
            request.execute_sync()  # this rank's shards, a barrier, megatron's metadata (collective)
        return shard_entries(partial, buckets)

    entries = agree(what, write)
    return commit_save(partial, final, step, entries, state, config_yaml, keep_last, keep_every, keep_steps)


class CheckpointSaveError(RuntimeError):
    """A save failed (the message names the checkpoint directory and the rank); the previous checkpoint
    stays ``latest``."""


def prune(root: Path, keep_last: int, keep_every: int | None, keep_steps: Collection[int] = ()) -> list[str]:
    """Delete complete checkpoints except the newest ``keep_last``, every step that is a multiple of
    ``keep_every`` and every step of ``keep_steps`` (``checkpoint.save_steps``: a sweep trunk's branch
    points); the one ``latest`` names is always kept. Returns the names removed."""
    root = Path(root)
    latest = (root / LATEST).read_text().strip() if (root / LATEST).exists() else None
    names = saved_checkpoint_names(root)
    keep = set(names[-keep_last:]) if keep_last > 0 else set()
    if keep_every:
        keep |= {n for n in names if int(n.split("_")[1]) % keep_every == 0}
    keep |= {n for n in names if int(n.split("_")[1]) in set(keep_steps)}
    if latest:
        keep.add(latest)
    removed = [n for n in names if n not in keep]
    for n in removed:
        shutil.rmtree(root / n, ignore_errors=True)
    return removed


def remove_partial_saves(run_dir) -> list[str]:
    """Delete ``iter_*.partial`` leftovers of killed saves (rank 0, before training). Returns their names."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    gone = [p.name for p in root.iterdir() if p.name.endswith(PARTIAL_SUFFIX)]
    for n in gone:
        shutil.rmtree(root / n, ignore_errors=True)
    return gone
