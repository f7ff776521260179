"""``k2-data prepare.input=...`` (k2.launcher.datasets.preprocess / sources): raw-text corpora written by the
test from real text (the docstrings of standard-library modules) in JSONL (plain, .gz, .zst), Parquet and
plain text give the token stream of encoding each document with the tokenizer directly (the reference is
``tokenizers`` itself, not the code under test); any worker count gives the same bytes; a build killed
with SIGKILL and run again gives the bytes of an uninterrupted build; bad inputs give one error naming
the file / setting."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from k2.config.errors import ConfigError
from k2.config.load import load_config
from k2.launcher import data as data_entry
from k2.launcher.benchmarks.data_prepare import stdlib_docstrings
from k2.launcher.datasets import preprocess as P
from k2.launcher.datasets.resolve import resolve_data
from k2.launcher.datasets.tokenizer import EOD_TOKEN, HFTokenizer, train_byte_level_bpe
from support import REPO

VOCAB = 600


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return stdlib_docstrings(300)


def _cfg(inp, out, *extra, tokenizer=None):
    inp = inp if isinstance(inp, str) else "[" + ",".join(map(str, inp)) + "]"
    args = [
        f"prepare.input={inp}",
        f"prepare.output={out}",
        "prepare.progress=false",
        f"model.vocab_size={VOCAB}",
        f"data.vocab_size={VOCAB}",
        *extra,
    ]
    if tokenizer:
        args.append(f"data.tokenizer={tokenizer}")
    return load_config(args)


def _prepare(inp, out, *extra, tokenizer=None):
    return P.prepare_corpus(_cfg(inp, out, *extra, tokenizer=tokenizer), log=lambda s: None)


def _documents(prefix: str) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix, mmap=True)
    return [ds[i].tolist() for i in range(len(ds))]


def _reference(tokenizer_path: str, texts) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    eod = tok.token_to_id(EOD_TOKEN)
    return [tok.encode(t, add_special_tokens=False).ids + [eod] for t in texts if t]


def _write_jsonl(path: Path, texts, opener=open, key="text"):
    with opener(path, "wt", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": i, key: t}) + "\n")


def _bytes(prefixes) -> list[bytes]:
    return [Path(p + ext).read_bytes() for p in prefixes for ext in (".bin", ".idx")]


# ---------------------------------------------------------------------------------------------------
# formats: the same token stream as the tokenizer on each document
# ---------------------------------------------------------------------------------------------------


def test_jsonl_plain_gz_zst_in_a_directory(tmp_path, docs, tokenizer_json):
    import zstandard

    d = tmp_path / "in"
    d.mkdir()
    parts = [docs[:100], docs[100:200], docs[200:]]
    _write_jsonl(d / "a.jsonl", parts[0])
    _write_jsonl(d / "b.jsonl.gz", parts[1], opener=gzip.open)
    with open(d / "c.jsonl.zst", "wb") as raw, zstandard.ZstdCompressor().stream_writer(raw) as z:
        z.write("".join(json.dumps({"text": t}) + "\n" for t in parts[2]).encode())
    (d / "notes.md").write_text("not an input")  # unknown formats inside a directory are left out
    out = _prepare(str(d), tmp_path / "out" / "corpus", tokenizer=tokenizer_json)
    assert out.prefixes == [str(tmp_path / "out" / "corpus")]
    assert _documents(out.prefixes[0]) == _reference(tokenizer_json, docs)
    m = out.manifest
    assert m["documents"] == len(docs) and m["tokens"] == sum(map(len, _reference(tokenizer_json, docs)))
    assert [Path(i["path"]).name for i in m["inputs"]] == ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst"]
    assert m["inputs"][0]["sha256"] == P.file_sha256(str(d / "a.jsonl"))
    assert m["tokenizer"]["sha256"] == P.file_sha256(tokenizer_json) and not m["tokenizer"]["trained"]
    # the same settings again: nothing rebuilt
    again = _prepare(str(d), tmp_path / "out" / "corpus", tokenizer=tokenizer_json)
    assert not again.rebuilt


def test_parquet_and_a_custom_text_column(tmp_path, docs, tokenizer_json):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": list(range(len(docs))), "content": docs})
    pq.write_table(table, tmp_path / "x.parquet", row_group_size=64)
    out = _prepare(
        str(tmp_path / "*.parquet"),
        tmp_path / "pq",
        "prepare.text_key=content",
        "prepare.chunk_documents=50",
        tokenizer=tokenizer_json,
    )
    assert _documents(out.prefixes[0]) == _reference(tokenizer_json, docs)


def test_plain_text_files_and_paragraphs(tmp_path, docs, tokenizer_json):
    d = tmp_path / "txt"
    d.mkdir()
    for i, t in enumerate(docs[:40]):
        (d / f"doc{i:03d}.txt").write_text(t, encoding="utf-8")
    out = _prepare(str(d), tmp_path / "files", tokenizer=tokenizer_json)
    assert _documents(out.prefixes[0]) == _reference(tokenizer_json, docs[:40])
    # paragraph mode: blank-line separated blocks of one file (each keeps its trailing newline)
    paras = [" ".join(t.split()) for t in docs[:30]]
    (tmp_path / "book.txt").write_text("\n\n\n".join(paras) + "\n", encoding="utf-8")
    out = _prepare(
        str(tmp_path / "book.txt"), tmp_path / "paras", "prepare.text_document=paragraph", tokenizer=tokenizer_json
    )
    assert _documents(out.prefixes[0]) == _reference(tokenizer_json, [p + "\n" for p in paras])


def test_trained_tokenizer_shards_and_megatron_samples(tmp_path, docs):
    """data.tokenizer=null trains a BPE on the input; shards concatenate to one stream; the result
    resolves as data.path and megatron's GPTDataset samples it."""
    from k2.launcher.datasets.gpt import build_datasets

    _write_jsonl(tmp_path / "a.jsonl", docs)
    out = _prepare(str(tmp_path / "a.jsonl"), tmp_path / "o" / "c", "prepare.shard_documents=120")
    tok_path = str(tmp_path / "o" / "c.tokenizer.json")
    assert out.tokenizer_path == tok_path and out.manifest["tokenizer"]["trained"]
    assert HFTokenizer(tok_path).vocab_size == VOCAB
    assert [Path(p).name for p in out.prefixes] == ["c_00000", "c_00001", "c_00002"]
    assert [d["documents"] for d in out.manifest["datasets"]] == [120, 120, 60]
    stream = [doc for p in out.prefixes for doc in _documents(p)]
    assert stream == _reference(tok_path, docs)

    cfg = load_config(
        [
            f"data.path=[{','.join(out.prefixes)}]",
            f"data.tokenizer={tok_path}",
            f"data.valid_path={out.prefixes[2]}",
            f"model.vocab_size={VOCAB}",
            f"data.cache_dir={tmp_path / 'cache'}",
        ]
    )
    resolved = resolve_data(cfg)
    train_ds, _ = build_datasets(resolved, 64, 1, train_samples=8, valid_samples=2)
    flat = np.concatenate([np.asarray(d) for p in out.prefixes[:2] for d in _documents(p)])
    sample = train_ds[0]["tokens"].numpy()
    hits = np.flatnonzero(flat == sample[0])  # every sample is a window of the written stream
    assert any(np.array_equal(flat[h : h + 64], sample) for h in hits if h + 64 <= flat.size)


# ---------------------------------------------------------------------------------------------------
# determinism and resume
# ---------------------------------------------------------------------------------------------------


def test_one_and_two_workers_write_identical_bytes(tmp_path, docs, tokenizer_json):
    _write_jsonl(tmp_path / "a.jsonl", docs)
    # chunks of up to 40 records, ended early at 5,000 bytes: of varied record counts
    one = _prepare(
        str(tmp_path / "a.jsonl"),
        tmp_path / "w1" / "c",
        "prepare.workers=1",
        "prepare.chunk_documents=40",
        "prepare.chunk_bytes=5000",
        tokenizer=tokenizer_json,
    )
    two = _prepare(
        str(tmp_path / "a.jsonl"),
        tmp_path / "w2" / "c",
        "prepare.workers=2",
        "prepare.chunk_documents=40",
        "prepare.chunk_bytes=5000",
        tokenizer=tokenizer_json,
    )
    assert _bytes(one.prefixes) == _bytes(two.prefixes)
    assert _documents(one.prefixes[0]) == _reference(tokenizer_json, docs)


_KILLED_BUILD = """
import sys
from k2.config.load import load_config
from k2.launcher.datasets import preprocess as P
from k2.launcher.datasets import chunked
real = chunked.commit_chunk
def slow_commit(work, k, result):  # a build that takes long enough to be killed in the middle
    import time
    real(work, k, result)
    time.sleep(0.3)
chunked.commit_chunk = slow_commit
P.prepare_corpus(load_config(sys.argv[1:]), log=lambda s: None)
"""


def test_sigkill_and_rerun_equals_an_uninterrupted_build(tmp_path, docs, tokenizer_json):
    _write_jsonl(tmp_path / "a.jsonl", docs)
    # chunks of up to 20 records, ended early at 2,000 bytes: the resume skips the records the committed
    # chunks hold, which varies from chunk to chunk
    args = [
        f"prepare.input={tmp_path / 'a.jsonl'}",
        "prepare.progress=false",
        "prepare.chunk_documents=20",
        "prepare.chunk_bytes=2000",
        "prepare.workers=2",
        f"model.vocab_size={VOCAB}",
        f"data.tokenizer={tokenizer_json}",
    ]
    killed = tmp_path / "k" / "c"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_BUILD, *args, f"prepare.output={killed}"], cwd=REPO)
    work = Path(P.work_dir(str(killed)))
    deadline = time.time() + 120
    while not (work / "chunk_0000004.npz").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    import psutil

    helpers = psutil.Process(proc.pid).children(recursive=True)  # the 2 worker processes
    assert len(helpers) >= 2
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    _, alive = psutil.wait_procs(helpers, timeout=20)  # the workers exit with their k2-data process
    assert not alive, alive
    # killed: no complete-looking dataset, and the prefix is refused as an unfinished build
    assert not Path(str(killed) + ".bin").exists() and not Path(str(killed) + ".manifest.json").exists()
    assert 5 <= len(list(work.glob("chunk_*.npz"))) < 15
    cfg = load_config([f"data.path={killed}", f"data.tokenizer={tokenizer_json}", f"model.vocab_size={VOCAB}"])
    with pytest.raises(ConfigError, match="unfinished k2-data build"):
        resolve_data(cfg)
    seen = []
    resumed = P.prepare_corpus(load_config([*args, f"prepare.output={killed}"]), log=seen.append)
    assert any("resuming the build" in s for s in seen)
    clean = P.prepare_corpus(load_config([*args, f"prepare.output={tmp_path / 'u' / 'c'}"]), log=lambda s: None)
    assert _bytes(resumed.prefixes) == _bytes(clean.prefixes)
    assert resumed.manifest["documents"] == len(docs)
    assert not work.exists()


def test_memory_of_a_chunk_is_bounded_for_long_documents(tmp_path, tokenizer_json):
    """16 MB of long documents (standard-library source files of over 20 kB, 4 passes): with the default
    chunk of 2,048 records the whole corpus would be one chunk (its text and the tokenizer's ~100 bytes
    per token at once: 555 MB peak RSS here); ``prepare.chunk_bytes`` (1 MiB) keeps the peak RSS of the
    k2-data process (1 worker: it tokenizes in-process) at ~175 MB."""
    import sysconfig

    from k2.launcher.benchmarks.data_prepare import _peak_rss_mb, _prepare_args

    texts = [
        t
        for t in (
            f.read_text(encoding="utf-8", errors="replace")
            for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
        )
        if len(t) > 20_000
    ]
    _write_jsonl(tmp_path / "long.jsonl", [f"{t}\n# pass {r}" for r in range(4) for t in texts])
    assert (tmp_path / "long.jsonl").stat().st_size > 12e6
    peak_mb, code = _peak_rss_mb(
        _prepare_args(tmp_path / "long.jsonl", tmp_path / "o" / "c", tokenizer_json, 1, 2048, VOCAB)
    )
    assert code == 0 and peak_mb < 300, peak_mb


def test_crash_while_publishing_is_finished_by_the_rerun(tmp_path, docs, tokenizer_json, monkeypatch):
    _write_jsonl(tmp_path / "a.jsonl", docs[:50])
    prefix = tmp_path / "o" / "c"
    real, moved = os.replace, []

    def dying_replace(src, dst):
        if str(dst).endswith(".idx") and "/out/" in str(src):
            raise KeyboardInterrupt  # dies after the .bin moved, before the .idx and the manifest
        moved.append(dst)
        real(src, dst)

    monkeypatch.setattr(P.os, "replace", dying_replace)
    with pytest.raises(KeyboardInterrupt):
        _prepare(str(tmp_path / "a.jsonl"), prefix, tokenizer=tokenizer_json)
    monkeypatch.setattr(P.os, "replace", real)
    assert Path(str(prefix) + ".bin").exists() and not Path(str(prefix) + ".manifest.json").exists()
    assert P.unfinished_build(str(prefix))  # so data.path refuses it
    out = _prepare(str(tmp_path / "a.jsonl"), prefix, tokenizer=tokenizer_json)
    assert out.rebuilt and _documents(out.prefixes[0]) == _reference(tokenizer_json, docs[:50])


# ---------------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------------


def test_bad_record_is_named_with_file_and_line_or_skipped(tmp_path, docs, tokenizer_json):
    f = tmp_path / "a.jsonl"
    lines = [json.dumps({"text": t}) for t in docs[:10]]
    lines[6] = json.dumps({"body": "no text field"})
    lines[8] = "{not json"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as e:
        _prepare(str(f), tmp_path / "o", tokenizer=tokenizer_json)
    msg = str(e.value)
    assert f"{f}:7: bad record: no field 'text'" in msg and "prepare.bad_records=skip" in msg
    out = _prepare(str(f), tmp_path / "o", "prepare.bad_records=skip", tokenizer=tokenizer_json)
    kept = [t for i, t in enumerate(docs[:10]) if i not in (6, 8)]
    assert _documents(out.prefixes[0]) == _reference(tokenizer_json, kept)
    bad = out.manifest["bad_records"]
    assert bad["count"] == 2 and [b[0] for b in bad["first"]] == [f"{f}:7", f"{f}:9"]


@pytest.mark.parametrize(
    "make, setting, needles",
    [
        (lambda d: (d / "x.jsonl.gz").write_bytes(b"\x1f\x8b\x08garbage"), "", ["cannot read", "x.jsonl.gz"]),
        (lambda d: (d / "x.parquet").write_bytes(b"PAR1 not parquet"), "", ["cannot read", "x.parquet"]),
        (lambda d: (d / "x.csv").write_text("a,b\n"), "", ["x.csv", "not of a known format"]),
        (lambda d: None, "", ["matches no file"]),
        (
            lambda d: os.mkfifo(d / "x.jsonl"),
            "",
            ["x.jsonl is a FIFO (named pipe), not a regular file", "write the stream into a file first"],
        ),
        (lambda d: (d / "x.jsonl").write_text("\n\n"), "", ["prepare.input holds no document (1 file: ", "x.jsonl"]),
        (lambda d: (d / "x.jsonl").write_text('{"text": ""}\n'), "", ["holds no document", "1 empty texts"]),
        (lambda d: (d / "x.jsonl").write_text('{"text": "a"}\n'), "prepare.workers=0", ["prepare.workers=0"]),
        (
            lambda d: (d / "x.jsonl").write_text('{"text": "a"}\n'),
            "prepare.bad_records=ignore",
            ["prepare.bad_records='ignore'", "error, skip"],
        ),
    ],
)
def test_bad_inputs_give_one_clear_error(tmp_path, tokenizer_json, make, setting, needles):
    d = tmp_path / "in"
    d.mkdir()
    make(d)
    files = list(d.iterdir())
    target = str(files[0]) if files else str(d / "missing*.jsonl")
    with pytest.raises(ConfigError) as e:
        _prepare(target, tmp_path / "o", *([setting] if setting else []), tokenizer=tokenizer_json)
    for n in needles:
        assert n in str(e.value)
    assert not Path(str(tmp_path / "o") + ".bin").exists()


def test_parquet_without_the_text_column_names_file_and_columns(tmp_path, tokenizer_json):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "x.parquet")
    with pytest.raises(ConfigError, match=r"prepare.text_key='text': .*x.parquet has no such column \(columns: body\)"):
        _prepare(str(tmp_path / "x.parquet"), tmp_path / "o", tokenizer=tokenizer_json)


def test_tokenizer_larger_than_the_model_is_refused(tmp_path, tokenizer_json):
    (tmp_path / "x.jsonl").write_text('{"text": "a"}\n')
    cfg = load_config(
        [
            f"prepare.input={tmp_path / 'x.jsonl'}",
            f"prepare.output={tmp_path / 'o'}",
            f"data.tokenizer={tokenizer_json}",
            f"model.vocab_size={VOCAB - 1}",
        ]
    )
    with pytest.raises(
        ConfigError, match=f"data.tokenizer {tokenizer_json} has {VOCAB} ids but model.vocab_size={VOCAB - 1}"
    ):
        P.prepare_corpus(cfg, log=lambda s: None)


def test_training_with_another_tokenizer_than_the_builds_is_refused(tmp_path, docs, tokenizer_json):
    """A k2-data output read with a tokenizer of the same size but other merges: every id is inside the
    vocabulary, so only the manifest's tokenizer hash tells; refused naming the right tokenizer. Its own
    tokenizer, and a shard of a sharded build, are accepted."""
    _write_jsonl(tmp_path / "a.jsonl", docs[:60])
    out = _prepare(
        str(tmp_path / "a.jsonl"), tmp_path / "o" / "c", "prepare.shard_documents=40", tokenizer=tokenizer_json
    )
    other = str(tmp_path / "other.json")
    train_byte_level_bpe(docs[150:], VOCAB).save(other)
    assert HFTokenizer(other).vocab_size == VOCAB
    assert Path(other).read_bytes() != Path(tokenizer_json).read_bytes()

    def resolve(prefix, tok):
        return resolve_data(
            load_config(
                [f"data.path={prefix}", f"data.tokenizer={tok}", "data.split='50,50,0'", f"model.vocab_size={VOCAB}"]
            )
        )

    assert len(out.prefixes) == 2
    for prefix in out.prefixes:
        assert resolve(prefix, tokenizer_json).tokenizer_path == tokenizer_json
        with pytest.raises(
            ConfigError,
            match=f"data.path: '{prefix}' was tokenized by k2-data with "
            f"{tokenizer_json} .*not with data.tokenizer {other}",
        ):
            resolve(prefix, other)


def test_cli_prints_the_summary_and_exits_2_on_a_bad_setting(tmp_path, docs, tokenizer_json, capsys):
    _write_jsonl(tmp_path / "a.jsonl", docs[:20])
    args = [
        f"prepare.input={tmp_path / 'a.jsonl'}",
        f"prepare.output={tmp_path / 'o'}",
        "prepare.progress=false",
        f"data.tokenizer={tokenizer_json}",
        f"model.vocab_size={VOCAB}",
    ]
    assert data_entry.main(args) == 0
    out = capsys.readouterr().out
    assert "20 documents" in out and f"data.path={tmp_path / 'o'}" in out
    assert out.count("20 documents") == 1, out  # the summary once
    assert sorted(f.name for f in tmp_path.iterdir() if f.name.startswith(".")) == []  # no lock file left
    assert data_entry.main(args[:1] + args[2:]) == 2
    assert "prepare.output is null" in capsys.readouterr().err


def test_a_removed_lock_file_is_not_shared_by_two_holders(tmp_path):
    """file_lock(remove=True): a waiter that locked the file its holder deleted starts over on the file now
    at the path, so a newcomer and the waiter never hold the lock at once."""
    import threading

    from k2.launcher.datasets.locks import file_lock

    path = str(tmp_path / ".x.lock")
    inside, log = threading.Lock(), []

    def take(name):
        with file_lock(path, remove=True):
            assert inside.acquire(blocking=False), f"{name} entered while another holder was inside"
            log.append(name)
            threading.Event().wait(0.05)
            inside.release()

    threads = [threading.Thread(target=take, args=(f"t{i}",)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(log) == [f"t{i}" for i in range(6)] and not os.path.exists(path)


def test_a_full_disk_is_one_line_naming_the_path(tmp_path, docs, tokenizer_json, capsys, monkeypatch):
    """ENOSPC while the build writes (an OSError without a file name, as write(2) raises it): one error line
    naming prepare.output, exit 1, no traceback."""
    import errno

    from k2.launcher.datasets import preprocess

    def full(path, obj):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(preprocess, "write_json", full)
    _write_jsonl(tmp_path / "a.jsonl", docs[:5])
    out = tmp_path / "o"
    args = [
        f"prepare.input={tmp_path / 'a.jsonl'}",
        f"prepare.output={out}",
        "prepare.progress=false",
        f"data.tokenizer={tokenizer_json}",
        f"model.vocab_size={VOCAB}",
    ]
    assert data_entry.main(args) == 1
    err = capsys.readouterr().err
    assert err == (
        f"k2-data: error: cannot write prepare.output={out}: No space left on device (errno ENOSPC); "
        "free space there or choose another directory, then run again: the build resumes\n"
    ), err
