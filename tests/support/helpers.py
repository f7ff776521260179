"""Small helpers that unit and integration tests share."""

from __future__ import annotations

from k2.config import load_config
from k2.launcher.planning.memory import state_bytes
from k2.model.params import count_params
from k2.parallel.dims import ParallelDims


def run_tool(capsys, main, argv):
    """``main(argv)`` of an entry module in-process: ``(exit status, stdout, stderr)``."""
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def predict_state_bytes(overrides: list[str], world: int):
    """The planner's state bytes (``state_bytes[pp_rank][dp_rank]``) of the config for ``world`` ranks."""
    cfg = load_config(overrides)
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, world)
    return state_bytes(count_params(cfg), dims, precision=cfg.train.precision, optimizer=cfg.optim.name,
                       use_distributed_optimizer=bool(cfg.parallel.use_distributed_optimizer),
                       model_cfg=cfg.model)
