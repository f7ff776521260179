"""Tests of the data layer (k2.launcher.datasets: the embedded corpus, data settings, GPT datasets,
microbatches, the tokenizer; k2-data).

The read-only tests use the default embedded corpus (vocab 4096), built once per checkout into
``data_cache/`` by the ``stdlib_corpus`` fixture (or read from ``$K2_TEST_DATA_CACHE`` when set); the tests
of the build itself (crashes, kills, source changes) build small corpora in temporary directories.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from k2.config.errors import ConfigError
from k2.config.load import load_config
from k2.launcher import data as data_entry
from k2.launcher.datasets import corpus as D
from k2.launcher.datasets.gpt import build_datasets
from k2.launcher.datasets.microbatches import MicrobatchIterator
from k2.launcher.datasets.resolve import resolve_data
from k2.launcher.datasets.tokenizer import EOD_TOKEN, HFTokenizer
from support import REPO

#: the default data.vocab_size: the read-only tests use the session's default corpus (built once per
#: checkout into data_cache/, shared with the README's main job and the trainer tests)
VOCAB = 4096


def _cfg(cache_dir, *extra):
    return load_config([f"data.cache_dir={cache_dir}", f"data.vocab_size={VOCAB}", *extra])


@pytest.fixture(scope="session")
def corpus_cache(stdlib_corpus):
    return os.environ.get("K2_TEST_DATA_CACHE") or str(Path(stdlib_corpus.directory).parent)


@pytest.fixture(scope="session")
def corpus(corpus_cache):
    cfg = _cfg(corpus_cache)
    return D.prepare_stdlib_corpus(cfg.data, progress=False, verbose=False)


@pytest.fixture(scope="session")
def tok(corpus):
    return HFTokenizer(corpus.tokenizer_path)


def _stdlib_text(rel):
    raw = Path(D.default_stdlib_dir(), rel).read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


# ---------------------------------------------------------------------------------------------------
# the embedded corpus
# ---------------------------------------------------------------------------------------------------


def test_corpus_splits_partition_the_stdlib(corpus):
    m = corpus.manifest
    all_files = D.list_stdlib_files()
    assert len(all_files) > 100 and not any("site-packages" in f for f in all_files)
    train, valid = m["files"]["train"], m["files"]["valid"]
    assert set(train).isdisjoint(valid)
    assert sorted(train + valid) == all_files
    assert m["file_count"] == len(all_files)
    assert m["documents"] == {"train": len(train), "valid": len(valid)}
    # ~valid_fraction (0.02) of documents held out, chosen by path hash
    assert 0.005 < len(valid) / len(all_files) < 0.06
    assert all(D._is_valid_doc(f, 0.02) for f in valid)
    assert not any(D._is_valid_doc(f, 0.02) for f in train)
    assert m["python_version"] == D._python_version() and m["vocab_size"] == VOCAB
    assert Path(corpus.directory).name == f"stdlib-{D._python_version()}-v{VOCAB}"
    assert not corpus.directory.startswith(".")


def test_indexed_datasets_readable_by_megatron(corpus, tok):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    m = corpus.manifest
    for split, prefix in (("train", corpus.train_prefix), ("valid", corpus.valid_prefix)):
        ds = IndexedDataset(prefix)
        assert len(ds) == m["documents"][split]
        assert int(ds.sequence_lengths.sum()) == m["tokens"][split]
        assert ds.index.dtype == np.uint16
        for i in (0, len(ds) // 2, len(ds) - 1):
            doc = ds[i]
            assert doc[-1] == tok.eod  # every document ends with exactly one EOD
            assert tok.eod not in doc[:-1] and tok.pad not in doc
            assert doc.max() < tok.vocab_size


def test_valid_documents_detokenize_to_the_real_files(corpus, tok):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(corpus.valid_prefix)
    valid_files = corpus.manifest["files"]["valid"]
    assert len(valid_files) == len(ds)
    for i in range(min(len(ds), 8)):
        assert tok.detokenize(ds[i][:-1]) == _stdlib_text(valid_files[i])


def test_tokenizer_wrapper(tok):
    assert tok.vocab_size == VOCAB
    assert tok.eod == tok.backend.token_to_id(EOD_TOKEN)
    assert tok.pad >= 0 and tok.pad != tok.eod
    text = "def f(x):\n\treturn x ** 2  # ünïcødé ✓\r\n"
    ids = tok.tokenize(text)
    assert all(isinstance(i, int) for i in ids) and tok.detokenize(ids) == text
    assert len(ids) < len(text.encode())  # BPE merges something
    assert tok.unique_identifiers["tokenizer_path"] == tok.path
    json.dumps(tok.unique_identifiers)  # megatron hashes this


def test_second_call_is_idempotent_and_fast(corpus_cache, corpus, capsys):
    files = sorted(Path(corpus.directory).iterdir())
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in files}
    t0 = time.time()
    again = D.prepare_stdlib_corpus(_cfg(corpus_cache).data, progress=False)
    assert time.time() - t0 < 15
    assert not again.rebuilt and again.train_prefix == corpus.train_prefix
    assert "skipped" in capsys.readouterr().out
    after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in Path(corpus.directory).iterdir()}
    assert after == before


def test_cli_summary_reuses_the_corpus(corpus_cache, corpus, capsys):
    assert (
        data_entry.main([f"data.cache_dir={corpus_cache}", f"data.vocab_size={VOCAB}", f"model.vocab_size={VOCAB}"])
        == 0
    )
    out = capsys.readouterr().out
    assert "already up to date" in out
    assert f"{corpus.manifest['documents']['valid']:,d} documents" in out
    assert f"{corpus.manifest['tokens']['train']:,d} tokens" in out
    assert corpus.directory in out


def test_cli_bad_setting_exits_with_message(corpus_cache, capsys):
    assert data_entry.main([f"data.cache_dir={corpus_cache}", "data.vocab_size=100"]) == 2
    assert "data.vocab_size=100" in capsys.readouterr().err


def _mini_stdlib(dst: Path, n=40) -> Path:
    src = D.default_stdlib_dir()
    for rel in D.list_stdlib_files()[:n]:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(os.path.join(src, rel), dst / rel)
    return dst


def _no_complete_output(cache: Path):
    assert not list(cache.rglob("manifest.json"))
    assert not [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")]


def test_failed_build_leaves_no_complete_looking_dir(tmp_path, monkeypatch):
    src = _mini_stdlib(tmp_path / "src")
    cache = tmp_path / "cache"
    cfg = load_config([f"data.cache_dir={cache}", "data.vocab_size=300", "data.valid_fraction=0.1"])
    calls = []

    def crash_in_the_middle(tok, texts):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated crash")
        return real_encode(tok, texts)

    real_encode = D._encode_chunk
    monkeypatch.setattr(D, "_ENCODE_CHUNK", 8)
    monkeypatch.setattr(D, "_encode_chunk", crash_in_the_middle)
    with pytest.raises(RuntimeError, match="simulated crash"):
        D.prepare_stdlib_corpus(cfg.data, stdlib_dir=str(src), progress=False, verbose=False)
    _no_complete_output(cache)
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name]  # cleaned up on the way out

    # a leftover of a SIGKILLed build is removed by the next build, which then completes
    monkeypatch.setattr(D, "_encode_chunk", real_encode)
    name = D.stdlib_corpus_dir(cfg.data).rsplit("/", 1)[1]
    stale = cache / f".{name}.tmp-999999"
    stale.mkdir()
    (stale / "manifest.json").write_text("{}")
    paths = D.prepare_stdlib_corpus(cfg.data, stdlib_dir=str(src), progress=False, verbose=False)
    assert paths.rebuilt and not stale.exists()
    assert paths.manifest["file_count"] == 40 and paths.manifest["documents"]["valid"] >= 1

    # a changed source file changes the content hash -> rebuilt, not silently reused
    first = D.list_stdlib_files(str(src))[0]
    with open(src / first, "a") as f:
        f.write("\n# edited\n")
    again = D.prepare_stdlib_corpus(cfg.data, stdlib_dir=str(src), progress=False, verbose=False)
    assert again.rebuilt and again.manifest["source_sha256"] != paths.manifest["source_sha256"]
    assert not [p for p in cache.iterdir() if ".old-" in p.name or ".tmp-" in p.name]


def test_sigkilled_build_leaves_no_complete_looking_dir(tmp_path):
    src = _mini_stdlib(tmp_path / "src")
    cache = tmp_path / "cache"
    script = f"""
import time
from k2.launcher.datasets import corpus as D
from k2.config import load_config
D._ENCODE_CHUNK = 4
real = D._encode_chunk
def slow(tok, texts):
    time.sleep(0.5)
    return real(tok, texts)
D._encode_chunk = slow
cfg = load_config(["data.cache_dir={cache}", "data.vocab_size=300"])
D.prepare_stdlib_corpus(cfg.data, stdlib_dir="{src}", progress=False, verbose=False)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not list(cache.glob(".*.tmp-*/train.bin")):
            assert proc.poll() is None, "build finished before it could be killed"
            time.sleep(0.1)
        assert list(cache.glob(".*.tmp-*/train.bin")), "build never started writing"
        time.sleep(0.6)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    _no_complete_output(cache)


# ---------------------------------------------------------------------------------------------------
# resolve_data: bad input
# ---------------------------------------------------------------------------------------------------


def _user_data(tmp_path, corpus):
    """A user-style dataset: a copy of the corpus' valid split and its tokenizer."""
    d = tmp_path / "user"
    d.mkdir(exist_ok=True)
    for ext in (".bin", ".idx"):
        shutil.copyfile(corpus.valid_prefix + ext, d / f"docs{ext}")
    shutil.copyfile(corpus.tokenizer_path, d / "tokenizer.json")
    return str(d / "docs"), str(d / "tokenizer.json")


def _resolve(tmp_path, *overrides, model_vocab=VOCAB):
    return resolve_data(load_config([f"data.cache_dir={tmp_path}/c", f"model.vocab_size={model_vocab}", *overrides]))


@pytest.mark.parametrize(
    "make, needles",
    [
        (lambda p, t: [f"data.path='{p}x'", f"data.tokenizer='{t}'"], ["data.path", "x.bin"]),
        (lambda p, t: [f"data.path='{p}'", f"data.tokenizer='{t}x'"], ["data.tokenizer", "x"]),
        (lambda p, t: [f"data.path='{p}'"], ["data.tokenizer"]),
        (lambda p, t: [f"data.path=[0.5,'{p}',0.5]", f"data.tokenizer='{t}'"], ["data.path", "even"]),
        (
            lambda p, t: [f"data.path=[heavy,'{p}',0.5,'{p}']", f"data.tokenizer='{t}'"],
            ["data.path", "'heavy'", "not a number"],
        ),
        (lambda p, t: [f"data.path=[-1,'{p}',2,'{p}']", f"data.tokenizer='{t}'"], ["data.path", "negative"]),
        (lambda p, t: [f"data.path=[0,'{p}']", f"data.tokenizer='{t}'"], ["data.path", "0"]),
        (lambda p, t: [f"data.path=['{p}',0.5,'{p}',0.5]", f"data.tokenizer='{t}'"], ["data.path"]),
        (
            lambda p, t: [f"data.path='{p}'", f"data.valid_path=[1,'{p}nope']", f"data.tokenizer='{t}'"],
            ["data.valid_path", "nope.bin"],
        ),
        (lambda p, t: [f"data.path='{p}'", "data.split=abc", f"data.tokenizer='{t}'"], ["data.split"]),
        (lambda p, t: [f"data.path='{p}'", "data.split='0,1,0'", f"data.tokenizer='{t}'"], ["data.split"]),
        (lambda p, t: [f"data.tokenizer='{t}'"], ["data.tokenizer", "data.path is null"]),
        (lambda p, t: [f"data.valid_path='{p}'"], ["data.valid_path"]),
        (lambda p, t: ["data.valid_fraction=1.5"], ["data.valid_fraction"]),
    ],
)
def test_bad_data_settings_raise_config_error(tmp_path, corpus, make, needles):
    prefix, tokpath = _user_data(tmp_path, corpus)
    with pytest.raises(ConfigError) as e:
        _resolve(tmp_path, *make(prefix, tokpath))
    for n in needles:
        assert n in str(e.value), str(e.value)


def test_missing_idx_is_named(tmp_path, corpus):
    prefix, tokpath = _user_data(tmp_path, corpus)
    os.remove(prefix + ".idx")
    with pytest.raises(ConfigError, match=r"data\.path.*missing file .*docs\.idx"):
        _resolve(tmp_path, f"data.path='{prefix}'", f"data.tokenizer='{tokpath}'")


def test_truncated_bin_is_detected(tmp_path, corpus):
    prefix, tokpath = _user_data(tmp_path, corpus)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ConfigError, match=r"data\.path.*docs\.bin has 100 bytes"):
        _resolve(tmp_path, f"data.path='{prefix}'", f"data.tokenizer='{tokpath}'")


def test_vocab_larger_than_model_names_both_numbers(tmp_path, corpus):
    prefix, tokpath = _user_data(tmp_path, corpus)
    with pytest.raises(ConfigError) as e:
        _resolve(tmp_path, f"data.path='{prefix}'", f"data.tokenizer='{tokpath}'", model_vocab=512)
    msg = str(e.value)
    assert f"{VOCAB}" in msg and "model.vocab_size=512" in msg and f"model.vocab_size={VOCAB}" in msg
    with pytest.raises(ConfigError) as e:  # embedded corpus: data.vocab_size vs model.vocab_size
        _resolve(tmp_path, "data.vocab_size=8192", model_vocab=4096)
    msg = str(e.value)
    assert "data.vocab_size=8192" in msg and "model.vocab_size=4096" in msg


def test_resolve_user_blends(tmp_path, corpus):
    prefix, tokpath = _user_data(tmp_path, corpus)
    r = _resolve(tmp_path, f"data.path=[3,'{prefix}.bin',1,'{corpus.train_prefix}']", f"data.tokenizer='{tokpath}'")
    assert r.train_blend == ([prefix, corpus.train_prefix], [3.0, 1.0])  # .bin suffix dropped
    assert r.valid_blend is None and r.split == "98,2,0"
    assert r.tokenizer_vocab_size == VOCAB and not r.embedded
    assert r.stats[prefix] == (corpus.manifest["documents"]["valid"], corpus.manifest["tokens"]["valid"])
    r = _resolve(
        tmp_path,
        f"data.path=['{prefix}','{prefix}','{prefix}']",
        f"data.valid_path='{prefix}'",
        f"data.tokenizer='{tokpath}'",
    )
    assert r.train_blend == ([prefix] * 3, None) and r.valid_blend == ([prefix], None) and r.split is None
    r = _resolve(tmp_path, f"data.vocab_size={VOCAB}")
    assert r.embedded and r.train_blend[0][0].endswith(f"stdlib-{D._python_version()}-v{VOCAB}/train")


# ---------------------------------------------------------------------------------------------------
# megatron GPT datasets
# ---------------------------------------------------------------------------------------------------


def test_gpt_dataset_samples(tmp_path, corpus_cache, corpus, tok):
    resolved = resolve_data(_cfg(corpus_cache, f"model.vocab_size={VOCAB}"))
    resolved.index_cache_dir = str(tmp_path / "idx")
    train, valid = build_datasets(resolved, seq_length=64, seed=1234, train_samples=100, valid_samples=10)
    assert len(train) >= 100 and len(valid) >= 10
    s = train[3]
    assert set(s) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert s["tokens"].shape == (64,) and s["tokens"].dtype == torch.int64
    assert torch.equal(s["labels"][:-1], s["tokens"][1:])  # labels = tokens shifted by one
    assert torch.equal(s["position_ids"], torch.arange(64))
    assert torch.all(s["loss_mask"] == 1.0)
    assert int(s["tokens"].max()) < tok.vocab_size
    assert list(Path(resolved.index_cache_dir).glob("*GPTDataset-train-shuffle_index.npy"))
    # valid samples come from held-out files: their text is in a valid file, not necessarily a train one
    valid_text = "".join(_stdlib_text(f) for f in corpus.manifest["files"]["valid"])
    piece = tok.detokenize(t for t in valid[0]["tokens"].tolist() if t != tok.eod)
    assert piece[5:40] in valid_text
    # deterministic in the seed; a different seed shuffles differently
    train2, _ = build_datasets(resolved, seq_length=64, seed=1234, train_samples=100, valid_samples=10)
    assert all(torch.equal(train[i]["tokens"], train2[i]["tokens"]) for i in range(5))
    train3, _ = build_datasets(resolved, seq_length=64, seed=7, train_samples=100, valid_samples=10)
    assert not all(torch.equal(train[i]["tokens"], train3[i]["tokens"]) for i in range(5))


def test_gpt_dataset_weighted_blend_with_split(tmp_path, corpus):
    prefix, tokpath = _user_data(tmp_path, corpus)
    r = _resolve(
        tmp_path,
        f"data.path=[0.75,'{corpus.train_prefix}',0.25,'{prefix}']",
        f"data.tokenizer='{tokpath}'",
        "data.split='90,10,0'",
    )
    train, valid = build_datasets(r, seq_length=32, seed=1, train_samples=400, valid_samples=40)
    assert len(train) == 400 and len(valid) == 40
    ids = np.array([int(train[i]["dataset_id"]) for i in range(400)])
    assert abs((ids == 0).mean() - 0.75) < 0.02
    it = MicrobatchIterator(train, 8, 4, 0, 1)
    mb = next(it)
    assert mb["tokens"].shape == (4, 32) and mb["dataset_id"].shape == (4,)


def test_too_long_seq_for_valid_split_is_a_config_error(tmp_path, corpus):
    prefix, tokpath = _user_data(tmp_path, corpus)
    r = _resolve(
        tmp_path, f"data.path='{corpus.train_prefix}'", f"data.valid_path='{prefix}'", f"data.tokenizer='{tokpath}'"
    )
    seq = corpus.manifest["tokens"]["valid"] + 10
    with pytest.raises(ConfigError, match="data.valid_path"):
        build_datasets(r, seq_length=seq, seed=1, train_samples=2, valid_samples=None)


def test_embedded_corpus_not_prepared(tmp_path):
    r = resolve_data(load_config([f"data.cache_dir={tmp_path}"]))
    with pytest.raises(FileNotFoundError, match="k2-data"):
        build_datasets(r, 16, 1, 4, 4)


# ---------------------------------------------------------------------------------------------------
# microbatches
# ---------------------------------------------------------------------------------------------------


class _Numbered:
    """Sample i = tokens filled with i."""

    def __init__(self, n, seq=4):
        self.n, self.seq = n, seq

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        t = torch.full((self.seq,), int(i), dtype=torch.long)
        return {"tokens": t, "labels": t + 1, "loss_mask": torch.ones(self.seq)}


def _ids(mb):
    return mb["tokens"][:, 0].tolist()


def test_microbatches_partition_the_global_batch():
    ds, gbs, mbs = _Numbered(1000), 12, 2
    for dp in (1, 2, 3, 6):
        its = [MicrobatchIterator(ds, gbs, mbs, r, dp, start_sample=24) for r in range(dp)]
        assert its[0].num_microbatches == gbs // (mbs * dp)
        for step in range(3):
            got = []
            for it in its:  # DP rank order, microbatches in order
                for _ in range(it.num_microbatches):
                    mb = next(it)
                    assert mb["tokens"].shape == (mbs, 4) and mb["loss_mask"].shape == (mbs, 4)
                    got += _ids(mb)
            assert got == list(range(24 + step * gbs, 24 + (step + 1) * gbs))
            assert all(it.consumed_samples == 24 + (step + 1) * gbs for it in its)


def test_microbatches_wrap_around_with_epoch_counter():
    ds = _Numbered(10)
    it = MicrobatchIterator(ds, 4, 2, 0, 1)
    seen = [_ids(next(it)) for _ in range(6)]  # 3 global batches = 12 samples > 10
    assert sum(seen, []) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]
    assert it.consumed_samples == 12 and it.epoch == 1
    assert it.sample_numbers(2, 1) == [10, 11]


def test_microbatch_resume_continues_the_same_sequence():
    ds = _Numbered(100)
    a = MicrobatchIterator(ds, 8, 2, 1, 2)
    for _ in range(2 * a.num_microbatches):
        next(a)
    b = MicrobatchIterator(ds, 8, 2, 1, 2, start_sample=a.consumed_samples)
    assert [_ids(next(a)) for _ in range(4)] == [_ids(next(b)) for _ in range(4)]
    # several iterators (one per pipeline model chunk) see the same sequence independently
    c, d = (MicrobatchIterator(ds, 8, 2, 1, 2) for _ in range(2))
    assert [_ids(next(c)) for _ in range(3)] == [_ids(next(d)) for _ in range(3)]


def test_microbatch_bad_global_batch_is_a_config_error():
    with pytest.raises(ConfigError) as e:
        MicrobatchIterator(_Numbered(10), 10, 2, 0, 3)
    msg = str(e.value)
    assert "train.global_batch_size=10" in msg and "train.micro_batch_size=2" in msg and "DP size 3" in msg


# ---------------------------------------------------------------------------------------------------
# torch.distributed initialised (gloo): megatron's rank-0-first build with barriers
# ---------------------------------------------------------------------------------------------------


def _dist_worker(rank, world, init_file, resolved, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        train, valid = build_datasets(resolved, seq_length=32, seed=5, train_samples=64, valid_samples=8)
        it = MicrobatchIterator(train, 8, 2, rank, world)
        toks = torch.cat([next(it)["tokens"] for _ in range(2 * it.num_microbatches)])
        torch.save({"tokens": toks, "valid0": valid[0]["tokens"]}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_build_with_torch_distributed_initialised(tmp_path, corpus_cache, corpus):
    from support.distributed import start_processes_forked  # (torch.multiprocessing.spawn's, forked)

    resolved = resolve_data(_cfg(corpus_cache, f"model.vocab_size={VOCAB}"))
    resolved.index_cache_dir = str(tmp_path / "idx")
    start_processes_forked(_dist_worker, args=(2, str(tmp_path / "store"), resolved, str(tmp_path)), nprocs=2)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert torch.equal(r0["valid0"], r1["valid0"])
    # single process, distributed not initialised, same cache: same samples; DP union = global batches
    train, _ = build_datasets(resolved, seq_length=32, seed=5, train_samples=64, valid_samples=8)
    single = MicrobatchIterator(train, 8, 2, 0, 1)
    ref = torch.cat([next(single)["tokens"] for _ in range(2 * single.num_microbatches)])
    per_step = [torch.cat([r0["tokens"][4 * s : 4 * s + 4], r1["tokens"][4 * s : 4 * s + 4]]) for s in range(2)]
    assert torch.equal(torch.cat(per_step), ref)


@pytest.mark.parametrize("rank, holds", [(0, True), (1, False)])
def test_index_cache_writer_holds_the_build_lock(tmp_path, corpus_cache, corpus, monkeypatch, rank, holds):
    """Runs that share index_cache_dir never read each other's half-written index files: while megatron
    builds, the writer (global rank 0 under torch.distributed) holds <index_cache_dir>/.build.lock; the
    other ranks, which only read after megatron's barrier, take no lock (they would deadlock rank 0)."""
    import fcntl

    import torch.distributed as dist
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    resolved = resolve_data(_cfg(corpus_cache, f"model.vocab_size={VOCAB}"))
    resolved.index_cache_dir = str(tmp_path / "idx")
    seen = []

    def probe(self):
        with open(tmp_path / "idx" / ".build.lock", "a") as f:  # another process's attempt at the lock
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen.append(False)
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            except BlockingIOError:
                seen.append(True)
        return [1], [1], None

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: rank)
    monkeypatch.setattr(BlendedMegatronDatasetBuilder, "build", probe)
    build_datasets(resolved, seq_length=32, seed=5, train_samples=8, valid_samples=8)
    assert seen == [holds]


def test_token_ids_outside_the_vocabulary_name_the_file(tmp_path, corpus, capsys):
    """Random bytes in a user .bin (same size, so the .idx still agrees): every tool refuses the data
    before any rank starts, naming the file, the id and its position; a clean file passes the scan."""
    prefix, tokpath = _user_data(tmp_path, corpus)
    settings = [f"data.path='{prefix}'", f"data.tokenizer='{tokpath}'"]
    _resolve(tmp_path, *settings)  # the copy of the corpus is clean
    size = os.path.getsize(prefix + ".bin")
    noise = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    noise[1000:1002] = 0xFF  # token 500 is 65535 whatever the rest (uint16 ids)
    noise[:1000] = 0  # tokens before it are id 0
    Path(prefix + ".bin").write_bytes(noise.tobytes())
    with pytest.raises(ConfigError) as e:
        _resolve(tmp_path, *settings)
    msg = str(e.value)
    assert f"{prefix}.bin holds token id 65535 at token 500" in msg and f"ids 0..{VOCAB - 1}" in msg
    assert data_entry.main([f"data.cache_dir={tmp_path}/c", *settings]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("k2-data: error: ") and f"{prefix}.bin" in err[0]
