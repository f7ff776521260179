"""Shared fixtures: a one-rank megatron world (gloo) for unit tests of modules built by megatron."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def free_port() -> int:
    """An unused TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def megatron_world1():
    """torch.distributed (gloo, world 1) + megatron parallel_state with all sizes 1.

    Yields nothing; tears down at the end of the session.
    """
    import torch
    import torch.distributed as dist

    from parallel import cpu_backend

    cpu_backend.enable()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not dist.is_initialized():  # (no MASTER_* in os.environ: subprocess trainers must not inherit it)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)
    ps.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    yield
    ps.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def stdlib_corpus():
    """The embedded stdlib corpus at the default settings (built once into data_cache/, shared with
    the README's main job)."""
    from launcher.config import load_config
    from launcher.data import prepare_stdlib_corpus

    return prepare_stdlib_corpus(load_config([]).data, progress=False, verbose=False)


@pytest.fixture
def no_process_start(monkeypatch):
    """Records (instead of doing) any start of a process group, a training run or local ranks.

    Yields the list of what was attempted; a config error must leave it empty.
    """
    import torch.distributed as dist

    from launcher import train

    started: list[str] = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: started.append("pg"))
    monkeypatch.setattr(train, "run", lambda *a, **k: started.append("run"))
    monkeypatch.setattr(train, "_spawn_local", lambda *a, **k: started.append("spawn"))
    return started


@pytest.fixture(scope="session")
def three_step_runs(tmp_path_factory, stdlib_corpus):
    """``run(layout_overrides, nproc, decouple_wgrad)`` -> tests/distributed.py ``three_step_run``, each
    distinct run once per session (shared by the parallel-equivalence, MuonClip, grouped-experts, wgrad
    and activation-memory tests)."""
    from distributed import three_step_run

    root, cache = tmp_path_factory.mktemp("three_step_runs"), {}
    return lambda layout, nproc, decouple_wgrad: three_step_run(root, list(layout), nproc, decouple_wgrad, cache)
