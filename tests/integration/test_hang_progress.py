"""A long evaluation is not a hang while its batches move; a rank that stops in the middle of one is.

One 2-rank run with ``run.hang_timeout_s=5``: the evaluations have 200 batches of 0.05 s each (10 s, twice
the allowance; tests/support/scripts/fault_train.py's ``$K2_EVAL_BATCH_S``: the batches after the first
sleep instead of running the model, so the test pays for the loop, not the FLOPs). The evaluation after
step 2 (the second of the launch: the first of each kind gets the start-up allowance) completes; in the
one after step 4 rank 1 stops itself (SIGSTOP) after 50 batches, and the watchdog names it within the
allowance plus one heartbeat tick of the moment the batches stopped.
"""

from __future__ import annotations

import pytest

from support.distributed import run_trainer

TIMEOUT_S = 5.0
TICK_S = 0.5  # the heartbeat of a 5 s allowance (HangWatchdog.tick_s)
#: what a loaded 2-core machine adds to the watchdog thread's own wake-up and report (measured: < 1 s)
SLACK_S = 2.0


@pytest.mark.slow
def test_a_200_batch_evaluation_completes_and_a_rank_stopped_in_one_is_named(tmp_path, stdlib_corpus):
    run_dir, out = tmp_path / "run", tmp_path / "out.txt"
    recs = run_trainer(
        [
            "train.iters=4",
            "train.eval_interval=2",
            "train.eval_iters=200",
            "train.save_interval=2",
            f"run.hang_timeout_s={TIMEOUT_S}",
            "run.hang_startup_timeout_s=300",
            "checkpoint.async_save=false",
        ],
        2,
        run_dir,
        script="fault_train.py",
        expect_failure=True,
        stdout_to=out,
        env={
            "K2_FAULT": "sigstop_eval:4:1",
            "K2_STOP_AFTER": "50",
            "K2_EVAL_BATCH_S": "0.05",
            "K2_TEST_OUT": str(tmp_path),
        },
    )
    text = out.read_text()
    # the evaluation after step 2: 200 batches, longer than the allowance, completed
    by_step = {r["step"]: r for r in recs}
    assert "val_loss" in by_step[2], text[-3000:]
    eval_2 = by_step[2]["time_eval_s"] - by_step[1]["time_eval_s"]
    assert eval_2 > 2 * TIMEOUT_S - 1, eval_2
    # the one after step 4: rank 1 stopped after 50 batches, named within the allowance plus a tick
    lines = [x for x in text.splitlines() if x.startswith("k2-train: hang:")]
    assert len(lines) == 1 and "at 'eval 4'" in lines[0], text[-3000:]
    assert "rank 1 stopped responding (last heartbeat at 'eval 4'" in lines[0] and "rank 0 " not in lines[0], lines
    stopped = float((tmp_path / "stopped").read_text())
    report = max((run_dir / "hang").glob("*/report.txt"), key=lambda f: f.stat().st_mtime)
    assert report.read_text().strip() == lines[0]
    waited = report.stat().st_mtime - stopped
    assert TIMEOUT_S - 0.5 < waited <= TIMEOUT_S + TICK_S + SLACK_S, waited
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000002"  # (evaluated before saved)
    assert (run_dir / "requeue").read_text().startswith("hang eval 4")  # the requeue status, 42
