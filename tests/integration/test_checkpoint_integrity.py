"""Checkpoint integrity: what a saved checkpoint records about its files, and resume refusing a damaged
or incomplete one with the checkpoint, the file and the ``resume.from=...`` of one that verifies.

One 2-rank run (DP=2, two checkpoints) is trained once per module; each test damages a copy of it. The
refusals that need no file contents are decided before any process group (in-process here); the
checksum refusal runs the ranks once.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from support import REPO
from support.distributed import QUIET, rank_launch_cmd, run_trainer, trainer_env

RUN = ["train.iters=2", "train.save_interval=1", "train.eval_interval=0"]
LATEST, OLDER = "iter_0000002", "iter_0000001"


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, stdlib_corpus):
    """A 2-rank run with checkpoints at steps 1 and 2 (latest)."""
    run_dir = tmp_path_factory.mktemp("integrity") / "run"
    run_trainer(RUN, 2, run_dir)
    return run_dir


def _copy(saved_run: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the run dir and the path of its latest checkpoint."""
    run_dir = tmp_path / "run"
    shutil.copytree(saved_run, run_dir)
    return run_dir, run_dir / "checkpoints" / LATEST


def _plan(run_dir: Path, *extra: str):
    from k2.config.load import load_config
    from k2.launcher.training.prepare import prepare_run

    return prepare_run(load_config([*RUN, *QUIET, f"run.dir={run_dir}", *extra]), 2)


#: one step more than the checkpoints hold: a finished run is "nothing to do" and loads nothing
ONE_MORE = [x for x in RUN if not x.startswith("train.iters=")] + ["train.iters=3"]


def _resume_in_ranks(run_dir: Path) -> str:
    """k2-train resuming ``run_dir`` on 2 ranks, which must fail; its output."""
    args = [*ONE_MORE, *QUIET, f"run.dir={run_dir}", "launch.nproc_per_node=2"]
    proc = subprocess.run(
        rank_launch_cmd(2, ["-m", "k2.launcher.train"], args),
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    return out


def _flip_byte(path: Path) -> None:
    """Change one byte in the middle of ``path``, keeping its size."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _refusal(run_dir: Path) -> str:
    from k2.config.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        _plan(run_dir)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def _assert_offers_older(msg: str, run_dir: Path) -> None:
    older = run_dir / "checkpoints" / OLDER
    assert f"that verify (files and sizes): {OLDER};" in msg, msg
    assert f"resume.from={older}" in msg, msg


def test_manifest_lists_every_file_with_size_and_checksum(saved_run):
    from k2.launcher.checkpointing.manifest import file_checksum

    ckpt = saved_run / "checkpoints" / LATEST
    manifest = json.loads((ckpt / "k2_manifest.json").read_text())
    on_disk = {p.name for p in ckpt.iterdir() if p.is_file()} - {"k2_manifest.json"}
    assert set(manifest["files"]) == on_disk
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "metadata.json", "k2_state.json", "config.yaml"} <= on_disk
    for name, entry in manifest["files"].items():
        assert entry["size"] == (ckpt / name).stat().st_size, name
        assert entry["xxh3_64"] == file_checksum(ckpt / name), name
    assert json.loads((ckpt / "k2_state.json").read_text())["manifest"] is True


def test_truncated_shard_is_refused_naming_checkpoint_and_file(saved_run, tmp_path):
    run_dir, ckpt = _copy(saved_run, tmp_path)
    shard = ckpt / "__1_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    msg = _refusal(run_dir)
    assert f"checkpoint {ckpt} is damaged or incomplete: __1_0.distcp: " in msg and "truncated" in msg, msg
    _assert_offers_older(msg, run_dir)


def test_k2_train_refuses_a_damaged_checkpoint_with_one_line_and_exit_2(saved_run, tmp_path, capsys):
    """The CLI contract: k2-train exits 2 with one ``k2-train: error:`` line before any rank starts."""
    from k2.launcher.train import main

    run_dir, ckpt = _copy(saved_run, tmp_path)
    (ckpt / "__0_0.distcp").unlink()
    assert main([*RUN, *QUIET, f"run.dir={run_dir}", "launch.nproc_per_node=2"]) == 2
    out = capsys.readouterr()
    err = out.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"k2-train: error: checkpoint {ckpt} is damaged"), err
    assert "__0_0.distcp: missing" in err[0] and "spawning" not in out.out


def test_deleted_dot_metadata_is_refused(saved_run, tmp_path):
    run_dir, ckpt = _copy(saved_run, tmp_path)
    (ckpt / ".metadata").unlink()
    msg = _refusal(run_dir)
    assert f"checkpoint {ckpt} is damaged or incomplete: .metadata: missing" in msg, msg
    _assert_offers_older(msg, run_dir)


def test_deleted_metadata_json_is_not_offered_as_complete(saved_run, tmp_path):
    run_dir, ckpt = _copy(saved_run, tmp_path)
    (ckpt / "metadata.json").unlink()
    msg = _refusal(run_dir)
    assert str(ckpt) in msg and "metadata.json is missing" in msg, msg
    _assert_offers_older(msg, run_dir)
    from k2.launcher.checkpointing.paths import complete_checkpoint_names

    assert complete_checkpoint_names(run_dir / "checkpoints") == [OLDER]


def test_one_byte_changed_in_any_file_is_found_by_its_checksum(saved_run, tmp_path):
    """Every file of the checkpoint, the manifest included: one byte changed, the size kept."""
    from k2.launcher.checkpointing.manifest import verify

    run_dir, ckpt = _copy(saved_run, tmp_path)
    names = sorted(p.name for p in ckpt.iterdir())
    assert len(names) >= 7
    for name in names:
        original = (ckpt / name).read_bytes()
        _flip_byte(ckpt / name)
        problems = sorted({p for r in (0, 1) for p in verify(ckpt, "checksum", rank=r, world_size=2)})
        assert len(problems) == 1 and problems[0].startswith(f"{name}: "), (name, problems)
        assert verify(ckpt, "size") == [] or name == "k2_manifest.json", name  # sizes kept
        (ckpt / name).write_bytes(original)
    assert verify(ckpt, "checksum") == []


def test_flipped_byte_in_a_shard_is_refused_at_resume_by_the_ranks(saved_run, tmp_path):
    """The checksum check runs in the ranks (each hashes its share, all agree) before the model is
    built: every rank exits 2; rank 0's one error line names the checkpoint, the file and the override."""
    run_dir, ckpt = _copy(saved_run, tmp_path)
    _flip_byte(ckpt / "__1_0.distcp")
    _plan(run_dir)  # the size check before any process group passes
    out = _resume_in_ranks(run_dir)
    line = next((x for x in out.splitlines() if f"checkpoint {ckpt} is damaged" in x), None)
    assert line and line.startswith("k2-train: error: "), out[-3000:]
    assert "__1_0.distcp: content changed" in line, line
    assert out.count("is damaged or incomplete") == 1, out[-3000:]  # rank 0 alone reports
    _assert_offers_older(line, run_dir)
    assert json.loads((ckpt / "k2_state.json").read_text())["step"] == 2  # nothing was trained or saved
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [OLDER, LATEST, "latest"]


def test_verify_size_and_none_skip_the_checksum(saved_run, tmp_path):
    from k2.config.errors import ConfigError

    run_dir, ckpt = _copy(saved_run, tmp_path)
    _flip_byte(ckpt / "__0_0.distcp")
    assert _plan(run_dir, "checkpoint.verify=size").resume_from == ckpt
    (ckpt / ".metadata").unlink()
    with pytest.raises(ConfigError, match=r"\.metadata: missing"):
        _plan(run_dir, "checkpoint.verify=size")
    with pytest.raises(ConfigError, match="checkpoint.verify='fast'; allowed: checksum, size, none"):
        _plan(run_dir, "checkpoint.verify=fast")


def test_checkpoint_without_manifest_from_an_older_version_is_accepted(saved_run, tmp_path):
    from k2.launcher.checkpointing.manifest import is_legacy, verify

    run_dir, ckpt = _copy(saved_run, tmp_path)
    (ckpt / "k2_manifest.json").unlink()
    msg = _refusal(run_dir)  # this version's checkpoint without its manifest: incomplete
    assert "k2_manifest.json: missing" in msg, msg
    state = json.loads((ckpt / "k2_state.json").read_text())
    del state["manifest"]
    (ckpt / "k2_state.json").write_text(json.dumps(state))
    assert is_legacy(ckpt) and verify(ckpt, "checksum") == []
    assert _plan(run_dir).resume_from == ckpt


# --- pickled parts that would run code (the manifest rewritten to match) ------------------------------


def _payload_pickle(mark: Path) -> bytes:
    """Pickle opcodes that call ``os.system("touch <mark>")`` and discard the result (protocol 0: GLOBAL,
    MARK, STRING, TUPLE, REDUCE, POP), to go in front of a real pickle stream."""
    return b"cposix\nsystem\n(" + f"S'touch {mark}'\n".encode() + b"tR0"


class _Payload:
    def __init__(self, mark: Path):
        self.mark = mark

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.mark}",)


def _rewrite_manifest(ckpt: Path) -> None:
    """What whoever can write the directory can do: a manifest that matches the files as they are."""
    from k2.launcher.checkpointing.manifest import checkpoint_files, file_entries, verify, write_manifest

    write_manifest(ckpt, file_entries(ckpt, checkpoint_files(ckpt)))
    assert verify(ckpt, "checksum") == []


def _export_refusal(capsys, ckpt: Path, out: Path) -> str:
    from k2.launcher import convert

    assert convert.main(["export", f"checkpoint={ckpt}", f"out={out}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"k2-convert: error: checkpoint {ckpt} is refused: "), err
    assert not out.exists()
    return err


def test_a_payload_in_dot_metadata_with_a_rewritten_manifest_is_refused_by_resume_and_export(
    saved_run, tmp_path, capsys
):
    """DCP's .metadata with a call of os.system in front of the real metadata (plain pickle.load would run
    it and go on to load the checkpoint normally) and the manifest rewritten to match: k2-train refuses it
    in one line before any rank starts, k2-convert export too, and the command never ran."""
    from k2.launcher.train import main

    run_dir, ckpt = _copy(saved_run, tmp_path)
    mark = tmp_path / "PWNED"
    meta = ckpt / ".metadata"
    meta.write_bytes(_payload_pickle(mark) + meta.read_bytes())
    _rewrite_manifest(ckpt)
    assert main([*ONE_MORE, *QUIET, f"run.dir={run_dir}", "launch.nproc_per_node=2"]) == 2
    out = capsys.readouterr()
    err = out.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"k2-train: error: checkpoint {ckpt} is refused: "), err
    assert ".metadata: it names posix.system" in err[0] and "spawning" not in out.out, err
    _export_refusal(capsys, ckpt, tmp_path / "hf")
    assert not mark.exists()


def test_a_payload_in_a_pickled_object_of_a_shard_is_refused_by_the_ranks_and_by_export(saved_run, tmp_path, capsys):
    """Rank 1's RNG state (a torch.save payload inside __1_0.distcp) replaced by one that calls os.system,
    .metadata pointing at it (with DCP's own classes only) and the manifest rewritten: the ranks refuse it
    before the model is built, rank 0 in one line; k2-convert export refuses it too; the command never ran."""
    import dataclasses
    import io
    import pickle

    import torch

    run_dir, ckpt = _copy(saved_run, tmp_path)
    mark = tmp_path / "PWNED"
    buf = io.BytesIO()
    torch.save([_Payload(mark)], buf)
    shard = ckpt / "__1_0.distcp"
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(buf.getvalue())
    meta = pickle.loads((ckpt / ".metadata").read_bytes())  # (a test's own, trusted file)
    index = next(
        i
        for i in meta.storage_data
        if i.fqn.startswith("rng_state/") and meta.storage_data[i].relative_path == shard.name
    )
    meta.storage_data[index] = dataclasses.replace(meta.storage_data[index], offset=offset, length=len(buf.getvalue()))
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    _rewrite_manifest(ckpt)
    _plan(run_dir)  # .metadata itself is clean: no refusal before the ranks start
    out = _resume_in_ranks(run_dir)
    lines = [x for x in out.splitlines() if "is refused" in x]
    assert len(lines) == 1 and lines[0].startswith(f"k2-train: error: checkpoint {ckpt} is refused: "), out[-3000:]
    assert f"__1_0.distcp (the object {index.fqn}): it names posix.system" in lines[0], lines[0]
    assert json.loads((ckpt / "k2_state.json").read_text())["step"] == 2  # nothing was trained or saved
    err = _export_refusal(capsys, ckpt, tmp_path / "hf")
    assert "it names posix.system" in err
    assert not mark.exists()
