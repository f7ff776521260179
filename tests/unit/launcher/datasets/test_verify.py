"""Damaged k2-data outputs (k2.launcher.datasets.verify, resolve, the k2-data / k2-train entries), each as a
new user would damage them: the ``.idx`` 100 bytes short, 64 bytes of the ``.bin`` zeroed (its size
unchanged), the ``.bin`` cut in half. ``k2-data verify`` names each bad file in one line and exits 2;
k2-train refuses a short ``.idx`` or a cut ``.bin`` in one line (exit 2) before any rank starts, and a
zeroed ``.bin`` too with ``data.verify=true`` (without it the sizes and headers agree: it is not found, as
documented)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k2.config.load import load_config
from k2.launcher import data as data_entry
from k2.launcher import train as train_entry
from k2.launcher.benchmarks.data_prepare import stdlib_docstrings
from k2.launcher.checksums import file_checksum
from k2.launcher.datasets import preprocess as P
from k2.launcher.datasets.resolve import resolve_data
from k2.launcher.datasets.tokenizer import train_byte_level_bpe

VOCAB = 600


@pytest.fixture
def built(tmp_path):
    """A two-shard k2-data build of real text: ``(prefixes, tokenizer, manifest path)``."""
    docs = stdlib_docstrings(200)
    tok = str(tmp_path / "tokenizer.json")
    train_byte_level_bpe(docs, VOCAB).save(tok)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    out = P.prepare_corpus(
        load_config(
            [
                f"prepare.input={tmp_path / 'a.jsonl'}",
                f"prepare.output={tmp_path / 'c'}",
                "prepare.progress=false",
                "prepare.shard_documents=100",
                f"data.tokenizer={tok}",
                f"model.vocab_size={VOCAB}",
            ]
        ),
        log=lambda s: None,
    )
    return out.prefixes, tok, out.manifest_path


def _zero(path: str, at: int = 40, n: int = 64) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(b"\0" * n)


def _train_args(prefix: str, tok: str, tmp_path, *extra) -> list[str]:
    return [
        f"data.path={prefix}",
        f"data.tokenizer={tok}",
        f"model.vocab_size={VOCAB}",
        "data.split='90,10,0'",
        f"run.dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'cache'}",
        *extra,
    ]


def test_every_output_is_in_the_manifest_with_its_checksum(built):
    prefixes, _, manifest_path = built
    outputs = json.loads(Path(manifest_path).read_text())["outputs"]
    d = Path(manifest_path).parent
    assert sorted(outputs) == sorted(Path(p + ext).name for p in prefixes for ext in (".bin", ".idx"))
    for name, entry in outputs.items():  # hashed while written, equal to a hash of the file read back
        assert entry == {"size": (d / name).stat().st_size, "xxh3_64": file_checksum(d / name)}, name


def test_k2_data_verify_names_each_damaged_file_in_one_line(built, capsys):
    prefixes, _, manifest_path = built
    assert data_entry.main(["verify", manifest_path]) == 0
    out = capsys.readouterr().out
    assert "4 files match" in out and "GB/s" in out, out
    _zero(prefixes[0] + ".bin")
    idx = Path(prefixes[1] + ".idx")
    idx.write_bytes(idx.read_bytes()[:-100])
    assert data_entry.main(["verify", prefixes[1]]) == 2  # (a dataset prefix: its whole build is checked)
    err = capsys.readouterr().err.strip().splitlines()
    damaged = [line for line in err if line.startswith("k2-data: damaged: ")]
    assert len(damaged) == 2 and len(err) == 3, err
    assert f"{prefixes[0]}.bin: content changed" in damaged[0]
    assert (
        f"{prefixes[1]}.idx: {idx.stat().st_size} bytes, {manifest_path} records {idx.stat().st_size + 100}"
        in damaged[1]
    )
    assert err[2].startswith("k2-data: verify: 2 of 4 files damaged")


def test_k2_train_refuses_a_short_idx_in_one_line_before_any_rank(built, tmp_path, capsys, no_process_start):
    """The ``.idx`` 100 bytes short: the lengths it starts with are intact, so only its size against its
    header tells (megatron would fail later with an AttributeError per rank)."""
    prefixes, tok, _ = built
    idx = Path(prefixes[0] + ".idx")
    idx.write_bytes(idx.read_bytes()[:-100])
    assert train_entry.main(_train_args(prefixes[0], tok, tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"k2-train: error: data.path: {idx} is damaged: "), err
    assert "truncated" in err[0] and no_process_start == []


def test_k2_train_refuses_a_bin_cut_in_half_naming_both_files(built, tmp_path, capsys, no_process_start):
    prefixes, tok, _ = built
    bin_path = Path(prefixes[0] + ".bin")
    bin_path.write_bytes(bin_path.read_bytes()[: bin_path.stat().st_size // 2])
    assert train_entry.main(_train_args(prefixes[0], tok, tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{bin_path} has" in err[0] and f"{prefixes[0]}.idx describes" in err[0], err
    assert no_process_start == []


def test_a_zeroed_bin_is_refused_with_data_verify_before_any_step(built, tmp_path, capsys, no_process_start):
    prefixes, tok, manifest_path = built
    _zero(prefixes[0] + ".bin")
    resolve_data(load_config(_train_args(prefixes[0], tok, tmp_path)))  # sizes and headers agree: not found
    assert train_entry.main(_train_args(prefixes[0], tok, tmp_path, "data.verify=true")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"k2-train: error: data.verify: {prefixes[0]}.bin: content changed"), err
    assert manifest_path in err[0] and no_process_start == [] and not (tmp_path / "run").exists()


def test_data_verify_prints_its_cost_and_names_datasets_without_a_manifest(built, tmp_path, capsys):
    from k2.launcher.datasets.verify import verify_datasets

    prefixes, _, _ = built
    lines: list[str] = []
    verify_datasets([*prefixes, "/elsewhere/megatron_text_document"], log=lines.append)
    assert len(lines) == 1 and "4 files of 2 datasets match" in lines[0] and "GB/s" in lines[0], lines
    assert "no manifest" in lines[0] and "/elsewhere/megatron_text_document" in lines[0]
