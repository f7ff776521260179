"""fp32 accumulators that survive megatron's BF16 wrapper.

megatron's ``Float16Module`` (``train.precision=bf16``) calls ``module.bfloat16()``, which casts every
floating buffer to bf16 (8 significand bits): a running maximum loses its low bits and token counts above
256 no longer add up exactly. Our accumulators -- QK-Clip's per-head max logit (``K2CoreAttention``), the
per-step expert token counts and megatron's own expert-bias token counter (``K2Router``) -- read themselves
through :func:`fp32_buffer` before each update. (megatron does the same for ``expert_bias`` alone:
``TopKRouter._maintain_float32_expert_bias``.)
"""

from __future__ import annotations

import torch


def fp32_buffer(module: torch.nn.Module, name: str, device: torch.device | None = None) -> torch.Tensor:
    """``module.<name>`` as an fp32 tensor on ``device`` (default: where it is); when it is not, it is
    converted (values kept) and set back on the module under the same name, so a registered buffer stays
    registered. Returns the tensor to update in place."""
    buf = getattr(module, name)
    target = buf.device if device is None else device
    if buf.device != target or buf.dtype != torch.float32:
        buf = buf.to(device=target, dtype=torch.float32)
        setattr(module, name, buf)
    return buf
