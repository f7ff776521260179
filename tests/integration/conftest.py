"""Every test under tests/integration starts ranks, a sweep, Slurm or k2-train's own launcher: all are
marked ``slow`` (skip locally with ``-m 'not slow'``; CI runs them)."""

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.slow)
