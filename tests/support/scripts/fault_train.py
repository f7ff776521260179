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
* ``crash_save`` -- rank RANK dies (``os._exit(1)``) inside the save of step STEP, after writing its
  tensors and before the checkpoint is made visible (a node lost mid-save).
"""

import os
import signal
import sys


import k2.launcher.checkpointing.store as store
import k2.launcher.training.step as step
import k2.launcher.training.trainer as trainer
from k2.launcher import train

KIND, STEP, RANK = os.environ["K2_FAULT"].split(":")
STEP, RANK = int(STEP), int(RANK)
ME = int(os.environ.get("RANK", "0"))
train_steps = 0
_run_microbatches = trainer.run_microbatches


def run_microbatches(forward_backward, iters, model, phase, forward_only):
    global train_steps
    if not forward_only:
        train_steps += 1
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


trainer.init_distributed = init_distributed
trainer.run_microbatches = run_microbatches  # the training step's
step.run_microbatches = run_microbatches  # evaluate()'s
store._before_commit = before_commit

if __name__ == "__main__":  # megatron's checkpoint writer starts a multiprocessing manager (spawn)
    sys.exit(train.main(sys.argv[1:]))
