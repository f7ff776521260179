"""Loading a checkpoint: its verification against the manifest before anything is loaded (every rank hashing
its share), the model, optimizer and RNG state of a resume (or the model weights alone), and the repairs
megatron-core 0.19.2's optimizers need around a load on a path without Apex / Transformer Engine. What is
loaded is the sharded state dict a save writes (:func:`k2.launcher.checkpointing.store.sharded_state_dict`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from k2.config.errors import ConfigError
from k2.launcher.checkpointing.load_progress import load_progress
from k2.launcher.checkpointing.manifest import checkpoint_files, is_legacy, rank_share, verify
from k2.launcher.checkpointing.paths import damaged_checkpoint_error, read_state, unsafe_checkpoint_error
from k2.launcher.checkpointing.rng import set_rng_state
from k2.launcher.checkpointing.store import sharded_state_dict
from k2.launcher.checkpointing.unpickle import load_errors, pickle_problems, raise_if_refused, restricted_unpickling
from k2.optim.build import leaf_optimizers


def verify_checkpoint(path, level: str) -> float:
    """Collective: check the checkpoint at ``path`` against its manifest before it is loaded, each rank
    hashing its share of the files (``level`` is ``checkpoint.verify``: checksum, size or none), and read the
    pickled parts of its share as the load will (:func:`k2.launcher.checkpointing.unpickle.pickle_problems`, at
    every level); every rank gets the same verdict. Rank 0 prints a warning for a checkpoint without a manifest
    (written before manifests existed: it cannot be verified, and is loaded as it is).

    Returns:
        The seconds it took (the slowest rank's share decides).

    Raises:
        ConfigError: on rank 0, naming the checkpoint, each damaged file, the checkpoints next to it
            that verify and the ``resume.from=...`` override to use one
            (:func:`k2.launcher.checkpointing.paths.damaged_checkpoint_error`); or each pickled part that
            names code outside the allow-list (:func:`k2.launcher.checkpointing.paths.unsafe_checkpoint_error`).
        SystemExit: status 2 on the other ranks (the same verdict, without repeating the line).
    """
    import torch.distributed as dist

    t0 = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    everyone: list[Any] = [None] * world
    # the pickled parts of this rank's share, read as the load will read them (whatever the level)
    unsafe = pickle_problems(path, rank_share(checkpoint_files(path), rank, world))
    dist.all_gather_object(everyone, (verify(path, level, rank, world), unsafe))
    damaged = sorted({p for part, _ in everyone for p in part})
    unsafe = sorted({p for _, part in everyone for p in part})
    if (damaged or unsafe) and rank == 0:
        raise damaged_checkpoint_error(path, damaged) if damaged else unsafe_checkpoint_error(path, unsafe)
    if damaged or unsafe:  # rank 0 prints the one error line; the others exit with the same status (2) silently
        raise SystemExit(2)
    seconds = time.perf_counter() - t0
    if rank == 0 and level != "none" and is_legacy(path):
        print(
            f"k2-train: warning: checkpoint {path} has no manifest (written by an older k2-launcher): "
            "its files cannot be verified; loading it as it is",
            flush=True,
        )
    elif rank == 0 and level != "none":
        print(f"k2-train: checkpoint {path} verified ({level}, {world} ranks) in {seconds:.2f} s", flush=True)
    return seconds


def _materialise_optimizer_state(optimizer) -> None:
    """Give every parameter of a fresh optimizer its (zero) state before a load.

    megatron-core 0.19.2's ``DistributedOptimizer.sharded_state_dict(is_loading=True)`` first calls its
    ``state_dict()``, which without Apex/Transformer Engine reads ``state[p]["step"]`` of every parameter
    and asserts they agree -- it fails (assert / KeyError 'step') on a fresh optimizer, i.e. on every
    resume on CPU or on a GPU without TE. Megatron's own remedy (``_init_optimizer_states_with_dummy_values``)
    runs an optimizer step, which applies weight decay to the parameters; here the state is created in
    place instead (zeros and step 0, every value overwritten by the load), through megatron's
    ``init_state_fn`` where the optimizer has one (Adam moments, Muon momentum).
    """
    for opt in leaf_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        init_fn = getattr(opt, "init_state_fn", None)
        if init_fn is not None:
            init_fn(inner, getattr(opt, "config", None))
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state[p]
                if isinstance(inner, torch.optim.Adam) or isinstance(inner, torch.optim.AdamW):
                    st.setdefault("exp_avg", torch.zeros_like(p, memory_format=torch.preserve_format))
                    st.setdefault("exp_avg_sq", torch.zeros_like(p, memory_format=torch.preserve_format))
                    st.setdefault("step", torch.tensor(0.0, dtype=torch.float32))


def _restore_step_counts(optimizer) -> None:
    """Give each parameter its own, correct Adam ``step`` after a load.

    megatron-core 0.19.2's ``DistributedOptimizer.load_state_dict`` on the path without Apex/TE (i)
    puts ONE ``step`` tensor into the state of every parameter, which torch's Adam then increments in
    place once per parameter, and (ii) copies the per-parameter ``step`` of the ``dp_reshardable``
    parameter state over it, which loads as 0. Either way the bias correction of every later update
    differs from an uninterrupted run (found by the bitwise-resume test, tests/integration/test_checkpoint.py). The
    step megatron keeps in each param group (restored correctly) is the true count.
    """
    for opt in leaf_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            step = group.get("step")
            for p in group["params"]:
                st = inner.state.get(p)
                if st and isinstance(st.get("step"), torch.Tensor):
                    st["step"] = (
                        torch.tensor(float(step), dtype=st["step"].dtype, device=st["step"].device)
                        if step is not None
                        else st["step"].detach().clone()
                    )


def modelsharded_state_dict(chunks: list) -> dict:
    """megatron's sharded state dict of the model chunks alone (``model`` / ``model0..``, as in a full
    checkpoint); ``chunks`` are bare ``GPTModel`` chunks or DDP-wrapped ones."""
    bare = [getattr(c, "module", c) for c in chunks]
    if len(bare) == 1:
        return {"model": bare[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(bare)}


def load_model_weights(path, chunks: list) -> None:
    """Load the model tensors of the checkpoint at ``path`` into ``chunks`` (bare or DDP-wrapped), for
    this run's layout whatever layout wrote it (megatron reshards model tensors); nothing else is read.

    Collective: every rank calls it. Raises ConfigError when the checkpoint cannot be loaded.
    """
    from megatron.core import dist_checkpointing

    sd = modelsharded_state_dict(chunks)
    try:
        with restricted_unpickling(), load_progress():
            loaded = dist_checkpointing.load(sd, str(path))
    except load_errors() as e:
        raise_if_refused(path, e)
        first = (str(e).strip().splitlines() or [""])[0]
        raise ConfigError(f"checkpoint {path}: model weights could not be loaded ({type(e).__name__}: {first})") from e
    bare = [getattr(c, "module", c) for c in chunks]
    for i, chunk in enumerate(bare):
        chunk.load_state_dict(loaded["model" if len(bare) == 1 else f"model{i}"], strict=True)


def load_checkpoint(path, model: list, optimizer, same_world: bool) -> dict:
    """Load model chunks, optimizer and (when the world size is the checkpoint's) this rank's RNG state.

    Returns:
        The checkpoint's ``k2_state.json``.

    Collective: every rank calls it. Megatron's dist-checkpointing reads each rank's tensors, resharding
    the model for the current layout and the optimizer for the current DP size.
    """
    from megatron.core import dist_checkpointing

    path = Path(path)
    state = read_state(path)
    _materialise_optimizer_state(optimizer)
    sd = sharded_state_dict(model, optimizer, is_loading=True, with_rng=same_world)
    try:
        with restricted_unpickling(), load_progress():  # pickled parts: a checkpoint's classes only
            loaded = dist_checkpointing.load(sd, str(path))
    except load_errors() as e:  # e.g. damage that checkpoint.verify=size / none does not look for
        raise_if_refused(path, e)
        first = (str(e).strip().splitlines() or [""])[0]
        raise ConfigError(
            f"checkpoint {path} could not be loaded ({type(e).__name__}: {first}); "
            "if it is damaged, checkpoint.verify=checksum names the file"
        ) from e
    if len(model) == 1:
        model[0].module.load_state_dict(loaded["model"], strict=True)
    else:
        for i, chunk in enumerate(model):
            chunk.module.load_state_dict(loaded[f"model{i}"], strict=True)
    with torch.no_grad():
        optimizer.load_state_dict(loaded["optimizer"])
    _restore_step_counts(optimizer)
    if same_world:
        set_rng_state(loaded["rng_state"])
    return state
