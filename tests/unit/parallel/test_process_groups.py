"""Process groups of k2-train (k2.parallel.distributed.init_distributed): settings that matter on GPUs
only, read through what gloo exposes of the same groups."""

from __future__ import annotations

import json
import subprocess

from support import REPO
from support.distributed import rank_launch_cmd, trainer_env

# one rank, PP/EP/DP of 1: megatron still creates every group it would create for a larger layout
GROUP_TIMEOUTS = """
import json, sys, torch, torch.distributed as dist
from k2.config import load_config
from k2.parallel.dims import ParallelDims
from k2.parallel.distributed import DistEnv, init_distributed
cfg = load_config(["parallel=single"])
init_distributed(DistEnv(0, 1, 0, False), ParallelDims.from_config(cfg.parallel, cfg.model, 1), 0, timeout_s=4321)
out = {}
for pg, (backend, _) in dist.distributed_c10d._world.pg_map.items():
    name = dist.distributed_c10d._world.pg_names.get(pg, "?")
    out[name] = pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()
print(json.dumps(out))
"""


def test_every_process_group_gets_the_runs_timeout(tmp_path):
    """``init_distributed(timeout_s=...)`` gives that timeout to every group, not only the default one:
    megatron creates its PP, EP, DP and model-parallel groups with ``distributed_timeout_minutes`` (30
    min by default). On NCCL a subgroup that times out first aborts the process before the hang watchdog
    (whose allowance stays below ``timeout_s``) can end the run with its requeue status."""
    script = tmp_path / "groups.py"
    script.write_text(GROUP_TIMEOUTS)
    p = subprocess.run(rank_launch_cmd(1, [str(script)], []), cwd=REPO, env=trainer_env(), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    timeouts = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(timeouts) > 10, timeouts  # the default group and megatron's (PP, EP, DP, MP, ...)
    assert {t for t in timeouts.values()} == {4321.0}, timeouts
