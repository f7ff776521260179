"""Per-phase data settings (``schedule.phases.<i>.data``): inheritance, validation against the files, the
stretches of steps one dataset build serves and each blend's data position, and ``k2-plan``'s listing.
The trainer run that switches blend and resumes across the switch is tests/integration/test_phase_data.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from k2.config.errors import ConfigError
from k2.config.load import load_config
from k2.launcher import plan as plan_entry
from k2.launcher.datasets.resolve import phase_data_settings, resolve_data, resolve_phase_data
from k2.launcher.training import phase_data as PD
from k2.schedules.resolve import resolve_schedule
from support.fake_runs import write_dataset as _write_dataset
from support.helpers import run_tool

# 2,048 tokens per step; at 128 tokens 16 sequences per step, at 512 tokens 4
PHASES = (
    "[{name:a,steps:2,lr_style:constant,lr_start:1.0e-3,seq_length:128},"
    "{name:b,steps:2,lr_style:constant,data:{path:B}},"
    "{name:c,steps:2,lr_style:constant,seq_length:512},"
    "{name:d,steps:2,lr_style:constant,seq_length:128,data:{path:A,valid_path:V}},"
    "{name:e,steps:2,lr_style:constant,data:{path:B}}]"
)


def test_settings_inherit_from_the_previous_phase():
    cfg = load_config(["data.path=A", "data.tokenizer=t.json", f"schedule.phases={PHASES}"])
    assert phase_data_settings(cfg) == [("A", None), ("B", None), ("B", None), ("A", "V"), ("B", "V")]


def test_phase_data_is_validated_and_named(tmp_path):
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(15)} | {"<|endoftext|>": 15}, unk_token="w0"))
    tok.save(str(tmp_path / "tok.json"))
    for name in ("A", "B", "V"):
        _write_dataset(str(tmp_path / name), [[1, 2, 3, 15]] * 50)
    base = [f"data.path={tmp_path / 'A'}", f"data.tokenizer={tmp_path / 'tok.json'}", "model.vocab_size=16"]
    phases = (
        PHASES.replace("path:B", f"path:'{tmp_path / 'B'}'")
        .replace("path:A", f"path:'{tmp_path / 'A'}'")
        .replace("valid_path:V", f"valid_path:'{tmp_path / 'V'}'")
    )
    cfg = load_config([*base, f"schedule.phases={phases}"])
    resolved = resolve_phase_data(cfg, resolve_data(cfg))
    assert [r.train_blend[0][0].rsplit("/", 1)[1] for r in resolved] == ["A", "B", "B", "A", "B"]
    assert resolved[1] is resolved[2] and resolved[3].valid_blend[0][0].endswith("/V")
    assert resolved[4].valid_blend == resolved[3].valid_blend  # valid_path carried on with the next blend

    missing = load_config([*base, "schedule.phases.0.data.path=" + str(tmp_path / "nope")])
    with pytest.raises(ConfigError, match=r"schedule.phases.0.data: data.path: dataset prefix .*nope.* missing"):
        resolve_phase_data(missing, resolve_data(missing))
    embedded = load_config([f"schedule.phases.1.data.path={tmp_path / 'B'}"])
    with pytest.raises(ConfigError, match=r"schedule.phases.1.data names its own data but data.path is null"):
        resolve_phase_data(embedded, resolve_data(embedded))


def test_stretches_and_data_position_per_blend(monkeypatch):
    """Each (seq_length, blend) is one dataset build; a blend that comes back continues its samples."""
    cfg = load_config(["data.path=A", "data.tokenizer=t.json", f"schedule.phases={PHASES}", "train.micro_batch_size=1"])
    schedule = resolve_schedule(cfg)
    blend = {n: SimpleNamespace(train_blend=([n], None), valid_blend=None, split="98,2,0") for n in "AB"}
    plan = SimpleNamespace(
        schedule=schedule,
        steps=10,
        data=blend["A"],
        dims=SimpleNamespace(vpp=1, dp=1),
        phase_data=(blend["A"], blend["B"], blend["B"], blend["A"], blend["B"]),
    )
    builds, starts = [], []
    monkeypatch.setattr(
        PD,
        "build_datasets",
        lambda data, seq, seed, train_samples, valid_samples: (
            builds.append((data.train_blend[0][0], seq, train_samples)) or ("train", "valid")
        ),
    )
    monkeypatch.setattr(
        PD, "microbatch_iterators", lambda ds, phase, plan, dp_rank, start_sample=0: starts.append(start_sample) or []
    )
    data = PD.PhaseData(1, 1, plan, 0)
    for step in range(1, 11):
        data.enter(schedule.step_phase(step), step)
    # stretches: A@128 steps 1-2 and 7-8, B@128 steps 3-4 and 9-10, B@512 steps 5-6
    assert [k[1][0] + (k[0],) for k, _, _ in data.stretches()] == [
        ("A", 128),
        ("B", 128),
        ("B", 512),
        ("A", 128),
        ("B", 128),
    ]
    assert builds == [("A", 128, 64), ("B", 128, 64), ("B", 512, 8), ("A", 128, 64), ("B", 128, 64)]
    # samples: A 0,16 then 32,48 (continues); B@128 0,16 then 32,48; B@512 0,4
    assert starts == [0, 16, 0, 16, 0, 4, 32, 48, 32, 48]
    # resumed at step 9 (a fresh PhaseData): the same position as the uninterrupted run
    starts.clear()
    PD.PhaseData(1, 1, plan, 0).enter(schedule.step_phase(9), 9)
    assert starts == [32]


def test_plan_lists_each_phases_blend(capsys):
    args = ["schedule.phases.3.data.path=[0.6,/d/hq,0.4,/d/web]", "cluster.gpus_per_node=2"]
    rc, out, _ = run_tool(capsys, plan_entry.main, [*args, "output=json"])
    assert rc == 0
    rows = json.loads(out)["phase_data"]
    assert [r["data_path"] for r in rows] == [None] * 3 + [[0.6, "/d/hq", 0.4, "/d/web"]] * 2
    rc, out, _ = run_tool(capsys, plan_entry.main, args)
    assert rc == 0 and 'anneal_512  [0.6, "/d/hq", 0.4, "/d/web"]' in out
