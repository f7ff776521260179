"""Activation memory per schedule phase in ``k2-train``: every ``memory.*`` change is made at the phase
boundary, without a restart.

A schedule phase may override ``memory.*`` (``schedule.phases.<i>.memory``, resolved on
:class:`k2.schedules.wsd.Phase`); ``k2-plan`` plans each phase with its own settings. The trainer builds
the model once with saved-tensor scopes for every phase's settings (:func:`run_memory_options`) and, on
entering a phase (and on a restore), sets that phase's FP8 storage, offload and recompute sites -- ``layer``,
``layernorm``, ``mla_up_proj``, ``swiglu``, ``moe_down_proj`` -- on every layer
(:func:`k2.model.activation_memory.set_memory_options`: each switch is read per forward). A step after the
boundary computes and saves what a run restarted from a checkpoint at the boundary with that phase's
settings would (tests/integration/test_memory_train.py). Nothing is refused: the phase overrides are
checked like the ``memory`` group (:func:`k2.config.validate.check_phase_memory`) when the schedule is
resolved.
"""

from __future__ import annotations

__all__ = ["apply_phase_memory", "phase_memory_options", "run_memory_options"]


def phase_memory_options(phase):
    """:class:`k2.model.activation_memory.MemoryOptions` of ``phase`` (its resolved ``memory`` site lists;
    a phase without them: all off)."""
    # imported here: the module is imported by k2-train's parent process, which must not pay the model's
    # import of torch and megatron-core
    from k2.model.activation_memory import MemoryOptions

    return MemoryOptions.from_sites(phase.memory or {})


def run_memory_options(schedule) -> list:
    """The distinct options of the phases of ``schedule`` that run a step, in phase order (the model is
    built with scopes for all of them: ``k2.model.build.build_model_chunks``'s ``memory_switches``)."""
    out = []
    for p in schedule.phases:
        opts = phase_memory_options(p) if p.steps else None
        if opts is not None and opts not in out:
            out.append(opts)
    return out


def apply_phase_memory(chunks: list, phase) -> None:
    """Make every transformer layer of ``chunks`` run with ``phase``'s ``memory.*`` settings from the next
    forward on (:func:`k2.model.activation_memory.set_memory_options`)."""
    from k2.model.activation_memory import set_memory_options

    set_memory_options(chunks, phase_memory_options(phase))
