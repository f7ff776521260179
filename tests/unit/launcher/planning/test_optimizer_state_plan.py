"""The planner's optimizer-state figures for K2 (launcher/planning/memory.py ``state_bytes``): MuonClip's
ZeRO-1 layout against the unpadded 6 bytes per parameter (BF16 weight + FP32 gradient,
docs/k2_reference.md "Training system").

The reference is computed without megatron's layout: ``6 x`` the unpadded parameter count of each GPU.
"""

from __future__ import annotations

import pytest

from support.helpers import predict_state_bytes

# (no optimizer offload: the layer-wise counter-case cannot offload, and the figures here are the device's)
K2 = ["model=kimi_k2", "parallel=k2_256gpu", "train.precision=bf16", "optim=muonclip", "optim.offload_fraction=0"]


@pytest.mark.parametrize("zero1", ["byte_range", "layer_wise"])
def test_k2_muonclip_param_and_grad_bytes_unpadded(zero1):
    """Byte-range Distributed Muon (the default): every GPU of every PP rank, rank 0 (the dense layer's
    18432 x 7168 matrices) included, within 1% of 6 B per parameter. megatron's layer-wise layout (the
    counter-case) pads whole matrices into the DP shards: +27% on the MoE ranks, about 2x on rank 0."""
    states = predict_state_bytes([*K2, f"optim.muon_zero1={zero1}"], 256)
    ratio = [max((x.params + x.grads) / (6 * x.param_numel) for x in row) for row in states]
    assert len(ratio) == 16
    if zero1 == "byte_range":
        assert max(ratio) <= 1.01 and min(ratio) >= 1.0, ratio
    else:
        assert ratio[0] > 1.9 and min(ratio[1:15]) > 1.2, ratio
