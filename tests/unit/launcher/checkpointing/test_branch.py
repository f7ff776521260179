"""A run started as a cooldown branch of another run's checkpoint (launcher/checkpointing/branch.py): its
schedule must be the trunk's up to the branch point; its run dir starts with the trunk's records up to there."""

from __future__ import annotations

import json

import pytest

from k2.config.errors import ConfigError

P0 = "{name:warmup,steps:2,lr_style:linear,lr_start:0.0,lr_end:3.0e-3,seq_length:128}"
TRUNK = f"schedule.phases=[{P0},{{name:stable,until_tokens:20480,lr_style:constant,lr_start:3.0e-3}}]"


def _cfg(phases: str):
    from k2.config.load import load_config

    return load_config(["schedule.global_batch_tokens=512", phases])


def _branch(stable_until: int, decay: str = "minus_sqrt", lr: float = 3.0e-3) -> str:
    return (
        f"schedule.phases=[{P0},{{name:stable,until_tokens:{stable_until},lr_style:constant,lr_start:{lr}}},"
        f"{{name:cooldown,until_tokens:5120,lr_style:{decay},lr_start:{lr},lr_end:0.0}}]"
    )


def test_a_branch_may_differ_from_its_trunk_only_after_the_branch_point():
    from k2.launcher.checkpointing.branch import check_branch_schedule

    trunk = _cfg(TRUNK).schedule
    check_branch_schedule(_cfg(_branch(4096)), trunk, 8, "ck")  # decays from step 9 on: fine
    with pytest.raises(ConfigError, match=r"at step 8 \(before the branch point, step 8\)"):
        check_branch_schedule(_cfg(_branch(3584)), trunk, 8, "ck")  # its decay starts at step 8
    with pytest.raises(ConfigError, match="at step 2 .* LR 0.002 .* the trunk trained LR 0.003"):
        check_branch_schedule(_cfg(_branch(4096, lr=2.0e-3)), trunk, 8, "ck")


def test_the_branch_run_dir_starts_with_the_trunks_records_up_to_the_branch_point(tmp_path):
    from k2.launcher.checkpointing.branch import BRANCH_FILE, seed_branch_run_dir

    trunk = tmp_path / "trunk"
    ck = trunk / "checkpoints" / "iter_0000003"
    ck.mkdir(parents=True)
    lines = [json.dumps({"step": s, "loss": 1.0 / (s + 1)}) for s in range(0, 6)]
    (trunk / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 6, "lo')  # a torn last record
    branch = tmp_path / "branch"
    assert seed_branch_run_dir(branch, ck, 3) is True
    assert (branch / "metrics.jsonl").read_text() == "\n".join(lines[:4]) + "\n"  # the same bytes
    info = json.loads((branch / BRANCH_FILE).read_text())
    assert info["trunk_step"] == 3 and info["trunk_dir"] == str(trunk.resolve()) and info["copied_records"] == 4
    (branch / "metrics.jsonl").write_text("its own\n")
    assert seed_branch_run_dir(branch, ck, 3) is False  # a second start leaves the branch's records alone
    assert (branch / "metrics.jsonl").read_text() == "its own\n"
