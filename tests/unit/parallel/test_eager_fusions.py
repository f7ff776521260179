"""``import k2.parallel`` keeps megatron-core's and emerging-optimizers' import-time ``torch.compile``
decorations eager (k2.parallel.eager_fusions), with or without CUDA, in a fresh interpreter as every rank
and tool starts: no inductor import, the same functions (the router's expert-bias update, the one on K2's
path, included), and ``torch.compile`` itself untouched after."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support import REPO

PROBE = r"""
import json, sys
import torch
if sys.argv[1] == "cuda":  # a GPU machine, as far as the import-time decisions can tell
    torch.cuda.is_available = lambda: True
real_compile = torch.compile
import k2.parallel
import megatron.core
from megatron.core.transformer.moe.router import TopKRouter
import megatron.core.jit as jit
from megatron.core.fusions import fused_bias_swiglu
from emerging_optimizers.scalar_optimizers.update_functions import adam
print(json.dumps({
    "jit_fuser_is_compile": jit.jit_fuser is real_compile,
    "swiglu_is_plain_function": type(fused_bias_swiglu.bias_swiglu).__name__ == "function",
    "adam_is_plain_function": type(adam.calculate_adam_update).__name__ == "function",
    "expert_bias_update_is_eager": not hasattr(TopKRouter._apply_expert_bias, "_torchdynamo_orig_callable"),
    "inductor_imported": "torch._inductor.compile_fx" in sys.modules,
    "compile_restored": torch.compile is real_compile,
}))
"""


@pytest.mark.parametrize("machine", ["cpu", "cuda"])
def test_import_time_compile_stays_eager(machine):
    out = subprocess.run(
        [sys.executable, "-c", PROBE, machine],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {
        "jit_fuser_is_compile": False,
        "swiglu_is_plain_function": True,
        "adam_is_plain_function": True,
        "expert_bias_update_is_eager": True,
        "inductor_imported": False,
        "compile_restored": True,
    }, got
