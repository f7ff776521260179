"""What k2-train sets for the ranks' CUDA libraries (k2.launcher.training.cuda_env): the allocator
configuration k2-plan's reserved memory assumes, and run.deterministic."""

from __future__ import annotations

import os

import torch

from k2.config import load_config
from k2.launcher.training.cuda_env import apply_determinism, configure_cuda_env


def test_the_allocator_configuration_k2_plan_assumes_is_set_unless_the_job_sets_its_own():
    env = {}
    configure_cuda_env(load_config([]), env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    configure_cuda_env(load_config([]), env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    env = {}
    configure_cuda_env(load_config(["launch.cuda_alloc_conf=null", "run.deterministic=true"]), env)
    assert env == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def test_k2_train_sets_it_before_the_trainer_starts(monkeypatch, tmp_path):
    """The rank's environment when the trainer is entered (the trainer itself replaced): the allocator
    configuration is there before any CUDA allocation, and run.deterministic's torch settings are on."""
    from k2.launcher import train
    from k2.launcher.training import trainer
    from k2.parallel import distributed

    seen = {}

    def run(cfg, plan, env):
        seen.update(
            conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            det=torch.are_deterministic_algorithms_enabled(),
            warn=torch.is_deterministic_algorithms_warn_only_enabled(),
            bench=torch.backends.cudnn.benchmark,
        )
        return {}

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(trainer, "run", run)
    # (no process group is made here; another test's in this process must survive the teardown)
    monkeypatch.setattr(distributed, "destroy_distributed", lambda: None)
    try:
        assert train.main([f"run.dir={tmp_path / 'run'}", "run.deterministic=true", "run.wandb.mode=disabled"]) == 0
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    assert seen == {"conf": "expandable_segments:True", "det": True, "warn": True, "bench": False}


def test_determinism_is_off_by_default():
    before = torch.are_deterministic_algorithms_enabled()
    apply_determinism(load_config([]))
    assert torch.are_deterministic_algorithms_enabled() == before
