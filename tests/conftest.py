"""Shared fixtures: a one-rank megatron world (gloo) for unit tests of modules built by megatron."""

from __future__ import annotations

import os

# one intra-op thread per test process (also under a bare `python -m pytest`; scripts/k2 test sets it
# too): xdist workers and trainer ranks outnumber the cores, and spinning OpenMP threads waste CPU
os.environ.setdefault("OMP_NUM_THREADS", "1")

import atexit
import shutil
import tempfile

# The processes the tests start get a temp dir of this session's, removed when it ends: wandb makes two
# temp dirs in every process that imports it (media, artifacts), which a rank killed by a test's signal
# or leaving by os._exit never removes. (gettempdir first: pytest's own base temp dir stays where it was.)
tempfile.gettempdir()
_CHILDREN_TMP = tempfile.mkdtemp(prefix="k2-tests-")
os.environ["TMPDIR"] = _CHILDREN_TMP
atexit.register(shutil.rmtree, _CHILDREN_TMP, True)

import gc  # noqa: E402

import pytest  # noqa: E402

# Garbage collection in a test process: the imports (torch, megatron-core, transformers) and the tests'
# models leave ~300k+ long-lived objects that every full collection rescans (~0.2 s each; ~10% of the
# CPU of the unit tests measured on a 2-core EPYC). A young collection every 10,000 allocations instead
# of 700 (cyclic garbage still goes, a little later) and what is alive after collection frozen
# (pytest_collection_finish) halve that.
gc.set_threshold(10_000, 10, 10)

import k2.parallel  # noqa: E402,F401 (before any test module imports megatron-core: k2.parallel.eager_fusions)
from support import REPO, free_port  # noqa: E402

# The multi-process files that take longest, heaviest first (seconds on 2 CPU cores, summed over the
# file's tests). With `--dist loadfile --no-loadscope-reorder` the xdist workers take whole files in
# this order, so the long ones start first and the short unit files fill the gaps at the end (longest
# processing time first); without the ordering a long file started last decides the wall time.
_HEAVY_FIRST = {  # (measured in a whole-suite run on 3 workers, machine load ~8)
    # (2026-12-07, 4 workers: the grid and requeue tests 198 + 239 s; the grid's jobs forked by the fork server)
    "tests/integration/test_slurm_real.py": 440,
    # one test: 80 one-rank steps of k2_tiny (151-334 s in whole-suite runs); unlisted, it started last
    "tests/integration/test_expert_balance.py": 330,
    "tests/integration/test_slurm_two_nodes.py": 510,  # a 2-node Slurm job through two faults + a 4-rank reference
    "tests/integration/test_checkpoint.py": 330,  # (alone: 148 CPU-s, 120-150 s wall on a loaded Xeon)
    # 4 runs of 3 steps (cpu4 and PP1 x EP2 x DP2, the overlap on and off) + a one-step resume (alone: 55
    # CPU-s on a loaded Xeon; unlisted, it started after every listed file)
    "tests/integration/test_ep_overlap.py": 150,
    "tests/integration/test_hang_progress.py": 80,  # (alone: 18 CPU-s, 71 s wall: mostly waiting)
    "tests/integration/test_preemption_cli.py": 265,
    "tests/integration/test_slurm_two_nodes_timeouts.py": 260,  # two Slurm jobs, mostly waiting on timeouts
    "tests/integration/test_hang_watchdog.py": 170,  # three cpu4 launches of k2-train, each ends in a 15 s hang
    "tests/integration/test_interrupt_cli.py": 75,  # Ctrl-C to a pp2 k2-train, a rerun and a reference
    "tests/integration/test_background_writer_faults.py": 113,  # killed, stopped and full-disk writers
    # TINY=1 gpu_session.sh: its steps forked by the fork server (alone: 68 CPU-s, 170 s wall on a loaded Xeon)
    "tests/integration/test_gpu_session.py": 80,
    "tests/integration/test_sweep.py": 155,
    "tests/integration/test_bench_runs.py": 150,
    "tests/unit/launcher/planning/test_memory_plan.py": 150,  # 24 single-rank meter runs + a 4-rank state-bytes build
    "tests/integration/test_phase_data.py": 145,
    "tests/integration/test_pipeline_wgrad.py": 145,
    "tests/integration/test_train_run.py": 125,
    "tests/integration/test_schedule_run.py": 115,
    "tests/integration/test_activation_plan_measured.py": 115,  # one cpu4 launch, 9 builds + steps
    "tests/unit/launcher/benchmarks/test_bench.py": 108,
    "tests/integration/test_muonclip_parallel.py": 107,
    "tests/integration/test_hf_convert_runs.py": 105,
    "tests/integration/test_memory_train.py": 105,
    "tests/unit/launcher/planning/test_plan.py": 87,
    "tests/unit/launcher/datasets/test_data.py": 78,
    "tests/unit/launcher/hf/test_hf_convert.py": 68,  # + an import in a child process
    "tests/unit/config/test_validate.py": 63,
    "tests/integration/test_background_write_watchdog.py": 50,  # one 1-rank run waiting 24 s on a slow writer
    "tests/integration/test_spike_guard.py": 35,  # one cpu4 run of 4 steps, a checkpoint per step
    "tests/integration/test_checkpoint_integrity.py": 38,
    "tests/integration/test_resume_rng_context.py": 35,
    "tests/integration/test_startup_signal.py": 20,
    "tests/unit/launcher/datasets/test_prepare_corpus.py": 40,
    "tests/unit/schedules/test_trace_plot.py": 12,
}


@pytest.fixture(autouse=True)
def _library_warning_filters():
    """pytest records every warning of a test under its own filters; the product's filters for
    library messages that need no action apply inside tests too, so the summary lists only the rest."""
    from k2.launcher.quiet import ignore_library_warnings

    ignore_library_warnings()


def pytest_collection_modifyitems(config, items):
    """Runs the heaviest test files first (stable: every other file keeps its collection order)."""
    items.sort(key=lambda item: -_HEAVY_FIRST.get(item.nodeid.split("::")[0], 0))


def pytest_collection_finish(session):
    """Freeze what the collection imported (modules, test items: alive for the whole session) out of the
    garbage collector's scans (``gc.freeze``)."""
    gc.collect()
    gc.freeze()


def _start_fork_server(path: str):
    """Start tests/support/zygote.py serving on the Unix socket ``path``; returns its ``Popen`` once it
    listens. Raises RuntimeError when it does not start within 120 s."""
    import subprocess
    import sys
    import time

    from support.distributed import SUPPORT, trainer_env

    proc = subprocess.Popen(
        [sys.executable, str(SUPPORT / "zygote.py"), path],
        cwd=REPO,
        env=trainer_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    ready = proc.stdout.readline().strip() == "ready"
    while ready and not os.path.exists(path) and time.time() < deadline:
        time.sleep(0.05)
    if not ready or proc.poll() is not None:
        raise RuntimeError("the tests' fork server did not start (tests/support/zygote.py)")
    return proc


def _stop_fork_server(proc) -> None:
    import subprocess

    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _wants_fork_server() -> bool:
    return os.environ.get("K2_TEST_LAUNCHER", "server") == "server"


def pytest_configure(config):
    """Under xdist, the controller starts one fork server for all its workers (they inherit its socket
    through ``K2_TEST_FORK_SERVER``): one import of torch and megatron-core (~7.5 CPU-s) for the session
    instead of one per worker. It serves its clients concurrently (a fork per launch)."""
    from support.distributed import FORK_SERVER_ENV

    is_controller = not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None)
    if not is_controller or not _wants_fork_server() or os.environ.get(FORK_SERVER_ENV):
        return
    path = os.path.join(tempfile.mkdtemp(prefix="fork-server-", dir=_CHILDREN_TMP), "socket")
    config._k2_fork_server = _start_fork_server(path)
    os.environ[FORK_SERVER_ENV] = path  # (before the workers start: they inherit it)


def pytest_unconfigure(config):
    from support.distributed import FORK_SERVER_ENV

    proc = getattr(config, "_k2_fork_server", None)
    if proc is not None:
        os.environ.pop(FORK_SERVER_ENV, None)
        _stop_fork_server(proc)


@pytest.fixture(scope="session", autouse=True)
def fork_server(tmp_path_factory):
    """The session's fork server (tests/support/zygote.py): trainer launches of tests/support/distributed.py
    go through it. Under xdist the controller's (``pytest_configure``); else started here and stopped at
    the end of the session. Skipped with ``K2_TEST_LAUNCHER=fork|torchrun``."""
    from support.distributed import FORK_SERVER_ENV

    if not _wants_fork_server():
        yield None
        return
    if os.environ.get(FORK_SERVER_ENV):  # the xdist controller's
        yield os.environ[FORK_SERVER_ENV]
        return
    path = str(tmp_path_factory.mktemp("fork_server") / "socket")
    proc = _start_fork_server(path)
    os.environ[FORK_SERVER_ENV] = path
    try:
        yield path
    finally:
        os.environ.pop(FORK_SERVER_ENV, None)
        _stop_fork_server(proc)


@pytest.fixture(scope="session")
def megatron_world1():
    """torch.distributed (gloo, world 1) + megatron parallel_state with all sizes 1.

    Yields nothing; tears down at the end of the session.
    """
    import torch
    import torch.distributed as dist

    from k2.parallel import cpu_backend

    cpu_backend.enable()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not dist.is_initialized():  # (no MASTER_* in os.environ: subprocess trainers must not inherit it)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
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
    from k2.config.load import load_config
    from k2.launcher.datasets.corpus import prepare_stdlib_corpus

    return prepare_stdlib_corpus(load_config([]).data, progress=False, verbose=False)


@pytest.fixture
def no_process_start(monkeypatch):
    """Records (instead of doing) any start of a process group, a training run or local ranks.

    Yields the list of what was attempted; a config error must leave it empty.
    """
    import torch.distributed as dist

    from k2.launcher.training import launch, trainer

    started: list[str] = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: started.append("pg"))
    monkeypatch.setattr(trainer, "run", lambda *a, **k: started.append("run"))
    # (k2.launcher.train imports it when it runs: its --help does not wait for torch)
    monkeypatch.setattr(launch, "spawn_local_ranks", lambda *a, **k: started.append("spawn"))
    return started


@pytest.fixture(scope="session")
def three_step_runs(tmp_path_factory, stdlib_corpus):
    """``run(layout_overrides, nproc, decouple_wgrad)`` -> tests/support/distributed.py ``three_step_run``, each
    distinct run once per session (shared by the parallel-equivalence, MuonClip, grouped-experts, wgrad
    and activation-memory tests)."""
    from support.distributed import three_step_run

    # (the base temp dir's parent is shared by all xdist workers of the session)
    shared = tmp_path_factory.getbasetemp()
    shared = shared.parent if shared.name.startswith("popen-gw") else shared
    root, cache = shared / "three_step_runs", {}
    return lambda layout, nproc, decouple_wgrad: three_step_run(root, list(layout), nproc, decouple_wgrad, cache)
