"""The trainer follows the schedule: a CPU run of k2_tiny on cpu4 (PP2 x VPP2 x EP2 x DP2) crosses a
context-length boundary mid-run (128 -> 512 tokens) without restarting, keeps 2,048 tokens per step,
switches to YaRN at a later boundary, and keeps learning. Expected steps and LRs are computed here from
the phase lengths (rounding rule: a boundary at T tokens takes effect after step ceil(T / 2048))."""

from __future__ import annotations

import math

import pytest

from support.distributed import run_trainer

pytestmark = pytest.mark.slow

B = 2048
SHORT_END = 8_000  # 8,000 / 2,048 = 3.9: the short phase ends after step 4
LONG = 12_288  # 6 steps at 512 tokens: 3 to compare the first with and 3 for the last
LONG_END = SHORT_END + LONG
PEAK, FLOOR = 1.0e-3, 3.0e-4  # the LR after warmup, at the end of the cosine
PHASES = (
    f"[{{name:warmup,steps:2,lr_style:linear,lr_start:0.0,lr_end:{PEAK},seq_length:128}},"
    f"{{name:short,until_tokens:{SHORT_END},lr_style:constant}},"
    f"{{name:long,tokens:{LONG},lr_style:cosine,lr_end:{FLOOR},seq_length:512,micro_batch_size:1}},"
    "{name:long_yarn,tokens:4096,lr_style:constant,rope_type:yarn}]"
)


def expected_lr(tokens: float) -> float:
    if tokens <= 2 * B:
        return PEAK * tokens / (2 * B)
    if tokens <= SHORT_END:
        return PEAK
    r = min(1.0, (tokens - SHORT_END) / LONG)
    if tokens <= LONG_END:
        return FLOOR + (PEAK - FLOOR) * 0.5 * (1 + math.cos(math.pi * r))
    return FLOOR


def test_cpu4_run_crosses_a_context_boundary(tmp_path, stdlib_corpus):
    recs = run_trainer(
        [
            "parallel=cpu4",
            f"schedule.phases={PHASES}",
            "train.eval_interval=0",
            "run.seed=11",
            "checkpoint.save_at_end=false",
        ],
        4,
        tmp_path,
    )
    switch = math.ceil(SHORT_END / B) + 1  # first step at 512 tokens
    yarn = math.ceil(LONG_END / B) + 1  # first step with YaRN
    last = math.ceil((LONG_END + 4096) / B)  # the end of the last phase ends the run
    assert [r["step"] for r in recs] == list(range(1, last + 1))
    for r in recs:
        s = r["step"]
        assert r["consumed_tokens"] == s * B  # tokens per step constant across the switch
        want_ctx = 128 if s < switch else 512
        assert r["seq_length"] == want_ctx and r["global_batch_size"] * want_ctx == B
        # microbatches per DP rank: 16 / (2 x 2) at 128 tokens, 4 / (1 x 2) at 512
        assert r["num_microbatches"] == (4 if s < switch else 2)
        assert r["phase"] == ("warmup" if s <= 2 else "short" if s < switch else "long" if s < yarn else "long_yarn")
        assert r["lr"] == pytest.approx(expected_lr(s * B), rel=1e-9)
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
    loss = {r["step"]: r["loss"] for r in recs}
    # keeps learning across the switch: the long-context phase ends lower than it starts, and lower
    # than the run started
    first_long = [loss[s] for s in range(switch, switch + 3)]
    last_long = [loss[s] for s in range(yarn - 3, yarn)]
    assert sum(last_long) / 3 < sum(first_long) / 3 < loss[1]
    assert max(loss[s] for s in range(switch, last + 1)) < loss[1]
    # YaRN (factor 32, mscale_all_dim 1) multiplies every attention logit's scale by
    # (0.1 ln 32 + 1)^2 = 1.85 at the step it starts: the max logit jumps there and only there
    jump = (0.1 * math.log(32) + 1) ** 2
    ratio = {s: recs[s - 1]["max_attn_logit"] / recs[s - 2]["max_attn_logit"] for s in range(switch + 1, last + 1)}
    assert ratio[yarn] == pytest.approx(jump, rel=0.25), ratio
    assert all(abs(ratio[s] - 1) < 0.25 for s in ratio if s != yarn), ratio
