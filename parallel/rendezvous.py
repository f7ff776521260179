"""The rendezvous of a multi-node job: every rank meets at ``MASTER_ADDR:MASTER_PORT`` within
``launch.rendezvous_timeout_s``, or every rank that came stops with one error naming the ranks and the
nodes that did not.

torch's own ``env://`` rendezvous waits the process group's timeout and then says only how many ranks
joined ("Timed out ... waiting for clients. 2/4 clients joined"), not which node is missing. Here rank 0
starts torch's ``TCPStore`` (the same store ``env://`` would create; it is then handed to
``init_process_group``; under torchrun every rank uses its agent's store instead), every rank writes its
node name under ``k2/rendezvous/<restart>/<rank>`` and waits for all
the others' keys. On a timeout the ranks that joined know who they are, and the job's node list
(``SLURM_JOB_NODELIST``, expanded as Slurm does) says which nodes never showed up.

Local ranks forked by k2-train's own launcher (:mod:`k2.launcher.training.fork_ranks`) get the store's
listening socket from it, already bound to ``MASTER_PORT`` (its descriptor in ``$K2_MASTER_LISTEN_FD``):
a port chosen free and released before rank 0 binds it again can be taken in between by another launch on
the same machine (two runs of a sweep, a test suite's workers), and a rank then connects to a stranger's
socket and fails at start-up.
"""

from __future__ import annotations

import datetime
import os
import socket
import time

from k2.parallel.hostlist import expand_hostlist

__all__ = ["LISTEN_FD_ENV", "RendezvousTimeout", "node_name", "rendezvous"]

#: the descriptor of the listening socket the local launcher bound for rank 0's store (module docstring)
LISTEN_FD_ENV = "K2_MASTER_LISTEN_FD"

_KEY = "k2/rendezvous/"


class RendezvousTimeout(RuntimeError):
    """Not every rank reached the rendezvous in time; the message names the missing ranks and nodes."""


def node_name() -> str:
    """This rank's node: Slurm's ``SLURMD_NODENAME`` when set, else the short hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def _missing_nodes(joined: dict[int, str]) -> str:
    """The part of the message that names the nodes: those of the job's node list not heard from."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return ""
    try:
        expected = expand_hostlist(nodelist)
    except ValueError:
        return f"; the job's nodes: {nodelist}"
    silent = [h for h in expected if h not in set(joined.values())]
    return f"; nodes of SLURM_JOB_NODELIST={nodelist} with no rank at the rendezvous: {', '.join(silent) or 'none'}"


def _who_came(store, key: str, rank: int, world_size: int, where: str, timeout_s: float) -> str:
    """The message of a rendezvous that timed out: the ranks and nodes that came and those that did not.
    Rank 0 (the store's server) lingers a moment first, so that the others can still read the store."""
    try:
        joined = {r: store.get(f"{key}{r}").decode() for r in range(world_size) if store.check([f"{key}{r}"])}
    except (RuntimeError, OSError):  # rank 0 stopped first and took its store with it
        joined, where = {rank: node_name()}, where + "(rank 0's store is gone; this rank's view) "
    if rank == 0:
        time.sleep(3.0)
    missing = [r for r in range(world_size) if r not in joined]
    by_node: dict[str, list[int]] = {}
    for r, h in sorted(joined.items()):
        by_node.setdefault(h, []).append(r)
    present = "; ".join(f"{h}: ranks {', '.join(map(str, rs))}" for h, rs in by_node.items())
    return (
        f"{where}{len(joined)} of {world_size} ranks arrived within {timeout_s:g} s "
        f"(launch.rendezvous_timeout_s); missing ranks {', '.join(map(str, missing))}; arrived: {present}"
        f"{_missing_nodes(joined)}"
    )


def _all_arrived(store, keys: list[str], where: str, rank: int) -> bool:
    """Whether every rank's key is in the store. Rank 0 counts its timeout from its own arrival, so a rank
    that came later can still be waiting when rank 0 has reported who came and stopped, taking its store
    with it: that is this rank's end too, in one line (torch raises DistNetworkError, a RuntimeError).

    Raises:
        RendezvousTimeout: the store is gone.
    """
    try:
        return store.check(keys)
    except (RuntimeError, OSError) as e:
        raise RendezvousTimeout(
            f"{where}: rank {rank} on {node_name()}: rank 0's store closed while this rank waited for the "
            f"others (rank 0 reached its launch.rendezvous_timeout_s first and reported who came; "
            f"{str(e).splitlines()[0]})"
        ) from None


def _inherited_listen_fd(is_master: bool) -> int | None:
    """The store's listening socket inherited from the local launcher (module docstring) for rank 0; the
    other ranks close their copy. The variable is removed, so that no process this one starts sees it."""
    fd = os.environ.pop(LISTEN_FD_ENV, None)
    if fd is None:
        return None
    if is_master:
        return int(fd)
    os.close(int(fd))
    return None


def rendezvous(rank: int, world_size: int, timeout_s: float, collective_timeout_s: float):
    """Meet every rank at ``MASTER_ADDR:MASTER_PORT`` (module docstring).

    Args:
        rank, world_size: this process's global rank and the job's number of ranks.
        timeout_s: seconds to wait for every rank (``launch.rendezvous_timeout_s``), counted from this
            rank's arrival; rank 0's node being late is waited for as long.
        collective_timeout_s: the store's timeout afterwards (the process group's own timeout: gloo
            exchanges its addresses and megatron creates its groups through this store).

    Returns:
        the ``torch.distributed.TCPStore`` for ``init_process_group(store=...)``.

    Raises:
        RendezvousTimeout: rank 0 could not be reached, or some rank did not arrive, within ``timeout_s``,
            or rank 0's store closed while this rank waited (rank 0 timed out first); the message names
            ``MASTER_ADDR:MASTER_PORT``, the ranks and nodes that joined and those that did not.
    """
    import torch.distributed as dist

    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    where = f"rendezvous at MASTER_ADDR:MASTER_PORT={addr}:{port}"
    limit = datetime.timedelta(seconds=timeout_s)
    start = time.monotonic()
    # under torchrun its agent already serves a store at MASTER_PORT: every rank is a client of it (as in
    # torch's env:// rendezvous), and the keys carry the agent's restart count
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    key = f"{_KEY}{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    is_master = rank == 0 and not agent_store
    listen_fd = _inherited_listen_fd(is_master)
    try:
        store = dist.TCPStore(
            addr,
            port,
            world_size,
            is_master=is_master,
            timeout=limit,
            wait_for_workers=False,
            master_listen_fd=listen_fd,
        )
    except (RuntimeError, OSError) as e:  # (torch's DistStoreError is a RuntimeError)
        raise RendezvousTimeout(
            f"{where}: rank {rank} on {node_name()} could not reach rank 0's store within {timeout_s:g} s "
            f"(launch.rendezvous_timeout_s): is the node {addr} up? ({str(e).splitlines()[0]})"
            f"{_missing_nodes({rank: node_name()})}"
        ) from None
    store.set(f"{key}{rank}", node_name())
    # polled, not store.wait(timeout): a timed-out wait leaves the client's connection unusable, and the
    # store is still needed to say who came
    keys = [f"{key}{r}" for r in range(world_size)]
    while not _all_arrived(store, keys, where, rank):
        if time.monotonic() - start >= timeout_s:
            raise RendezvousTimeout(_who_came(store, key, rank, world_size, f"{where}: ", timeout_s))
        time.sleep(0.2)
    store.set_timeout(datetime.timedelta(seconds=collective_timeout_s))
    return store
