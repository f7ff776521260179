"""Whether a run keeps anything in host memory: the cheap test that decides if ``k2-train`` must plan host
memory (:func:`k2.launcher.planning.analysis.check_host_memory`) before its ranks start. Config only: no
model, no megatron-core (the planner's import of the model costs several CPU-seconds, which a run that
offloads nothing, or a bad setting, should not pay)."""

from __future__ import annotations


def offloads_anything(cfg, schedule) -> bool:
    """True when ``optim.offload_fraction`` > 0 or a running phase of ``schedule`` (its own ``memory.*``
    override, else the ``memory`` group) offloads an activation site."""
    if float(cfg.optim.offload_fraction) > 0:
        return True
    for phase in schedule.phases:
        if not phase.steps:
            continue
        mem = getattr(phase, "memory", None)
        if mem is None:
            mem = cfg.get("memory")
        if mem is not None and list(mem.get("offload") or []):
            return True
    return False
