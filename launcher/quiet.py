"""Filters for library messages that carry no action for a k2-launcher user, installed once per process.

Importing any part of ``k2.launcher`` installs them (``k2/launcher/__init__.py``), so they are in place
before megatron-core is first imported. What is dropped: a CPU run has no Apex / Transformer Engine by
design; megatron's experimental-API and deprecation notices; megatron asking for a rank before any
process group exists (``k2-plan`` never starts one); torch's distributed-checkpoint notices on every
resume; megatron log lines named below. Every other warning
is left as it is. This module imports nothing of k2-launcher.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence

__all__ = ["quiet_libraries", "ignore_library_warnings"]

_IGNORED_WARNINGS = (
    r"Apex is not installed",
    r".*Transformer Engine and Apex are not installed",
    r"MimoModelConfig is experimental",
    r"full scope is deprecated",
    # megatron's DistributedOptimizer.zero_grad reads .grad of its fp32 shard views, which are not
    # leaves ("throws grad-access warning", its own comment in distrib_optimizer.py); harmless
    r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
    # torch's own distributed checkpoint, used inside megatron's torch_dist format, warns about its
    # internal ShardedTensor use on every save/load
    r"Please use DTensor instead and we are deprecating ShardedTensor",
    # megatron-core's logging asks for the rank at import time, before any process group exists
    r"Could not determine rank from torch.distributed",
    # torch's distributed checkpoint on every resume: megatron reads the checkpoint's metadata without a
    # process group on purpose, and calls load() with positional arguments
    r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in a "
    r"single process",
    r"The argument order of load has been changed",
)

# logger name -> substrings of messages dropped from it
_DROPPED_LOG_MESSAGES = {
    "megatron.core.models.gpt.gpt_model": ("GPTModel IS DEPRECATED",),
    "megatron.core.distributed.distributed_data_parallel": ("full_param_layout not provided",),
    # logged on every synchronous save too (megatron wraps even a synchronous torch_dist save in its
    # async machinery); k2-launcher does not use megatron's async save
    "megatron.core.dist_checkpointing.strategies.torch": ("async save is deprecated",),
    # every run, at megatron's default (no rerun of suspicious steps, which k2-launcher does not use)
    "megatron.core.rerun_state_machine": ("RerunStateMachine initialized in mode RerunMode.DISABLED",),
}


class _DropMessages(logging.Filter):
    def __init__(self, needles: Sequence[str]):
        super().__init__()
        self.needles = tuple(needles)

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(n in record.getMessage() for n in self.needles)


_QUIET = False


def ignore_library_warnings() -> None:
    """Add the warning filters above to the current filter list (each call adds them again: for a
    context that replaced the process's filters, e.g. ``warnings.catch_warnings`` or a test runner)."""
    for msg in _IGNORED_WARNINGS:
        warnings.filterwarnings("ignore", message=msg)
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"megatron\..*")


def quiet_libraries() -> None:
    """Install the warning and log filters above (idempotent; once per process)."""
    global _QUIET
    if _QUIET:
        return
    ignore_library_warnings()
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    for name, needles in _DROPPED_LOG_MESSAGES.items():
        logging.getLogger(name).addFilter(_DropMessages(needles))
    _QUIET = True
