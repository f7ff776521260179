"""MuonClip (layer 5, above ``k2.schedules``; K2 report section 2.1): Muon for weight matrices, AdamW for the rest, QK-Clip after each step.

Modules (one direction): :mod:`k2.optim.muon` (the K2 Muon update on top of emerging-optimizers' Newton-Schulz)
-> :mod:`k2.optim.params` (which parameter goes to which optimizer, and how a stored tensor splits into the
matrices Muon orthogonalises) -> :mod:`k2.optim.build` (megatron's optimizers assembled for ZeRO-1) ->
:mod:`k2.optim.qk_clip` (per-head weight rescaling from the recorded max logits).
"""
