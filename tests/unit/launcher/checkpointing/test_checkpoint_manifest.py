"""The manifest of a checkpoint directory (k2.launcher.checkpointing.manifest) on small files: what it
records, which rank hashes which file, and what each verification level finds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k2.launcher.checkpointing.manifest import (
    check_structure,
    file_entries,
    rank_share,
    verify,
    write_manifest,
)

FILES = {
    "__0_0.distcp": b"a" * 1000,
    "__1_0.distcp": b"b" * 3000,
    "__2_0.distcp": b"c" * 10,
    ".metadata": b"meta",
    "metadata.json": b"{}",
    "common.pt": b"pt",
    "k2_state.json": b'{"manifest": true}',
}


def _checkpoint(tmp_path: Path) -> Path:
    d = tmp_path / "iter_0000004"
    d.mkdir()
    for name, data in FILES.items():
        (d / name).write_bytes(data)
    write_manifest(d, file_entries(d, FILES))
    return d


def test_each_rank_hashes_the_shards_it_wrote_rank0_the_rest():
    names = sorted(FILES)
    assert rank_share(names, 1, 3) == ["__1_0.distcp"]
    assert rank_share(names, 0, 3) == [".metadata", "__0_0.distcp", "common.pt", "k2_state.json", "metadata.json"]
    # fewer ranks than writers (a resume at a smaller DP): shards of rank R go to R mod world
    assert rank_share(names, 0, 2) == [
        ".metadata",
        "__0_0.distcp",
        "__2_0.distcp",
        "common.pt",
        "k2_state.json",
        "metadata.json",
    ]
    shares = [n for r in range(4) for n in rank_share(names, r, 4)]
    assert sorted(shares) == names  # every file exactly once


def test_manifest_records_size_and_checksum_written_atomically(tmp_path):
    d = _checkpoint(tmp_path)
    record = json.loads((d / "k2_manifest.json").read_text())
    assert record["files"]["__1_0.distcp"]["size"] == 3000
    assert record["total_bytes"] == sum(len(v) for v in FILES.values())
    assert not list(d.glob("*.tmp"))
    assert verify(d, "checksum") == [] and verify(d, "size") == []


def test_each_level_finds_what_it_promises(tmp_path):
    d = _checkpoint(tmp_path)
    (d / "common.pt").write_bytes(b"pT")  # same size, other content
    assert verify(d, "checksum") == [verify(d, "checksum")[0]] and verify(d, "checksum")[0].startswith(
        "common.pt: content changed"
    )
    assert verify(d, "size") == [] and verify(d, "none") == []
    (d / "__2_0.distcp").write_bytes(b"c" * 4)
    assert any(p.startswith("__2_0.distcp: 4 bytes, the manifest records 10") for p in verify(d, "size"))
    (d / "__0_0.distcp").unlink()
    (d / "stray.bin").write_bytes(b"x")
    problems = check_structure(d)
    assert "__0_0.distcp: missing" in problems
    assert not any(p.startswith("stray.bin") for p in problems)  # a file no load reads
    with pytest.raises(ValueError, match="allowed: checksum, size, none"):
        verify(d, "fast")


def test_an_edited_manifest_is_refused(tmp_path):
    d = _checkpoint(tmp_path)
    record = json.loads((d / "k2_manifest.json").read_text())
    record["files"]["common.pt"]["size"] = 2  # same value: still consistent
    (d / "k2_manifest.json").write_text(json.dumps(record))
    assert verify(d, "size") == []
    record["files"]["common.pt"]["xxh3_64"] = "0" * 16
    (d / "k2_manifest.json").write_text(json.dumps(record))
    assert verify(d, "size")[0].startswith("k2_manifest.json: unreadable (ValueError: its own checksum")


def test_save_error_names_the_path_and_keeps_the_previous_latest(tmp_path, megatron_world1, monkeypatch):
    """A disk-full error inside megatron's save: the error names the checkpoint directory and the rank;
    ``latest`` still names the previous checkpoint, which still verifies."""
    import errno

    from megatron.core import dist_checkpointing

    from k2.launcher.checkpointing import store
    from k2.launcher.checkpointing.loading import verify_checkpoint

    (tmp_path / "checkpoints").mkdir()
    previous = _checkpoint(tmp_path / "checkpoints")
    (tmp_path / "checkpoints" / "latest").write_text(previous.name + "\n")

    def disk_full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "sharded_state_dict", lambda *a, **k: {})
    monkeypatch.setattr(dist_checkpointing, "save", disk_full)
    with pytest.raises(store.CheckpointSaveError) as e:
        store.save_checkpoint(tmp_path, 8, [], None, {}, "", keep_last=2, keep_every=None)
    partial = tmp_path / "checkpoints" / "iter_0000008.partial"
    assert str(e.value).startswith(f"saving checkpoint step 8 into {partial} failed on rank 0: OSError: ")
    assert "No space left on device" in str(e.value)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == previous.name
    assert verify_checkpoint(previous, "checksum") >= 0


def test_verify_checkpoint_refuses_with_the_file_named(tmp_path, megatron_world1):
    from k2.config.errors import ConfigError
    from k2.launcher.checkpointing.loading import verify_checkpoint

    d = _checkpoint(tmp_path)
    (d / "__1_0.distcp").write_bytes(b"B" + FILES["__1_0.distcp"][1:])
    with pytest.raises(
        ConfigError,
        match=rf"checkpoint {d} is damaged or incomplete: __1_0.distcp: content "
        r"changed .*no other checkpoint in .* verifies",
    ):
        verify_checkpoint(d, "checksum")
    assert verify_checkpoint(d, "size") >= 0  # the size is kept: found by the checksum only


def test_checkpoint_of_an_older_version_loads_with_a_warning(tmp_path, megatron_world1, capsys):
    from k2.launcher.checkpointing.loading import verify_checkpoint

    d = _checkpoint(tmp_path)
    (d / "k2_manifest.json").unlink()
    (d / "k2_state.json").write_text("{}")  # no "manifest": true
    verify_checkpoint(d, "checksum")
    assert f"warning: checkpoint {d} has no manifest" in capsys.readouterr().out
    verify_checkpoint(d, "none")
    assert capsys.readouterr().out == ""
