"""Without CUDA, ``import k2.parallel`` keeps megatron-core's and emerging-optimizers' import-time
``torch.compile`` decorations eager (k2.parallel.eager_fusions), in a fresh interpreter as every rank
and tool starts: no inductor import, the same functions, and ``torch.compile`` itself untouched after."""

from __future__ import annotations

import json
import subprocess
import sys

from support import REPO

PROBE = r"""
import json, sys
import torch
real_compile = torch.compile
import k2.parallel
import megatron.core
import megatron.core.jit as jit
from megatron.core.fusions import fused_bias_swiglu
from emerging_optimizers.scalar_optimizers.update_functions import adam
print(json.dumps({
    "jit_fuser_is_compile": jit.jit_fuser is real_compile,
    "swiglu_is_plain_function": type(fused_bias_swiglu.bias_swiglu).__name__ == "function",
    "adam_is_plain_function": type(adam.calculate_adam_update).__name__ == "function",
    "inductor_imported": "torch._inductor.compile_fx" in sys.modules,
    "compile_restored": torch.compile is real_compile,
}))
"""


def test_import_time_compile_stays_eager_without_cuda():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"jit_fuser_is_compile": False, "swiglu_is_plain_function": True,
                   "adam_is_plain_function": True, "inductor_imported": False, "compile_restored": True}, got
