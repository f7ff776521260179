"""``k2-data prepare.tasks=N`` (k2.launcher.datasets.pieces / array_build): the input cut into pieces at
record boundaries, each tokenized into its own shard by the task that owns it.

What "the bytes are the same for any number of tasks" means, tested here: the files an array build
publishes (every shard's ``.bin`` and ``.idx``, and ``PREFIX.manifest.json``) are byte for byte the same
whether one task built every piece or three tasks built them as separate processes would (each
``prepare.task`` run on its own, the last one finalizing); and the documents of the shards, read in
manifest order, are those of the one-process build (``prepare.tasks=null``) token for token. The
multi-machine case on a real Slurm: tests/integration/test_slurm_data_array.py."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from k2.config.errors import ConfigError
from k2.config.load import load_config
from k2.launcher import data as data_entry
from k2.launcher.benchmarks.data_prepare import stdlib_docstrings
from k2.launcher.datasets import array_build as A
from k2.launcher.datasets import chunked
from k2.launcher.datasets import preprocess as P
from k2.launcher.datasets.pieces import cut_pieces, line_start
from k2.launcher.datasets.resolve import resolve_data
from k2.launcher.datasets.sources import expand_inputs
from k2.launcher.datasets.tokenizer import EOD_TOKEN

VOCAB = 600
SHARD = 6000  # input bytes per piece: the large file is cut three times


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return stdlib_docstrings(240)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, docs) -> Path:
    """Three files: a large JSONL (cut into pieces), a small one, a gzipped one (never cut)."""
    d = tmp_path_factory.mktemp("corpus")
    lines = [json.dumps({"text": t}) + "\n" for t in docs]
    (d / "a_large.jsonl").write_text("".join(lines[:150]))
    (d / "b_small.jsonl").write_text("".join(lines[150:170]))
    with gzip.open(d / "c.jsonl.gz", "wt") as f:
        f.write("".join(lines[170:]))
    assert (d / "a_large.jsonl").stat().st_size > 3 * SHARD
    return d


def _args(inp, out, *extra, tokenizer=None):
    args = [
        f"prepare.input={inp}",
        f"prepare.output={out}",
        "prepare.progress=false",
        f"model.vocab_size={VOCAB}",
        f"data.vocab_size={VOCAB}",
        f"prepare.shard_bytes={SHARD}",
        "prepare.chunk_documents=16",
        *extra,
    ]
    return args + ([f"data.tokenizer={tokenizer}"] if tokenizer else [])


def _documents(prefix: str) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix, mmap=True)
    return [ds[i].tolist() for i in range(len(ds))]


def _published(out_dir: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(out_dir.iterdir())}


def test_pieces_are_cut_at_line_starts_and_compressed_files_are_not_cut(corpus):
    files = expand_inputs(str(corpus))
    pieces = cut_pieces(files, SHARD)
    segs = [s for p in pieces for s in p]
    # every byte of every file in exactly one piece, in order
    for fi, f in enumerate(files):
        mine = [(s, e) for i, s, e in segs if i == fi]
        assert mine[0][0] == 0 and mine[-1][1] == f.bytes
        assert all(a[1] == b[0] for a, b in zip(mine, mine[1:]))
    big = Path(files[0].path).read_bytes()
    cuts = [e for i, _, e in segs if i == 0][:-1]
    assert len(cuts) >= 3 and all(big[c - 1 : c] == b"\n" for c in cuts)  # at line starts only
    assert [(s, e) for i, s, e in segs if i == 2] == [(0, files[2].bytes)]  # the .gz: whole
    # at least shard_bytes per piece but the last; the small file shares a piece with its neighbours
    assert all(sum(e - s for _, s, e in p) >= SHARD for p in pieces[:-1])
    assert line_start(files[0].path, 1, files[0].bytes) == big.index(b"\n") + 1


def test_the_tokenizer_sample_holds_the_records_of_its_byte_budget(corpus):
    """The sample of a piece: its first records until they hold the budget's bytes (not the first record
    only, nor the reader's whole read-ahead block)."""
    files = expand_inputs(str(corpus / "a_large.jsonl"))
    cfg = load_config(_args(corpus, "/tmp/unused", "prepare.tasks=2"))
    lines = Path(files[0].path).read_bytes().splitlines(keepends=True)
    sizes = [sum(map(len, lines[: i + 1])) for i in range(len(lines))]
    expect = next(i for i, s in enumerate(sizes) if s >= 3000) + 1
    assert len(list(P.document_texts(cfg, files, max_bytes=3000))) == expect > 3


def test_one_task_and_three_tasks_write_the_same_bytes_and_the_one_process_documents(tmp_path, corpus, tokenizer_json):
    one = A.prepare_array(
        load_config(_args(corpus, tmp_path / "one" / "c", "prepare.tasks=1", tokenizer=tokenizer_json)),
        log=lambda s: None,
    )
    seen: list[str] = []
    for t in range(3):  # three array tasks, each on its own; the last one finalizes
        out = A.prepare_array(
            load_config(
                _args(
                    corpus, tmp_path / "three" / "c", "prepare.tasks=3", f"prepare.task={t}", tokenizer=tokenizer_json
                )
            ),
            log=seen.append,
        )
        assert (out is None) == (t < 2)
    assert any("task 2 of 3 is unfinished" in s for s in seen), seen
    assert _published(tmp_path / "one") == _published(tmp_path / "three")  # shards and manifest, bytes
    m = one.manifest
    assert len(m["datasets"]) >= 4 and [d["prefix"] for d in m["datasets"]] == [Path(p).name for p in one.prefixes]
    classic = P.prepare_corpus(
        load_config(_args(corpus, tmp_path / "classic" / "c", tokenizer=tokenizer_json)), log=lambda s: None
    )
    stream = [d for p in one.prefixes for d in _documents(p)]
    assert stream == _documents(classic.prefixes[0]) and m["documents"] == classic.manifest["documents"]
    assert len(m["inputs"]) == 3 and all("xxh3_64" in s for piece in m["pieces"] for s in piece["segments"])
    assert not Path(P.work_dir(str(tmp_path / "three" / "c"))).exists()
    # data.path takes the manifest: every shard, in order
    resolved = resolve_data(
        load_config(
            [
                f"data.path={one.manifest_path}",
                f"data.tokenizer={tokenizer_json}",
                "data.split='50,50,0'",
                f"model.vocab_size={VOCAB}",
            ]
        )
    )
    assert resolved.train_blend == (one.prefixes, None)
    assert data_entry.main(["verify", one.manifest_path]) == 0


def test_a_killed_task_resumes_and_finalize_names_the_unfinished_task(
    tmp_path, corpus, tokenizer_json, capsys, monkeypatch
):
    args = _args(corpus, tmp_path / "o" / "c", "prepare.tasks=2", tokenizer=tokenizer_json)
    real, commits = chunked.commit_chunk, []

    def dying_commit(work, k, result):  # task 1 killed after two chunks of its first piece
        real(work, k, result)
        commits.append(k)
        if len(commits) == 2:
            raise KeyboardInterrupt

    A.prepare_array(load_config([*args, "prepare.task=0"]), log=lambda s: None)
    monkeypatch.setattr(chunked, "commit_chunk", dying_commit)
    with pytest.raises(KeyboardInterrupt):
        A.prepare_array(load_config([*args, "prepare.task=1"]), log=lambda s: None)
    monkeypatch.setattr(chunked, "commit_chunk", real)
    capsys.readouterr()
    assert data_entry.main(["finalize", f"prepare.output={tmp_path / 'o' / 'c'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot finalize" in err[0] and "task 1 of 2 is unfinished" in err[0], err
    assert "task 0" not in err[0] and "prepare.task=T" in err[0]
    seen: list[str] = []
    out = A.prepare_array(load_config([*args, "prepare.task=1"]), log=seen.append)
    assert out is not None and any("resuming the build" in s and "2 chunks" in s for s in seen), seen
    A.prepare_array(
        load_config(_args(corpus, tmp_path / "ref" / "c", "prepare.tasks=1", tokenizer=tokenizer_json)),
        log=lambda s: None,
    )
    assert _published(tmp_path / "o") == _published(tmp_path / "ref")


def test_trained_tokenizer_is_trained_once_before_the_tasks_and_named_in_the_manifest(tmp_path, corpus):
    """data.tokenizer=null: a BPE trained on a sample of every piece (here the whole small corpus: the
    tokenizer of the one-process build), named in the manifest and published beside the shards."""
    out = A.prepare_array(load_config(_args(corpus, tmp_path / "a" / "c", "prepare.tasks=2")), log=lambda s: None)
    classic = P.prepare_corpus(load_config(_args(corpus, tmp_path / "b" / "c")), log=lambda s: None)
    tok = out.manifest["tokenizer"]
    assert tok["trained"] and tok["path"] == str(tmp_path / "a" / "c.tokenizer.json") == out.tokenizer_path
    assert tok["sha256"] == classic.manifest["tokenizer"]["sha256"]
    assert "c.tokenizer.json" in out.manifest["outputs"]
    from tokenizers import Tokenizer

    eod = Tokenizer.from_file(out.tokenizer_path).token_to_id(EOD_TOKEN)
    assert all(d[-1] == eod for p in out.prefixes for d in _documents(p))


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["prepare.task=0"], "prepare.task=0 needs prepare.tasks"),
        (["prepare.tasks=2", "prepare.task=2"], "prepare.task=2; allowed: null (every task here) or 0..1"),
        (["prepare.tasks=2", "prepare.task=1", "prepare.submit=true"], "give one or the other"),
        (["prepare.tasks=2", "prepare.shard_documents=10"], "set one or the other"),
        (["prepare.tasks=0"], "prepare.tasks=0; allowed"),
    ],
)
def test_bad_array_settings_are_one_error(tmp_path, corpus, extra, needle):
    with pytest.raises(ConfigError, match=None) as e:
        load_config(_args(corpus, tmp_path / "o", *extra))
    assert needle in str(e.value), e.value


def test_the_array_script_runs_each_task_with_the_same_settings(tmp_path, corpus, tokenizer_json, capsys):
    """submit.dry_run=true: the plan is made here, the script of the unfinished tasks is printed."""
    args = _args(
        corpus,
        tmp_path / "o" / "c",
        "prepare.tasks=3",
        "prepare.submit=true",
        "submit.dry_run=true",
        "submit.partition=cpu",
        "submit.time=2:00:00",
        tokenizer=tokenizer_json,
    )
    assert data_entry.main(args) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --array=0-2" in script and "#SBATCH --partition=cpu" in script
    assert "#SBATCH --time=2:00:00" in script and "#SBATCH --cpus-per-task=1" in script
    assert f"#SBATCH --output={tmp_path / 'o' / 'c'}.slurm-%A_%a.out" in script
    run = next(line for line in script.splitlines() if "-m k2.launcher.data" in line)
    assert run.endswith('prepare.task="$SLURM_ARRAY_TASK_ID"') and "prepare.tasks=3" in run
    assert "submit." not in run and "prepare.submit" not in run
    assert (Path(P.work_dir(str(tmp_path / "o" / "c"))) / "plan.json").is_file()
