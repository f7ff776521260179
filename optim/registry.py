"""The optimizers of ``optim.name``, each describing itself in one :class:`OptimizerSpec`: its name, how
to build it, which parameters it routes to which inner update, the bytes those updates keep and move per
parameter, and the extra work of its step. The trainer's builder
(:func:`k2.launcher.training.setup.setup`) and the planner (``k2-plan``'s memory, optimizer-time and
checkpoint figures) ask :func:`optimizer_spec` instead of keeping their own lists.

Adding an optimizer: its module (which defines ``SPECS``, a tuple of :class:`OptimizerSpec`), its config
section (``recipes/optim/<name>.yaml``, the Hydra choice ``optim=<name>``, and its settings in the
``optim`` schema), its tests, and its module's name in :data:`_MODULES`.

The spec modules are imported on the first lookup, so importing this module costs nothing.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from k2.config.choices import MuonZero1

if TYPE_CHECKING:
    from k2.config.schema import OptimConfig

__all__ = [
    "ADAMW_UPDATE",
    "MUON_UPDATE",
    "MatrixStep",
    "OptimizerSpec",
    "ParamUpdate",
    "Placement",
    "optimizer_names",
    "optimizer_spec",
]

#: the modules whose ``SPECS`` are the registered optimizers, in the order ``allowed:`` lists them
_MODULES = ("k2.optim.build",)


@dataclass(frozen=True)
class ParamUpdate:
    """One inner update (the optimizer a parameter is routed to) as the planner counts it.

    Attributes:
        route: the route name the parameters carry (:data:`k2.optim.params.ROUTE_ATTR`; the optimizer
            table's column).
        state_bytes: its FP32 state per parameter element, bytes (AdamW: ``exp_avg`` + ``exp_avg_sq`` = 8;
            Muon: the momentum, 4), without the FP32 master copy.
        step_bytes: per (sharded) parameter tensor, bytes (torch AdamW's float32 ``step``: 4; Muon: none).
        update_bytes: memory traffic of its element-wise update per parameter, bytes: the FP32 gradient read
            (4), the FP32 master and the states read and written (AdamW 24, Muon 16), the BF16 copy written
            (2), the gradient read once more for its norm and zeroed (8).
    """

    route: str
    state_bytes: int
    step_bytes: int
    update_bytes: int


#: torch's AdamW (megatron's Adam with decoupled weight decay)
ADAMW_UPDATE = ParamUpdate("adamw", state_bytes=8, step_bytes=4, update_bytes=4 + 24 + 2 + 8)
#: :class:`k2.optim.muon.K2Muon` (emerging-optimizers' Muon keeps no step counter)
MUON_UPDATE = ParamUpdate("muon", state_bytes=4, step_bytes=0, update_bytes=4 + 16 + 2 + 8)


@dataclass(frozen=True)
class MatrixStep:
    """Per-matrix work of an optimizer that orthogonalises weight matrices (Muon's Newton-Schulz). Under
    ZeRO-1 each matrix's FP32 gradient is gathered over its DP group first (Distributed Muon, "Muon is
    Scalable" section 2.3), which ``k2-plan`` prices with it.

    Attributes:
        iterations: iterations per step (the planner's figure: 5, K2's and Moonlight's).
        gemms: ``gemms(m, n)`` -> the GEMMs ``(m, k, n)`` of one iteration on an ``[m, n]`` matrix, ``m <= n``
            (priced by :func:`k2.launcher.planning.kernels.gemm_seconds`).
    """

    iterations: int
    gemms: Callable[[int, int], list]


@dataclass(frozen=True)
class Placement:
    """Where one run's parameters go under its optimizer: what the trainer's builder tags and wraps
    (:func:`k2.optim.params.tag_parameters`, :func:`k2.parallel.distributed.wrap_model`) and the planner
    lays out (``k2.launcher.planning.memory``), so both read the same answer.

    Attributes:
        muon: weight matrices are routed to the matrix update (Muon); False: every parameter takes the
            default update.
        zero1_muon: those matrices are sharded by ZeRO-1 (``k2.parallel.use_distributed_optimizer``): they
            sit in DDP buffers of their own.
        layer_wise: ... by megatron's layer-wise distributed optimizer (``optim.muon_zero1=layer_wise``);
            False: megatron's byte-range one, running Distributed Muon (:mod:`k2.optim.distributed_muon`).
        router_optimizer: ``optim.router_optimizer``, the MoE router weight's update when ``muon``.
    """

    muon: bool
    zero1_muon: bool
    layer_wise: bool
    router_optimizer: str


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer of ``optim.name``.

    Attributes:
        name: ``optim.name`` (and the Hydra choice ``optim=<name>``).
        build: ``build(optim_cfg, model, tcfg, schedule, use_distributed_optimizer)`` -> megatron's
            optimizer (:func:`k2.optim.build.build_optimizer` documents the arguments).
        default: the update of every parameter that is not a weight matrix routed to ``matrix`` (and of all
            of them when ``matrix`` is None).
        matrix: the update of the weight matrices :func:`k2.optim.params.route` picks (Muon), or None.
        matrix_step: the extra per-matrix work of ``matrix``, or None.
        settings: the ``optim`` keys that belong to this optimizer alone (its config section): the schema
            declares them (:func:`k2.config.schema.optimizer_settings`).
    """

    name: str
    build: Callable[..., Any]
    default: ParamUpdate
    matrix: ParamUpdate | None = None
    matrix_step: MatrixStep | None = None
    settings: tuple[str, ...] = field(default=())

    @property
    def updates(self) -> Mapping[str, ParamUpdate]:
        """Route name -> :class:`ParamUpdate`, every route this optimizer gives parameters."""
        return {u.route: u for u in (self.default, self.matrix) if u is not None}

    @property
    def main_update(self) -> ParamUpdate:
        """The update the planner's whole-model figures price every parameter at (its checkpoint bytes,
        offload and update traffic): the matrix update when there is one (most of K2's parameters are
        matrices), else the default."""
        return self.matrix if self.matrix is not None else self.default

    def placement(self, optim_cfg: OptimConfig, use_distributed_optimizer: bool) -> Placement:
        """The :class:`Placement` of the parameters under the ``optim`` section ``optim_cfg`` (of this
        optimizer) and ``k2.parallel.use_distributed_optimizer``."""
        muon = self.matrix is not None
        zero1_muon = muon and bool(use_distributed_optimizer)
        return Placement(
            muon=muon,
            zero1_muon=zero1_muon,
            layer_wise=zero1_muon and optim_cfg.muon_zero1 == MuonZero1.layer_wise,
            router_optimizer=str(optim_cfg.router_optimizer),
        )


_SPECS: dict[str, OptimizerSpec] = {}


def _registered() -> dict[str, OptimizerSpec]:
    if not _SPECS:
        for module in _MODULES:
            for spec in importlib.import_module(module).SPECS:
                _SPECS[spec.name] = spec
    return _SPECS


def optimizer_names() -> tuple[str, ...]:
    """The registered ``optim.name`` values, in registration order."""
    return tuple(_registered())


def optimizer_spec(name: str) -> OptimizerSpec:
    """The :class:`OptimizerSpec` of ``optim.name``.

    Raises:
        ValueError: an unknown name (the message names the setting and the allowed values).
    """
    specs = _registered()
    if name not in specs:
        raise ValueError(f"optim.name={name!r}; allowed: {', '.join(specs)}")
    return specs[name]
