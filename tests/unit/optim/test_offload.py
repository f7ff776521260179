"""Optimizer-state offload (optim/offload.py, ``optim.offload_fraction``) on one rank, in this process.

* Offload on vs off: 3 steps from the same weights and the same gradients give bitwise the same model
  weights, FP32 master shards and optimizer states (AdamW and byte-range MuonClip, BF16 parameters so
  the master copies move too).
* With ``optim.offload_fraction=1`` every optimizer tensor lies in the offload's host buffers between
  steps: the trainer's device-side optimizer bytes (tests/support/scripts/measure_state_bytes.py) are 0,
  as the planner's (``memory_per_gpu_bytes.optimizer`` of k2-plan), and both count all of the state as
  offloaded to host.
"""

from __future__ import annotations

import pytest
import torch

from k2.optim.build import leaf_optimizers
from support.helpers import build_one_rank, measure_state_bytes_script, predict_state_bytes


def _train(overrides: list[str], steps: int = 3):
    """``steps`` optimizer steps with the same synthetic gradients; returns (model, optimizer)."""
    cfg, chunks, model, optimizer = build_one_rank(
        ["train.precision=bf16", "model.first_k_dense_replace=1", *overrides]
    )
    for g in optimizer.param_groups:
        g["lr"], g["weight_decay"] = 1e-2, 0.1
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        for m in model:
            m.zero_grad_buffer()
            for buf in [*m.buffers, *m.expert_parallel_buffers]:
                buf.grad_data.copy_(torch.randn(buf.grad_data.shape, generator=gen) * 1e-2)
        optimizer.zero_grad()
        ok, _, _ = optimizer.step()
        assert ok
    return model, optimizer


def _optimizer_tensors(optimizer) -> list:
    out = []
    for leaf in leaf_optimizers(optimizer):
        for group in leaf.optimizer.param_groups:
            for p in group["params"]:
                out.append(p.detach())
                out += [v for _, v in sorted(leaf.optimizer.state[p].items()) if torch.is_tensor(v)]
    return out


@pytest.mark.parametrize("optim", ["adamw", "muonclip"])
def test_offload_bitwise_identical(megatron_world1, optim):
    ref_model, ref_opt = _train([f"optim={optim}"])
    got_model, got_opt = _train([f"optim={optim}", "optim.offload_fraction=1"])
    ref = dict(ref_model[0].named_parameters())
    for name, p in got_model[0].named_parameters():
        assert torch.equal(p, ref[name]), name
    a, b = _optimizer_tensors(ref_opt), _optimizer_tensors(got_opt)
    assert len(a) == len(b) > 0
    assert all(torch.equal(x, y.to(x.device)) for x, y in zip(a, b))
    # between steps every master shard (BF16 model: separate FP32 copies) and state is a host buffer
    host = got_opt.offload.host_storages()
    assert all(t.untyped_storage().data_ptr() in host for t in b)
    assert not any(t.untyped_storage().data_ptr() in host for t in a)


def test_offload_one_device_bytes_zero_trainer_and_planner(megatron_world1, tmp_path):
    from k2.config.load import load_config
    from k2.launcher.planning.cluster import plan_cluster
    from k2.launcher.training.prepare import prepare_run

    overrides = ["parallel=single", "optim=muonclip", "train.precision=bf16", "optim.offload_fraction=1"]
    cfg = load_config([*overrides, f"run.dir={tmp_path / 'run'}"])
    m = measure_state_bytes_script().measure(cfg, prepare_run(cfg, 1))
    p = predict_state_bytes(overrides, 1)[0][0]
    assert m["optimizer"] == p.optimizer > 0
    assert m["optimizer_device"] == 0
    mem = plan_cluster(load_config([*overrides, "cluster.nodes=1", "cluster.gpus_per_node=1"])).report[
        "memory_per_gpu_bytes"
    ]
    assert mem["optimizer"] == 0 and mem["optimizer_offloaded_to_host"] == p.optimizer


@pytest.mark.parametrize(
    "overrides,names",
    [
        (
            ["optim.offload_fraction=1", "parallel.use_distributed_optimizer=false"],
            "parallel.use_distributed_optimizer",
        ),
        (["optim=muonclip", "optim.offload_fraction=0.5", "optim.muon_zero1=layer_wise"], "optim.muon_zero1"),
        (["optim.offload_fraction=1.5"], "optim.offload_fraction"),
        (["plan.optimizer_offload_fraction=1"], "optim.offload_fraction"),  # the old planning-only name
    ],
)
def test_offload_settings_refused_with_one_error(overrides, names):
    from k2.config.errors import ConfigError
    from k2.config.load import load_config

    with pytest.raises(ConfigError, match=names.replace(".", r"\.")):
        load_config(overrides)
