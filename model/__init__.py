"""The K2 model on megatron-core (layer 3, above ``k2.parallel``): MLA core attention with per-head max
logits, the sigmoid router with expert bias, SwiGLU MLPs and grouped experts, model building; activation
memory (FP8 storage, recompute, offload); the dgrad/wgrad split of the linear layers; closed-form FLOP
and parameter counts used by the planner, the trainer and the tools (the planner's own counts -- saved
activation bytes, kernel seconds -- are in :mod:`k2.launcher.planning`)."""

import k2.parallel  # noqa: F401 (first: without CUDA, megatron-core's import-time torch.compile stays eager)
