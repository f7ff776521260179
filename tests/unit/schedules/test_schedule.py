"""Token-based schedule (schedules/wsd.py, schedules/lr.py): K2's 15.5T-token WSD numbers, the rounding
rule, zero-length phases, bad schedules, resume of the LR scheduler.

Expected values are computed here from the K2 report's numbers with closed-form formulas (linear
warmup, cosine ``end + (start - end) * (1 + cos(pi r)) / 2``, ``ceil(T / B)`` boundary steps), never
read back from the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from k2.config.errors import ConfigError
from k2.config.load import load_config
from k2.schedules.lr import TokenLRScheduler
from k2.schedules.resolve import resolve_schedule
from support.k2_schedule import ANNEAL_END, DECAY_END, K2_BATCH_TOKENS, PEAK, T, ceil_div, k2_lr


@pytest.fixture(scope="module")
def k2():
    return resolve_schedule(load_config(["model=kimi_k2"]))  # kimi_k2's schedule is k2_15t5


def test_k2_schedule_numbers(k2):
    B = K2_BATCH_TOKENS
    assert k2.global_batch_tokens == B and k2.weight_decay == 0.1
    # LR > 0 on the first step, exactly the peak at the end of warmup (step 500)
    assert k2.step_lr(1) > 0 and k2.step_lr(1) == pytest.approx(PEAK / 500, rel=1e-12)
    assert k2.step_lr(500) == PEAK
    assert k2.step_lr(499) < PEAK
    # constant to 10T: still the peak one batch before 10T
    assert k2.lr_at(10 * T - B) == PEAK
    # cosine midpoint 12.75T -> (2e-4 + 2e-5) / 2 = 1.1e-4; 2e-5 at 15.5T
    assert k2.lr_at(12.75 * T) == pytest.approx(1.1e-4, rel=1e-12)
    assert k2.lr_at(15.5 * T) == pytest.approx(DECAY_END, rel=1e-12)
    # the anneal is one rule across the 4K and 32K phases; 7e-6 at the end and after it
    assert k2.lr_at(15.9 * T) == pytest.approx(k2_lr(15.9 * T), rel=1e-12)
    assert k2.lr_at(15.96 * T) == pytest.approx(ANNEAL_END, rel=1e-12)
    last = ceil_div(15_960 * 10**9, B)
    assert k2.total_steps == last == 237_823
    assert k2.step_lr(last) == pytest.approx(ANNEAL_END, rel=1e-12)
    # a sample of steps against the closed form
    for step in (1, 250, 500, 501, 100_000, 149_012, 149_013, 190_000, 230_968, 230_969, 236_930, last):
        assert k2.step_lr(step) == pytest.approx(k2_lr(step * B), rel=1e-9, abs=1e-15), step


def test_k2_context_switch_and_batch(k2):
    B = K2_BATCH_TOKENS
    switch = ceil_div(15_900 * 10**9, B) + 1  # first step whose first token is past 15.9T
    before, after = k2.step_phase(switch - 1), k2.step_phase(switch)
    assert (before.seq_length, before.global_batch_size) == (4_096, 16_384)
    assert (after.seq_length, after.global_batch_size) == (32_768, 2_048)
    assert after.global_batch_size * after.seq_length == B  # 67M tokens in every phase
    assert after.first_step == switch
    # YaRN to 128K is the final setting: a zero-length phase that no step runs
    final = k2.phases[-1]
    assert (final.rope_type, final.seq_length, final.steps) == ("yarn", 131_072, 0)
    assert k2.step_phase(k2.total_steps).name == after.name


def test_boundaries_land_on_the_next_whole_step(k2):
    """10T / 67,108,864 = 149,011.6: the stable phase runs to step 149,012 and the cosine starts with
    step 149,013; the plan reports the exact token count the boundary lands on."""
    B = K2_BATCH_TOKENS
    stable, decay = k2.phases[1], k2.phases[2]
    assert (stable.last_step, decay.first_step) == (149_012, 149_013)
    assert k2.landed_tokens(10 * T) == 149_012 * B == 10_000_026_042_368
    assert k2.step_phase(149_012).name == "stable" and k2.step_phase(149_013).name == "decay"
    # every step's first token lies inside its phase's nominal range
    for p in k2.phases:
        if p.steps:
            assert p.start_tokens <= (p.first_step - 1) * B < p.end_tokens
            assert p.start_tokens <= (p.last_step - 1) * B < p.end_tokens
            assert p.last_step * B >= p.end_tokens  # the phase ran at least its nominal tokens


def tiny_lr(tokens: float) -> float:
    """recipes/schedule/tiny_wsd.yaml written out by hand."""
    B = 2048
    if tokens <= 20 * B:
        return 3e-3 * tokens / (20 * B)
    if tokens <= 350_000:
        return 3e-3
    if tokens <= 500_000:
        r = (tokens - 350_000) / 150_000
        return 3e-4 + (3e-3 - 3e-4) * 0.5 * (1 + math.cos(math.pi * r))
    r = min(1.0, (tokens - 500_000) / 114_400)
    return 3e-4 + (1.05e-4 - 3e-4) * r


def test_tiny_demo_every_step():
    s = resolve_schedule(load_config([]))
    assert s.name == "tiny_wsd" and s.total_steps == 614_400 // 2048 == 300
    for step in range(1, 301):
        assert s.step_lr(step) == pytest.approx(tiny_lr(step * 2048), rel=1e-9, abs=1e-15), step
        want_ctx = 128 if (step - 1) * 2048 < 550_000 else 512
        assert s.step_phase(step).seq_length == want_ctx
        assert s.step_phase(step).global_batch_size * want_ctx == 2048
    assert [p.name for p in s.phases] == ["warmup", "stable", "decay", "anneal_128", "anneal_512"]
    assert s.step_phase(ceil_div(550_000, 2048) + 1).name == "anneal_512"


def _schedule(phases: str, *extra: str):
    return resolve_schedule(load_config([f"schedule.phases={phases}", *extra]))


def test_zero_length_phases_are_skipped():
    # warmup then constant, the decay phase of length zero
    s = _schedule(
        "[{name:w,steps:10,lr_style:linear,lr_start:0.0,lr_end:1.0e-3,seq_length:128},"
        "{name:c,tokens:40960,lr_style:constant},"
        "{name:d,tokens:0,lr_style:cosine,lr_end:1.0e-4}]"
    )
    assert [p.steps for p in s.phases] == [10, 20, 0]
    assert s.total_steps == 30 and s.step_phase(30).name == "c"
    assert s.step_lr(10) == 1e-3 and s.step_lr(30) == 1e-3
    assert s.lr_at(10**9) == 1e-3  # the skipped decay never applies
    # a zero-step warmup: the first step is already in the constant phase at the peak
    s0 = resolve_schedule(load_config(["schedule.phases.0.steps=0"]))
    assert s0.phases[0].steps == 0 and s0.step_phase(1).name == "stable" and s0.step_lr(1) == 3e-3


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["schedule.phases.3.tokens=-5"], ["schedule.phases.3.tokens=-5", "negative"]),
        (["schedule.phases.2.until_tokens=300000"], ["schedule.phases.2.until_tokens", "out of order", "350,000"]),
        (["schedule.phases.0.steps=200"], ["schedule.phases.1.until_tokens", "warmup", "longer than the phase"]),
        (
            ["schedule.phases.2.lr_style=cosine_restarts"],
            ["schedule.phases.2.lr_style", "cosine_restarts", "linear", "minus_sqrt"],
        ),
        (
            ["schedule.phases.4.seq_length=262144"],
            ["schedule.phases.4.seq_length=262,144", "model.max_position_embeddings=131072"],
        ),
        (
            ["schedule.phases.4.seq_length=8192", "model.max_position_embeddings=4096"],
            ["schedule.phases.4.seq_length=8,192", "model.max_position_embeddings=4096"],
        ),
        (
            ["schedule.phases.4.seq_length=768"],
            ["schedule.global_batch_tokens=2,048", "schedule.phases.4.seq_length=768"],
        ),
        (["schedule.phases.0.lr_style=continue"], ["schedule.phases.0.lr_style=continue"]),
        (["schedule.phases.1.tokens=5"], ["schedule.phases.1", "exactly one of"]),
        (["schedule.phases.1.rope_type=alibi"], ["schedule.phases.1.rope_type", "rope, yarn"]),
    ],
)
def test_bad_schedules_name_the_setting(overrides, named):
    with pytest.raises(ConfigError) as e:
        resolve_schedule(load_config(overrides))
    for needle in named:
        assert needle in str(e.value), (needle, str(e.value))


def test_yarn_supports_up_to_factor_times_original():
    cfg = [
        "model.max_position_embeddings=4096",
        "schedule.phases.4.rope_type=yarn",
        "schedule.phases.4.seq_length=1024",
    ]
    s = resolve_schedule(load_config(cfg))
    assert s.phases[4].rope_type == "yarn"
    with pytest.raises(ConfigError, match="original_max_position_embeddings=256 x model.rotary_scaling_factor=2"):
        resolve_schedule(
            load_config([*cfg, "model.original_max_position_embeddings=256", "model.rotary_scaling_factor=2"])
        )


def test_every_phase_is_checked_for_microbatches():
    """cpu4 (PP2 x VPP2, DP2): the 512-token phase has 4 sequences per step; with micro_batch_size 2
    that is one microbatch per DP rank, fewer than pp=2."""
    from k2.parallel.dims import ParallelDims

    cfg = load_config(["parallel=cpu4", "schedule.phases.4.micro_batch_size=2"])
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, 4)
    with pytest.raises(ConfigError) as e:
        resolve_schedule(cfg, dims)
    msg = str(e.value)
    assert "schedule.phases.4 ('anneal_512')" in msg and "parallel.pp=2" in msg and "4,096" in msg
    ok = resolve_schedule(load_config(["parallel=cpu4"]), dims)
    assert [p.num_microbatches for p in ok.phases] == [16 // (2 * 2)] * 4 + [4 // (1 * 2)]


# ------------------------------------------------------------------ optimizer-facing scheduler


def _optimizer(peak: float):
    """Two param groups as megatron builds them: the default one, and one with a halved max_lr,
    lr_mult 2 and no weight decay (wd_mult 0, as megatron does for norms and biases)."""
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([{"params": [a]}, {"params": [b]}], lr=peak)
    opt.param_groups[0].update(max_lr=peak, lr_mult=1.0, wd_mult=1.0)
    opt.param_groups[1].update(max_lr=peak / 2, lr_mult=2.0, wd_mult=0.0, lr=torch.tensor(0.0))
    return opt


def test_scheduler_sets_every_group(k2):
    opt = _optimizer(PEAK)
    sched = TokenLRScheduler(k2, opt)
    want = PEAK / 500  # step 1
    assert opt.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12)
    assert opt.param_groups[1]["lr"].item() == pytest.approx(want * 0.5 * 2.0, rel=1e-6)  # tensor lr filled
    assert opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[1]["weight_decay"] == 0.0
    for _ in range(499):
        sched.step()
    assert opt.param_groups[0]["lr"] == PEAK and sched.lr == PEAK  # step 500


def test_resume_restores_the_next_steps_lr_once(k2):
    """State-dict round trip (until checkpointing exists): restoring after step N gives the LR of the
    uninterrupted run's step N+1, and restoring twice does not advance it twice."""
    B = K2_BATCH_TOKENS
    run = TokenLRScheduler(k2, _optimizer(PEAK))
    n = 700
    for _ in range(n):
        run.step()
    state = run.state_dict()
    assert state["consumed_tokens"] == n * B
    uninterrupted_next = run.optimizer.param_groups[0]["lr"]  # what step N+1 runs with
    assert uninterrupted_next == pytest.approx(k2_lr((n + 1) * B), rel=1e-12)

    restored = TokenLRScheduler(k2, _optimizer(PEAK))
    restored.load_state_dict(state)
    assert restored.optimizer.param_groups[0]["lr"] == uninterrupted_next
    restored.load_state_dict(state)  # twice in one process
    assert restored.optimizer.param_groups[0]["lr"] == uninterrupted_next
    assert restored.consumed_tokens == n * B
    # and both go on identically; a jump deep into the run lands on the closed form too
    run.step()
    restored.step()
    assert restored.optimizer.param_groups[0]["lr"] == run.optimizer.param_groups[0]["lr"]
    restored.load_state_dict({"consumed_tokens": 200_000 * B, "steps": 200_000})
    assert restored.lr == pytest.approx(k2_lr(200_001 * B), rel=1e-12)


@pytest.mark.parametrize("style", ["linear", "cosine", "exponential", "minus_sqrt"])
def test_wsd_decay_styles_equal_megatrons_scheduler_step_by_step(style):
    """Warmup 10 steps, stable 20, decay 30 with ``style``: every step's LR equals megatron-core's own
    ``OptimizerParamScheduler`` (``lr_decay_style="WSD"``, ``lr_wsd_decay_style=style``) at that step,
    an implementation of the curves independent of ours (``decay_coefficient``)."""
    from types import SimpleNamespace

    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    s = _schedule(
        "[{name:w,steps:10,lr_style:linear,lr_start:0.0,lr_end:1.0e-3,seq_length:128},"
        "{name:c,steps:20,lr_style:constant},"
        f"{{name:d,steps:30,lr_style:{style},lr_end:1.0e-4}}]"
    )
    assert s.total_steps == 60
    opt = SimpleNamespace(param_groups=[{"params": []}])
    ref = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=1e-3,
        min_lr=1e-4,
        lr_warmup_steps=10,
        lr_decay_steps=60,
        lr_decay_style="WSD",
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=60,
        wd_incr_style="constant",
        wsd_decay_steps=30,
        lr_wsd_decay_style=style,
    )
    ours, theirs = [], []
    for step in range(1, 61):
        ref.step(1)
        ours.append(s.step_lr(step))
        theirs.append(ref.get_lr(opt.param_groups[0]))
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-18)
    assert len(set(ours[30:])) == 30  # the decay really decays, step by step
