"""The test suite's local Slurm helper (tests/support/slurm_local.py) without starting Slurm: each cluster
claims ports no other test cluster on this machine holds, and stops only the munged it started (its own).
"""

from __future__ import annotations

import signal
import socket
import subprocess

import pytest


@pytest.fixture
def sl(tmp_path, monkeypatch):
    import support.slurm_local as sl

    monkeypatch.setattr(sl, "LOCK_DIR", tmp_path)
    return sl


def test_a_slot_is_held_until_released_and_a_slot_whose_ports_are_busy_is_skipped(sl):
    a, lock_a = sl.claim_slot("t", lambda i: True)
    b, lock_b = sl.claim_slot("t", lambda i: i != 1)  # slot 0 held by a, slot 1's ports busy
    assert (a, b) == (0, 2)
    sl.release_slot(lock_a)
    c, lock_c = sl.claim_slot("t", lambda i: True)
    assert c == 0
    with pytest.raises(sl.SlurmUnavailable, match="all 3 t test-cluster slots are taken"):
        sl.claim_slot("t", lambda i: i != 1, slots=3)
    for lock in (lock_b, lock_c):
        sl.release_slot(lock)


def test_two_clusters_get_different_ports_and_a_listened_port_is_not_free(sl, monkeypatch, tmp_path):
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        assert not sl.port_free(s.getsockname()[1])
    busy = {sl.FIRST_PORT + 1}  # something else listens on the first pair's slurmd port
    monkeypatch.setattr(sl, "port_free", lambda port: port not in busy)
    a, b = sl.LocalSlurm(tmp_path / "a"), sl.LocalSlurm(tmp_path / "b")
    a._claim_ports()
    b._claim_ports()
    assert a.ports == (sl.FIRST_PORT + 2, sl.FIRST_PORT + 3) and b.ports == (sl.FIRST_PORT + 4, sl.FIRST_PORT + 5)
    a.stop(timeout=1)  # gives its ports back
    a._claim_ports()
    assert a.ports == (sl.FIRST_PORT + 2, sl.FIRST_PORT + 3)
    a.stop(timeout=1)
    b.stop(timeout=1)


def test_stop_ends_the_clusters_own_munged_and_removes_its_directory(sl, tmp_path):
    cluster = sl.LocalSlurm(tmp_path / "c")
    assert cluster.env["MUNGE_SOCKET"] == str(cluster.munge_dir / "munge.socket")
    cluster.munge_dir = tmp_path / "munge"  # (not /run: nothing of the machine's)
    cluster.munge_dir.mkdir()
    sleeper = subprocess.Popen(["sleep", "60"])
    (cluster.munge_dir / "munged.pid").write_text(f"{sleeper.pid}\n")
    try:
        cluster.stop(timeout=5)
        assert sleeper.wait(timeout=5) == -signal.SIGTERM
        assert not cluster.munge_dir.exists()
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
