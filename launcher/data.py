"""``k2-data``: build the embedded default corpus, tokenize a corpus (on one machine or as a Slurm array),
check a user dataset, verify outputs against their manifest (:mod:`k2.launcher.datasets`)."""

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
       k2-data verify [MANIFEST_OR_PREFIX ...] [HYDRA_OVERRIDE ...]
       k2-data finalize prepare.output=PREFIX [prepare.tasks=N]

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

Across machines, prepare.tasks=N cuts the input into pieces of prepare.shard_bytes (1 GiB) at record
boundaries, one shard PREFIX_NNNNN.bin/.idx each, built by N tasks: here one after another, or
prepare.submit=true submits them as a Slurm array (submit.* sets its #SBATCH lines; run it again to
submit the unfinished tasks, which resume); prepare.task=T runs task T alone. The bytes do not depend
on N. The last task writes PREFIX.manifest.json: train on it with data.path=PREFIX.manifest.json.
`k2-data finalize` writes it, or names the unfinished tasks (exit 2).

`k2-data verify` reads every output a manifest lists (a MANIFEST path, a dataset PREFIX of a k2-data
build; default: prepare.output's manifest, else the datasets of data.path / data.valid_path, else the
embedded corpus) and compares its size and xxh3-64 checksum: one line per bad file, exit 2 if any.
Exit status 130: interrupted (Ctrl-C); a build resumes where it stopped when run again.

examples:
  k2-data
  k2-data data.vocab_size=8192 model.vocab_size=8192 data.cache_dir=/scratch/k2
  k2-data data.path=/data/web_text_document data.tokenizer=/data/tokenizer.json
  k2-data prepare.input='/data/web/*.jsonl.zst' prepare.output=/data/web_text_document \\
      prepare.workers=8 data.tokenizer=/data/tokenizer.json
  k2-data prepare.input=/data/web/ prepare.output=/data/web prepare.tasks=64 prepare.workers=16 \\
      prepare.submit=true submit.partition=cpu submit.time=12:00:00 data.tokenizer=/data/tokenizer.json
  k2-data verify /data/web.manifest.json
"""


def _data(args: list[str]) -> int:
    verb = args[0] if args and args[0] in ("verify", "finalize") else None
    if verb == "verify":
        from k2.launcher.tools.data_verify import verify_command

        return verify_command(args[1:])
    cfg = load_config(args[1:] if verb else args)
    try:
        if verb == "finalize":
            return _finalize(cfg)
        return _build(cfg, args)
    except KeyboardInterrupt:  # (committed chunks are kept: a build resumes after them)
        error(PROG, "interrupted (Ctrl-C); run the same command again: the build resumes where it stopped")
        return 130
    except OSError as e:  # a full disk, a read-only file system, no permission: one line naming the path
        where = e.filename or (
            f"prepare.output={cfg.prepare.output}"
            if cfg.prepare.input is not None
            else f"data.cache_dir={cfg.data.cache_dir}"
        )
        error(
            PROG,
            f"cannot write {where}: {e.strerror or e} (errno {errno.errorcode.get(e.errno, e.errno)}); "
            "free space there or choose another directory, then run again: the build resumes",
        )
        return 1


def _build(cfg: K2Config, overrides: list[str]) -> int:
    if cfg.prepare.input is not None:
        return _prepare(cfg, overrides)
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


def _prepare(cfg: K2Config, overrides: list[str]) -> int:
    if cfg.prepare.tasks is None:
        return _summary(prepare_corpus(cfg))
    if cfg.prepare.submit:
        from k2.launcher.tools.prepare_sbatch import submit_array

        return submit_array(cfg, overrides, log=lambda s: print(s, file=sys.stderr, flush=True))
    from k2.launcher.datasets.array_build import prepare_array

    out = prepare_array(cfg)
    return 0 if out is None else _summary(out)


def _finalize(cfg: K2Config) -> int:
    from k2.launcher.datasets.array_build import finalize
    from k2.launcher.datasets.preprocess import output_prefix

    return _summary(finalize(cfg, output_prefix(cfg), cfg.prepare.tasks, lambda s: print(s, flush=True)))


#: datasets listed one per line in the summary (an array build may write thousands)
_LISTED = 8


def _summary(out) -> int:
    m = out.manifest
    if len(m["datasets"]) > 1:  # (one dataset: the total line below says it all)
        for d in m["datasets"][:_LISTED]:
            print(f"k2-data: {d['prefix']}: {d['documents']:,d} documents, {d['tokens']:,d} tokens")
        if len(m["datasets"]) > _LISTED:
            print(f"k2-data: ... {len(m['datasets']) - _LISTED} more datasets (all in {out.manifest_path})")
    bad = m["bad_records"]["count"]
    print(
        f"k2-data: {m['documents']:,d} documents, {m['tokens']:,d} tokens (EOD included) from "
        f"{_count(len(m['inputs']), 'input file')}"
        + (f"; {bad} bad records skipped" if bad else "")
        + (f"; {m['empty_documents_skipped']} empty texts skipped" if m["empty_documents_skipped"] else "")
    )
    path = (
        out.prefixes[0]
        if len(out.prefixes) == 1
        else out.manifest_path
        if len(out.prefixes) > _LISTED
        else "[" + ",".join(out.prefixes) + "]"
    )
    print(
        f"k2-data: manifest {out.manifest_path}; train on it with data.path={path} "
        f"data.tokenizer={out.tokenizer_path} (model.vocab_size must be >= {m['tokenizer']['vocab_size']})"
    )
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
