"""Per-phase data: a cpu4 run (PP2 x VPP2 x EP2 x DP2) whose anneal phase switches to its own blend
and validation set (an anneal corpus written by ``k2-data prepare`` from the standard library's
docstrings, with the embedded corpus's tokenizer) switches without a restart, and resumes exactly from
a checkpoint before the switch and from one after it: per-step loss, grad norm and validation loss
equal, bitwise, to the uninterrupted run."""

from __future__ import annotations

import ast
import json
import sysconfig
from pathlib import Path

import pytest

from k2.config.load import load_config
from k2.launcher.datasets.preprocess import prepare_corpus
from support.distributed import run_trainer

pytestmark = pytest.mark.slow

SWITCH = 3  # first step of the anneal phase (2 warmup steps before it)


def _anneal_corpus(root: Path, tokenizer: str) -> str:
    docs = []
    for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:60]:
        try:
            tree = ast.parse(p.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        docs += [
            ast.get_docstring(n)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(n)
        ]
    (root / "anneal.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = prepare_corpus(
        load_config(
            [
                f"prepare.input={root / 'anneal.jsonl'}",
                f"prepare.output={root / 'anneal'}",
                "prepare.progress=false",
                f"data.tokenizer={tokenizer}",
            ]
        ),
        log=lambda s: None,
    )
    return out.prefixes[0]


def _args(corpus, anneal: str) -> list[str]:
    train, valid = corpus.train_prefix, corpus.valid_prefix
    phases = (
        "[{name:warmup,steps:2,lr_style:linear,lr_start:0.0,lr_end:3.0e-3,seq_length:128},"
        f"{{name:anneal,steps:3,lr_style:linear,lr_end:3.0e-4,"
        f"data:{{path:[0.5,'{train}',0.5,'{anneal}'],valid_path:'{anneal}'}}}}]"
    )
    return [
        "parallel=cpu4",
        f"schedule.phases={phases}",
        f"data.path={train}",
        f"data.valid_path={valid}",
        f"data.tokenizer={corpus.tokenizer_path}",
        "train.eval_interval=4",
        "train.eval_iters=1",
        "train.save_interval=2",
        "checkpoint.keep_last=3",
        "checkpoint.save_at_end=false",
        "run.seed=5",
    ]


def _state(ckpt: Path) -> dict:
    return json.loads((ckpt / "k2_state.json").read_text())


def test_anneal_blend_switch_resumes_exactly(tmp_path, stdlib_corpus):
    anneal = _anneal_corpus(tmp_path, stdlib_corpus.tokenizer_path)
    args = _args(stdlib_corpus, anneal)
    ref_dir = tmp_path / "ref"
    ref = {r["step"]: r for r in run_trainer(args, 4, ref_dir)}
    assert sorted(ref) == list(range(1, 6))
    assert [ref[s]["phase"] for s in range(1, 6)] == ["warmup"] * 2 + ["anneal"] * 3
    assert all("val_loss" in ref[s] for s in (4, 5))  # (evaluated on the anneal validation set)
    ckpts = ref_dir / "checkpoints"
    # the data position recorded per blend: before the switch the base blend, after it the anneal blend
    # (its 2 steps x 16 sequences so far)
    assert _state(ckpts / "iter_0000002")["data_path"] == [stdlib_corpus.train_prefix]
    after = _state(ckpts / "iter_0000004")
    assert after["data_path"] == [stdlib_corpus.train_prefix, anneal]
    assert after["consumed_samples_in_context"] == (4 - SWITCH + 1) * 16

    for start in (2, 4):  # resume before the switch (crosses it) and inside the anneal blend
        run = tmp_path / f"resume{start}"
        got = {r["step"]: r for r in run_trainer([*args, f"resume.from={ckpts / f'iter_{start:07d}'}"], 4, run)}
        assert sorted(got) == list(range(start + 1, 6))
        for s in got:
            assert (got[s]["loss"], got[s]["grad_norm"], got[s].get("val_loss")) == (
                ref[s]["loss"],
                ref[s]["grad_norm"],
                ref[s].get("val_loss"),
            ), (start, s)
