"""``TINY=1 bash benchmarks/gpu_session.sh``: the GPU session's steps on the CPU (k2_tiny, the checkout's
.venv), so that the device run does not fail on something a CPU could have shown: every step ends with
status 0 and every check of the summary passes (QK-Clip clips, the injected spike is skipped, background
and synchronous checkpoints are bitwise equal with the offloaded states in shared memory, the resumed
losses equal the uninterrupted ones, the hang watchdog ends a stopped save with 42), and k2-plan accepts
the GPU mode's configuration."""

from __future__ import annotations

import json
import subprocess

import pytest

from support import REPO
from support.distributed import fork_server_python, trainer_env


@pytest.mark.slow
def test_the_gpu_session_runs_on_cpu(tmp_path, stdlib_corpus):
    out = tmp_path / "session"
    env = {**trainer_env(), "TINY": "1", "OUT": str(out), "PYTHON": fork_server_python(tmp_path)}
    p = subprocess.run(
        ["bash", "benchmarks/gpu_session.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tiny"] and summary["checks"] and all(v is True for v in summary["checks"].values()), summary
    plan = json.loads((out / "plan.json").read_text())
    assert set(plan) == {"tiny", "gpu"} and plan["gpu"]["memory_per_gpu_bytes"]["transient"] > 0
    assert "failed steps: none" in (out / "status.txt").read_text()
