"""``launcher.train`` with one injected fault, for tests/test_checkpoint.py. ``$K2_FAULT`` =
``KIND:STEP:RANK``:

* ``sigterm_train`` -- global rank RANK sends itself SIGTERM in the middle of training step STEP (after
  the step started, before its microbatches run), as a preempting job manager would;
* ``sigterm_eval`` -- the same during the validation that follows step STEP;
* ``crash_save`` -- rank RANK dies (``os._exit(1)``) inside the save of step STEP, after writing its
  tensors and before the checkpoint is made visible (a node lost mid-save).
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import launcher.checkpoint as checkpoint  # noqa: E402
import launcher.train as train  # noqa: E402

KIND, STEP, RANK = os.environ["K2_FAULT"].split(":")
STEP, RANK = int(STEP), int(RANK)
ME = int(os.environ.get("RANK", "0"))
train_steps = 0
_run_microbatches = train.run_microbatches


def run_microbatches(forward_backward, iters, model, phase, forward_only):
    global train_steps
    if not forward_only:
        train_steps += 1
        if KIND == "sigterm_train" and train_steps == STEP and ME == RANK:
            os.kill(os.getpid(), signal.SIGTERM)
    elif KIND == "sigterm_eval" and train_steps == STEP and ME == RANK:
        os.kill(os.getpid(), signal.SIGTERM)
    return _run_microbatches(forward_backward, iters, model, phase, forward_only)


def before_commit(step):
    if KIND == "crash_save" and step == STEP and ME == RANK:
        os._exit(1)


train.run_microbatches = run_microbatches
checkpoint._before_commit = before_commit

if __name__ == "__main__":  # megatron's checkpoint writer starts a multiprocessing manager (spawn)
    sys.exit(train.main(sys.argv[1:]))
