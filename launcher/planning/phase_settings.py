"""The memory settings each schedule phase runs with, and whether a run keeps anything in host memory:
config only (no model, no megatron-core), so that ``k2-train`` can decide before its ranks start whether
it must plan host memory (:func:`k2.launcher.planning.analysis.check_host_memory`) without paying the
planner's import of the model (several CPU-seconds) for a run that offloads nothing, or a bad setting."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from k2.config.schema import K2Config, MemoryConfig
    from k2.schedules.wsd import Phase


def memory_settings(cfg: K2Config) -> MemoryConfig:
    """The ``memory`` section of ``cfg``."""
    return cfg.memory


def phase_memory_settings(cfg: K2Config, phase: Phase) -> MemoryConfig | dict:
    """The ``memory.*`` settings ``phase`` runs with: its own (a schedule phase may override them, already
    resolved on :class:`k2.schedules.wsd.Phase` as a mapping of site lists), else ``cfg.memory``."""
    return phase.memory if phase.memory is not None else memory_settings(cfg)


def offloads_anything(cfg: K2Config, schedule) -> bool:
    """True when ``optim.offload_fraction`` > 0 or a running phase of ``schedule`` (:func:`phase_memory_settings`)
    offloads an activation site."""
    if float(cfg.optim.offload_fraction) > 0:
        return True
    for phase in schedule.phases:
        mem = phase_memory_settings(cfg, phase) if phase.steps else None
        if mem is not None and list(mem.get("offload") or []):
            return True
    return False
