"""``k2-data prepare.tasks=N``: one corpus tokenized by N tasks (a Slurm array, or one after another here).

Three steps, each resumable and each safe to run again:

* **plan** (the process that runs ``prepare.tasks=N`` without ``prepare.task``, or the first task to
  start when there is none): the input is cut into pieces of ``prepare.shard_bytes`` at record
  boundaries (:mod:`k2.launcher.datasets.pieces`), and, when ``data.tokenizer`` is null, a byte-level
  BPE of ``data.vocab_size`` ids is trained once on a sample (the records of the first
  ``prepare.tokenizer_sample_bytes / pieces`` bytes of every piece); both go into
  ``PREFIX.partial/plan.json`` and ``PREFIX.partial/tokenizer.json``. Every input's size and
  modification time are recorded, not its checksum: hashing tens of terabytes in one process before the
  array starts would take hours; each task hashes its own segments instead.
* **tasks**: task ``t`` builds the pieces ``t, t + N, t + 2N, ...``; each piece is tokenized
  (:mod:`k2.launcher.datasets.chunked`: chunks committed into ``PREFIX.partial/piece_NNNNN/``, so a
  killed task resumes after its last chunk) into the shard ``PREFIX_NNNNN.bin/.idx`` (in
  ``PREFIX.partial/out/``) and marked done (``PREFIX.partial/piece_NNNNN.json``: its documents, tokens,
  bad records, outputs with size and xxh3-64 checksum, and the xxh3-64 of every input segment it read).
  A piece is built under its own lock, so a resubmitted task and a dying one never write it at once.
* **finalize** (the last task to finish, or ``k2-data finalize``): refused, naming every unfinished
  task, until every piece is done; then the shards, the tokenizer, and last ``PREFIX.manifest.json``
  (documents, tokens, every input, every piece's segments and their checksums, every output file with
  size and checksum) are moved into place and ``PREFIX.partial/`` is removed.

The bytes do not depend on the number of tasks: a shard is the tokens of its piece, and the pieces are
cut from the input alone. The shards in manifest order hold the documents of the one-process build
(``prepare.tasks=null``) of the same input, token for token. ``data.path=PREFIX.manifest.json`` trains
on all the shards.
"""

from __future__ import annotations

import itertools
import os
import shutil
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from k2.config.errors import ConfigError
from k2.launcher.checksums import ALGORITHM, file_checksum, file_entries
from k2.launcher.datasets.chunked import MAX_REPORTED_BAD, tokenize_chunks, write_datasets
from k2.launcher.datasets.idx_format import token_dtype
from k2.launcher.datasets.locks import file_lock
from k2.launcher.datasets.pieces import cut_pieces, input_state, piece_inputs
from k2.launcher.datasets.preprocess import (
    MANIFEST_SUFFIX,
    PreparedCorpus,
    document_texts,
    files_named,
    prepared,
    publish,
    read_json,
    settings,
    settings_key,
    tokenizer_entry,
    trained_tokenizer,
    unfinished_build,
    user_tokenizer,
    work_dir,
    write_json,
)
from k2.launcher.datasets.tokenizer import HFTokenizer

if TYPE_CHECKING:
    from k2.config.schema import K2Config

__all__ = ["PLAN_FILE", "finalize", "plan_build", "prepare_array", "run_task", "unfinished_tasks"]

PLAN_FILE = "plan.json"
Log = Callable[[str], None]


def _shard(prefix: str, k: int) -> str:
    return f"{os.path.basename(prefix)}_{k:05d}"


def _done_path(work: str, k: int) -> str:
    return os.path.join(work, f"piece_{k:05d}.json")


def _build_lock(prefix: str):
    return file_lock(os.path.join(os.path.dirname(prefix), f".{os.path.basename(prefix)}.lock"), remove=True)


def _key(cfg: K2Config, files, user_tok) -> dict:
    """What the output depends on (:func:`k2.launcher.datasets.preprocess.settings_key`, the inputs'
    sizes and times, the piece size, the tokenizer sample)."""
    p = cfg.prepare
    key = {
        **settings_key(cfg, user_tok),
        "array": True,
        "shard_bytes": int(p.shard_bytes),
        "inputs": [input_state(f) for f in files],
    }
    if user_tok is None:
        key["tokenizer"]["sample_bytes"] = int(p.tokenizer_sample_bytes)
    return key


# --------------------------------------------------------------------------- plan


def plan_build(cfg: K2Config, log: Log, start_over: bool) -> tuple[str, dict] | tuple[str, None]:
    """``(prefix, plan)``: the plan of ``PREFIX.partial/plan.json``, made now when there is none (module
    docstring); ``(prefix, None)`` when a finished build with the same key is in place (nothing to do).

    Args:
        start_over: a plan made with other inputs or settings is removed with its work (the process that
            plans the array); False: it is refused (a task must not remove the others' work).

    Raises:
        ConfigError: the inputs, the tokenizer, or (``start_over=False``) a plan of other inputs.
    """
    prefix, files = settings(cfg)
    user_tok = user_tokenizer(cfg)
    key = _key(cfg, files, user_tok)
    if _finished(prefix, key):
        return prefix, None
    work = work_dir(prefix)
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    with _build_lock(prefix):
        plan = read_json(os.path.join(work, PLAN_FILE))
        if plan is not None and plan["key"] == key:
            return prefix, plan
        if os.path.isdir(work):
            if not start_over:
                raise ConfigError(
                    f"{work} holds a build planned with other inputs or settings than this task's; "
                    "plan it again (the same k2-data command without prepare.task, or with "
                    "prepare.submit=true), then run the tasks"
                )
            log(f"k2-data: {work} holds a build of other inputs or settings: starting over")
            shutil.rmtree(work)
        os.makedirs(work)
        pieces = cut_pieces(files, int(cfg.prepare.shard_bytes))
        if not pieces:
            shutil.rmtree(work)
            raise ConfigError(f"prepare.input holds no document ({files_named(files)}: every file is empty)")
        tok_path = user_tok.path if user_tok is not None else _sample_tokenizer(cfg, files, pieces, work, log)
        plan = {
            "key": key,
            "pieces": pieces,
            "tokenizer": tok_path,
            "trained": user_tok is None,
            "tasks": int(cfg.prepare.tasks),
        }
        write_json(os.path.join(work, PLAN_FILE), plan)
    log(
        f"k2-data: planned {prefix}: {len(pieces)} pieces of ~{cfg.prepare.shard_bytes:,} input bytes "
        f"(prepare.shard_bytes) from {files_named(files)}"
    )
    return prefix, plan


def _sample_tokenizer(cfg: K2Config, files, pieces: list, work: str, log: Log) -> str:
    """The BPE of the array, trained once on the first ``tokenizer_sample_bytes / pieces`` bytes of every
    piece (all of a corpus smaller than the sample: then the tokenizer of the one-process build)."""
    budget = max(1, int(cfg.prepare.tokenizer_sample_bytes) // len(pieces))

    def texts():
        return itertools.chain.from_iterable(
            document_texts(cfg, piece_inputs(files, segs), max_bytes=budget) for segs in pieces
        )

    return trained_tokenizer(
        cfg,
        texts,
        work,
        log,
        f"a sample of the input (up to {budget:,} bytes of each of "
        f"{len(pieces)} pieces: prepare.tokenizer_sample_bytes)",
    )


def _finished(prefix: str, key: dict) -> bool:
    """A finished array build of ``prefix`` with this key is in place, every output at its size."""
    manifest = read_json(prefix + MANIFEST_SUFFIX)
    if manifest is None or manifest.get("key") != key or unfinished_build(prefix):
        return False
    d = os.path.dirname(prefix)
    return all(
        os.path.isfile(os.path.join(d, n)) and os.path.getsize(os.path.join(d, n)) == e["size"]
        for n, e in manifest["outputs"].items()
    )


# --------------------------------------------------------------------------- tasks


def task_pieces(n_pieces: int, task: int, tasks: int) -> list[int]:
    """The pieces task ``task`` of ``tasks`` builds: ``task, task + tasks, ...``."""
    return list(range(task, n_pieces, tasks))


def unfinished_tasks(work: str, plan: dict, tasks: int) -> dict[int, tuple[list[int], int]]:
    """``{task: (its pieces not done, its pieces)}`` of every task with a piece not done."""
    out = {}
    for t in range(tasks):
        mine = task_pieces(len(plan["pieces"]), t, tasks)
        todo = [k for k in mine if not os.path.isfile(_done_path(work, k))]
        if todo:
            out[t] = (todo, len(mine))
    return out


def run_task(cfg: K2Config, prefix: str, plan: dict, task: int, tasks: int, log: Log, progress: bool) -> None:
    """Build the pieces of ``task`` of ``tasks`` not done yet (module docstring)."""
    files = _checked_inputs(cfg, plan)
    tok = HFTokenizer(plan["tokenizer"])
    dtype = token_dtype(tok.vocab_size)
    mine = task_pieces(len(plan["pieces"]), task, tasks)
    t0 = time.time()
    for k in mine:
        _build_piece(cfg, prefix, plan, files, k, dtype, log, progress)
    log(
        f"k2-data: task {task} of {tasks}: {len(mine)} piece{'s' if len(mine) != 1 else ''} "
        f"({', '.join(map(str, mine)) or 'none'}) done in {time.time() - t0:.1f} s"
    )


def _checked_inputs(cfg: K2Config, plan: dict):
    """The input files of the plan, refused when one changed since (size or modification time)."""
    _, files = settings(cfg)
    now = [input_state(f) for f in files]
    if now != plan["key"]["inputs"]:
        changed = next((b["path"] for a, b in zip(now, plan["key"]["inputs"]) if a != b), "the file list")
        raise ConfigError(
            f"prepare.input: {changed} changed since the build was planned; plan it again (the same "
            "k2-data command without prepare.task, or with prepare.submit=true)"
        )
    return files


def _build_piece(cfg, prefix: str, plan: dict, files, k: int, dtype, log: Log, progress: bool) -> None:
    """Tokenize piece ``k`` into its shard and mark it done (under its own lock)."""
    work = work_dir(prefix)
    with file_lock(os.path.join(work, f"piece_{k:05d}.lock"), remove=True):
        if os.path.isfile(_done_path(work, k)) or not os.path.isfile(os.path.join(work, PLAN_FILE)):
            return  # done, or the build was finalized meanwhile
        t0 = time.time()
        chunks = os.path.join(work, f"piece_{k:05d}")
        os.makedirs(chunks, exist_ok=True)
        out = os.path.join(work, "out")
        os.makedirs(out, exist_ok=True)
        inputs = piece_inputs(files, plan["pieces"][k])
        n_bad, n_empty, bad = tokenize_chunks(
            cfg.prepare, inputs, chunks, plan["tokenizer"], dtype, progress, log, desc=f"k2-data: piece {k}"
        )
        datasets, outputs = write_datasets(chunks, out, lambda _i: _shard(prefix, k), dtype, None)
        segments = [[fi, s, e, file_checksum(files[fi].path, start=s, end=e)] for fi, s, e in plan["pieces"][k]]
        write_json(
            _done_path(work, k),
            {
                "datasets": datasets,
                "outputs": outputs,
                "segments": segments,
                "bad_records": n_bad,
                "first_bad": bad,
                "empty": n_empty,
            },
        )
        shutil.rmtree(chunks)
    docs = datasets[0]["documents"] if datasets else 0
    log(f"k2-data: piece {k}: {docs:,} documents -> {_shard(prefix, k)} in {time.time() - t0:.1f} s")


# --------------------------------------------------------------------------- finalize


def finalize(cfg: K2Config, prefix: str, tasks: int | None, log: Log) -> PreparedCorpus:
    """Publish the shards and the manifest of ``prefix`` (module docstring).

    Raises:
        ConfigError: no planned build at ``prefix``; a piece not done (naming every unfinished task of
            ``tasks``, default the plan's).
    """
    work = work_dir(prefix)
    with _build_lock(prefix):
        plan = read_json(os.path.join(work, PLAN_FILE))
        if plan is None:
            manifest = read_json(prefix + MANIFEST_SUFFIX)
            if manifest is not None and not unfinished_build(prefix):
                log(f"k2-data: {prefix} is finalized already")
                return prepared(prefix, manifest, rebuilt=False)
            raise ConfigError(
                f"prepare.output={prefix}: no array build planned there ({work}/{PLAN_FILE} is "
                "missing); run k2-data with prepare.tasks first"
            )
        tasks = int(tasks or plan.get("tasks") or 1)
        pending = unfinished_tasks(work, plan, tasks)
        if pending:
            raise ConfigError(
                f"cannot finalize {prefix}: {_pending_line(pending, tasks)}; run "
                f"{'it' if len(pending) == 1 else 'them'} again (the same k2-data command with "
                "prepare.task=T, or prepare.submit=true to submit every unfinished task): each "
                "resumes where it stopped"
            )
        manifest, outputs = _manifest(prefix, work, plan, tasks)
        publish(prefix, os.path.join(work, "out"), outputs, manifest)
        shutil.rmtree(work)
    log(f"k2-data: finalized {prefix}: {len(manifest['datasets'])} shards, {manifest['documents']:,} documents")
    return prepared(prefix, manifest, rebuilt=True)


def _pending_line(pending: dict, tasks: int) -> str:
    parts = [
        f"task {t} of {tasks} is unfinished (pieces {', '.join(map(str, todo[:8]))}"
        f"{' ...' if len(todo) > 8 else ''}: {total - len(todo)} of {total} done)"
        for t, (todo, total) in sorted(pending.items())
    ]
    return "; ".join(parts)


def _manifest(prefix: str, work: str, plan: dict, tasks: int) -> tuple[dict, dict]:
    """The manifest of the finished pieces and every output (the trained tokenizer copied beside them)."""
    base = os.path.basename(prefix)
    done = [read_json(_done_path(work, k)) for k in range(len(plan["pieces"]))]
    datasets = [d for piece in done for d in piece["datasets"]]
    if not datasets:
        raise ConfigError("prepare.input holds no document (every record is empty or bad)")
    outputs = {n: e for piece in done for n, e in piece["outputs"].items()}
    tok = HFTokenizer(plan["tokenizer"])
    tok_path = plan["tokenizer"]
    if plan["trained"]:
        shutil.copyfile(plan["tokenizer"], os.path.join(work, "out", base + ".tokenizer.json"))
        outputs.update(file_entries(os.path.join(work, "out"), [base + ".tokenizer.json"]))
        tok_path = prefix + ".tokenizer.json"
    first_bad = [b for piece in done for b in piece["first_bad"]][:MAX_REPORTED_BAD]
    manifest = {
        "key": plan["key"],
        "documents": sum(d["documents"] for d in datasets),
        "tokens": sum(d["tokens"] for d in datasets),
        "empty_documents_skipped": sum(piece["empty"] for piece in done),
        "bad_records": {
            "policy": plan["key"]["bad_records"],
            "count": sum(p["bad_records"] for p in done),
            "first": first_bad,
        },
        "inputs": plan["key"]["inputs"],
        "pieces": [
            {
                "segments": [{"input": fi, "start": s, "end": e, ALGORITHM: h} for fi, s, e, h in piece["segments"]],
                "dataset": piece["datasets"][0]["prefix"] if piece["datasets"] else None,
            }
            for piece in done
        ],
        "tokenizer": tokenizer_entry(tok, tok_path, trained=plan["trained"]),
        "token_dtype": np.dtype(token_dtype(tok.vocab_size)).name,
        "datasets": datasets,
        "outputs": dict(sorted(outputs.items())),
    }
    return manifest, manifest["outputs"]


# --------------------------------------------------------------------------- the entry


def prepare_array(
    cfg: K2Config, *, progress: bool | None = None, log: Log = lambda s: print(s, flush=True)
) -> PreparedCorpus | None:
    """``k2-data prepare.tasks=N``: with ``prepare.task=T``, task T (the plan made first when there is
    none; the build finalized when every piece is done); without, every task here one after another,
    then finalize. Returns the finished build, or None when pieces of other tasks are still unfinished.

    Raises:
        ConfigError: the settings or inputs (:func:`plan_build`); an input changed since the plan.
    """
    p = cfg.prepare
    show = bool(p.progress) if progress is None else progress
    prefix, plan = plan_build(cfg, log, start_over=p.task is None)
    if plan is None:
        log(f"k2-data: {prefix} is up to date (its manifest matches the inputs and settings): nothing rebuilt")
        return prepared(prefix, read_json(prefix + MANIFEST_SUFFIX), rebuilt=False)
    tasks, work = int(p.tasks), work_dir(prefix)
    if p.task is None:
        write_json(os.path.join(work, PLAN_FILE), {**plan, "tasks": tasks})
        for t in range(tasks):
            run_task(cfg, prefix, plan, t, tasks, log, show)
        return finalize(cfg, prefix, tasks, log)
    run_task(cfg, prefix, plan, int(p.task), tasks, log, show)
    pending = unfinished_tasks(work, plan, tasks) if os.path.isdir(work) else {}
    if pending:
        log(f"k2-data: {_pending_line(pending, tasks)}: the last task to finish writes the manifest")
        return None
    return finalize(cfg, prefix, tasks, log)
