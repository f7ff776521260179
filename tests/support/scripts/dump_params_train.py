"""Trainer that, when it ends, writes this rank's parameters by layout-independent global name to
$K2_TEST_OUT/params_rank<R>.pt (fp32 tensors), and to $K2_TEST_OUT/layout_rank<R>.json the Muon
parameters that a ZeRO-1 shard boundary cuts in the DDP buffers the run used ("cut") and in megatron's
byte-range layout of the same parameters ("cut_by_byte_range_layout"). With K2_DUMP_GRADS=1 it also
writes $K2_TEST_OUT/grads_rank<R>.pt: per optimizer step, this rank's accumulated gradient (megatron's
``main_grad``, before the data-parallel reduction) of every parameter by global name. Used by
tests/integration/test_muonclip_parallel.py and tests/integration/test_pipeline_wgrad.py."""

import json
import os
import sys
from pathlib import Path

import torch

from k2.parallel import cpu_backend

cpu_backend.enable()

import k2.launcher.training.setup as setup
from k2.optim.params import _global_names

captured = []
layout = {"cut": [], "cut_by_byte_range_layout": []}
_wrap_model = setup.wrap_model


def capturing_wrap_model(chunks, tcfg, *args, **kwargs):
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from k2.optim.build import shard_straddlers
    from k2.optim.params import ROUTE_ATTR

    names = {}
    for chunk in chunks:
        names.update(_global_names(chunk, tcfg))
        captured.extend((names[id(p)], p) for p in chunk.parameters())
    model = _wrap_model(chunks, tcfg, *args, **kwargs)
    muon = lambda ps_: sorted(names[id(p)] for p in ps_ if getattr(p, ROUTE_ATTR, "") == "muon")  # noqa: E731
    for ddp in model:
        if ddp.full_param_layout is None:
            continue
        layout["cut"] += muon(shard_straddlers(ddp.full_param_layout))
        byte_range = DistributedOptimizer.compute_full_param_layout(
            [p for p in ddp.module.parameters() if p.requires_grad],
            None,
            ps.get_data_parallel_world_size(with_context_parallel=True),
            ddp.ddp_config,
            expert_data_parallel_world_size=ps.get_expert_data_parallel_world_size(),
        )
        layout["cut_by_byte_range_layout"] += muon(shard_straddlers(byte_range))
    return model


setup.wrap_model = capturing_wrap_model

grads = []  # per step: {global name: main_grad before the DP reduction}
if os.environ.get("K2_DUMP_GRADS") == "1":
    _finalize = setup.finalize_model_grads

    def capturing_finalize(*args, **kwargs):
        grads.append({n: p.main_grad.detach().float().cpu().clone() for n, p in captured})
        return _finalize(*args, **kwargs)

    setup.finalize_model_grads = capturing_finalize

from k2.launcher import train

rc = train.main(sys.argv[1:])
out = Path(os.environ["K2_TEST_OUT"])
out.mkdir(parents=True, exist_ok=True)
rank = int(os.environ.get("RANK", 0))
torch.save({n: p.detach().float().cpu().clone() for n, p in captured}, out / f"params_rank{rank}.pt")
(out / f"layout_rank{rank}.json").write_text(json.dumps(layout))
if grads:
    torch.save(grads, out / f"grads_rank{rank}.pt")
sys.exit(rc)
