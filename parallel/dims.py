"""Validated parallel dimensions and the pipeline layer table (pure Python, no process groups).

:class:`ParallelDims` turns ``cfg.parallel`` + ``cfg.model`` + a world size into the numbers every
other part of the launcher needs (TP/PP/VPP/EP/DP sizes, the ``[pp_rank][vpp_stage]`` -> decoder-layer
table, the arguments to hand to megatron-core), in the style of torchtitan's ``ParallelDims``. It never
touches ``torch.distributed``: ``k2-plan`` calls it for a 256-GPU recipe on a laptop, and ``k2-train``
calls it before any process group exists so that a bad layout fails with one :class:`ConfigError`
instead of an assertion deep inside megatron on every rank.

Layer placement reproduces megatron-core 0.19.2 exactly (checked against megatron's own
``get_transformer_layer_offset`` / ``get_num_layers_to_build`` in ``tests/unit/parallel/test_dims.py``):

* ``parallel.layout`` set: megatron's ``PipelineParallelLayerLayout`` parses the string
  (``transformer/pipeline_parallel_layer_layout.py``); '|' separates *virtual* stages listed in the order
  ``virtual_stage = vpp_stage * pp + pp_rank``; ``E`` = embedding, ``t`` = decoder layer, ``L`` = loss
  (final norm + output head). The decoder layers are numbered in that virtual-stage order.
* ``parallel.first_stage_layers`` / ``last_stage_layers`` set (megatron's
  ``num_layers_in_first/last_pipeline_stage``): the given count is the number of layers on PP rank 0
  (rank pp-1) *summed over its vpp virtual stages*, split evenly among them; the remaining layers are
  split evenly over the middle PP ranks and their virtual stages (``transformer/transformer_block.py``
  ``get_num_layers_to_build``, ``transformer/transformer_layer.py`` ``get_transformer_layer_offset``,
  checks in ``transformer/transformer_config.py`` ``__post_init__``).
* neither: ``num_layers / (pp * vpp)`` layers per virtual stage.

In all three cases virtual stage ``i = vpp_stage * pp + pp_rank`` holds the next contiguous block of
decoder layers after virtual stage ``i - 1``. The embedding is always on (pp_rank 0, vpp_stage 0) and the
loss on (pp_rank pp-1, vpp_stage vpp-1) (a layout that places them elsewhere is rejected).

Megatron carves expert parallelism out of the data-parallel ranks (``parallel_state.py``
``initialize_model_parallel``: ``world_size % (expert_tp * ep * pp) == 0``), so EP needs no extra GPUs:
dp = world_size / (tp * pp) and, with expert TP 1 (``expert_tensor_parallel_size=1``, the layout of the
published DeepSeek-V3 TP runs), ep must divide tp * dp (= dp while tp = 1). ``k2-train`` runs TP 1 only;
``k2-plan`` plans TP (``tp_supported``).

The layer counts per stage and the cost-balanced layouts of the planner are :mod:`k2.parallel.layout`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from k2.config.errors import ConfigError
from k2.parallel.layout import counts_even, counts_from_layout, counts_uneven, divisors, format_values

if TYPE_CHECKING:
    from k2.config.schema import ModelConfig, ParallelConfig


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be an integer >= 1")
    return value


def _positive_int_or_none(value: Any, name: str) -> int | None:
    return None if value is None else _positive_int(value, name)


@dataclass(frozen=True)
class ParallelDims:
    """Parallel sizes of one run and where each decoder layer lives.

    Attributes:
        world_size: total number of ranks (processes; one per GPU, or per CPU rank on gloo).
        tp: tensor-parallel size (``k2-train``: 1; ``k2-plan`` plans more, expert TP 1).
        pp: pipeline-parallel size (number of PP ranks).
        vpp: virtual stages (model chunks) per PP rank; 1 = no interleaving (config ``null`` -> 1).
        ep: expert-parallel size, carved out of the DP ranks (megatron's ``expert_model_parallel_size``).
        dp: data-parallel size, derived: ``world_size // (tp * pp)``.
        num_layers: decoder layers of the model (``k2.model.num_layers``).
        stage_layers: ``stage_layers[pp_rank][vpp_stage]`` = global 0-based decoder-layer indices built by that
            virtual stage, equal to what megatron-core builds. May be empty (e.g. K2's loss-only stage).
        megatron_layout: value for ``TransformerConfig.pipeline_model_parallel_layout`` (the
            ``k2.parallel.layout`` string) or ``None`` for megatron's own split.
        first_stage_layers: value for ``TransformerConfig.num_layers_in_first_pipeline_stage`` (layers on
            PP rank 0 over all its virtual stages) or ``None``.
        last_stage_layers: value for ``TransformerConfig.num_layers_in_last_pipeline_stage`` or ``None``.
    """

    world_size: int
    tp: int
    pp: int
    vpp: int
    ep: int
    dp: int
    num_layers: int
    stage_layers: list[list[list[int]]]
    megatron_layout: str | None
    first_stage_layers: int | None
    last_stage_layers: int | None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_config(
        cls,
        parallel_cfg: ParallelConfig,
        model_cfg: ModelConfig,
        world_size: int,
        *,
        world_size_from: str = "launch.nproc_per_node x nodes",
        tp_supported: bool = False,
    ) -> ParallelDims:
        """Validate ``parallel_cfg`` against ``model_cfg`` and ``world_size`` and build the layer table.

        Args:
            parallel_cfg: ``cfg.parallel`` (keys of :class:`k2.config.schema.ParallelConfig`).
            model_cfg: ``cfg.model``; reads ``num_layers`` and ``num_moe_experts``.
            world_size: number of ranks the job runs on.
            world_size_from: how the caller got ``world_size``, named in error messages
                (e.g. ``"cluster.nodes x cluster.gpus_per_node"`` for ``k2-plan``).
            tp_supported: accept ``parallel.tp > 1`` (``k2-plan``: megatron's TP layout with expert TP 1,
                :mod:`k2.launcher.planning.tp_layout`); ``k2-train`` refuses it.

        Returns:
            The validated :class:`ParallelDims`.

        Raises:
            ConfigError: one message naming the offending setting(s) and the allowed values, for: tp != 1
                (unless ``tp_supported``);
                pp/ep/vpp < 1; world size not divisible by tp * pp; vpp > 1 with pp = 1; ``k2.parallel.layout``
                together with ``first/last_stage_layers``; a layout megatron cannot parse, whose stage
                count is not a multiple of pp, whose vpp disagrees with ``k2.parallel.vpp``, whose number of
                't' differs from ``k2.model.num_layers``, or that does not start with E / end with L;
                ``k2.model.num_layers`` (after the first/last-stage overrides) not divisible over the
                (remaining) PP x VPP stages; ``k2.model.num_moe_experts`` not divisible by ep; ep not
                dividing tp * dp.
        """
        tp = _positive_int(parallel_cfg.tp, "parallel.tp")
        if tp != 1 and not tp_supported:
            raise ConfigError(
                f"parallel.tp={tp} is not supported by k2-train yet: tensor parallelism is not wired into the "
                "K2 model, optimizer and CPU backend (k2-plan plans it); allowed parallel.tp: 1"
            )
        pp = _positive_int(parallel_cfg.pp, "parallel.pp")
        ep = _positive_int(parallel_cfg.ep, "parallel.ep")
        vpp_raw = parallel_cfg.vpp
        vpp = 1 if vpp_raw is None else _positive_int(vpp_raw, "parallel.vpp")
        world_size = _positive_int(world_size, f"world size ({world_size_from})")
        num_layers = _positive_int(model_cfg.num_layers, "model.num_layers")

        # ---- world size over tp x pp
        if world_size % (tp * pp) != 0:
            allowed = divisors(world_size // tp) if world_size % tp == 0 else []
            raise ConfigError(
                f"parallel.pp={pp} does not divide the world size {world_size} ({world_size_from})"
                + (f" / parallel.tp={tp}" if tp > 1 else "")
                + f"; allowed pp for this world size: {format_values(allowed)}"
            )
        dp = world_size // (tp * pp)

        if vpp > 1 and pp == 1:
            raise ConfigError(
                f"parallel.vpp={vpp} needs pipeline parallelism: virtual stages interleave over PP "
                "ranks and megatron-core would build every layer in every chunk with parallel.pp=1; "
                "set parallel.vpp=null (or 1), or parallel.pp >= 2"
            )

        table, layout_str, first, last = _layer_table(parallel_cfg, pp, vpp, num_layers)
        _check_experts(model_cfg, tp, pp, ep, dp, world_size)
        return cls(
            world_size=world_size,
            tp=tp,
            pp=pp,
            vpp=vpp,
            ep=ep,
            dp=dp,
            num_layers=num_layers,
            stage_layers=table,
            megatron_layout=layout_str,
            first_stage_layers=first,
            last_stage_layers=last,
        )

    # ------------------------------------------------------------------ queries

    @property
    def num_virtual_stages(self) -> int:
        """pp * vpp: the number of model chunks in the whole pipeline."""
        return self.pp * self.vpp

    @property
    def megatron_vpp(self) -> int | None:
        """``virtual_pipeline_model_parallel_size`` for megatron-core: ``None`` when vpp == 1."""
        return self.vpp if self.vpp > 1 else None

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel size (replicas of each expert): tp * dp / (expert_tp * ep) with expert TP 1
        (dp / ep while tp = 1)."""
        return self.tp * self.dp // self.ep

    def virtual_stage(self, pp_rank: int, vpp_stage: int) -> int:
        """Index of (pp_rank, vpp_stage) in pipeline order: ``vpp_stage * pp + pp_rank``."""
        self._check_stage(pp_rank, vpp_stage)
        return vpp_stage * self.pp + pp_rank

    def layers(self, pp_rank: int, vpp_stage: int) -> list[int]:
        """Global 0-based decoder-layer indices built by (pp_rank, vpp_stage) (a copy)."""
        self._check_stage(pp_rank, vpp_stage)
        return list(self.stage_layers[pp_rank][vpp_stage])

    def stage_has_embedding(self, pp_rank: int, vpp_stage: int) -> bool:
        """True for the one virtual stage that owns the input embedding: (pp_rank 0, vpp_stage 0)."""
        self._check_stage(pp_rank, vpp_stage)
        return pp_rank == 0 and vpp_stage == 0

    def stage_has_loss(self, pp_rank: int, vpp_stage: int) -> bool:
        """True for the one virtual stage that owns final norm, output head and loss:
        (pp_rank pp-1, vpp_stage vpp-1)."""
        self._check_stage(pp_rank, vpp_stage)
        return pp_rank == self.pp - 1 and vpp_stage == self.vpp - 1

    def pp_rank_contents(self, pp_rank: int) -> tuple[list[int], bool, bool]:
        """What PP rank ``pp_rank`` holds over all its virtual stages: its decoder layer indices (in
        stage order), whether it holds the embedding, whether it holds the loss (final norm, output head).

        Raises:
            IndexError: ``pp_rank`` outside ``[0, pp)``.
        """
        self._check_stage(pp_rank, 0)
        layers = [i for v in range(self.vpp) for i in self.stage_layers[pp_rank][v]]
        emb = any(self.stage_has_embedding(pp_rank, v) for v in range(self.vpp))
        loss = any(self.stage_has_loss(pp_rank, v) for v in range(self.vpp))
        return layers, emb, loss

    def megatron_kwargs(self) -> dict[str, Any]:
        """The pipeline/expert keyword arguments for megatron-core's ``TransformerConfig``."""
        return {
            "tensor_model_parallel_size": self.tp,
            "pipeline_model_parallel_size": self.pp,
            "virtual_pipeline_model_parallel_size": self.megatron_vpp,
            "expert_model_parallel_size": self.ep,
            "pipeline_model_parallel_layout": self.megatron_layout,
            "num_layers_in_first_pipeline_stage": self.first_stage_layers,
            "num_layers_in_last_pipeline_stage": self.last_stage_layers,
        }

    def checkpoint_layout(self) -> dict[str, int]:
        """``{"pp", "vpp", "ep", "dp", "world_size"}``: the layout a checkpoint records (its state file's
        ``layout``) and a resume compares against this run's (:mod:`k2.launcher.checkpointing.resume`)."""
        return {"pp": self.pp, "vpp": self.vpp, "ep": self.ep, "dp": self.dp, "world_size": self.world_size}

    def describe(self) -> str:
        """A human-readable table: one line per PP rank, one column per virtual stage."""
        lines = [
            f"world {self.world_size} = tp {self.tp} x pp {self.pp} x dp {self.dp} "
            f"(ep {self.ep} x expert-dp {self.expert_dp}); vpp {self.vpp}; {self.num_layers} layers"
        ]
        for r in range(self.pp):
            cells = []
            for v in range(self.vpp):
                ids = self.stage_layers[r][v]
                parts = (
                    (["E"] if self.stage_has_embedding(r, v) else [])
                    + ([f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])] if ids else [])
                    + (["L"] if self.stage_has_loss(r, v) else [])
                )
                cells.append(f"v{v}: " + (" ".join(parts) or "(empty)"))
            lines.append(f"pp{r}: " + " | ".join(cells))
        return "\n".join(lines)

    def _check_stage(self, pp_rank: int, vpp_stage: int) -> None:
        if not (0 <= pp_rank < self.pp and 0 <= vpp_stage < self.vpp):
            raise IndexError(
                f"stage (pp_rank={pp_rank}, vpp_stage={vpp_stage}) out of range for pp={self.pp}, vpp={self.vpp}"
            )


def _layer_table(
    parallel_cfg: ParallelConfig, pp: int, vpp: int, num_layers: int
) -> tuple[list[list[list[int]]], str | None, int | None, int | None]:
    """``(layout[pp_rank][vpp_stage] -> global layer indices, layout string, first, last)`` from
    ``parallel.layout`` or ``parallel.first/last_stage_layers`` or the even split (module docstring).

    Raises:
        ConfigError: the layout together with first/last_stage_layers, or any error of
            :mod:`k2.parallel.layout` naming the setting.
    """
    layout_str = parallel_cfg.layout
    first = parallel_cfg.first_stage_layers
    last = parallel_cfg.last_stage_layers
    if layout_str is not None and (first is not None or last is not None):
        raise ConfigError(
            f"parallel.layout={layout_str!r} cannot be combined with parallel.first_stage_layers="
            f"{first} / parallel.last_stage_layers={last} (megatron-core rejects "
            "pipeline_model_parallel_layout together with num_layers_in_first/last_pipeline_stage); "
            "set either the layout or first/last_stage_layers, the others to null"
        )
    if layout_str is not None:
        counts = counts_from_layout(layout_str, pp, vpp, num_layers)
    elif first is not None or last is not None:
        first = _positive_int_or_none(first, "parallel.first_stage_layers")
        last = _positive_int_or_none(last, "parallel.last_stage_layers")
        counts = counts_uneven(num_layers, pp, vpp, first, last)
    else:
        counts = counts_even(num_layers, pp, vpp)

    table: list[list[list[int]]] = [[[] for _ in range(vpp)] for _ in range(pp)]
    next_layer = 0
    for v in range(vpp):  # virtual-stage order: vpp_stage * pp + pp_rank
        for r in range(pp):
            table[r][v] = list(range(next_layer, next_layer + counts[r][v]))
            next_layer += counts[r][v]
    assert next_layer == num_layers, (next_layer, num_layers)  # guaranteed by the checks above
    return table, layout_str, first, last


def _check_experts(model_cfg: ModelConfig, tp: int, pp: int, ep: int, dp: int, world_size: int) -> None:
    """Experts over EP, and EP over the DP ranks (megatron carves EP out of DP).

    Raises:
        ConfigError: EP without experts, experts not divisible by EP, or EP not dividing DP.
    """
    num_experts = model_cfg.num_moe_experts
    if not num_experts:
        if ep != 1:
            raise ConfigError(
                f"parallel.ep={ep} needs an MoE model but model.num_moe_experts={num_experts}; "
                "allowed parallel.ep for a dense model: 1"
            )
    elif num_experts % ep != 0:
        allowed = [d for d in divisors(num_experts) if (tp * dp) % d == 0]
        raise ConfigError(
            f"model.num_moe_experts={num_experts} is not divisible by parallel.ep={ep} (each EP rank "
            f"holds num_moe_experts / ep experts); allowed parallel.ep for this model and "
            f"{'dp' if tp == 1 else 'tp x dp'}={tp * dp}: {format_values(allowed)}"
        )
    if (tp * dp) % ep != 0:  # megatron: world % (expert_tp * ep * pp) == 0, expert TP 1
        allowed = [d for d in divisors(tp * dp) if not num_experts or num_experts % d == 0]
        what = f"the data-parallel size dp={dp}" if tp == 1 else f"tp x dp = {tp} x {dp}"
        raise ConfigError(
            f"parallel.ep={ep} does not divide {what} (world size {world_size} / pp={pp}); megatron-core "
            f"carves expert parallelism out of the DP ranks (with expert TP 1, the TP x DP ranks); allowed "
            f"parallel.ep: {format_values(allowed)}"
        )


def check_microbatches(
    dims: ParallelDims,
    global_batch_size: int,
    micro_batch_size: int,
    *,
    gbs_name: str = "global_batch_size",
    mbs_name: str = "train.micro_batch_size",
) -> int:
    """Number of microbatches each DP rank runs per step: ``global_batch_size / (micro_batch_size * dp)``.

    Args:
        dims: the validated parallel dimensions.
        global_batch_size: sequences per optimizer step over all DP ranks (a schedule phase's
            ``schedule.global_batch_tokens / seq_length``).
        micro_batch_size: sequences per forward/backward pass (``train.micro_batch_size``).
        gbs_name, mbs_name: how error messages name the two settings (the schedule passes the phase's
            global batch, which it derives from ``schedule.global_batch_tokens / seq_length``).

    Returns:
        ``num_microbatches`` per DP rank (>= 1).

    Raises:
        ConfigError: the global batch is not a multiple of ``micro_batch_size * dp``; or, with vpp > 1,
            a microbatch count megatron-core's interleaved 1F1B cannot run. Its
            ``forward_backward_pipelining_with_interleaving`` (``pipeline_parallel/schedules.py``,
            0.19.2) requires ``pp <= microbatch_group_size_per_vp_stage <= num_microbatches`` and
            ``num_microbatches % microbatch_group_size_per_vp_stage`` to be 0 or >= pp; with the default
            group size (= pp, ``model_parallel_config.py``) that means ``num_microbatches >= pp`` and
            ``num_microbatches % pp == 0``. Non-interleaved 1F1B accepts any count.
    """
    gbs = _positive_int(global_batch_size, gbs_name)
    mbs = _positive_int(micro_batch_size, mbs_name)
    per_step = mbs * dims.dp
    if gbs % per_step != 0:
        raise ConfigError(
            f"{gbs_name}={gbs} is not divisible by {mbs_name}={mbs} x dp="
            f"{dims.dp} = {per_step}; allowed {gbs_name}: multiples of {per_step} "
            f"({', '.join(str(per_step * k) for k in range(1, 4))}, ...)"
        )
    m = gbs // per_step
    if dims.vpp > 1 and (m < dims.pp or m % dims.pp != 0):
        step = per_step * dims.pp
        raise ConfigError(
            f"{gbs_name}={gbs} / ({mbs_name}={mbs} x dp={dims.dp}) = {m} "
            f"microbatches per DP rank, but with parallel.vpp={dims.vpp} megatron-core's interleaved "
            f"1F1B schedule needs the number of microbatches to be >= parallel.pp={dims.pp} and a "
            f"multiple of it (microbatch_group_size_per_vp_stage defaults to pp); allowed "
            f"{gbs_name}: multiples of {step} ({', '.join(str(step * k) for k in range(1, 4))}"
            ", ...)"
        )
    return m
