"""The Triton per-head max-logit kernel (model/max_logit_kernel.py) on CPU through Triton's interpreter
(in a subprocess: TRITON_INTERPRET must be set before triton is first imported), against a float64
reference and the torch path of model/attention.py computed here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from support import REPO, SCRIPTS

pytest.importorskip("triton")

CASES = [  # b, h, sq, sk, d, causal, seed, scale, tile rows
    (2, 3, 50, 50, 24, True, 1, 0.3, 32),  # rows not a multiple of the tile
    (1, 2, 130, 130, 48, True, 2, 0.3, 32),  # several query and key tiles, diagonal tiles
    (2, 2, 33, 70, 20, True, 3, 0.3, 32),  # more keys than queries: causal aligned to the end
    (1, 2, 64, 40, 16, False, 4, 0.3, 32),
    (1, 2, 40, 40, 192, True, 5, 0.07, 16),  # MLA's qk head dim 192: padded to a 256-wide tile
]


def _inputs(b, h, sq, sk, d, seed):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(b, h, sq, d, generator=g), torch.randn(b, h, sk, d, generator=g)
    k[:, :, (3 * sk) // 4 :] *= 100  # as in the script: huge late keys, seen only by zeroed query rows
    q[:, :, (3 * sq) // 4 :] = 0
    return q, k


def _reference(q, k, scale, causal):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        rows = torch.arange(sq).unsqueeze(1) + (sk - sq)
        s = s.masked_fill(torch.arange(sk).unsqueeze(0) > rows, float("-inf"))
    return s.amax(dim=(0, 2, 3))


@pytest.fixture(scope="module")
def kernel_results():
    env = {"TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        [sys.executable, str(SCRIPTS / "max_logit_kernel_cases.py"), json.dumps(CASES)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("i", range(len(CASES)), ids=lambda i: "x".join(map(str, CASES[i][:5])))
def test_matches_float64_reference_and_the_torch_path(kernel_results, i):
    from k2.model.attention import per_head_max_logit

    b, h, sq, sk, d, causal, seed, scale, _ = CASES[i]
    got = torch.tensor(kernel_results[i]["values"], dtype=torch.float64)
    assert kernel_results[i]["dtype"] == "torch.float32" and got.shape == (h,)
    q, k = _inputs(b, h, sq, sk, d, seed)
    want = _reference(q, k, scale, causal)
    # FP32 accumulation of d products vs float64: a few ulps of the logit
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got.float(), per_head_max_logit(q, k, scale, causal), rtol=1e-5, atol=1e-4)
    if causal and sk == sq:  # without the mask the huge late keys would dominate
        assert (got < _reference(q, k, scale, False) / 10).all()


def test_sdpa_attention_uses_the_kernel_when_selected(megatron_world1, monkeypatch):
    """K2CoreAttention(backend=sdpa, max_logit_kernel=triton) records what the kernel returns where it can
    run (made to look so here) and the torch pass otherwise (CPU without the interpreter)."""
    from test_attention import make_module

    import k2.model.max_logit_kernel as mlk

    mod = make_module(backend="sdpa")
    mod.max_logit_kernel = "triton"
    q, k, v = torch.randn(16, 1, 4, 48), torch.randn(16, 1, 4, 48), torch.randn(16, 1, 4, 32)
    mod(q, k, v, None)
    torch_max = mod.max_logits.clone()  # no CUDA, no interpreter: the torch pass
    assert torch.isfinite(torch_max).all()
    mod.reset_max_logits()
    monkeypatch.setattr(mlk, "available", lambda device: True)
    monkeypatch.setattr(mlk, "per_head_max_logit_triton", lambda q, k, scale, causal: torch.full((4,), 7.0))
    mod(q, k, v, None)
    assert torch.equal(mod.max_logits, torch.full((4,), 7.0))
