"""MuonClip (layer 5, above ``k2.schedules``; K2 report section 2.1): Muon for weight matrices, AdamW for the
rest, QK-Clip after each step.

Modules (one direction): :mod:`k2.optim.muon` (the K2 Muon update on top of emerging-optimizers' Newton-Schulz)
-> :mod:`k2.optim.params` (which parameter goes to which optimizer, and how a stored tensor splits into the
matrices Muon orthogonalises) -> :mod:`k2.optim.build` (megatron's optimizers assembled for ZeRO-1) ->
:mod:`k2.optim.qk_clip` (per-head weight rescaling from the recorded max logits). Beside them:
:mod:`k2.optim.distributed_muon` (Muon on megatron's byte-range ZeRO-1 shards) and :mod:`k2.optim.offload`
(optimizer states in host memory between steps), both used by :mod:`k2.optim.build`.
:mod:`k2.optim.registry` names the optimizers of ``optim.name``: each describes itself (how it is built,
which parameters go to which update, the bytes those keep and move, the per-matrix step) for the trainer's
builder and ``k2-plan``.
"""

import k2.parallel  # noqa: F401 (first: without CUDA, megatron-core's import-time torch.compile stays eager)
