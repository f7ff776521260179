"""``k2-bench bench=data``: ``k2-data prepare`` end to end against the tokenizer's own ``encode_batch``.

The limit of the pipeline is the tokenizer: ``tokenizers.Tokenizer.encode_batch`` over every document
already in memory (its own thread pool over all cores), with nothing read, parsed or written, and the
freeing of its result not timed. ``encode_batch_fast`` (the same ids without character offsets), called
as ``k2-data`` calls it (batches of ``chunk_documents``, each freed), is timed too: the tokenizer's
share of the build. The benchmark writes a JSONL corpus of real text (the docstrings of the standard
library, repeated until ``corpus_mb`` MB) and times, in each of ``repeats`` rounds, both raw encodes and
:func:`k2.launcher.datasets.preprocess.prepare_corpus` over the same file with 1 and ``workers`` worker
processes (reading, JSON parsing, tokenizing, committing chunks, the megatron indexed-dataset output,
the manifest; the workers are forked from this process, torch imported). Rounds interleave
the sides, so a change in the load of a shared machine hits them alike; each figure is the median over
the rounds, and each ratio is of two medians of the same run. Tokens counted are the tokenizer's ids
without the EOD tokens, so every side counts the same thing.

Across machines (``prepare.tasks``, :mod:`k2.launcher.datasets.array_build`): in each round the same corpus is
also built as an array of ``array_tasks`` tasks run at once as separate ``k2-data`` processes (as a Slurm
array's tasks on one node would run; the plan made first, the last task finalizing) and as the same
array build in one process (``prepare.tasks=1``: the same bytes); the ratio of their medians is the
speed-up of the array here, and each task's peak RSS (``VmHWM``) is reported. On a machine with fewer
cores than tasks the tasks share the cores: the ratio then shows the cost of splitting, not a cluster's
speed-up, which is the tasks x the rate of one task (``array_one_process_tokens_per_s``).

Memory: the build streams. Peak RSS (``VmHWM`` of a separate ``k2-data`` process, 1 worker) is
measured for corpora of ``rss_mb`` and 4 x ``rss_mb`` MB: streamed, it stays flat while the corpus grows,
so it does not depend on the corpus fitting in memory. With ``memory_limit_mb`` > 0 a third build runs
inside a memory cgroup limited to that many MB (cgroup v2 ``memory.max`` or v1
``memory.limit_in_bytes``, needs root; the figure says why when none can be made) over a corpus of
``2 x memory_limit_mb`` MB: a build that held the corpus would be killed by the kernel's OOM killer, a
streamed one finishes (its exit status, its peak RSS -- which counts the shared libraries' pages too --
and the most memory charged to the cgroup, page cache included, are reported). The limit must leave room
for the process itself: ``k2-data prepare`` peaks at ~100 MB of RSS here (Python, numpy, tokenizers,
OmegaConf; it imports neither torch nor megatron-core), so 200 MB is enough.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k2.launcher.benchmarks.common import bench_options

if TYPE_CHECKING:
    from k2.config.schema import K2Config

DEFAULTS = {
    "corpus_mb": 8.0,
    "repeats": 3,
    "rss_mb": 2.0,
    "vocab_size": 4096,
    "workers": 2,
    "chunk_documents": 2048,
    "memory_limit_mb": 0,
    "array_tasks": 4,
    "array_pieces_per_task": 4,
}
# The raw references, timed over the same documents: ``encode_batch`` in one call over all of them, its
# result freed after the clock stops (the limit the pipeline is measured against); and
# ``encode_batch_fast`` (tokenizers >= 0.20: the same ids without the character offsets) called as k2-data
# calls it, in batches of ``chunk_documents``, each freed before the next: the tokenizer's share of
# k2-data's own work, so the ratio to it is the cost of everything else (reading, parsing, the ids out of
# Python, the processes, the output). (One ``encode_batch_fast`` call over a whole 32 MB corpus took
# 1.5-1.7x the CPU of ``encode_batch`` here, so it is not timed that way.)
RAW_METHODS = ("encode_batch", "encode_batch_fast")
_CGROUP_V2, _CGROUP_V1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/memory")


def stdlib_docstrings(limit: int | None = None) -> list[str]:
    """Docstrings of the stdlib's top-level modules (module, class and function ones), in file order:
    real text with unicode and code, the benchmark's (and the tests') corpus. ``limit``: at most this many."""
    out = []
    for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(p.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        out += [
            ast.get_docstring(n)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(n)
        ]
        if limit is not None and len(out) >= limit:
            return out[:limit]
    return out


def write_jsonl_corpus(path: Path, megabytes: float, docs: list[str]) -> int:
    """Write ``docs`` as ``{"text": ...}`` lines, repeated (with the pass number, so no two lines are the
    same) until the file holds ``megabytes`` MB. Returns the number of documents."""
    n, size, limit = 0, 0, int(megabytes * 1e6)
    with open(path, "w", encoding="utf-8") as f:
        while size < limit:
            for d in docs:
                line = json.dumps({"text": f"{d}\n[{n}]"}) + "\n"
                f.write(line)
                size, n = size + len(line), n + 1
                if size >= limit:
                    break
    return n


def _prepare_args(inp: Path, out: Path, tok: Path, workers: int, chunk: int, vocab: int) -> list[str]:
    return [
        f"prepare.input={inp}",
        f"prepare.output={out}",
        f"prepare.workers={workers}",
        f"prepare.chunk_documents={chunk}",
        "prepare.progress=false",
        f"data.tokenizer={tok}",
        f"model.vocab_size={vocab}",
    ]


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process (all its threads) and of its reaped children."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


# Runs k2-data in the child and, at its exit, writes the child's own peak RSS (``VmHWM`` of
# /proc/self/status, in kB) to the file named by the first argument. Not ``wait4``'s ``ru_maxrss``: Linux
# carries a process's high-water mark across ``exec``, so a child forked from this benchmark process
# (torch and megatron-core imported) would report at least this process's resident memory.
_REPORT_PEAK_RSS = """
import atexit, runpy, sys
out = sys.argv.pop(1)
def report():
    with open("/proc/self/status") as f:
        hwm = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
    with open(out, "w") as f:
        f.write(hwm)
atexit.register(report)
sys.argv[0] = "k2-data"
runpy.run_module("k2.launcher.data", run_name="__main__")
"""


def _peak_rss_mb(args: list[str], cgroup: Path | None = None) -> tuple[float | None, int]:
    """``(peak resident memory in MB, exit status)`` of a ``k2-data`` process run with ``args`` (its own
    ``VmHWM``; None when it was killed before it could report it), inside the memory cgroup directory
    ``cgroup`` when given (the child writes its pid into ``cgroup.procs`` before it runs k2-data). Raises
    RuntimeError when k2-data fails outside a cgroup."""
    with tempfile.NamedTemporaryFile(prefix="k2-bench-rss-", suffix=".kb", delete=False) as f:
        report = Path(f.name)
    try:
        cmd = [sys.executable, "-c", _REPORT_PEAK_RSS, str(report), *args]
        if cgroup is not None:  # (a shell: it joins the cgroup, then becomes k2-data; no preexec_fn in Python)
            cmd = ["sh", "-c", f'echo $$ > "{cgroup / "cgroup.procs"}" && exec "$@"', "sh", *cmd]
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL if cgroup else None)
        if proc.returncode and cgroup is None:
            raise RuntimeError(f"k2-data {' '.join(args)} failed ({proc.returncode})")
        kb = report.read_text().strip()
        return (int(kb) / 1024 if kb else None), proc.returncode
    finally:
        report.unlink(missing_ok=True)


def _memory_cgroup(limit_mb: float) -> tuple[Path | None, str]:
    """A new memory cgroup limited to ``limit_mb`` MB: ``(its directory, "cgroup v2" / "cgroup v1")``, or
    ``(None, why not)`` where this machine gives none (no cgroup file system, not root, no memory
    controller)."""
    limit = str(int(limit_mb * 2**20))
    name = f"k2-bench-data-{os.getpid()}"
    try:
        if (_CGROUP_V2 / "cgroup.controllers").exists():
            if "memory" not in (_CGROUP_V2 / "cgroup.subtree_control").read_text().split():
                return None, "cgroup v2 without the memory controller enabled for child groups"
            d = _CGROUP_V2 / name
            d.mkdir()
            (d / "memory.max").write_text(limit)
            if (d / "memory.swap.max").exists():  # no swapping around the limit either
                (d / "memory.swap.max").write_text("0")
            return d, "cgroup v2"
        if (_CGROUP_V1 / "memory.limit_in_bytes").exists():
            d = _CGROUP_V1 / name
            d.mkdir()
            (d / "memory.limit_in_bytes").write_text(limit)
            if (d / "memory.memsw.limit_in_bytes").exists():  # memory + swap: no swapping around it
                (d / "memory.memsw.limit_in_bytes").write_text(limit)
            return d, "cgroup v1"
    except OSError as e:
        return None, f"could not create a memory cgroup ({e})"
    return None, "no cgroup memory controller at /sys/fs/cgroup"


def _limited_build(o: dict, root: Path, docs: list[str], tok_path: Path) -> dict:
    """The build of a ``2 x memory_limit_mb`` MB corpus inside a cgroup of ``memory_limit_mb`` MB."""
    limit = float(o["memory_limit_mb"])
    cgroup, how = _memory_cgroup(limit)
    if cgroup is None:
        return {"skipped": how}
    try:
        path = root / "limited.jsonl"
        write_jsonl_corpus(path, 2 * limit, docs)
        t0 = time.perf_counter()
        rss, code = _peak_rss_mb(
            _prepare_args(
                path,
                root / "limited_out" / "c",
                tok_path,
                int(o["workers"]),
                int(o["chunk_documents"]),
                int(o["vocab_size"]),
            ),
            cgroup,
        )
        charged = next(
            (int(f.read_text()) for f in (cgroup / "memory.max_usage_in_bytes", cgroup / "memory.peak") if f.exists()),
            None,
        )  # (v1 / v2: the most memory charged to the cgroup at once)
        return {
            "cgroup": how,
            "memory_limit_mb": limit,
            "corpus_mb": round(path.stat().st_size / 2**20, 1),
            "exit_status": code,
            "finished": code == 0,
            "peak_rss_mb": None if rss is None else round(rss, 1),
            "peak_charged_mb": None if charged is None else round(charged / 2**20, 1),
            "build_s": round(time.perf_counter() - t0, 1),
        }
    finally:
        for _ in range(50):  # (the cgroup can be removed once its last process is gone)
            try:
                cgroup.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def bench_data(cfg: K2Config) -> dict[str, Any]:
    """Tokens/s of ``k2-data prepare`` (1 and ``workers`` processes) over the tokenizer's raw
    ``encode_batch`` (and ``encode_batch_fast``) on the same JSONL input in one run; peak RSS of a
    streamed build at two corpus sizes.

    Options: ``corpus_mb`` (MB of JSONL timed), ``repeats`` (rounds; each round times every raw encode and
    every build once, interleaved so that drifts in the machine's load hit every side alike; the figures
    are medians over the rounds), ``rss_mb`` (the smaller RSS corpus; 0 = no RSS runs), ``vocab_size``
    (of the byte-level BPE trained for the benchmark), ``workers``, ``chunk_documents``,
    ``memory_limit_mb`` (> 0: the memory-limited build of the module docstring,
    ``figures["memory_limited"]``).

    Raises:
        ConfigError: an option below its minimum (``corpus_mb`` > 0, ``repeats`` >= 1, ``workers`` >= 1,
            ``chunk_documents`` >= 1).
    """
    from k2.config.errors import ConfigError

    o = bench_options(cfg, DEFAULTS)
    for key in ("repeats", "workers", "chunk_documents"):
        if o[key] < 1:
            raise ConfigError(f"bench.options.{key}={o[key]} must be >= 1")
    if o["corpus_mb"] <= 0:
        raise ConfigError(f"bench.options.corpus_mb={o['corpus_mb']} must be > 0")

    from k2.launcher.datasets.tokenizer import train_byte_level_bpe

    docs = stdlib_docstrings()
    with tempfile.TemporaryDirectory(prefix="k2-bench-data-") as tmp:
        root = Path(tmp)
        tok_path = root / "tokenizer.json"
        tok = train_byte_level_bpe(docs[:2000], int(o["vocab_size"]))
        tok.save(str(tok_path))
        inp = root / "corpus.jsonl"
        n_docs = write_jsonl_corpus(inp, o["corpus_mb"], docs)
        texts = [json.loads(line)["text"] for line in inp.open(encoding="utf-8")]
        workers = sorted({1, int(o["workers"])})
        sides = {
            **{m: functools.partial(_raw_encode, tok, texts, m, int(o["chunk_documents"])) for m in RAW_METHODS},
            **{w: functools.partial(_timed_build, o, root, inp, tok_path, w) for w in workers},
        }
        tasks = int(o["array_tasks"])
        if tasks > 0:  # the array build: one process, then `tasks` processes at once (module docstring)
            sides.update({f"array{n}": functools.partial(_timed_array, o, root, inp, tok_path, n) for n in (1, tasks)})
        runs: dict[Any, list] = {k: [] for k in sides}
        for _ in range(int(o["repeats"])):
            for k, fn in sides.items():
                runs[k].append(fn())
        rates = _rate_figures({k: v for k, v in runs.items() if not str(k).startswith("array")}, workers)
        if tasks > 0:
            rates.update(_array_figures(runs, tasks, rates["tokens"]))
        figures: dict[str, Any] = {
            "corpus_bytes": inp.stat().st_size,
            "documents": n_docs,
            "tokens": rates["tokens"],
            "cpu_count": os.cpu_count(),
            "repeats": int(o["repeats"]),
            **rates,
        }
        if o["rss_mb"] > 0:  # memory: a streamed build of a corpus 4x larger uses no more memory
            figures.update(_rss_figures(o, root, docs, tok_path))
        if o["memory_limit_mb"] > 0:
            figures["memory_limited"] = _limited_build(o, root, docs, tok_path)
    return figures


def _rss_figures(o: dict, root: Path, docs: list[str], tok_path: Path) -> dict[str, Any]:
    """Peak RSS (MB) of a one-process streamed build of a ``rss_mb`` MB corpus and of one 4x larger, and
    the ratio of the two (``rss_growth_for_4x_corpus``)."""
    rss = {}
    for mult in (1, 4):
        path = root / f"rss_{mult}.jsonl"
        write_jsonl_corpus(path, o["rss_mb"] * mult, docs)
        rss[mult] = (
            path.stat().st_size,
            _peak_rss_mb(
                _prepare_args(
                    path,
                    root / f"rss_out{mult}" / "c",
                    tok_path,
                    1,
                    int(o["chunk_documents"]),
                    int(o["vocab_size"]),
                )
            )[0],
        )
    return {
        "rss": {f"corpus_{b / 1e6:.2f}MB_peak_rss_mb": round(r, 1) for b, r in rss.values()},
        "rss_growth_for_4x_corpus": rss[4][1] / rss[1][1],
    }


def _raw_encode(tok, texts: list, method: str, chunk_documents: int) -> tuple[float, float, int]:
    """(s, CPU-s, tokens) of ``tok.<method>`` over every text, as ``RAW_METHODS`` says."""
    t0, c0 = time.perf_counter(), _cpu_s()
    if method == "encode_batch":  # one call; its result is freed after the clock stops
        enc = tok.encode_batch(texts, add_special_tokens=False)
        dt, cpu = time.perf_counter() - t0, _cpu_s() - c0
        return dt, cpu, sum(map(len, enc))
    n = 0
    for i in range(0, len(texts), chunk_documents):  # as k2-data calls it: batch by batch, each freed
        n += sum(map(len, tok.encode_batch_fast(texts[i : i + chunk_documents], add_special_tokens=False)))
    return time.perf_counter() - t0, _cpu_s() - c0, n


def _timed_build(o: dict, root: Path, inp: Path, tok_path: Path, w: int) -> tuple[float, float, int]:
    """(s, CPU-s, tokens without the EOD ones) of ``k2-data prepare`` with ``w`` workers, into a fresh
    directory each call."""
    from k2.config.load import load_config
    from k2.launcher.datasets.preprocess import prepare_corpus

    out_dir = Path(tempfile.mkdtemp(prefix=f"out_w{w}_", dir=root))
    c = load_config(_prepare_args(inp, out_dir / "c", tok_path, w, int(o["chunk_documents"]), int(o["vocab_size"])))
    t0, c0 = time.perf_counter(), _cpu_s()
    out = prepare_corpus(c, log=lambda s: None)
    dt, cpu = time.perf_counter() - t0, _cpu_s() - c0  # (the workers are reaped by then)
    shutil.rmtree(out_dir)
    return dt, cpu, out.manifest["tokens"] - out.manifest["documents"]


def _timed_array(o: dict, root: Path, inp: Path, tok_path: Path, tasks: int) -> tuple[float, float, int, list]:
    """(s, CPU-s, tokens without the EOD ones, each task's peak RSS in MB) of an array build of ``tasks``
    tasks: the plan in this process, then the tasks at once, each a ``k2-data`` process (the last one
    finalizes), into a fresh directory each call; ``tasks`` = 1 is the same build in one process."""
    import json as _json

    from k2.config.load import load_config
    from k2.launcher.datasets.array_build import plan_build

    out_dir = Path(tempfile.mkdtemp(prefix=f"out_a{tasks}_", dir=root))
    pieces = int(o["array_pieces_per_task"]) * int(o["array_tasks"])
    args = [
        *_prepare_args(inp, out_dir / "c", tok_path, 1, int(o["chunk_documents"]), int(o["vocab_size"])),
        f"prepare.tasks={tasks}",
        f"prepare.shard_bytes={max(1, inp.stat().st_size // pieces)}",
    ]
    t0, c0 = time.perf_counter(), _cpu_s()
    plan_build(load_config(args), log=lambda s: None, start_over=True)
    reports = [Path(out_dir / f"rss{t}.kb") for t in range(tasks)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _REPORT_PEAK_RSS, str(reports[t]), *args, f"prepare.task={t}"],
            stdout=subprocess.DEVNULL,
        )
        for t in range(tasks)
    ]
    codes = [p.wait() for p in procs]
    dt, cpu = time.perf_counter() - t0, _cpu_s() - c0
    if any(codes):
        raise RuntimeError(f"k2-data array tasks failed: exit statuses {codes}")
    manifest = _json.loads((out_dir / "c.manifest.json").read_text())
    rss = [round(int(r.read_text().strip()) / 1024, 1) for r in reports]
    shutil.rmtree(out_dir)
    return dt, cpu, manifest["tokens"] - manifest["documents"], rss


def _array_figures(runs: dict, tasks: int, tokens: int) -> dict[str, Any]:
    """The array's figures (module docstring): medians of the one-process and the ``tasks``-process builds,
    their ratio, each task's peak RSS (the largest over the rounds)."""
    one, many = runs["array1"], runs[f"array{tasks}"]
    assert all(t == tokens for _, _, t, _ in one + many), "the array builds wrote other tokens"
    med1, medn = statistics.median(d for d, *_ in one), statistics.median(d for d, *_ in many)
    return {
        "array_tasks": tasks,
        "array_one_process_s": [round(d, 4) for d, *_ in one],
        f"array_{tasks}_tasks_s": [round(d, 4) for d, *_ in many],
        "array_one_process_tokens_per_s": tokens / med1,
        f"array_{tasks}_tasks_tokens_per_s": tokens / medn,
        f"array_{tasks}_tasks_speedup": med1 / medn,
        "array_task_peak_rss_mb": [max(r[i] for *_, r in many) for i in range(tasks)],
    }


def _rate_figures(runs: dict, workers: list) -> dict[str, Any]:
    """Tokens/s and tokens/CPU-s of each side (medians over the rounds), k2-data's over the raw encode."""
    tokens = runs["encode_batch"][0][2]
    for k, rs in runs.items():  # every side counts the same tokens
        assert all(t == tokens for _, _, t in rs), (k, [t for _, _, t in rs], tokens)
    med = {
        k: (statistics.median(d for d, _, _ in rs), statistics.median(c for _, c, _ in rs)) for k, rs in runs.items()
    }
    figures: dict[str, Any] = {"tokens": tokens}
    for m in RAW_METHODS:
        figures[f"raw_{m}_tokens_per_s"] = tokens / med[m][0]
        figures[f"raw_{m}_s"] = [round(d, 4) for d, _, _ in runs[m]]
        figures[f"raw_{m}_tokens_per_cpu_s"] = tokens / med[m][1]
    for w in workers:
        dt, cpu = med[w]
        figures[f"k2_data_workers{w}_tokens_per_s"] = tokens / dt
        figures[f"k2_data_workers{w}_s"] = [round(d, 4) for d, _, _ in runs[w]]
        figures[f"k2_data_workers{w}_over_raw"] = med["encode_batch"][0] / dt
        figures[f"k2_data_workers{w}_over_raw_fast"] = med["encode_batch_fast"][0] / dt
        # CPU seconds (this process and its workers): what other load on a shared machine changes least
        figures[f"k2_data_workers{w}_tokens_per_cpu_s"] = tokens / cpu
        figures[f"k2_data_workers{w}_cpu_over_raw"] = med["encode_batch"][1] / cpu
    return figures
