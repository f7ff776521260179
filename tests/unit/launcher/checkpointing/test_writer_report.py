"""The report of a background checkpoint writer (a forked process) reaches its rank through a pipe: once the
writer has exited, the rank reads what it sent to the end and learns at once whether a report came. A
writer killed before reporting costs no wait: the hang watchdog's allowance (``run.hang_timeout_s``, a
few seconds in tests) must not be spent waiting for a report that cannot come."""

import multiprocessing as mp
import os
import signal
import time

import pytest

from k2.launcher.checkpointing.background import CheckpointWriterDied, PipeChannel, _writer_outcome


def _writer(report: PipeChannel, how: str) -> None:
    if how == "report":
        report.put({f"__0_{i}.distcp": {"sha256": "0" * 64, "bytes": i} for i in range(20_000)})  # > a pipe's 64 KiB
    elif how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)


def _run_writer(how: str):
    report = PipeChannel()
    proc = mp.get_context("fork").Process(target=_writer, args=(report, how))
    proc.start()
    proc.join(timeout=60)
    assert proc.exitcode is not None
    return report, proc


@pytest.mark.parametrize(
    "how,says", [("sigkill", "was killed by SIGKILL (kill -9"), ("silent", "exited with status 0 without reporting")]
)
def test_a_writer_gone_without_a_report_is_named_without_waiting(how, says):
    report, proc = _run_writer(how)
    t0 = time.perf_counter()
    with pytest.raises(CheckpointWriterDied, match=r"its background writer \(pid \d+\) " + says.replace("(", r"\(")):
        _writer_outcome(report, proc)
    assert time.perf_counter() - t0 < 0.5
    report.close()


def test_a_report_larger_than_the_pipe_arrives_whole():
    report, proc = _run_writer("report")
    entries = _writer_outcome(report, proc)
    assert len(entries) == 20_000 and entries["__0_19999.distcp"]["bytes"] == 19_999
    report.close()
