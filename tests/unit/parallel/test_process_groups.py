"""Process groups of k2-train (k2.parallel.distributed.init_distributed): settings that matter on GPUs
only, read through what gloo exposes of the same groups."""

from __future__ import annotations

import json
import subprocess

import pytest

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
    p = subprocess.run(
        rank_launch_cmd(1, [str(script)], []), cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    timeouts = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(timeouts) > 10, timeouts  # the default group and megatron's (PP, EP, DP, MP, ...)
    assert {t for t in timeouts.values()} == {4321.0}, timeouts


def test_each_rank_gets_its_own_gpu_or_one_clear_error():
    """One GPU bound per rank -> it; all the node's GPUs visible -> the one at LOCAL_RANK; a subset of
    several -> the rank's place among those sharing it (next test), refused in one line naming the
    bindings without that place (no rendezvous store) or with more ranks than GPUs on the subset."""
    from k2.config import ConfigError
    from k2.parallel.distributed import local_device_index

    assert [local_device_index(r, 8, 1) for r in range(8)] == [0] * 8
    assert [local_device_index(r, 8, 8) for r in range(8)] == list(range(8))
    assert local_device_index(3, 4, 8) == 3
    with pytest.raises(
        ConfigError,
        match=r"local rank 4 of 8 ranks on this node sees 4 CUDA devices.*"
        r"--gpus-per-task=1",
    ):
        local_device_index(4, 8, 4)
    with pytest.raises(ConfigError, match="shared with 4 lower local ranks"):
        local_device_index(7, 8, 4, position=4)
    with pytest.raises(ConfigError, match="sees 0 CUDA devices"):
        local_device_index(0, 1, 0)


def test_ranks_that_share_a_subset_of_gpus_take_one_each(monkeypatch):
    """``srun --gpu-bind=closest`` on a two-socket node with the ranks dealt to the sockets round-robin:
    local ranks 0, 2, 4, 6 see GPUs 0-3, ranks 1, 3, 5, 7 see GPUs 4-7. Each takes its place among the
    ranks with the same set (exchanged through the rendezvous store): 0, 0, 1, 1, 2, 2, 3, 3 -- where
    ``LOCAL_RANK % 4`` gave 0, 1, 2, 3, 0, 1, 2, 3 (ranks 0 and 4 both on GPU 0)."""
    import torch.distributed as dist

    from k2.parallel.distributed import DistEnv, _gpu_position, local_device_index

    store = dist.HashStore()
    got = []
    for r in range(8):  # (each rank waits only for the lower ranks' keys: in order, one thread will do)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3" if r % 2 == 0 else "4,5,6,7")
        got.append(local_device_index(r, 8, 4, _gpu_position(store, DistEnv(r, 8, r, True, 8))))
    assert got == [0, 0, 1, 1, 2, 2, 3, 3]


def test_slurm_tasks_on_this_node(monkeypatch):
    import os

    from k2.parallel.distributed import dist_env

    # a copy: dist_env sets RANK, WORLD_SIZE, ... for Slurm ranks, which must not outlive this test
    monkeypatch.setattr(
        os,
        "environ",
        {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_TASKS_PER_NODE")
        },
    )
    monkeypatch.setenv("SLURM_PROCID", "9")
    monkeypatch.setenv("SLURM_NTASKS", "10")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "4(x2),2")
    monkeypatch.setenv("SLURM_NODEID", "2")
    env = dist_env()
    assert (env.rank, env.local_rank, env.local_world_size) == (9, 1, 2)
    monkeypatch.setenv("SLURM_NODEID", "1")
    assert dist_env().local_world_size == 4


def test_nccl_is_told_its_device(monkeypatch):
    """init_process_group gets the rank's GPU as ``device_id`` (NCCL binds and creates its communicator
    for it at once instead of guessing the device at the first collective). Seam: the device choice and
    init_process_group itself."""
    import torch
    import torch.distributed as dist

    from k2.config import load_config
    from k2.parallel import distributed
    from k2.parallel.dims import ParallelDims

    seen = {}

    class Stop(Exception):
        pass

    def init_process_group(**kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # (init_distributed sets them: restored after the test)
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setattr(distributed, "_cuda_device", lambda env, store=None: torch.device("cuda", 3))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    cfg = load_config([])
    with pytest.raises(Stop):
        distributed.init_distributed(
            distributed.DistEnv(0, 1, 0, False), ParallelDims.from_config(cfg.parallel, cfg.model, 1), 0
        )
    assert seen["backend"] == "nccl" and seen["device_id"] == torch.device("cuda", 3)
