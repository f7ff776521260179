"""``plan.what_if.*``: settings of published runs that ``k2-train`` does not have, for ``k2-plan``'s
comparisons with those runs only (``k2-plan plan.published=...``); every figure they enter is labelled
with them (:meth:`WhatIf.labels`). How the step-time model uses each: :mod:`k2.launcher.planning.step_time`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from omegaconf import OmegaConf

if TYPE_CHECKING:
    from k2.config.schema import K2Config


@dataclass(frozen=True)
class WhatIf:
    """``plan.what_if.*`` (defaults: none of them).

    Attributes:
        fsdp: FSDP2 under torch's pipelining as NeMo AutoModel runs it (the DP traffic per pipeline flush).
        dualpipe: DeepSeek's DualPipe (arXiv 2412.19437 section 3.2.1).
        deepep: megatron's ``flex`` dispatcher with DeepEP (its rates and SMs, FP8 payload with
            ``train.fp8_recipe``, one network copy per remote node).
        node_limit: a token's experts on at most this many nodes (None: the model's group-limited routing).
        pipeline_flushes: gradient accumulation over this many pipeline schedules per step.
        mtp_layers: multi-token-prediction modules computed on the stage holding the loss (DeepSeek-V3,
            arXiv 2412.19437 section 2.2): their time counts, their FLOPs stay out of the model FLOPs.
        cuda_graphs: full-iteration CUDA graphs: no host term (:mod:`k2.launcher.planning.host_bound`).
    """

    fsdp: bool = False
    dualpipe: bool = False
    deepep: bool = False
    node_limit: int | None = None
    pipeline_flushes: int = 1
    mtp_layers: int = 0
    cuda_graphs: bool = False

    @classmethod
    def from_config(cls, cfg: K2Config) -> WhatIf:
        sel = lambda k, d=False: OmegaConf.select(cfg, f"plan.what_if.{k}", default=d)  # noqa: E731
        return cls(
            bool(sel("fsdp")),
            bool(sel("dualpipe")),
            bool(sel("deepep")),
            sel("node_limit", None),
            int(sel("pipeline_flushes", 1) or 1),
            int(sel("mtp_layers", 0) or 0),
            bool(sel("cuda_graphs")),
        )

    def labels(self) -> list[str]:
        return (
            [k for k in ("fsdp", "dualpipe", "deepep") if getattr(self, k)]
            + ([f"flushes{self.pipeline_flushes}"] if self.pipeline_flushes > 1 else [])
            + ([f"mtp{self.mtp_layers}"] if self.mtp_layers else [])
            + (["cuda_graphs"] if self.cuda_graphs else [])
        )
