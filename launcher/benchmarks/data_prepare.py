"""``k2-bench bench=data``: ``k2-data prepare`` end to end against the tokenizer's own ``encode_batch``.

The limit of the pipeline is the tokenizer: ``tokenizers.Tokenizer.encode_batch`` over every document
already in memory (its own thread pool over all cores), with nothing read, parsed or written. The
benchmark writes a JSONL corpus of real text (the docstrings of the standard library, repeated until
``corpus_mb`` MB), times that raw encode once before and once after the ``k2-data`` builds (the median
of the two is the reference: the machine may be shared), and times
:func:`k2.launcher.datasets.preprocess.prepare_corpus` over the same file with 1 and 2 worker processes
(reading, JSON parsing, tokenizing, committing chunks, the megatron ``IndexedDatasetBuilder`` output,
the manifest; the one-time import of megatron-core is done before the clock starts). Tokens counted
are the tokenizer's ids without the EOD tokens, so both sides count the same thing.

Memory: the build streams. Peak RSS (``ru_maxrss`` of a separate ``k2-data`` process, 1 worker) is
measured for corpora of ``rss_mb`` and 4 x ``rss_mb`` MB: streamed, it stays flat while the corpus grows,
so it does not depend on the corpus fitting in memory.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Optional
from typing import Any

from k2.launcher.benchmarks.common import bench_options

DEFAULTS = {"corpus_mb": 2.0, "rss_mb": 2.0, "vocab_size": 4096, "workers": 2, "chunk_documents": 2048}


def stdlib_docstrings(limit: Optional[int] = None) -> list[str]:
    """Docstrings of the stdlib's top-level modules (module, class and function ones), in file order:
    real text with unicode and code, the benchmark's (and the tests') corpus. ``limit``: at most this many."""
    out = []
    for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(p.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        out += [ast.get_docstring(n) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(n)]
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
    return [f"prepare.input={inp}", f"prepare.output={out}", f"prepare.workers={workers}",
            f"prepare.chunk_documents={chunk}", "prepare.progress=false", f"data.tokenizer={tok}",
            f"model.vocab_size={vocab}"]


def _peak_rss_mb(args: list[str]) -> float:
    """Peak resident memory (MB) of a ``k2-data`` process run with ``args`` (``wait4``'s ``ru_maxrss``)."""
    proc = subprocess.Popen([sys.executable, "-m", "k2.launcher.data", *args], stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"k2-data {' '.join(args)} failed ({proc.returncode})")
    return usage.ru_maxrss / 1024


def bench_data(cfg) -> dict[str, Any]:
    """Tokens/s of ``k2-data prepare`` (1 and ``workers`` processes) over the tokenizer's raw
    ``encode_batch`` on the same JSONL input in one run; peak RSS of a streamed build at two corpus sizes.

    Options: ``corpus_mb`` (MB of JSONL timed), ``rss_mb`` (the smaller RSS corpus; 0 = no RSS runs),
    ``vocab_size`` (of
    the byte-level BPE trained for the benchmark), ``workers``, ``chunk_documents``.
    """
    import megatron.core.datasets.indexed_dataset  # noqa: F401  (imported once, outside the clock)

    from k2.config.load import load_config
    from k2.launcher.datasets.preprocess import prepare_corpus
    from k2.launcher.datasets.tokenizer import train_byte_level_bpe

    o = bench_options(cfg, DEFAULTS)
    docs = stdlib_docstrings()
    with tempfile.TemporaryDirectory(prefix="k2-bench-data-") as tmp:
        root = Path(tmp)
        tok_path = root / "tokenizer.json"
        tok = train_byte_level_bpe(docs[:2000], int(o["vocab_size"]))
        tok.save(str(tok_path))
        inp = root / "corpus.jsonl"
        n_docs = write_jsonl_corpus(inp, o["corpus_mb"], docs)
        texts = [json.loads(line)["text"] for line in inp.open(encoding="utf-8")]

        def raw() -> tuple[float, int]:
            t0 = time.perf_counter()
            enc = tok.encode_batch(texts, add_special_tokens=False)
            dt = time.perf_counter() - t0
            return dt, sum(len(e.ids) for e in enc)

        raw_runs = [raw()]
        tokens = raw_runs[0][1]
        figures: dict[str, Any] = {"corpus_bytes": inp.stat().st_size, "documents": n_docs, "tokens": tokens,
                                   "cpu_count": os.cpu_count()}
        e2e = {}
        for w in sorted({1, int(o["workers"])}):
            c = load_config(_prepare_args(inp, root / f"out_w{w}" / "c", tok_path, w,
                                          int(o["chunk_documents"]), int(o["vocab_size"])))
            t0 = time.perf_counter()
            out = prepare_corpus(c, log=lambda s: None)
            dt = time.perf_counter() - t0
            assert out.manifest["tokens"] - out.manifest["documents"] == tokens  # same tokens as raw
            e2e[w] = dt
        raw_runs.append(raw())
        raw_s = (raw_runs[0][0] + raw_runs[1][0]) / 2  # the median of two
        figures["raw_encode_batch_tokens_per_s"] = tokens / raw_s
        figures["raw_encode_batch_s"] = [round(r[0], 3) for r in raw_runs]
        for w, dt in e2e.items():
            figures[f"k2_data_workers{w}_tokens_per_s"] = tokens / dt
            figures[f"k2_data_workers{w}_over_raw"] = raw_s / dt
        if o["rss_mb"] <= 0:  # rss_mb=0: throughput only
            return figures
        # memory: a streamed build of a corpus 4x larger uses no more memory
        rss = {}
        for mult in (1, 4):
            path = root / f"rss_{mult}.jsonl"
            write_jsonl_corpus(path, o["rss_mb"] * mult, docs)
            rss[mult] = (path.stat().st_size, _peak_rss_mb(_prepare_args(
                path, root / f"rss_out{mult}" / "c", tok_path, 1, int(o["chunk_documents"]),
                int(o["vocab_size"]))))
        figures["rss"] = {f"corpus_{b / 1e6:.2f}MB_peak_rss_mb": round(r, 1) for b, r in rss.values()}
        figures["rss_growth_for_4x_corpus"] = rss[4][1] / rss[1][1]
    return figures
