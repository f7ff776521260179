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
    return state_bytes(
        count_params(cfg),
        dims,
        precision=cfg.train.precision,
        optim=cfg.optim,
        use_distributed_optimizer=bool(cfg.parallel.use_distributed_optimizer),
        model_cfg=cfg.model,
    )


def build_one_rank(overrides: list[str], layers: int = 2):
    """This process's one-rank model and optimizer, built as the trainer builds them (needs the
    ``megatron_world1`` fixture): ``(cfg, chunks, DDP-wrapped model, megatron optimizer)``. Dense layers
    only unless ``overrides`` set ``model.first_k_dense_replace`` (fast)."""
    from k2.launcher.training.setup import setup
    from k2.schedules.resolve import resolve_schedule

    cfg = load_config([f"model.num_layers={layers}", f"model.first_k_dense_replace={layers}", *overrides])
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, 1)
    parts = setup(cfg, dims, resolve_schedule(cfg), init=3)
    return cfg, parts.chunks, parts.model, parts.optimizer


def measure_state_bytes_script():
    """tests/support/scripts/measure_state_bytes.py as a module (its ``measure`` runs in this process)."""
    import importlib.util

    from support import SCRIPTS

    spec = importlib.util.spec_from_file_location("measure_state_bytes", SCRIPTS / "measure_state_bytes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
