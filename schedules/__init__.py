"""Schedules (layer 4, above ``k2.model``): the training schedule counted in tokens (``wsd``: phases, LR
rule; ``resolve``: validation of ``cfg.schedule`` for a layout), the LR / weight-decay scheduler
(``lr``), its plot and megatron's pipeline schedule hooked for decoupled weight gradients (``pipeline``;
the planner's simulator of its order is :mod:`k2.launcher.planning.pipeline_sim`)."""

import k2.parallel  # noqa: F401 (first: without CUDA, megatron-core's import-time torch.compile stays eager)
