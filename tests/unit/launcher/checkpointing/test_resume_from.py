"""``resume.from=PATH`` that names no checkpoint: one error naming ``resume.from`` and what it may name, never
advice to delete a "damaged checkpoint" that is something else (in-process, no ranks start)."""

from __future__ import annotations

import pytest

from k2.config.errors import ConfigError
from k2.config.load import load_config
from k2.launcher.training.prepare import prepare_run
from support.fake_runs import SINGLE
from support.fake_runs import fake_checkpoint as _fake_checkpoint


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
    assert msg.startswith(f"resume.from={data} is not a checkpoint") and "damaged" not in msg and "delete" not in msg, (
        msg
    )
    assert "is a file" in _refusal(tmp_path, data / "corpus_text_document.bin")


def test_a_damaged_checkpoint_is_still_named_as_one(tmp_path):
    ck = _fake_checkpoint(tmp_path / "old", 4, [f"run.dir={tmp_path / 'old'}"], SINGLE)
    (ck / "k2_state.json").unlink()
    assert "not a complete k2-launcher checkpoint (k2_state.json is missing)" in _refusal(tmp_path, ck)


def test_resume_compares_the_datasets_not_the_path_strings(tmp_path, monkeypatch):
    """The same files under a relative path resume; other files behind the same path are refused, naming
    the phase and both fingerprints (the checkpoint records them: k2_state.json data_fingerprint)."""
    import json

    from tokenizers import Tokenizer, models

    from k2.launcher.datasets.fingerprint import dataset_fingerprint
    from support.fake_runs import write_dataset as _write_dataset

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(15)} | {"<|endoftext|>": 15}, unk_token="w0"))
    tok.save(str(tmp_path / "tok.json"))
    prefix = str(tmp_path / "data" / "corpus")
    (tmp_path / "data").mkdir()
    _write_dataset(prefix, [[1, 2, 3, 15]] * 50)
    base = [f"data.tokenizer={tmp_path / 'tok.json'}", "model.vocab_size=16"]
    run_dir = tmp_path / "run"
    ck = _fake_checkpoint(run_dir, 4, [*base, f"data.path={prefix}", f"run.dir={run_dir}"], SINGLE)
    state = json.loads((ck / "k2_state.json").read_text())
    state.update(phase="warmup", data_path=[prefix], data_fingerprint={prefix: dataset_fingerprint(prefix)})
    (ck / "k2_state.json").write_text(json.dumps(state))

    monkeypatch.chdir(tmp_path)  # the same files, named relative to the current directory
    plan = prepare_run(load_config([*base, "data.path=data/corpus", f"run.dir={run_dir}"]), 1)
    assert plan.resume_from == ck

    _write_dataset(prefix, [[1, 2, 15]] * 60)  # other documents behind the same path
    with pytest.raises(
        ConfigError,
        match=r"would train phase 'warmup' on other data: .*corpus then \(.* bytes, "
        r"sha256 \w+\) vs .*corpus now \(.*resume.force=true",
    ):
        prepare_run(load_config([*base, f"data.path={prefix}", f"run.dir={run_dir}"]), 1)
    assert (
        prepare_run(
            load_config([*base, f"data.path={prefix}", f"run.dir={run_dir}", "resume.force=true"]), 1
        ).resume_from
        == ck
    )
