"""``k2-train``: train a K2-family model with megatron-core's PP/VPP/EP/ZeRO-1 machinery.

``k2-train parallel=cpu4`` spawns ``launch.nproc_per_node`` local ranks itself (forked after one import
of the trainer: :mod:`k2.launcher.training.fork_ranks`) when it is not already under torchrun or srun; it
composes the config and plans the run once, and each rank enters :func:`rank_main` with them. ``torchrun -m
k2.launcher.train ...`` and ``srun python -m k2.launcher.train ...`` run as one rank each (each composes
the config from its command line).
With ``-m`` / ``--multirun`` it runs a sweep, one training per point (:mod:`k2.launcher.tools.sweep`).

Exit status: 0 when the run finished, 2 for a bad setting, a damaged dataset (a truncated or mismatched
``.idx`` / ``.bin``; with ``data.verify=true`` a checksum that differs from the k2-data manifest) or a run
dir another trainer owns (:mod:`k2.launcher.checkpointing.run_lock`), 3 when the loss or gradient norm became NaN / inf
(``k2.launcher.cli.DIVERGED_EXIT``), 1 when a checkpoint could not be saved (one line naming the
directory and the rank), 42 (``REQUEUE_EXIT_CODE``) when it saved a
checkpoint and stopped for preemption (SIGTERM / SIGUSR1 or ``run.max_minutes``), 130 (``INTERRUPT_EXIT``)
when stopped by Ctrl-C (SIGINT: the first press saves the step, a second stops at once:
:mod:`k2.launcher.training.preemption`), 1 when not every rank reached the rendezvous within
``launch.rendezvous_timeout_s`` (the error names the missing nodes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from k2.config import ConfigError, load_config
from k2.launcher.cli import BAD_SETTING_EXIT, DIVERGED_EXIT, REQUEUE_EXIT_CODE, error, run_main
from k2.launcher.training.preemption import INTERRUPT_EXIT

if TYPE_CHECKING:
    from k2.config.schema import K2Config

PROG = "k2-train"

USAGE = """usage: k2-train [-m] [HYDRA_OVERRIDE ...]

Train a K2-family model. Outside torchrun/srun it starts launch.nproc_per_node local ranks itself; under
torchrun or srun it runs as one rank. A run.dir holding a checkpoint is resumed from its latest one (a
finished run prints "nothing to do"). -m runs a sweep, one training per point. Outputs: <run.dir>/
metrics.jsonl, checkpoints/, config.yaml, wandb/. Exit status 3: the loss or gradient norm became NaN /
inf; 42: a checkpoint was saved for preemption (the Slurm script requeues); 130: stopped by Ctrl-C (the
first press saves the step in progress, a second stops at once).

examples:
  k2-train parallel=cpu4                                  # 4 CPU ranks, the k2_tiny demo (300 steps)
  k2-train parallel=cpu4 run.dir=runs/try1 train.iters=50 train.save_interval=10
  k2-train parallel=pp2 schedule.phases.1.lr_start=1e-3 optim=muonclip
  k2-train data.path=/data/corpus_text_document data.tokenizer=/data/tokenizer.json
  k2-train -m +experiment=sparsity_sweep                  # the sparsity sweep, point after point
"""


def _train(args: list[str]) -> int:
    from k2.launcher.tools.sweep import split_multirun

    multirun, overrides = split_multirun(args)
    # a mistyped key or a bad value is refused here, before torch and megatron-core are imported (seconds
    # to tens of seconds on a busy machine); so are the imports below, not at the top: --help prints first
    cfg = None if multirun else load_config(overrides)
    from k2.launcher.checkpointing.resume import plan_resume
    from k2.launcher.checkpointing.run_lock import RunDirLock, raise_if_busy
    from k2.launcher.tools.sweep import run_sweep
    from k2.launcher.training.prepare import prepare_run
    from k2.parallel.distributed import dist_env

    env = dist_env()
    if multirun:
        if env.launched:
            error(
                PROG,
                "-m (a sweep) starts one run per point itself; run it outside torchrun/srun (or "
                "submit the points with k2-submit -m)",
            )
            return BAD_SETTING_EXIT
        return run_sweep(overrides)
    assert cfg is not None  # (loaded above: one run)
    world = env.world_size if env.launched else cfg.launch.nproc_per_node
    could_own = env.rank == 0
    try:
        plan = prepare_run(cfg, world)  # every setting first: a bad one exits 2 before run.dir is created
    except ConfigError:
        if could_own:  # a run dir another trainer is writing right now: say that, not what it holds
            raise_if_busy(cfg.run.dir)
        raise
    if cfg.data.verify and env.rank == 0:  # every file read whole, before any rank starts (the others wait)
        _verify_data(plan)
    if plan.nothing_to_do:  # a finished run run again: no rank starts
        if env.rank == 0:
            print(f"{PROG}: {plan.nothing_to_do}", flush=True)
        return 0
    if plan.ends_before_decay and env.rank == 0:
        print(f"{PROG}: note: {plan.ends_before_decay}", flush=True)
    # one owner per run dir (k2.launcher.checkpointing.run_lock): this process, when it spawns the ranks
    # or is global rank 0 of its own launch; taken before anything in the run dir is written
    owner = could_own
    try:
        with RunDirLock.acquire(cfg.run.dir) if owner else contextlib.nullcontext():
            if owner:  # decided again under the lock: a previous owner may have saved or pruned since
                plan = dataclasses.replace(plan, resume_from=plan_resume(cfg, plan.layout))
            return _run(cfg, plan, env)
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (start-up, teardown): one line, no traceback
        from k2.launcher.training.preemption import kept_note

        error(PROG, f"interrupted (Ctrl-C); {kept_note(cfg.run.dir)}")
        return INTERRUPT_EXIT


def _verify_data(plan) -> None:
    """``data.verify=true``: every dataset of every phase against its k2-data manifest
    (:func:`k2.launcher.datasets.verify.verify_datasets`; the embedded corpus once it is built)."""
    import os

    from k2.launcher.datasets.verify import verify_datasets

    prefixes = [
        p
        for d in (plan.phase_data or (plan.data,))
        for blend in (d.train_blend, d.valid_blend)
        if blend is not None
        for p in blend[0]
    ]
    verify_datasets([p for p in prefixes if os.path.isfile(p + ".bin")], log=lambda s: print(s, flush=True))


def _run(cfg: K2Config, plan, env) -> int:
    """Start the local ranks (outside torchrun / srun, world size > 1) or run as this launch's rank."""
    from k2.launcher.datasets.corpus import prepare_stdlib_corpus
    from k2.launcher.training.cuda_env import configure_cuda_env
    from k2.launcher.training.launch import spawn_local_ranks

    configure_cuda_env(cfg)  # before any CUDA library starts, here and (inherited) in the ranks
    if not env.launched and plan.dims.world_size > 1:
        if cfg.data.path is None:
            prepare_stdlib_corpus(cfg.data)  # once, before the ranks start
        # the ranks call rank_main by its module's name: under ``python -m k2.launcher.train`` this module
        # is ``__main__``, which in the rank launcher is another module
        import k2.launcher.train

        return spawn_local_ranks(cfg, plan, k2.launcher.train.rank_main)
    return _run_rank(cfg, plan, env, spawned=False)


def rank_main(cfg: K2Config, plan) -> int:
    """The entry of a rank that ``k2-train`` spawned (:func:`k2.launcher.training.launch.spawn_local_ranks`):
    train with the config ``k2-train`` composed and validated and the plan it made (resume decision
    included, taken under the run dir's lock), as one rank of torchrun's environment contract (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``...), without composing or planning again.

    Args:
        cfg: the read-only config of :func:`k2.config.load_config`.
        plan: :class:`k2.launcher.training.prepare.RunPlan` of that config for this world size.

    Returns:
        the rank's exit status (module docstring; 0 after a preemption save: the parent turns the
        requeue marker into :data:`REQUEUE_EXIT_CODE`).
    """
    from k2.parallel.distributed import dist_env

    return run_main(PROG, lambda _args: _run_rank(cfg, plan, dist_env(), spawned=True), [])


def _run_rank(cfg: K2Config, plan, env, spawned: bool) -> int:
    """Train as rank ``env.rank``; ``spawned``: started by this process's parent ``k2-train``."""
    from k2.launcher.training.cuda_env import apply_determinism
    from k2.parallel.distributed import destroy_distributed
    from k2.parallel.processes import exit_with_parent
    from k2.parallel.rendezvous import RendezvousTimeout

    if spawned:
        exit_with_parent()  # no rank outlives k2-train (k2.launcher.training.launch)
    # imported here, not at the top: the trainer imports megatron-core (~6 s of CPU), which a process that
    # only checks the settings and starts the local ranks (or a sweep) does not need
    from k2.launcher.training.fork_ranks import imports_without_collection

    with imports_without_collection():  # (a rank forked by fork_ranks has them already)
        from k2.launcher.checkpointing.store import CheckpointSaveError
        from k2.launcher.training.step import TrainingDiverged
        from k2.launcher.training.trainer import run

    apply_determinism(cfg)
    import torch.distributed as dist

    caller_group = dist.is_initialized()  # a process group that was here before (a test's) stays as it was
    try:
        record = run(cfg, plan, env)
    except TrainingDiverged as e:  # every rank stops at the same step; one line says why
        if env.rank == 0:
            error(PROG, e)
        return DIVERGED_EXIT
    except RendezvousTimeout as e:  # every rank that came says who is missing (rank 0 may be the one)
        error(PROG, e)
        return 1
    except CheckpointSaveError as e:  # every rank raises it; one line names the directory and the rank
        if env.rank == 0:
            error(PROG, e)
        return 1
    finally:
        if not caller_group:
            destroy_distributed()
    if record.get("preempted") and not spawned:
        return INTERRUPT_EXIT if record["preempted"] == "interrupt" else REQUEUE_EXIT_CODE
    # ranks spawned by k2-train exit 0 after a preemption save, so that their launcher does not take the
    # first rank to finish for a failure and stop the others mid-save; the parent turns the requeue
    # marker the save left into REQUEUE_EXIT_CODE (spawn_local_ranks)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``k2-train [HYDRA_OVERRIDE ...]``; returns the exit status (module docstring)."""
    return run_main(PROG, _train, argv, usage=USAGE)


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
