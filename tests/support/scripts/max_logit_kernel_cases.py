"""Runs model/max_logit_kernel.py under Triton's CPU interpreter (TRITON_INTERPRET=1 must be set before
triton is first imported, so this runs in its own process) on the cases given as JSON in argv[1]:
[[b, h, sq, sk, d, causal, seed, scale, block], ...]. Prints one JSON list of per-head results."""

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch

from k2.model.max_logit_kernel import per_head_max_logit_triton

out = []
for b, h, sq, sk, d, causal, seed, scale, block in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(b, h, sq, d, generator=g), torch.randn(b, h, sk, d, generator=g)
    # huge keys late in the sequence, seen (causal) only by query rows that are zero: a kernel that
    # ignored the causal mask would report them
    k[:, :, (3 * sk) // 4 :] *= 100
    q[:, :, (3 * sq) // 4 :] = 0
    got = per_head_max_logit_triton(q, k, scale, causal, block_m=block, block_n=block)
    out.append({"dtype": str(got.dtype), "values": got.tolist()})
print(json.dumps(out))
