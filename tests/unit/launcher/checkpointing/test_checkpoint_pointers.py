"""Checkpoint pointers stay inside their run: ``checkpoints/latest`` (and a run dir or ``checkpoints/``
directory given as ``resume.from`` or ``k2-convert export checkpoint=``) may name only a checkpoint of
the same ``checkpoints/`` directory; a ``latest`` that is not a file is refused at once instead of
failing the run's last commit (in-process, no ranks start)."""

from __future__ import annotations

import os

import pytest

from k2.config.errors import ConfigError
from k2.config.load import load_config
from k2.launcher.checkpointing.paths import latest_checkpoint
from k2.launcher.training.prepare import prepare_run
from support.fake_runs import SINGLE
from support.fake_runs import fake_checkpoint as _fake_checkpoint


def _plan(run_dir, *extra):
    return prepare_run(load_config([f"run.dir={run_dir}", *extra]), 1)


def _refused(run_dir, *extra) -> str:
    with pytest.raises(ConfigError) as e:
        _plan(run_dir, *extra)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


@pytest.fixture
def two_runs(tmp_path):
    """Our run with a checkpoint at step 6, another run with one at step 9."""
    ours, other = tmp_path / "ours", tmp_path / "OTHER_RUN"
    _fake_checkpoint(ours, 6, [f"run.dir={ours}"], SINGLE)
    _fake_checkpoint(other, 9, [f"run.dir={ours}"], SINGLE)
    return ours, other


@pytest.mark.parametrize(
    "text", ["../../OTHER_RUN/checkpoints/iter_0000009", "{other}/checkpoints/iter_0000009", "..", "."]
)
def test_a_latest_that_points_outside_the_run_is_refused(two_runs, text):
    ours, other = two_runs
    latest = ours / "checkpoints" / "latest"
    latest.write_text(text.format(other=other) + "\n")
    msg = _refused(ours)
    assert msg.startswith(
        f"{latest} names {text.format(other=other)!r}, which is not a checkpoint of {ours / 'checkpoints'}"
    ), msg
    assert "iter_0000006" in msg  # what it may name instead
    with pytest.raises(ConfigError):
        latest_checkpoint(ours)
    # a run dir given as resume.from: the same rule for its own latest
    with pytest.raises(ConfigError, match="which is not a checkpoint of"):
        _plan(ours.parent / "third", f"resume.from={ours}")


def test_a_checkpoint_name_that_is_a_link_out_of_the_run_is_refused_and_never_chosen(two_runs):
    ours, other = two_runs
    root = ours / "checkpoints"
    os.symlink(other / "checkpoints" / "iter_0000009", root / "iter_0000009")
    (root / "latest").write_text("iter_0000009\n")
    msg = _refused(ours)
    assert f"{root / 'latest'} names 'iter_0000009', which is not a checkpoint of {root}" in msg, msg
    assert "a link to" in msg, msg
    # latest missing: the newest checkpoint that verifies is ours, not the linked one
    (root / "latest").unlink()
    assert _plan(ours).resume_from == root / "iter_0000006"


def test_resume_from_a_checkpoint_of_another_run_is_still_allowed_when_asked_for(two_runs):
    ours, other = two_runs
    ck = other / "checkpoints" / "iter_0000009"
    assert _plan(ours.parent / "fresh", f"resume.from={ck}").resume_from == ck


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_latest_that_is_not_a_file_is_refused_before_anything_runs(two_runs, kind):
    ours, _ = two_runs
    latest = ours / "checkpoints" / "latest"
    latest.unlink()
    latest.mkdir() if kind == "directory" else os.mkfifo(latest)
    msg = _refused(ours)
    what = "a directory" if kind == "directory" else "a FIFO (named pipe)"
    assert msg.startswith(f"{latest} is {what}, not the file k2-train writes"), msg
    assert "move it away" in msg and "iter_0000006" in msg, msg


def test_k2_convert_export_follows_the_same_rule(two_runs, tmp_path, capsys):
    from k2.launcher import convert

    ours, _ = two_runs
    (ours / "checkpoints" / "latest").write_text("../../OTHER_RUN/checkpoints/iter_0000009\n")
    assert convert.main(["export", f"run.dir={ours}", f"out={tmp_path / 'hf'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "which is not a checkpoint of" in err, err
    assert not (tmp_path / "hf").exists()
