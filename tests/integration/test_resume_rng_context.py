"""Resume is exact where it depends on more than the weights: the RNG state (dropout on, so every step
draws random masks) and the data position across a context-length switch (128 -> 512 tokens per
sequence at step 3). One rank, a 5-step run straight against 3 steps + a resume to 5: the resumed steps
must be bitwise equal. (Without the checkpoint's RNG restore the resumed run draws its masks from the
seed's initial state, and without the per-phase data position it reads the wrong 512-token sequences:
either makes steps 4-5 differ.)"""

from __future__ import annotations

import re

import pytest

from k2.config.load import load_config
from k2.model.params import count_params
from support.distributed import run_trainer

pytestmark = pytest.mark.slow

RUN = [
    "parallel=single",
    "model.hidden_dropout=0.1",
    "model.attention_dropout=0.1",
    "schedule.global_batch_tokens=1024",
    "train.eval_interval=0",
    "train.save_interval=null",
    "schedule.phases=[{name:warmup,steps:2,lr_style:linear,lr_start:0.0,lr_end:1.0e-3,seq_length:128},"
    "{name:long,steps:3,lr_style:constant,seq_length:512}]",
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, stdlib_corpus):
    """The 5-step run straight (no checkpoint: nothing resumes from it): (run dir, records)."""
    run_dir = tmp_path_factory.mktemp("rng") / "ref"
    return run_dir, run_trainer([*RUN, "train.iters=5", "checkpoint.save_at_end=false"], 1, run_dir)


def test_resume_restores_rng_and_data_position_across_a_context_switch(reference, tmp_path):
    ref = reference[1]
    assert [(r["step"], r["seq_length"]) for r in ref] == [(1, 128), (2, 128), (3, 512), (4, 512), (5, 512)]
    first = run_trainer([*RUN, "train.iters=3"], 1, tmp_path / "run")
    assert [r["loss"] for r in first] == [r["loss"] for r in ref[:3]]
    every = run_trainer([*RUN, "train.iters=5"], 1, tmp_path / "run")  # (metrics.jsonl: both runs)
    assert [r["step"] for r in every] == [1, 2, 3, 4, 5]
    resumed = every[3:]
    for got, want in zip(resumed, ref[3:], strict=True):
        assert (got["loss"], got["grad_norm"], got["consumed_tokens"]) == (
            want["loss"],
            want["grad_norm"],
            want["consumed_tokens"],
        ), (got, want)


def test_optimizer_params_table_covers_every_parameter(reference):
    """``<run.dir>/optimizer_params.txt`` (docs/optimizer.md): one row per parameter pattern with its
    count and shape; the rows add up to the model's closed-form parameter count, and its total line
    names the same number. (The reference run's: dropout and the batch do not change the parameters.)"""
    lines = (reference[0] / "optimizer_params.txt").read_text().splitlines()
    rows = [x.split() for x in lines[1:] if x and not x.startswith("elements:")]
    total = 0
    for name, count, shape, optimizer, *_ in rows:
        n = 1
        for d in shape.split("x"):
            n *= int(d)
        total += int(count) * n
        assert optimizer in ("adamw", "muon"), name
    want = count_params(load_config(["parallel=single"])).total
    assert total == want
    summary = [x for x in lines if x.startswith("elements:")]
    assert len(summary) == 1
    assert sum(int(v.replace(",", "")) for v in re.findall(r"[\d,]{2,}", summary[0])) == want, summary
