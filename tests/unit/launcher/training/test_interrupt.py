"""Ctrl-C and torn records without a trainer (k2.launcher.training.preemption, launch, metrics): the
first SIGINT is a stop request like SIGTERM's but with its own reason, marker and exit status, repeated
deliveries of one press are one request, a second press at the top of the run stops every process at
once in one line; what a stop keeps is said as it is; a record cut by a kill is moved aside before a
start appends after it. The whole runs: tests/integration/test_interrupt_cli.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from k2.launcher.training import preemption as PR
from k2.launcher.training.metrics import set_aside_torn_records


def _checkpoint(run_dir: Path, step: int) -> None:
    """A checkpoint directory ``latest`` names, complete as far as :func:`kept_note` reads it."""
    from k2.launcher.checkpointing.manifest import file_entries, write_manifest

    d = run_dir / "checkpoints" / f"iter_{step:07d}"
    d.mkdir(parents=True)
    for name in ("metadata.json", ".metadata"):
        (d / name).write_text("{}")
    (d / "k2_state.json").write_text(json.dumps({"step": step, "manifest": True}))
    write_manifest(d, file_entries(d, ["metadata.json", ".metadata", "k2_state.json"]))
    (run_dir / "checkpoints" / "latest").write_text(d.name + "\n")


def test_kept_note_says_what_a_stop_keeps(tmp_path):
    assert PR.kept_note(tmp_path) == "no checkpoint exists yet: the next start begins at step 1"
    _checkpoint(tmp_path, 10)
    (tmp_path / "checkpoints" / "iter_0000020.partial").mkdir()
    note = PR.kept_note(tmp_path)
    assert note.startswith(f"kept: {tmp_path / 'checkpoints' / 'iter_0000010'} (step 10): the next start resumes")
    assert note.endswith("iter_0000020.partial is an unfinished save (removed by the next start)")


def test_the_first_sigint_asks_for_a_stop_once_with_its_own_reason(tmp_path, monkeypatch):
    import k2.parallel.distributed as D

    monkeypatch.setattr(D, "all_reduce_int", lambda value, op: value)
    seen: list[str] = []
    p = PR.Preemption(on_signal=seen.append, run_dir=tmp_path, top=False).install()
    try:
        for _ in range(3):  # one press, delivered by the terminal and passed on by two launchers
            os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
    finally:
        p.uninstall()
    assert seen == ["SIGINT"] and p.local_request() == 3
    assert p.agreed() and p.reason == "interrupt" and p.why == "interrupted: Ctrl-C (SIGINT)"
    p.leave_marker(tmp_path, 7)
    assert (tmp_path / PR.INTERRUPT_MARKER).read_text() == "7\n" and not (tmp_path / PR.REQUEUE_MARKER).exists()
    note = p.notice("SIGINT", "step 7")
    assert "saving a checkpoint at the end of step 7" in note and f"status {PR.INTERRUPT_EXIT}" in note
    assert "Ctrl-C again stops at once" in note and "no checkpoint exists yet" in note
    assert "resumes from its last checkpoint" not in note


def test_a_ctrl_c_wins_over_a_preemption_signal(monkeypatch):
    import k2.parallel.distributed as D

    monkeypatch.setattr(D, "all_reduce_int", lambda value, op: max(value, 1))  # another rank got SIGTERM
    p = PR.Preemption()
    p.interrupted = True
    assert p.agreed() and p.reason == "interrupt"


_TOP = r"""
import os, signal, subprocess, sys, time
from k2.launcher.training.preemption import Preemption
run_dir = sys.argv[1]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # (a checkpoint writer)
p = Preemption(run_dir=run_dir, top=True, on_signal=lambda n: print("first", n, flush=True)).install()
print("ready", child.pid, flush=True)
time.sleep(60)
"""


def test_a_second_ctrl_c_at_the_top_stops_every_process_at_once_in_one_line(tmp_path):
    p = subprocess.Popen(
        [sys.executable, "-c", _TOP, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        ready = p.stdout.readline().split()
        assert ready[0] == "ready", ready
        child = int(ready[1])
        p.send_signal(signal.SIGINT)
        assert p.stdout.readline().strip() == "first SIGINT"
        t0 = time.time()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == PR.INTERRUPT_EXIT and time.time() - t0 < 10
    assert err.strip().splitlines() == [
        "k2-train: Ctrl-C again: stopped at once (SIGKILL to 1 processes); the step in progress is not saved; "
        "no checkpoint exists yet: the next start begins at step 1"
    ], err
    assert not Path(f"/proc/{child}").exists() or Path(f"/proc/{child}/stat").read_text().split()[2] == "Z"


def test_the_launcher_passes_the_first_ctrl_c_on_and_stops_everything_on_the_second(tmp_path):
    """k2-train's own launcher (forwarding_signals): the first SIGINT goes to its child, the second is the
    hard stop (run in a helper process: the hard stop exits the process it runs in)."""
    code = (
        "import os, signal, subprocess, sys, time\n"
        "from k2.launcher.training.launch import forwarding_signals\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal, time\\n"
        'signal.signal(signal.SIGINT, lambda *a: print("child got SIGINT", flush=True))\\n'
        'print("child ready", flush=True); time.sleep(60)\'])\n'
        f"with forwarding_signals(child, to_workers=True, run_dir={str(tmp_path)!r}):\n"
        "    child.wait()\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "child ready"
        p.send_signal(signal.SIGINT)
        assert p.stdout.readline().strip() == "child got SIGINT"
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == PR.INTERRUPT_EXIT, err
    assert len(err.strip().splitlines()) == 1 and "Ctrl-C again: stopped at once (SIGKILL to 1 processes)" in err


def test_a_torn_last_record_is_moved_aside_so_the_file_parses_line_by_line(tmp_path):
    records = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2, 3)]
    torn = '{"step": 4, "loss": 0.2'
    (tmp_path / "metrics.jsonl").write_text("\n".join(records) + "\n" + torn)
    # an earlier start that appended after such a text left it between records, in the other file
    (tmp_path / "metrics.replayed.jsonl").write_text(records[0] + "\n" + torn + records[1] + "\n" + records[2])
    notes = set_aside_torn_records(tmp_path)
    assert len(notes) == 2 and "moved to metrics.jsonl.torn" in notes[0] and f"{len(torn)} bytes" in notes[0]
    assert [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        json.loads(r) for r in records
    ]
    assert (tmp_path / "metrics.jsonl.torn").read_text() == torn + "\n"
    replayed = (tmp_path / "metrics.replayed.jsonl").read_text()
    assert replayed.endswith("\n") and [json.loads(x)["step"] for x in replayed.splitlines()] == [1, 3]
    assert set_aside_torn_records(tmp_path) == []  # intact files are left alone


def test_ctrl_c_outside_a_tools_own_handling_is_one_line_and_130(capsys):
    from k2.launcher.cli import run_main

    def body(_args):
        raise KeyboardInterrupt

    assert run_main("k2-plan", body, []) == 130
    assert capsys.readouterr().err == "k2-plan: interrupted (Ctrl-C)\n"
