"""``k2-data``: build the embedded default corpus, or check a user dataset (:mod:`k2.launcher.datasets`)."""

from __future__ import annotations

import errno
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from k2.config import load_config
from k2.launcher.cli import error, run_main
from k2.launcher.datasets.corpus import prepare_stdlib_corpus
from k2.launcher.datasets.preprocess import prepare_corpus
from k2.launcher.datasets.resolve import resolve_data

if TYPE_CHECKING:
    from k2.config.schema import K2Config

PROG = "k2-data"

USAGE = """usage: k2-data [HYDRA_OVERRIDE ...]

Prepare the embedded default corpus (data.path=null): the Python standard library's own *.py files,
a byte-level BPE tokenizer (data.vocab_size) and megatron .bin/.idx train/valid splits, written to
<data.cache_dir>/stdlib-<pyver>-v<vocab>/. Idempotent. With data.path set, validate the user data
(data.path, data.valid_path, data.tokenizer, data.split) and print its size instead.

With prepare.input set, tokenize a raw-text corpus (JSONL, also .gz/.zst; Parquet; plain text; files,
directories or globs) into megatron indexed datasets at prepare.output (PREFIX.bin/.idx, or
PREFIX_00000.bin/.idx ... with prepare.shard_documents) plus PREFIX.manifest.json, with data.tokenizer
or a byte-level BPE of data.vocab_size ids trained on the input (PREFIX.tokenizer.json). Settings:
prepare.text_key (text), prepare.text_document (file|paragraph, for .txt), prepare.workers (1),
prepare.bad_records (error|skip), prepare.shard_documents (null), prepare.chunk_documents (2048),
prepare.chunk_bytes (1048576: a chunk also ends at this many bytes of input).
A killed build resumes where it stopped when run again; the output does not depend on the workers.
Exit status 1: a file could not be written (full disk, read-only file system, permission; one line
naming the path).

examples:
  k2-data
  k2-data data.vocab_size=8192 model.vocab_size=8192 data.cache_dir=/scratch/k2
  k2-data data.path=/data/web_text_document data.tokenizer=/data/tokenizer.json
  k2-data prepare.input='/data/web/*.jsonl.zst' prepare.output=/data/web_text_document \\
      prepare.workers=8 data.tokenizer=/data/tokenizer.json
"""


def _data(args: list[str]) -> int:
    cfg = load_config(args)
    try:
        return _build(cfg)
    except OSError as e:  # a full disk, a read-only file system, no permission: one line naming the path
        where = e.filename or (f"prepare.output={cfg.prepare.output}" if cfg.prepare.input is not None
                               else f"data.cache_dir={cfg.data.cache_dir}")
        error(PROG, f"cannot write {where}: {e.strerror or e} (errno {errno.errorcode.get(e.errno, e.errno)}); "
                    "free space there or choose another directory, then run again: the build resumes")
        return 1


def _build(cfg: K2Config) -> int:
    if cfg.prepare.input is not None:
        return _prepare(cfg)
    resolved = resolve_data(cfg)
    if resolved.embedded:
        paths = prepare_stdlib_corpus(cfg.data)
        m = paths.manifest
        print(
            f"k2-data: Python {m['python_version']} stdlib, {m['file_count']} files "
            f"({len(m['non_utf8_files'])} not UTF-8, read as latin-1) -> {paths.directory}"
        )
        for s in ("train", "valid"):
            print(
                f"  {s:5s}: {m['documents'][s]:6,d} documents {m['tokens'][s]:12,d} tokens  "
                f"{getattr(paths, s + '_prefix')}.bin/.idx"
            )
        print(
            f"  tokenizer: {paths.tokenizer_path} (byte-level BPE, {m['tokenizer_vocab_size']} ids, "
            f"eod={m['eod_id']} pad={m['pad_id']})"
        )
        if paths.rebuilt:
            print(f"  built in {m['build_seconds']:.1f} s")
        else:
            print("  already up to date: nothing rebuilt")
    else:
        for key, blend in (("data.path", resolved.train_blend), ("data.valid_path", resolved.valid_blend)):
            if blend is None:
                continue
            for i, p in enumerate(blend[0]):
                docs, toks = resolved.stats[p]
                w = "" if blend[1] is None else f" weight {blend[1][i]:g}"
                print(f"k2-data: {key}: {p}{w}: {docs:,d} documents, {toks:,d} tokens")
        if resolved.valid_blend is None:
            print(f"k2-data: validation carved from data.path by data.split={resolved.split}")
        print(f"k2-data: tokenizer {resolved.tokenizer_path} ({resolved.tokenizer_vocab_size} ids): OK")
    return 0


def _prepare(cfg: K2Config) -> int:
    out = prepare_corpus(cfg)
    m = out.manifest
    if len(m["datasets"]) > 1:  # (one dataset: the total line below says it all)
        for d in m["datasets"]:
            print(f"k2-data: {d['prefix']}: {d['documents']:,d} documents, {d['tokens']:,d} tokens")
    bad = m["bad_records"]["count"]
    print(f"k2-data: {m['documents']:,d} documents, {m['tokens']:,d} tokens (EOD included) from "
          f"{_count(len(m['inputs']), 'input file')}"
          + (f"; {bad} bad records skipped" if bad else "")
          + (f"; {m['empty_documents_skipped']} empty texts skipped" if m["empty_documents_skipped"] else ""))
    path = out.prefixes[0] if len(out.prefixes) == 1 else "[" + ",".join(out.prefixes) + "]"
    print(f"k2-data: manifest {out.manifest_path}; train on it with data.path={path} "
          f"data.tokenizer={out.tokenizer_path} (model.vocab_size must be >= {m['tokenizer']['vocab_size']})")
    return 0


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def main(argv: Sequence[str] | None = None) -> int:
    """``k2-data [HYDRA_OVERRIDE ...]``: corpus summary out; 0, or 2 for a bad setting."""
    return run_main(PROG, _data, argv, usage=USAGE)


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
