"""``k2.launcher.train`` with one injected fault, for tests/integration/test_checkpoint.py and
test_preemption_cli.py. ``$K2_FAULT`` = ``KIND:STEP:RANK``:

* ``sigterm_train`` -- global rank RANK sends itself SIGTERM in the middle of training step STEP (after
  the step started, before its microbatches run), as a preempting job manager would;
* ``sigterm_eval`` -- the same during the validation that follows step STEP;
* ``sigusr1_save`` -- rank RANK sends itself SIGUSR1 (Slurm's time-limit notice) inside the save of
  step STEP, after writing its tensors;
* ``sigusr1_before_pg`` -- rank RANK sends itself SIGUSR1 just before the process groups are created
  (STEP is unused): a notice that arrives while the trainer is still starting;
* ``sigkill_train`` -- global rank RANK sends itself SIGKILL in the middle of training step STEP (a
  node lost, ``kill -9``);
* ``erofs_save`` -- on rank RANK the save of step STEP fails as on a file system that turned
  read-only (``OSError`` EROFS after writing its shards);
* ``slow_write`` -- the background writer (``checkpoint.async_save``) of the checkpoint of step STEP on
  rank RANK writes its first shard file slowly, 1 KiB every 0.5 s for ``$K2_SLOW_WRITE_S`` seconds (a
  slow file system), before megatron writes it;
* ``sigstop_eval`` -- global rank RANK stops itself (SIGSTOP) in the evaluation that follows step STEP,
  after ``$K2_STOP_AFTER`` of its batches, having written the time into ``$K2_TEST_OUT/stopped``;
* ``writer_sigkill`` / ``writer_sigstop`` -- the background writer (``checkpoint.async_save``) of the
  checkpoint of step STEP on rank RANK sends itself SIGKILL (``kill -9``, the out-of-memory killer) /
  SIGSTOP before it writes;
* ``writer_enospc`` -- that writer's file system is full: its ``fsync`` of each shard (where a full disk
  shows with delayed allocation) fails with ENOSPC, inside megatron's writer;
* ``none`` -- no fault (for ``$K2_HOLD_WRITER`` or ``$K2_EVAL_BATCH_S`` alone);
* ``crash_save`` -- rank RANK dies (``os._exit(1)``) inside the save of step STEP, after writing its
  tensors and before the checkpoint is made visible (a node lost mid-save).

``$K2_SHARED_OFFLOAD=1`` (optional): the offloaded optimizer states (``optim.offload_fraction``) live in
shared memory, which a forked background writer shares instead of copying on write, as it shares the
pinned buffers they live in on a GPU.

``$K2_EVAL_BATCH_S`` = seconds (optional): every evaluation batch after the first of each evaluation
takes that long and returns the first batch's losses instead of running the model (a long evaluation,
200 batches, at the cost of a sleep: what is tested is the loop around the batches, not the model).

``$K2_HOLD_WRITER`` = ``STEP:RANK`` (optional): the background writer (``checkpoint.async_save``) of
the checkpoint of step STEP on global rank RANK waits, before it writes, until that rank has started
step STEP + 2 (so two optimizer steps update the state while it is written, and a fault injected in
step STEP + 2 hits the write in progress).
"""

import errno
import os
import signal
import sys
import time
from pathlib import Path

import k2.launcher.checkpointing.background as background
import k2.launcher.checkpointing.store as store
import k2.launcher.training.step as step
import k2.launcher.training.trainer as trainer
from k2.launcher import train

KIND, STEP, RANK = os.environ["K2_FAULT"].split(":")
STEP, RANK = int(STEP), int(RANK)
ME = int(os.environ.get("RANK", "0"))
train_steps = 0
_run_microbatches = trainer.run_microbatches


HOLD = [int(x) for x in os.environ["K2_HOLD_WRITER"].split(":")] if os.environ.get("K2_HOLD_WRITER") else None
HOLD_FLAG = Path(os.environ.get("K2_TEST_OUT", "/tmp")) / f"k2-hold-writer-{os.getppid()}-{ME}"


EVAL_BATCH_S = float(os.environ.get("K2_EVAL_BATCH_S", "0"))
_eval = {"step": None, "batches": 0, "losses": None}


def _eval_batch(forward_backward, iters, model, phase):
    """One evaluation batch under ``$K2_EVAL_BATCH_S`` / ``sigstop_eval`` (module docstring)."""
    if _eval["step"] != train_steps:
        _eval.update(step=train_steps, batches=0, losses=None)
    _eval["batches"] += 1
    if (
        KIND == "sigstop_eval"
        and train_steps == STEP
        and ME == RANK
        and _eval["batches"] == int(os.environ["K2_STOP_AFTER"]) + 1
    ):
        (Path(os.environ["K2_TEST_OUT"]) / "stopped").write_text(f"{time.time()}\n")
        os.kill(os.getpid(), signal.SIGSTOP)
    if _eval["losses"] is None:
        _eval["losses"] = _run_microbatches(forward_backward, iters, model, phase, True)
    else:
        time.sleep(EVAL_BATCH_S)
    return _eval["losses"]


def run_microbatches(forward_backward, iters, model, phase, forward_only):
    global train_steps
    if forward_only and (EVAL_BATCH_S or KIND == "sigstop_eval"):
        return _eval_batch(forward_backward, iters, model, phase)
    if not forward_only:
        train_steps += 1
        if HOLD and ME == HOLD[1] and train_steps == HOLD[0] + 2:
            HOLD_FLAG.touch()  # the held writer may go on
        if KIND in ("sigterm_train", "sigkill_train") and train_steps == STEP and ME == RANK:
            os.kill(os.getpid(), signal.SIGTERM if KIND == "sigterm_train" else signal.SIGKILL)
    elif KIND == "sigterm_eval" and train_steps == STEP and ME == RANK:
        os.kill(os.getpid(), signal.SIGTERM)
    return _run_microbatches(forward_backward, iters, model, phase, forward_only)


def before_commit(step):
    if KIND == "crash_save" and step == STEP and ME == RANK:
        os._exit(1)
    if KIND == "sigusr1_save" and step == STEP and ME == RANK:
        os.kill(os.getpid(), signal.SIGUSR1)


_init_distributed = trainer.init_distributed


def init_distributed(*args, **kwargs):
    if KIND == "sigusr1_before_pg" and ME == RANK:
        os.kill(os.getpid(), signal.SIGUSR1)
    return _init_distributed(*args, **kwargs)


def _run_dir() -> Path:
    return Path(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("run.dir=")))


def _full_disk_fsync(fd):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def writer_started():  # in the forked writer: train_steps is the step of its checkpoint
    if KIND.startswith("writer_") and ME == RANK and train_steps == STEP:
        if KIND == "writer_enospc":
            os.fsync = _full_disk_fsync  # (this process only: the forked writer)
        else:
            os.kill(os.getpid(), signal.SIGKILL if KIND == "writer_sigkill" else signal.SIGSTOP)
    if KIND == "slow_write" and ME == RANK and train_steps == STEP:
        shard = _run_dir() / "checkpoints" / f"iter_{STEP:07d}.partial" / f"__{ME}_0.distcp"
        end = time.time() + float(os.environ["K2_SLOW_WRITE_S"])
        with open(shard, "wb") as f:
            while time.time() < end:
                f.write(b"\0" * 1024)
                f.flush()
                time.sleep(0.5)
    if HOLD and ME == HOLD[1] and train_steps == HOLD[0]:
        deadline = time.time() + 300
        while not HOLD_FLAG.exists() and time.time() < deadline:
            time.sleep(0.05)
        HOLD_FLAG.unlink(missing_ok=True)


_shard_entries = store.shard_entries


def shard_entries(partial, buckets):
    if KIND == "erofs_save" and ME == RANK and train_steps == STEP:
        raise OSError(30, "Read-only file system", str(partial))
    return _shard_entries(partial, buckets)


if os.environ.get("K2_SHARED_OFFLOAD") == "1":
    import k2.optim.offload as offload

    _host_buffer = offload.host_buffer
    offload.host_buffer = lambda shape, dtype, pin: _host_buffer(shape, dtype, pin).share_memory_()

trainer.init_distributed = init_distributed
store.shard_entries = shard_entries
background.shard_entries = shard_entries  # (in the forked writer of checkpoint.async_save)
background._writer_started = writer_started
trainer.run_microbatches = run_microbatches  # the training step's
step.run_microbatches = run_microbatches  # evaluate()'s
store._before_commit = before_commit

if __name__ == "__main__":  # megatron's checkpoint writer starts a multiprocessing manager (spawn)
    sys.exit(train.main(sys.argv[1:]))
