"""Trainer with a skewed router: every token prefers the first half of the experts, so with EP=2 the
second EP rank receives zero tokens. Writes, per rank, the number of tokens its local experts received
to $K2_TEST_OUT/tokens_rank<R>.json. Used by tests/integration/test_moe_zero_tokens.py."""

import json
import os
import sys
from pathlib import Path

import torch

from k2.parallel import cpu_backend

cpu_backend.enable()

from k2.model.mlp import K2SequentialMLP
from k2.model.router import K2Router

SKEW = 10.0
received = {"tokens": 0, "calls": 0}

_orig_gating = K2Router.gating


def skewed_gating(self, input):
    logits = _orig_gating(self, input)
    bias = torch.full((logits.shape[-1],), -SKEW, dtype=logits.dtype, device=logits.device)
    bias[: logits.shape[-1] // 2] = SKEW
    return logits + bias


K2Router.gating = skewed_gating

_orig_forward = K2SequentialMLP.forward


def counting_forward(self, permuted_local_hidden_states, tokens_per_expert, *args, **kwargs):
    received["tokens"] += int(permuted_local_hidden_states.shape[0])
    received["calls"] += 1
    return _orig_forward(self, permuted_local_hidden_states, tokens_per_expert, *args, **kwargs)


K2SequentialMLP.forward = counting_forward

from k2.launcher import train

rc = train.main(sys.argv[1:])
out = Path(os.environ["K2_TEST_OUT"])
out.mkdir(parents=True, exist_ok=True)
rank = int(os.environ.get("RANK", 0))
(out / f"tokens_rank{rank}.json").write_text(json.dumps(received))
sys.exit(rc)
