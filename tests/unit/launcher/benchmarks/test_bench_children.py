"""The trainers a benchmark starts run as a user's ``k2-train`` would: in the repository root (so relative
settings such as ``data.cache_dir=data_cache`` name the checkout's folders, not ``launcher/``'s) and in an
environment without this process's place in a distributed job; and the registry imports a benchmark's
module only when that benchmark is looked up."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from k2.config.recipes import repo_root
from k2.parallel.processes import JOB_VARS, child_env
from support import REPO


@pytest.fixture
def in_a_job(monkeypatch):
    """This process as a rank of a Slurm job would see it."""
    for k in JOB_VARS:
        monkeypatch.setenv(k, "7")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("K2_TEST_KEPT", "yes")


def test_child_env_drops_the_job_and_keeps_the_rest(in_a_job):
    env = child_env(OMP_NUM_THREADS="1")
    assert not [k for k in env if k in JOB_VARS or k.startswith("SLURM_")]
    assert env["K2_TEST_KEPT"] == "yes" and env["OMP_NUM_THREADS"] == "1"


def test_repo_root_is_the_checkout():
    assert repo_root() == REPO and (repo_root() / "pyproject.toml").is_file()


class _Stop(Exception):
    pass


def _capture(calls: list):
    def run(cmd, **kwargs):
        calls.append(kwargs)
        raise _Stop  # the trainer is not started

    return run


@pytest.mark.parametrize(
    "module,call",
    [
        (
            "checkpoint",
            lambda m, tmp: m._run(
                {"moe_experts": 8, "moe_ffn": 64, "iters": 4, "save_interval": 2, "timeout": 1}, False, tmp
            ),
        ),
        (
            "pipeline",
            lambda m, tmp: m._run(
                {"parallel": "single", "model": "k2_tiny", "nproc": 1, "iters": 2, "timeout": 1}, False, tmp, cuda=False
            ),
        ),
    ],
)
def test_benchmark_trainers_run_in_the_repository_root(module, call, monkeypatch, tmp_path, in_a_job):
    import importlib

    mod = importlib.import_module(f"k2.launcher.benchmarks.{module}")
    calls: list = []
    monkeypatch.setattr(mod.subprocess, "run", _capture(calls))
    with pytest.raises(_Stop):
        call(mod, tmp_path)
    assert Path(calls[0]["cwd"]) == REPO
    assert not [k for k in calls[0]["env"] if k in JOB_VARS or k.startswith("SLURM_")]


def test_ep_overlap_trainers_run_in_the_repository_root(tmp_path, in_a_job):
    from k2.launcher.benchmarks import ep_overlap

    class Link:
        def run_pair(self, cmd, env, cwd, timeout):
            self.env, self.cwd = env, cwd
            raise _Stop

    link = Link()
    o = {
        "model": "k2_tiny",
        "num_layers": 2,
        "moe_ffn_hidden_size": 64,
        "micro_batch_size": 1,
        "global_batch_tokens": 512,
        "decouple_wgrad": False,
        "iters": 2,
        "timeout": 1,
    }
    with pytest.raises(_Stop):
        ep_overlap._train(link, o, tmp_path, False)
    assert Path(link.cwd) == REPO and not [k for k in link.env if k in JOB_VARS or k.startswith("SLURM_")]


def test_the_registry_imports_a_benchmark_only_when_looked_up():
    code = (
        "import sys; import k2.launcher.benchmarks.registry as r; "
        "print(sorted(m for m in sys.modules if m.startswith('k2.launcher.benchmarks.') "
        "and m.rsplit('.', 1)[1] in r.BENCHMARKS.values())); "
        "print(r.benchmark('checkpoint').__module__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "k2.launcher.benchmarks.checkpoint"], out.stdout + out.stderr
