"""Activation memory per schedule phase in ``k2-train``: which ``memory.*`` changes the trainer makes at a
phase boundary, without a restart, and the check that refuses the others before any rank starts.

A schedule phase may override ``memory.*`` (``schedule.phases.<i>.memory``, resolved on
:class:`k2.schedules.wsd.Phase`). ``k2-plan`` plans every such setting. The trainer switches whole-layer
recompute (``memory.recompute`` site ``layer``, an attribute each layer reads per forward:
:func:`k2.model.activation_memory.set_layer_recompute`), which is what K2's 32K anneal adds. The other sites
are built into the layers' hooks and megatron's ``TransformerConfig`` when the model is built, so a phase
that changes them is refused up front (naming the phase setting) rather than silently ignored.
"""

from __future__ import annotations

from k2.config.errors import ConfigError

__all__ = ["apply_phase_memory", "check_phase_memory_switches"]

#: the memory.* change k2-train makes at a phase boundary
SWITCHABLE = {"recompute": ("layer",)}


def _fixed(memory: dict) -> dict:
    return {k: sorted(set(v) - set(SWITCHABLE.get(k, ()))) for k, v in memory.items()}


def check_phase_memory_switches(schedule, memory_cfg) -> None:
    """Every phase that runs a step uses the ``memory`` group's settings (``memory_cfg``, which the model
    is built with) up to the sites the trainer switches (:data:`SWITCHABLE`).

    Raises:
        ConfigError: a phase override that changes another site, naming ``schedule.phases.<i>.memory.<key>``.
    """
    base = {k: list((memory_cfg[k] if memory_cfg is not None else None) or []) for k in ("fp8_store", "recompute",
                                                                                       "offload")}
    fixed = _fixed(base)
    for p in schedule.phases:
        if not p.steps or p.memory is None:
            continue
        now = _fixed(p.memory)
        for key in now:
            if now[key] != fixed[key]:
                raise ConfigError(
                    f"schedule.phases.{p.index}.memory.{key}={p.memory[key]} (phase '{p.name}') changes "
                    f"memory.{key}={base[key]}; k2-train switches at a phase boundary only memory.recompute "
                    "site layer (allowed: add or drop 'layer'; set the other sites in the memory group for "
                    "the whole run)")


def apply_phase_memory(chunks: list, phase) -> None:
    """Set whole-layer recompute on every transformer layer of ``chunks`` as ``phase`` asks."""
    # imported here: k2-train's parent process runs the check above before any rank starts and must not
    # pay the model's import of torch and megatron-core for it
    from k2.model.activation_memory import set_layer_recompute

    if phase.memory is not None:
        set_layer_recompute(chunks, "layer" in phase.memory["recompute"])
