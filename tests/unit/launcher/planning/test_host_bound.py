"""The ``host`` term of k2-plan's step-time model (launcher/planning/host_bound.py): the host's time per
operator against a hand-computed case, the max(host, GPU) rule per stretch between the dispatcher's waits,
the term on the published one-microbatch Moonlight run (it moves the step; removing it fails the test) and
its absence where the GPU's work per kernel is large or CUDA graphs replay the step."""

from __future__ import annotations

import dataclasses

import pytest

from k2.launcher.planning import host_bound
from k2.launcher.planning.hardware import load_profile


def test_host_seconds_against_a_hand_computed_case():
    """100 forward and 200 backward operators at 10 / 5 us each, 56% / 57% of them also a 4 us launch call."""
    p = dataclasses.replace(
        load_profile("h100"), host_forward_operator_us=10.0, host_backward_operator_us=5.0, kernel_launch_us=4.0
    )
    f, b = host_bound.host_seconds((100, 200), p)
    assert f == pytest.approx(100 * (10 + 0.56 * 4) * 1e-6)  # 1.224 ms
    assert b == pytest.approx(200 * (5 + 0.57 * 4) * 1e-6)  # 1.456 ms


def test_each_waiting_stretch_is_max_of_host_and_gpu_the_rest_pooled():
    """Segments (waits, host F, host B, GPU F, GPU B): two MoE layers waiting in the forward, host-bound
    by 3 and 0 ms; the dense layer and loss pooled (host 2 + 1 = 3 ms against GPU 1 + 1 = 2 ms: 1 ms)."""
    seg = [(True, 5e-3, 1e-3, 2e-3, 4e-3), (True, 1e-3, 1e-3, 2e-3, 4e-3), (False, 2e-3, 9e-3, 1e-3, 1e-3),
           (False, 1e-3, 1e-3, 1e-3, 1e-3)]  # fmt: skip
    forward = host_bound._stretches(seg, 1, 3, lambda s: s[0])
    assert forward == pytest.approx(3e-3 + 0 + 1e-3)
    # the backward without a waiting recompute: one stretch, host 12 ms against GPU 10 ms
    assert host_bound._stretches(seg, 2, 4, lambda s: False) == pytest.approx(2e-3)
    # it vanishes when every stretch's GPU work exceeds the host's
    big = [(w, hf, hb, 10 * gf, 10 * gb) for w, hf, hb, gf, gb in seg]
    assert host_bound._stretches(big, 1, 3, lambda s: s[0]) == 0.0


@pytest.fixture(scope="module")
def moonlight():
    from k2.launcher.planning.published import compare_run, published_runs

    run = next(r for r in published_runs() if r["name"] == "moonlight_16b_8_h100_bridge_bf16")
    return run, compare_run(run)


def test_one_microbatch_moonlight_step_is_host_bound(moonlight):
    """Moonlight-16B-A3B, one 4K microbatch per DP rank on 8 H100: the host issues each MoE layer's forward
    slower than the GPU runs it (hundreds of operators against ~2 ms of small GEMMs), and the step carries
    it; with no host cost in the profile the term and that time are gone."""
    from k2.launcher.planning.published import compare_run

    run, with_host = moonlight
    host = with_host["breakdown_s"]["host"]
    assert 0.05 < host < with_host["step_s"] / 2
    without = compare_run(run, ["plan.what_if.cuda_graphs=true"])
    assert without["breakdown_s"]["host"] == 0.0
    assert with_host["step_s"] - without["step_s"] == pytest.approx(host, rel=0.05)
    assert "cuda_graphs" in without["what_if"]


def test_the_term_vanishes_for_large_gemms_per_kernel():
    """The same model and layout with 32 sequences per microbatch: each stretch's GPU work exceeds what
    the host issues, so nothing is exposed."""
    from k2.launcher.planning.published import compare_run, published_runs

    run = next(r for r in published_runs() if r["name"] == "moonlight_16b_8_h100_bridge_bf16")
    big = compare_run(run, ["train.micro_batch_size=32", "schedule.global_batch_tokens=524288"])
    assert big["breakdown_s"]["host"] == 0.0


def test_a_grace_host_issues_operators_slower_than_a_dgx_xeon():
    """The NVL72 profiles' host figures are the x86 Xeon's x 37.08 / 13.48 (a torch Linear forward's CPU
    time on GB200 against DGX H100, TransformerEngine issue #2053); the x86 hosts (B200, H100) keep it."""
    x86 = load_profile("h100")
    for name in ("gb200_nvl72", "gb300_nvl72"):
        grace = load_profile(name)
        assert grace.host_forward_operator_us == pytest.approx(x86.host_forward_operator_us * 37.08 / 13.48, rel=0.01)
        assert grace.host_backward_operator_us == pytest.approx(x86.host_backward_operator_us * 37.08 / 13.48, rel=0.01)
    assert load_profile("b200").host_forward_operator_us == x86.host_forward_operator_us


def test_the_ep_overlap_keeps_the_host_term(moonlight):
    """megatron's combined 1F1B issues the same operators from the same host thread: with
    ``pipeline.ep_overlap`` the step keeps the host's exposed seconds (one microbatch: nothing to pair, so
    the same step as without)."""
    from k2.launcher.planning.published import compare_run

    run, plain = moonlight
    overlap = compare_run(run, ["pipeline.ep_overlap=true"])
    assert "ep_comm_sms" in overlap["breakdown_s"]  # (the overlap's model ran)
    assert overlap["breakdown_s"]["host"] == pytest.approx(plain["breakdown_s"]["host"], rel=1e-9)
    assert overlap["step_s"] == pytest.approx(plain["step_s"], rel=1e-6)
