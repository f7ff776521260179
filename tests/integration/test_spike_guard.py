"""The loss-spike guard on cpu4 (PP2 x VPP2 x EP2 x DP2, ZeRO-1, MuonClip): an outlier injected on rank 0
alone is skipped by every rank, and the state after the skipped step is bitwise the state before it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from support.distributed import run_trainer

# the smallest window (4): detection starts once it holds 2 steps, so the spike can be step 3 of 4 steps
CPU4_SKIP = [
    "parallel=cpu4",
    "optim=muonclip",
    "train.eval_interval=0",
    "train.micro_batch_size=4",
    "schedule.phases.0.steps=0",
    "train.iters=4",
    "train.save_interval=1",
    "checkpoint.keep_last=10",
    "checkpoint.save_at_end=false",
    "train.spike.action=skip",
    "train.spike.window=4",
    "train.spike.sigma=1000",
]


def _all_tensors(ckpt: Path, tmp_path: Path) -> dict:
    """Every tensor of a torch_dist checkpoint (model, optimizer states and step counters, router expert
    bias), read without a process group; the RNG states are left out (they move every step)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    sd = torch.load(out, weights_only=False)
    flat = {}

    def walk(prefix, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}/{k}", x)
        elif torch.is_tensor(v):
            flat[prefix] = v

    walk("", sd)
    return {k: v for k, v in flat.items() if "rng" not in k}


def _differing(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Flat indices where ``a`` and ``b`` differ (NaN equal to NaN)."""
    a, b = a.flatten(), b.flatten()
    return ((a != b) & ~(torch.isnan(a) & torch.isnan(b))).nonzero().flatten()


def test_injected_spike_is_skipped_by_every_rank_bitwise(tmp_path, stdlib_corpus):
    """K2_TEST_SPIKE=3:1e6 multiplies the loss rank 0's guard sees at step 3 (the window holds steps 1-2):
    the run logs one spike line, step 3's record says spike/skip and no update, its tokens count as
    consumed, and every tensor of the step-3 checkpoint (weights, FP32 masters, Adam moments, Muon
    momentum, step counters, expert bias) equals the step-2 checkpoint's -- which needs every rank to have
    skipped, since each rank's shards are in it; step 4 trains again."""
    run_dir = tmp_path / "run"
    out = tmp_path / "stdout.txt"
    recs = run_trainer(CPU4_SKIP, 4, run_dir, env={"K2_TEST_SPIKE": "3:1e6"}, stdout_to=out)
    by = {r["step"]: r for r in recs}
    assert [s for s, r in by.items() if r["spike"]] == [3], [(s, r["loss"], r["grad_norm"]) for s, r in by.items()]
    assert by[3]["spike_action"] == "skip" and by[3]["spike_on"] == ["loss"]
    assert by[3]["update_successful"] is False and by[4]["update_successful"] is True
    assert by[3]["consumed_tokens"] == by[2]["consumed_tokens"] + (by[2]["consumed_tokens"] // 2)
    lines = [x for x in out.read_text().splitlines() if ": spike (" in x]
    assert len(lines) == 1 and lines[0].startswith("step 3: spike (loss ") and "update skipped" in lines[0]
    ckpts = run_dir / "checkpoints"
    before, after, later = (_all_tensors(ckpts / f"iter_000000{s}", tmp_path) for s in (2, 3, 4))
    assert before.keys() == after.keys() and any("expert_bias" in k for k in before)
    assert any("momentum_buffer" in k for k in before), sorted(before)[:20]
    changed = {k: _differing(before[k], after[k]) for k in before}
    # megatron's ZeRO-1 flat buffers start each parameter at a multiple of 64 elements (distributed
    # optimizer padding); the k2_tiny tensors are multiples of 32 elements, so the uninitialised padding
    # the checkpoint copies is at offsets 32..63 of a 64-block. Everything else must be equal.
    assert not {
        k: v
        for k, v in changed.items()
        if v.numel() and ("optimizer.distributed" not in k or bool((v % 64 < 32).any()))
    }, changed
    assert any(not torch.equal(after[k], later[k]) for k in after if "expert_bias" in k)  # step 4 updated
    state = json.loads((ckpts / "iter_0000003" / "k2_state.json").read_text())["spike"]
    assert len(state["losses"]) == 2 and state["consecutive"] == 1  # the skipped step's loss kept out
