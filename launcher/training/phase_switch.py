"""Entering a schedule phase without a restart, on one rank: the phase's datasets and microbatch iterators
(:class:`k2.launcher.training.phase_data.PhaseData`: another sequence length or blend), every MLA layer's
RoPE / YaRN (:func:`k2.model.rope.set_rope_type`), its ``memory.*`` settings (FP8 storage, offload,
recompute: :mod:`k2.launcher.training.phase_memory`) and, with ``pipeline.ep_overlap``, whether the pipeline
overlaps the EP all-to-alls in it. The trainer enters the first phase after the restore and every later one
at its boundary, both through :meth:`PhaseSwitch.enter`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from k2.launcher.training.phase_data import PhaseData
from k2.launcher.training.phase_memory import apply_phase_memory, phase_memory_options
from k2.model.rope import set_rope_type

if TYPE_CHECKING:
    from k2.config.schema import ModelConfig
    from k2.schedules.wsd import Phase

__all__ = ["PhaseSwitch"]


class PhaseSwitch:
    """What a phase boundary switches, over the run's parts.

    Args:
        data: the rank's :class:`PhaseData`; chunks: the bare model chunks (their layers' memory settings);
        model: the DDP-wrapped chunks (their MLA layers' RoPE); tcfg: megatron's ``MLATransformerConfig``;
        model_cfg: ``cfg.model`` (the RoPE / YaRN numbers); pipeline: the
        :class:`k2.schedules.pipeline.PipelineHooks`, or None; rope_type: the RoPE the model was built with.
    """

    def __init__(
        self,
        data: PhaseData,
        chunks: list[Any],
        model: list[Any],
        tcfg: Any,
        model_cfg: ModelConfig,
        pipeline: Any,
        rope_type: str,
    ) -> None:
        self.data, self.chunks, self.model, self.tcfg = data, chunks, model, tcfg
        self.model_cfg, self.pipeline, self.rope_type = model_cfg, pipeline, rope_type

    def enter(self, phase: Phase, step: int) -> None:
        """Serve ``phase`` from ``step`` on: its datasets, RoPE and ``memory.*`` settings."""
        self.data.enter(phase, step)
        if phase.rope_type != self.rope_type:
            set_rope_type(self.model, self.tcfg, self.model_cfg, phase.rope_type)
            self.rope_type = phase.rope_type
        apply_phase_memory(self.chunks, phase)  # FP8 storage, offload, recompute
        if self.pipeline is not None:  # pipeline.ep_overlap: off in a phase recomputing whole layers
            self.pipeline.enter_phase(phase_memory_options(phase))

    def describe(self, phase: Phase, tokens_per_step: int) -> str:
        """One line on ``phase``: its sequence length, global batch (``tokens_per_step`` tokens), microbatches
        per DP rank, RoPE and, with the pipeline hooks, whether its EP all-to-alls are overlapped."""
        overlap = self.pipeline.phase_note(phase_memory_options(phase)) if self.pipeline is not None else ""
        return (
            f"phase '{phase.name}': seq_length {phase.seq_length}, global batch "
            f"{phase.global_batch_size} x {phase.seq_length} = {tokens_per_step:,} tokens, "
            f"{phase.num_microbatches} microbatches/DP rank of {phase.micro_batch_size}, "
            f"{phase.rope_type}{overlap}"
        )
