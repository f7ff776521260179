"""The rendezvous of a launched job (k2.parallel.rendezvous), in one process: each rank a thread with its
own TCPStore connection on a free local port."""

from __future__ import annotations

import threading
import time

import pytest

from k2.parallel.rendezvous import RendezvousTimeout, rendezvous
from support import free_port


def _meet(world: int, ranks, timeout_s: float, late: dict | None = None) -> dict:
    """Run ``rendezvous`` for ``ranks`` of a ``world``-rank job in threads (rank r starting ``late[r]`` s
    late); returns ``{rank: store or exception}``."""
    out = {}

    def one(rank):
        time.sleep((late or {}).get(rank, 0))
        try:
            out[rank] = rendezvous(rank, world, timeout_s, collective_timeout_s=30)
        except RendezvousTimeout as e:
            out[rank] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.fixture
def master(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("SLURM_JOB_NODELIST", "k2node[1-2]")
    monkeypatch.setenv("SLURMD_NODENAME", "k2node1")


def test_a_late_rank_within_the_timeout_is_waited_for(master):
    out = _meet(2, [0, 1], timeout_s=20, late={1: 2.0})
    assert not any(isinstance(v, Exception) for v in out.values()), out
    out[0].set("x", "1")  # one store: what rank 0 writes, rank 1 reads
    assert out[1].get("x") == b"1"


def test_a_missing_node_is_named(master):
    t0 = time.monotonic()
    out = _meet(3, [0, 1], timeout_s=2)  # rank 2 (on k2node2) never comes
    assert time.monotonic() - t0 < 15
    for rank in (0, 1):
        msg = str(out[rank])
        assert isinstance(out[rank], RendezvousTimeout), out
        assert "2 of 3 ranks arrived within 2 s (launch.rendezvous_timeout_s); missing ranks 2" in msg, msg
        assert "k2node1: ranks 0, 1" in msg and "no rank at the rendezvous: k2node2" in msg, msg


def test_an_unreachable_rank_0_is_named(master):
    out = _meet(2, [1], timeout_s=2)
    msg = str(out[1])
    assert isinstance(out[1], RendezvousTimeout) and "could not reach rank 0's store within 2 s" in msg, msg
    assert "is the node 127.0.0.1 up?" in msg, msg


def test_a_rank_whose_rank_0_timed_out_first_stops_in_one_line(master, monkeypatch):
    """Rank 0 counts its timeout from its own arrival: a rank that came more than rank 0's linger later was
    still polling when rank 0 reported and stopped, and torch's DistNetworkError from the closed store
    ended it with a traceback (seen in a two-node Slurm run). It is a RendezvousTimeout now."""
    import torch.distributed as dist

    class ClosedStore:  # (rank 0's server stopped after this rank set its key)
        def __init__(self, *a, **k):
            pass

        def set(self, *a):
            pass

        def check(self, keys):
            raise dist.DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed.")

    monkeypatch.setattr(dist, "TCPStore", ClosedStore)
    with pytest.raises(RendezvousTimeout, match="rank 0's store closed while this rank waited") as e:
        rendezvous(1, 2, timeout_s=20, collective_timeout_s=30)
    assert "MASTER_ADDR:MASTER_PORT=127.0.0.1:" in str(e.value) and "\n" not in str(e.value)
