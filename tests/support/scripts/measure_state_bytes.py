"""Build the model, DDP and optimizer exactly as ``k2-train`` does, run one optimizer step (so the
optimizer states exist), and write what this rank allocated to $K2_TEST_OUT/state_rank<R>.json:

* ``params``: bytes of the parameters (DDP's contiguous param buffers when they exist, else the
  parameters themselves);
* ``grads``: bytes of DDP's gradient buffers;
* ``optimizer``: bytes of every tensor the optimizers hold (fp32 master copies that are not views of the
  model's storage, and the states: Adam moments, Muon momentum, step counters), each storage once;
* ``optimizer_device``: the part of ``optimizer`` not kept in host memory by ``optim.offload_fraction``
  (k2.optim.offload: the storages its ``host_storages`` names);
* ``pp_rank``, ``dp_rank``, ``expert_dp_rank``.

Used by tests/unit/launcher/planning/test_memory_plan.py (predicted == measured): run under torchrun with
the trainer's overrides, or :func:`measure` in an existing one-rank megatron world.
"""

import json
import os
import sys
from pathlib import Path

import torch


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _torch_optimizers(opt, out: list) -> list:
    """Every ``torch.optim.Optimizer`` inside megatron's (chained / wrapped) optimizer."""
    if isinstance(opt, torch.optim.Optimizer):
        out.append(opt)
        return out
    subs = getattr(opt, "chained_optimizers", None)
    if subs is not None:
        for sub in subs:
            _torch_optimizers(sub, out)
        return out
    inner = getattr(opt, "optimizer", None)
    if inner is not None and inner is not opt:
        _torch_optimizers(inner, out)
    return out


def measure(cfg, plan) -> dict:
    """Build as ``k2-train`` does in the current megatron world, step once, return this rank's bytes."""
    from megatron.core import parallel_state as ps

    from k2.launcher.training.setup import setup

    parts = setup(cfg, plan.dims, plan.schedule, init=cfg.run.seed)
    chunks, model, optimizer = parts.chunks, parts.model, parts.optimizer
    for m in model:
        m.zero_grad_buffer()
    optimizer.zero_grad()
    for m in model:  # a non-zero gradient everywhere, so every optimizer state is created and used
        for buf in [*m.buffers, *m.expert_parallel_buffers]:
            buf.grad_data.fill_(1e-3)
    optimizer.step()

    seen: set[int] = set()
    params = grads = 0
    for m in model:
        for buf in [*m.buffers, *m.expert_parallel_buffers]:
            if buf.param_data is not None:
                ptr, n = _storage(buf.param_data)
                if ptr not in seen:
                    seen.add(ptr)
                    params += n
            ptr, n = _storage(buf.grad_data)
            if ptr not in seen:
                seen.add(ptr)
                grads += n
    for c in chunks:
        for p in c.parameters():
            ptr, n = _storage(p.data)
            if ptr not in seen:  # parameters outside DDP's param buffers (no distributed optimizer)
                seen.add(ptr)
                params += n
    optim_bytes = host_bytes = 0
    offload = getattr(optimizer, "offload", None)
    host = offload.host_storages() if offload is not None else set()
    for opt in _torch_optimizers(optimizer, []):
        tensors = [p for g in opt.param_groups for p in g["params"]]
        tensors += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
        for t in tensors:
            ptr, n = _storage(t)
            if ptr not in seen:
                seen.add(ptr)
                optim_bytes += n
                host_bytes += n if ptr in host else 0
    return {
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "dp_rank": ps.get_data_parallel_rank(),
        "expert_dp_rank": ps.get_expert_data_parallel_rank(),
        "params": params,
        "grads": grads,
        "optimizer": optim_bytes,
        "optimizer_device": optim_bytes - host_bytes,
    }


def main() -> None:
    from k2.config.load import load_config
    from k2.launcher.training.prepare import prepare_run
    from k2.parallel.distributed import destroy_distributed, dist_env, init_distributed

    cfg = load_config(sys.argv[1:])
    env = dist_env()
    plan = prepare_run(cfg, env.world_size)
    init_distributed(env, plan.dims, cfg.run.seed)
    out = {"rank": env.rank, **measure(cfg, plan)}
    Path(os.environ["K2_TEST_OUT"], f"state_rank{env.rank}.json").write_text(json.dumps(out))
    destroy_distributed()


if __name__ == "__main__":
    main()
