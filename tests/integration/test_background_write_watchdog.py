"""A background checkpoint write slower than the hang watchdog's allowance is not a hang while it moves:
the wait for it keeps the watchdog alive as long as the writers' bytes grow
(:meth:`k2.launcher.checkpointing.background.BackgroundSaver.wait`, ``HangWatchdog.keep_alive``)."""

import re

import pytest

from tests.support.distributed import run_trainer

pytestmark = pytest.mark.usefixtures("stdlib_corpus")

ALLOWANCE_S = 8  # run.hang_timeout_s
SLOW_S = 3 * ALLOWANCE_S  # the writer of step 2's checkpoint takes this long before megatron writes


@pytest.mark.slow
def test_a_slow_background_write_that_moves_is_waited_for(tmp_path):
    """One rank, a save every 2 steps, step 2's writer writing 1 KiB every 0.5 s for 3x the allowance:
    the save of step 4 waits for it (the checkpoint time of step 4 is longer than the allowance) and the
    run ends with both checkpoints committed, not with the watchdog's requeue. Without the keep-alive
    the watchdog ends the run at 'save 4' after 8 s (exit 42)."""
    run_dir = tmp_path / "run"
    out = tmp_path / "out.txt"
    recs = run_trainer(
        [
            "model=k2_tiny",
            "train.iters=4",
            "train.save_interval=2",
            "train.eval_interval=0",
            "checkpoint.async_save=true",
            "checkpoint.save_at_end=false",
            f"run.hang_timeout_s={ALLOWANCE_S}",
        ],
        1,
        run_dir,
        script="fault_train.py",
        env={"K2_FAULT": "slow_write:2:0", "K2_SLOW_WRITE_S": str(SLOW_S)},
        stdout_to=out,
    )
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    text = out.read_text()
    assert "hang:" not in text
    seconds = {
        int(s): float(t) for s, t in re.findall(r"step (\d+): checkpoint \S+iter_\d+ \([^,]+, ([\d.]+) s\)", text)
    }
    assert set(seconds) == {2, 4}, text[-2000:]
    assert seconds[2] >= SLOW_S  # staging to commit: the slow write
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000004"
    assert not (run_dir / "requeue").exists()
    # the save of step 4 waited for the writer longer than the allowance: steps 3-4 took less than the rest
    assert SLOW_S - sum(r["step_time_s"] for r in recs[2:]) > ALLOWANCE_S + 2
