"""Every test under tests/integration starts ranks, a sweep, Slurm or k2-train's own launcher: all are
marked ``slow`` (skip locally with ``-m 'not slow'``; CI runs them). Shared here: the one-node and the
two-node Slurm clusters of the files that submit jobs to one."""

import os

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-node Slurm on localhost (tests/support/slurm_local.py) for one test file, on ports no other
    test cluster on this machine holds (so files on different xdist workers, and other checkouts' suites,
    run theirs side by side). Where Slurm cannot start, the test fails naming the step that failed,
    unless ``K2_ALLOW_NO_SLURM=1`` (then it skips)."""
    from support.slurm_local import LocalSlurm, SlurmUnavailable

    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except SlurmUnavailable as e:
        if os.environ.get("K2_ALLOW_NO_SLURM") == "1":
            pytest.skip(f"Slurm cannot run here: {e}")
        raise
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A two-node Slurm cluster (tests/support/slurm_two_nodes.py) for one test file, with the first
    number no other test process on this machine holds: files on different workers, and other checkouts'
    suites, each get their own bridge, namespaces and ports at the same time. Skips where the kernel
    refuses network namespaces; checks that stopping it left nothing behind."""
    from support.slurm_two_nodes import NamespacesRefused, TwoNodeSlurm

    cluster = TwoNodeSlurm(tmp_path_factory.mktemp("slurm2"))
    try:
        cluster.start()
    except NamespacesRefused as e:
        pytest.skip(f"the kernel refuses network namespaces here: {e}")
    yield cluster
    cluster.stop()
    assert cluster.leftovers() == []
