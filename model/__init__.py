"""The K2 model on megatron-core (layer 3, above ``k2.parallel``): MLA core attention with per-head max
logits, the sigmoid router with expert bias, SwiGLU MLPs and grouped experts, model building; activation
memory (FP8 storage, recompute, offload); the dgrad/wgrad split of the linear layers; closed-form FLOP,
parameter and saved-activation counts used by the planner and the trainer."""

import k2.parallel  # noqa: E402,F401 (first: without CUDA, megatron-core's import-time torch.compile stays eager)
