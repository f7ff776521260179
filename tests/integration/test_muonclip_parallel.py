"""MuonClip under ZeRO-1: 3 steps on 1 rank, on DP=2 and on cpu4 (PP2 x VPP2 x EP2 x DP2) give the same
weights (the real trainer, megatron's distributed optimizer on, gloo).

Every rank must apply exactly the update one rank would apply to the DP-averaged full gradient. With the
default ``optim.muon_zero1=byte_range`` (Distributed Muon on megatron's byte-range layout,
optim/distributed_muon.py) the runs report which Muon matrices a shard boundary cuts, and the DP=2 and
cpu4 runs assert that at least one is cut (gathered, orthogonalised whole, sliced); with
``optim.muon_zero1=layer_wise`` (megatron's layer-wise layout) none is.

Newton-Schulz runs in fp32 here (``optim.muon_fp32_matmul_prec=highest``): in bf16 the last-bit
differences of the DP reduction order (DP=1 sums 8 microbatches, DP=2 two sums of 4) flip bf16 roundings
inside NS, which moves the update by ~2^-8 relative whatever the distribution; the fp32 check isolates
the distribution. (bf16 NS is checked against the reference in tests/unit/optim/test_muon.py.)
"""

from __future__ import annotations

import json

import pytest
import torch

from support.distributed import MUONCLIP_FP32

pytestmark = pytest.mark.slow


def _run(three_step_runs, nproc: int, extra=()) -> tuple[list[dict], dict, dict]:
    """(metrics records, {global name: weight} merged over ranks, layout report merged over ranks) of
    3 steps with MUONCLIP_FP32 (tests/support/distributed.py: THREE_STEPS, shared per session)."""
    run = three_step_runs([*extra, *MUONCLIP_FP32], nproc, False)
    weights: dict = {}
    layout = {"cut": set(), "cut_by_byte_range_layout": set()}
    for r in range(nproc):
        for name, w in run["dumps"][r][1].items():
            if name in weights:  # DP replicas hold the same weights, bit for bit
                assert torch.equal(weights[name], w), name
            weights[name] = w
        for key, names in json.loads((run["dump_dir"] / f"layout_rank{r}.json").read_text()).items():
            layout[key] |= set(names)
    return run["records"], weights, layout


@pytest.fixture(scope="module")
def single_rank(three_step_runs):
    return _run(three_step_runs, 1)


def _assert_same_weights(ref: dict, got: dict):
    assert set(ref) == set(got)
    for name, want in ref.items():
        bad = ~torch.isclose(got[name], want, rtol=1.3e-6, atol=1e-5)  # torch's fp32 tolerance
        # Adam divides each element's gradient by its own RMS: for the few elements whose gradient is
        # ~adam_eps (3 of 524,288 embedding entries here) the DP reduction order moves the update
        # visibly. Muon matrices, norms, router: none.
        adam_outliers = name.endswith(("word_embeddings.weight", "output_layer.weight"))
        limit = int(1e-4 * want.numel()) if adam_outliers else 0
        assert int(bad.sum()) <= limit, (name, int(bad.sum()), (got[name] - want).abs().max().item())
        assert (got[name] - want).abs().max().item() < 1e-4, name


def _assert_run(single_rank, got_run, *, straddles: bool):
    ref_recs, ref_w, _ = single_rank
    recs, weights, layout = got_run
    assert len(recs) == len(ref_recs) > 0
    for r, g in zip(ref_recs, recs, strict=True):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-5)
    assert ref_recs[2]["loss"] < ref_recs[0]["loss"]  # it trains
    _assert_same_weights(ref_w, weights)
    # byte-range: some Muon matrix straddles two DP shards (the gathered case); layer-wise: none
    assert bool(layout["cut"]) is straddles, layout["cut"]
    assert layout["cut_by_byte_range_layout"], "test model has no matrix that byte-range ZeRO-1 cuts"
    return layout


def test_dp2_matches_single_rank(three_step_runs, single_rank):
    _assert_run(single_rank, _run(three_step_runs, 2), straddles=True)


def test_cpu4_matches_single_rank(three_step_runs, single_rank):
    _assert_run(single_rank, _run(three_step_runs, 4, ["parallel=cpu4"]), straddles=True)


def test_dp2_offload_bitwise_identical(three_step_runs):
    """optim.offload_fraction=1 (the momentum in host memory between steps): the same losses and weights
    as the run without, bit for bit."""
    ref_recs, ref_w, _ = _run(three_step_runs, 2)
    recs, weights, _ = _run(three_step_runs, 2, ["optim.offload_fraction=1"])
    assert [r["loss"] for r in recs] == [r["loss"] for r in ref_recs]
    assert set(weights) == set(ref_w) and all(torch.equal(weights[n], ref_w[n]) for n in ref_w)


def test_dp2_layer_wise_matches_single_rank(three_step_runs, single_rank):
    _assert_run(single_rank, _run(three_step_runs, 2, ["optim.muon_zero1=layer_wise"]), straddles=False)
