"""The planner's state bytes (parameters, gradient buffers, optimizer states) equal what k2-train allocates
on every rank of a real multi-rank run.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from support import REPO, SCRIPTS
from support.helpers import predict_state_bytes


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides,nproc",
    [
        (["parallel=cpu4", "optim=adamw"], 4),  # byte-range ZeRO-1, FP32 parameters (own master copy)
        (["parallel=cpu4", "optim=muonclip", "train.precision=bf16"], 4),  # byte-range Distributed Muon + FP32 masters
    ],
    ids=["adamw-fp32-cpu4", "muonclip-bf16-cpu4"],
)
def test_state_bytes_equal_trainer_allocation(tmp_path, overrides, nproc):
    from support.distributed import rank_launch_cmd, trainer_env

    cmd = rank_launch_cmd(
        nproc,
        [str(SCRIPTS / "measure_state_bytes.py")],
        [*overrides, "run.wandb.mode=disabled", f"run.dir={tmp_path / 'run'}"],
    )
    proc = subprocess.run(
        cmd, cwd=REPO, env=trainer_env({"K2_TEST_OUT": str(tmp_path)}), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    predicted = predict_state_bytes(overrides, nproc)
    for r in range(nproc):
        m = json.loads((tmp_path / f"state_rank{r}.json").read_text())
        p = predicted[m["pp_rank"]][m["dp_rank"]]
        assert p.expert_dp_rank == m["expert_dp_rank"]
        assert (p.params, p.grads, p.optimizer) == (m["params"], m["grads"], m["optimizer"]), (r, m)
