"""What a rank's CUDA libraries read when they start, set by ``k2-train`` before any of them does.

* ``PYTORCH_CUDA_ALLOC_CONF`` from ``launch.cuda_alloc_conf`` (default ``expandable_segments:True``:
  segments grow in place instead of leaving gaps between fixed-size segments, the fragmentation
  ``k2-plan``'s ``plan.gpu_overheads.fragmentation`` assumes; PyTorch "CUDA semantics", memory
  management). torch's caching allocator parses it once, at the first CUDA allocation, so it is set in
  ``k2-train``'s own process before any rank starts (forked or launched ranks inherit it) and again in
  each rank (torchrun / srun start them with the job's environment). A value already in the environment
  wins: the job's own setting.
* ``run.deterministic``: ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS's condition for reproducible
  results, which torch's deterministic mode checks), torch's deterministic algorithms (``warn_only``: an op
  without a deterministic kernel warns instead of failing the run) and no cuDNN autotuning
  (:func:`apply_determinism`, in the rank).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from k2.config.schema import K2Config

__all__ = ["ALLOC_CONF_ENV", "apply_determinism", "configure_cuda_env"]

ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"


def configure_cuda_env(cfg: K2Config, environ: MutableMapping[str, str] | None = None) -> None:
    """Put the environment settings of the module docstring into ``environ`` (default ``os.environ``),
    keeping any value already there. Imports nothing heavy (k2-train's parent runs it)."""
    env = os.environ if environ is None else environ
    if cfg.launch.cuda_alloc_conf:
        env.setdefault(ALLOC_CONF_ENV, str(cfg.launch.cuda_alloc_conf))
    if cfg.run.deterministic:
        env.setdefault(CUBLAS_ENV, ":4096:8")


def apply_determinism(cfg: K2Config) -> None:
    """In a rank, before the model is built: ``run.deterministic``'s torch settings (module docstring);
    nothing when it is off."""
    if not cfg.run.deterministic:
        return
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
