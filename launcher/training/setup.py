"""The training parts of a run, built in one place: :func:`setup` returns a :class:`SetupOutput` (megatron's
``TransformerConfig``, the model chunks, DDP, the optimizer, QK-Clip, the LR scheduler and the pipeline
hooks).

The trainer (:class:`k2.launcher.training.trainer.Trainer`, when it is made), the benchmarks that build a model
(``bench=step``, ``bench=optimizer``, ``bench=memory``) and the tests' one-rank builder all call it, so
the order that matters is written once (Megatron-Bridge's ``setup()`` / ``SetupOutput`` does the same):

1. megatron's ``TransformerConfig`` and the model chunks (one ``GPTModel`` per VPP stage of this rank);
2. the initial weights (``init``);
3. every parameter's optimizer route (:func:`k2.optim.params.tag_parameters`), decided *before* DDP lays
   out its ZeRO-1 buffers, because MuonClip's matrices get buffers of their own;
4. the pipeline hooks (decoupled weight gradients are set up before DDP registers its grad hooks);
5. megatron's DDP, then the optimizer of ``optim.name`` (its :class:`k2.optim.registry.OptimizerSpec`),
   QK-Clip and the LR scheduler, and the two ``TransformerConfig`` hooks megatron's pipeline schedule calls.

Requires megatron's ``parallel_state`` initialised for ``dims`` (the process groups are the caller's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron.core.distributed import finalize_model_grads

from k2.model.activation_memory import MemoryOptions
from k2.model.build import build_model_chunks, layout_independent_init, transformer_config
from k2.optim.build import build_optimizer
from k2.optim.params import ParamRoute, param_rules, tag_parameters
from k2.optim.qk_clip import QKClip
from k2.optim.registry import optimizer_spec
from k2.parallel.distributed import wrap_model
from k2.schedules.lr import TokenLRScheduler
from k2.schedules.pipeline import setup_pipeline

if TYPE_CHECKING:
    from k2.config.schema import K2Config

__all__ = ["CONFIG_INIT", "SetupOutput", "setup"]

#: ``init`` of :func:`setup` that follows the config: the layout-independent init from ``run.seed`` when
#: ``train.deterministic_init``, else megatron's own (the trainer's rule)
CONFIG_INIT = "config"


@dataclass
class SetupOutput:
    """The parts :func:`setup` built for this rank.

    Attributes:
        tcfg: megatron ``MLATransformerConfig`` (its ``finalize_model_grads_func`` and ``grad_scale_func``
            set for megatron's pipeline schedule).
        chunks: the unwrapped model chunks (``GPTModel``, one per VPP stage of this rank).
        model: the same chunks wrapped in megatron's DDP.
        optimizer: megatron's optimizer of ``optim.name`` (a ``ChainedOptimizer``).
        qk_clip: :class:`k2.optim.qk_clip.QKClip` at ``optim.qk_clip_tau``.
        routes: this rank's :class:`k2.optim.params.ParamRoute` list (which optimizer steps which parameter).
        pipeline: :class:`k2.schedules.pipeline.PipelineHooks`, or None (``pipeline=False``, or no
            ``pipeline.*`` switch set).
        scheduler: :class:`k2.schedules.lr.TokenLRScheduler` (step 1's LR already set), or None
            (``lr_scheduler=False``: the caller sets the LR).
    """

    tcfg: Any
    chunks: list
    model: list
    optimizer: Any
    qk_clip: QKClip
    routes: list[ParamRoute]
    pipeline: Any = None
    scheduler: TokenLRScheduler | None = None


def _initialise(init, chunks: list, tcfg, cfg: K2Config) -> None:
    """The initial weights of ``chunks`` (see :func:`setup`'s ``init``)."""
    if init == CONFIG_INIT:
        if cfg.train.deterministic_init:
            layout_independent_init(chunks, tcfg, cfg.run.seed)
    elif callable(init):
        init(chunks, tcfg)
    elif init is not None:
        layout_independent_init(chunks, tcfg, int(init))


def setup(
    cfg: K2Config,
    dims,
    schedule,
    *,
    rope_type: str | None = None,
    memory: MemoryOptions | None = None,
    memory_switches: Sequence[MemoryOptions] = (),
    init: str | int | Callable[[list, Any], None] | None = CONFIG_INIT,
    pipeline: bool = False,
    lr_scheduler: bool = False,
) -> SetupOutput:
    """Build this rank's training parts in the trainer's order (module docstring).

    Args:
        cfg: a validated config (``model``, ``train``, ``optim``, ``parallel``, ``pipeline``, ``run``).
        dims: :class:`k2.parallel.dims.ParallelDims` of the initialised process groups.
        schedule: the resolved :class:`k2.schedules.wsd.Schedule` (the optimizer's peak and final LR).
        rope_type: ``rope`` | ``yarn`` of the first step (None: ``model.rope_type``).
        memory / memory_switches: the ``memory.*`` saved-tensor options of
            :func:`k2.model.build.build_model_chunks` (one set, or every phase's).
        init: :data:`CONFIG_INIT` (the trainer's rule), an int (the layout-independent init from that seed,
            the same weights under any layout), a callable ``init(chunks, tcfg)``, or None (megatron's init).
        pipeline: build the ``pipeline.*`` hooks (decoupled weight gradients, trace, EP overlap).
        lr_scheduler: build the token-based LR scheduler (it sets step 1's LR and weight decay).

    Returns:
        :class:`SetupOutput`.

    Raises:
        ValueError: QK-Clip under tensor parallelism (:class:`k2.optim.qk_clip.QKClip`).
    """
    tcfg = transformer_config(cfg, dims, rope_type=rope_type)
    chunks = build_model_chunks(cfg, dims, tcfg, memory, memory_switches=memory_switches)
    _initialise(init, chunks, tcfg, cfg)
    dist_opt = bool(cfg.parallel.use_distributed_optimizer)
    spec = optimizer_spec(cfg.optim.name)
    place = spec.placement(cfg.optim, dist_opt)
    routes = tag_parameters(
        chunks,
        tcfg,
        muon=place.muon,
        zero1_muon=place.zero1_muon,
        default_route=spec.default.route,
        **param_rules(cfg.optim),
    )
    hooks, delay_wgrad = setup_pipeline(cfg.pipeline, chunks) if pipeline else (None, False)
    model = wrap_model(chunks, tcfg, dist_opt, layer_wise=place.layer_wise, delay_wgrad_compute=delay_wgrad)
    optimizer = build_optimizer(cfg.optim, model, tcfg, schedule, dist_opt)
    qk_clip = QKClip(model, optimizer, cfg.optim.qk_clip_tau, cfg.model.num_layers)
    scheduler = TokenLRScheduler(schedule, optimizer) if lr_scheduler else None
    tcfg.finalize_model_grads_func = finalize_model_grads
    tcfg.grad_scale_func = optimizer.scale_loss
    return SetupOutput(tcfg, chunks, model, optimizer, qk_clip, routes, hooks, scheduler)
