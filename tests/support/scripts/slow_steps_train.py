"""``k2.launcher.train`` whose every training step first sleeps ``$K2_STEP_SLEEP_S`` seconds (default 2),
for tests that wait, while the run trains, for something from outside it (Slurm's time-limit notice in
tests/integration/test_slurm_two_nodes_timeouts.py): the run stays in the middle of its steps for as long
as it takes at a fraction of the CPU that steps back to back would burn. Nothing else changes."""

import os
import sys
import time

import k2.launcher.training.trainer as trainer
from k2.launcher import train

SLEEP_S = float(os.environ.get("K2_STEP_SLEEP_S", "2"))
_run_microbatches = trainer.run_microbatches


def run_microbatches(forward_backward, iters, model, phase, forward_only):
    if not forward_only:  # (after the step started, before its microbatches run)
        time.sleep(SLEEP_S)
    return _run_microbatches(forward_backward, iters, model, phase, forward_only)


trainer.run_microbatches = run_microbatches  # the training step's

if __name__ == "__main__":
    sys.exit(train.main(sys.argv[1:]))
