"""``k2-data prepare.tasks=4 prepare.submit=true`` on a real one-node Slurm (tests/support/slurm_local.py):
a corpus of three files, one larger than a task's share (cut into pieces inside it) and one gzipped (not
cut), tokenized by a 4-task array job. One task is cancelled (``scancel JOB_1``) after it committed its
first chunk; ``k2-data finalize`` refuses, naming it; the same submit command again submits that task
alone, which resumes after its committed chunks and, finishing last, writes the manifest. The shards'
documents in manifest order equal the one-process build's token for token, and ``k2-data verify`` finds
every output at its size and checksum.

Needs root (munged, slurmd) and Slurm installed (or ``K2_INSTALL_SLURM=1``), as tests/integration/test_slurm_real.py.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from k2.config.load import load_config
from k2.launcher.benchmarks.data_prepare import stdlib_docstrings
from k2.launcher.datasets.chunked import DELAY_ENV
from k2.launcher.datasets.preprocess import prepare_corpus
from k2.launcher.datasets.tokenizer import train_byte_level_bpe
from support import REPO
from support.distributed import trainer_env
from support.slurm_local import wait_for as _wait

pytestmark = pytest.mark.slow

VOCAB = 600
TASKS = 4


def _documents(prefix: str) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix, mmap=True)
    return [ds[i].tolist() for i in range(len(ds))]


def _k2_data(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "k2.launcher.data", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_four_task_array_resumes_a_cancelled_task_and_equals_the_one_process_build(slurm, tmp_path):
    docs = stdlib_docstrings(400)
    inp = tmp_path / "corpus"
    inp.mkdir()
    lines = [json.dumps({"text": t}) + "\n" for t in docs]
    (inp / "a_large.jsonl").write_text("".join(lines[:250]))
    (inp / "b.jsonl").write_text("".join(lines[250:300]))
    with gzip.open(inp / "c.jsonl.gz", "wt") as f:
        f.write("".join(lines[300:]))
    total = sum(f.stat().st_size for f in inp.iterdir())
    assert (inp / "a_large.jsonl").stat().st_size > total / TASKS  # larger than a task's share
    tok = str(tmp_path / "tokenizer.json")
    train_byte_level_bpe(docs, VOCAB).save(tok)
    common = [f"prepare.input={inp}", "prepare.chunk_documents=8", f"data.tokenizer={tok}", f"model.vocab_size={VOCAB}"]
    reference = prepare_corpus(
        load_config([*common, f"prepare.output={tmp_path / 'one' / 'c'}", "prepare.progress=false"]), log=lambda s: None
    )

    out = tmp_path / "array" / "c"
    submit = [
        *common,
        f"prepare.output={out}",
        f"prepare.tasks={TASKS}",
        "prepare.submit=true",
        f"prepare.shard_bytes={total // 10}",
        "submit.time=10",
        "submit.cpus_per_task=1",
    ]
    env = trainer_env({**slurm.env, DELAY_ENV: "0.5"})  # (a task slow enough to be cancelled in the middle)
    first = _k2_data(env, *submit)
    assert first.returncode == 0, first.stderr
    job = first.stdout.strip()
    assert f"tasks 0-{TASKS - 1} of {TASKS}" in first.stderr, first.stderr

    def log(task: int, j: str = job) -> str:
        f = Path(f"{out}.slurm-{j}_{task}.out")
        return f.read_text() if f.exists() else "(no log)"

    def ended(j: str, tasks) -> bool:
        try:
            return all(
                slurm.job_field(f"{j}_{t}", "JobState") not in ("PENDING", "RUNNING", "COMPLETING", "") for t in tasks
            )
        except RuntimeError:  # (a task of a pending array that Slurm has not split off yet)
            return False

    chunk = Path(f"{out}.partial") / "piece_00001" / "chunk_0000000.npz"  # task 1's first piece
    _wait(chunk.exists, 600, lambda: f"task 1's first chunk: {log(1)}", every=0.1)
    subprocess.run(["scancel", f"{job}_1"], env=slurm.env, check=True)
    _wait(lambda: ended(job, range(TASKS)), 600, lambda: f"job {job}: {[log(t) for t in range(TASKS)]}")
    states = [slurm.job_field(f"{job}_{t}", "JobState") for t in range(TASKS)]
    assert states[1] == "CANCELLED" and states[0] == states[2] == states[3] == "COMPLETED", states
    assert not Path(f"{out}.manifest.json").exists()

    refused = _k2_data(env, "finalize", f"prepare.output={out}")
    err = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(err) == 1, refused.stderr
    assert f"task 1 of {TASKS} is unfinished" in err[0] and "task 0" not in err[0], err

    again = _k2_data(env, *submit)  # submits the unfinished task alone
    assert again.returncode == 0 and f"tasks 1 of {TASKS}" in again.stderr, again.stderr
    job2 = again.stdout.strip()
    _wait(lambda: ended(job2, [1]), 600, lambda: f"job {job2}: {log(1, job2)}")
    assert slurm.job_field(f"{job2}_1", "JobState") == "COMPLETED", log(1, job2)
    assert "resuming the build" in log(1, job2) and "finalized" in log(1, job2), log(1, job2)

    manifest = json.loads(Path(f"{out}.manifest.json").read_text())
    shards = [str(out.parent / d["prefix"]) for d in manifest["datasets"]]
    assert len(shards) >= TASKS + 1
    assert [d for s in shards for d in _documents(s)] == _documents(reference.prefixes[0])
    verified = _k2_data(env, "verify", f"{out}.manifest.json")
    assert verified.returncode == 0 and f"{2 * len(shards)} files match" in verified.stdout, verified.stderr
