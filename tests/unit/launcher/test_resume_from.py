"""``resume.from=PATH`` that names no checkpoint: one error naming ``resume.from`` and what it may name, never
advice to delete a "damaged checkpoint" that is something else (in-process, no ranks start)."""

from __future__ import annotations

import pytest

from k2.config.errors import ConfigError
from k2.config.load import load_config
from k2.launcher.training.prepare import prepare_run

from test_checkpoint_rules import SINGLE, _fake_checkpoint


def _refusal(tmp_path, where) -> str:
    with pytest.raises(ConfigError) as e:
        prepare_run(load_config([f"run.dir={tmp_path / 'run'}", f"resume.from={where}"]), 1)
    return str(e.value)


def test_missing_path_names_resume_from(tmp_path):
    msg = _refusal(tmp_path, "/nope")
    assert msg.startswith("resume.from=/nope: no such directory; allowed: a checkpoint"), msg


def test_a_data_directory_is_not_a_damaged_checkpoint(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "corpus_text_document.bin").write_bytes(b"\0" * 64)
    (data / "corpus_text_document.idx").write_bytes(b"\0" * 64)
    msg = _refusal(tmp_path, data)
    assert msg.startswith(f"resume.from={data} is not a checkpoint") and "damaged" not in msg and \
        "delete" not in msg, msg
    assert "is a file" in _refusal(tmp_path, data / "corpus_text_document.bin")


def test_a_damaged_checkpoint_is_still_named_as_one(tmp_path):
    ck = _fake_checkpoint(tmp_path / "old", 4, [f"run.dir={tmp_path / 'old'}"], SINGLE)
    (ck / "k2_state.json").unlink()
    assert "not a complete k2-launcher checkpoint (k2_state.json is missing)" in _refusal(tmp_path, ck)
