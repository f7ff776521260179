"""Loss-spike guard (``train.spike.*``): a step whose loss or gradient norm is an outlier against the recent
steps is logged, skipped or ends the run.

A value ``v`` of a step is a spike when ``v > mean + sigma * std`` of the same quantity over the last
``train.spike.window`` accepted steps (population std; detection starts once half the window is filled,
fewer values give no usable spread) -- the rule of OLMo-core's ``SkipStepOptimizer`` (128 steps, 6 sigma).
Only the high side counts: a loss far below the window is not harmful. Detected steps do not enter the
window, so one spike does not widen the band that the next is measured against.

The step's loss and gradient norm are global (the same on every rank after their all-reduces), but the
decision is still all-reduced (MAX of a flag) so that every rank acts alike even if a rank's float
arithmetic or an injected test value differs.

``skip`` uses megatron's own no-update path: the optimizer's ``prepare_grads`` reports "found inf" for the
step, so ``MegatronOptimizer.step`` returns before the update; weights, FP32 master copies, AdamW moments,
Muon momentum and the optimizer step counters are untouched. megatron updates the MoE router's expert bias
(auxiliary-loss-free balancing) in ``finalize_model_grads``, during the forward-backward, so the guard keeps
a copy of those small ``[num_experts]`` vectors from before the step and puts it back on a skip. The
scheduler still moves on: the step's tokens count as consumed (as OLMo-core's skipped steps do).

The window is part of the checkpoint's ``k2_state.json`` (key ``spike``) so a resumed run decides exactly
as an uninterrupted one.

Test seam: ``K2_TEST_SPIKE=STEP:FACTOR`` multiplies the loss the guard sees at optimizer step ``STEP`` on
rank 0 only (the other ranks learn of it through the all-reduced decision); the recorded loss is unchanged.
"""

from __future__ import annotations

import math
import os
import statistics
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from k2.launcher.training.step import TrainingDiverged
from k2.parallel.distributed import all_reduce_int

if TYPE_CHECKING:
    from k2.config.schema import SpikeConfig

__all__ = ["SpikeGuard", "TEST_SPIKE_ENV"]

#: environment variable of the test seam (module docstring)
TEST_SPIKE_ENV = "K2_TEST_SPIKE"


def _injected(step: int, rank: int) -> float:
    """The factor ``K2_TEST_SPIKE`` puts on rank 0's loss at ``step`` (1.0 elsewhere)."""
    spec = os.environ.get(TEST_SPIKE_ENV)
    if not spec or rank != 0:
        return 1.0
    at, factor = spec.split(":")
    return float(factor) if int(at) == step else 1.0


def _outlier(value: float | None, window: deque, sigma: float, min_count: int) -> bool:
    if value is None or len(window) < min_count:
        return False
    mean = statistics.fmean(window)
    return value > mean + sigma * statistics.pstdev(window, mean)


class SpikeGuard:
    """The spike window of one rank and the decision of each step (the same on every rank).

    Args:
        cfg: ``train.spike`` (window, sigma, action, max_consecutive_skips).
        rank: this process's global rank (for the test seam).

    Use per step: :meth:`before_step` before the forward-backward, :meth:`optimizer_step` instead of
    ``optimizer.step()``, then :meth:`finish_step` with the step's metrics record.
    """

    def __init__(self, cfg: SpikeConfig, rank: int = 0):
        self.window, self.sigma, self.action = int(cfg.window), float(cfg.sigma), cfg.action
        self.max_consecutive_skips = int(cfg.max_consecutive_skips)
        self.rank = rank
        self.losses: deque = deque(maxlen=self.window)
        self.grad_norms: deque = deque(maxlen=self.window)
        self.consecutive = 0
        self._bias: list = []
        self.last: dict = {}

    # ------------------------------------------------------------------ the step

    def before_step(self, model: list) -> None:
        """With ``action=skip``: keep the MoE routers' expert bias (updated by megatron during the
        forward-backward) so a skipped step can put it back. ``model``: the DDP-wrapped chunks."""
        self._bias = []
        if self.action != "skip":
            return
        for chunk in model:
            for module in chunk.modules():
                bias = getattr(module, "expert_bias", None)
                if torch.is_tensor(bias):
                    self._bias.append((bias, bias.detach().clone()))

    def optimizer_step(self, step: int, optimizer, loss: float) -> tuple:
        """``optimizer.step()`` with the spike decision of ``step`` (collective: every rank calls it).

        Args:
            step: the optimizer step (1-based); optimizer: megatron's (chained) optimizer;
            loss: the step's global per-token loss (before the update).

        Returns:
            ``(update_successful, grad_norm, spike)``: megatron's first two (``grad_norm`` is the norm
            the guard measured when it skipped the update), and whether the step was a spike.
        """
        if self.action != "skip":  # decided after megatron's step, on its grad norm: the step is untouched
            update_ok, grad_norm, _ = optimizer.step()
            spike = self._decide(step, loss, None if grad_norm is None else float(grad_norm))
            return update_ok, grad_norm, spike
        measured: dict = {}
        prepare = optimizer.prepare_grads

        def prepare_then_decide() -> bool:  # megatron's step skips the update when this returns True
            if prepare():
                return True
            measured["grad_norm"] = float(optimizer.get_grad_norm())
            measured["spike"] = self._decide(step, loss, measured["grad_norm"])
            if measured["spike"]:
                for bias, saved in self._bias:
                    bias.copy_(saved)
            return measured["spike"]

        optimizer.prepare_grads = prepare_then_decide  # this call only (megatron's step calls it first)
        try:
            update_ok, grad_norm, _ = optimizer.step()
        finally:
            del optimizer.prepare_grads
        if "spike" not in measured:  # megatron found inf/NaN gradients: not a spike, the divergence check's
            self.last = {"spike": False}
            return update_ok, grad_norm, False
        return update_ok, measured["grad_norm"] if measured["spike"] else grad_norm, measured["spike"]

    def _decide(self, step: int, loss: float, grad_norm: float | None) -> bool:
        seen = loss * _injected(step, self.rank)
        min_count = max(2, self.window // 2)
        which = [
            name
            for name, value, window in (("loss", seen, self.losses), ("grad_norm", grad_norm, self.grad_norms))
            if _outlier(value, window, self.sigma, min_count)
        ]
        flag = all_reduce_int(int(bool(which)), "max")
        self.last = {"spike": bool(flag)}
        if flag:
            self.consecutive += 1
            self.last["spike_action"] = self.action
            self.last["spike_on"] = which or ["another rank's value"]
            self.last["spike_sigmas"] = {
                name: self._sigmas(v, w)
                for name, v, w in (("loss", seen, self.losses), ("grad_norm", grad_norm, self.grad_norms))
                if name in which
            }
        else:
            self.consecutive = 0  # (a NaN / inf value stops the run in the divergence check next)
            for value, window in ((seen, self.losses), (grad_norm, self.grad_norms)):
                if value is not None and math.isfinite(value):
                    window.append(value)
        return bool(flag)

    @staticmethod
    def _sigmas(value: float, window: deque) -> float:
        mean = statistics.fmean(window)
        std = statistics.pstdev(window, mean)
        return (value - mean) / std if std > 0 else math.inf

    # ------------------------------------------------------------------ reporting

    def finish_step(
        self, step: int, record: dict, log: Callable[[str], None], last_checkpoint: Callable[[], Path | None]
    ) -> None:
        """Report the decision of ``step`` and stop the run when it must end.

        Adds to ``record`` (the step's ``metrics.jsonl`` record) ``spike`` (bool) and, for a spike,
        ``spike_action``, ``spike_on`` (``loss`` / ``grad_norm``) and ``spike_sigmas`` (distance from the
        window's mean in standard deviations); ``log`` gets one line per spike.

        Raises:
            TrainingDiverged: a spike with ``action=stop``, or more than ``max_consecutive_skips`` skips in
                a row (the message names the last checkpoint, from ``last_checkpoint()``).
        """
        record.update(self.last)
        if not self.last.get("spike"):
            return
        on = ", ".join(f"{k} {v:.1f} sigma" for k, v in self.last["spike_sigmas"].items()) or "on another rank's values"
        what = {
            "log": "logged only (train.spike.action=log)",
            "skip": "update skipped, its tokens count as consumed",
            "stop": "stopping the run (train.spike.action=stop)",
        }[self.action]
        log(f"step {step}: spike ({on} above the mean of the last {len(self.losses)} steps): {what}")
        why = None
        if self.action == "stop":
            why = f"loss spike at step {step} (train.spike.action=stop)"
        elif self.action == "skip" and self.consecutive > self.max_consecutive_skips:
            why = (
                f"{self.consecutive} loss spikes in a row up to step {step} (more than "
                f"train.spike.max_consecutive_skips={self.max_consecutive_skips})"
            )
        if why is not None:
            last = last_checkpoint()
            raise TrainingDiverged(
                f"{why}; the step is not saved; "
                + (
                    f"the last checkpoint is {last}"
                    if last is not None
                    else "no checkpoint was saved before it (train.save_interval)"
                )
            )

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict:
        """The window for ``k2_state.json`` (JSON floats round-trip exactly)."""
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms), "consecutive": self.consecutive}

    def load_state_dict(self, saved: dict | None) -> None:
        """Continue from a checkpoint's ``spike`` record (None: a checkpoint written without the guard)."""
        if not saved:
            return
        self.losses.extend(saved["losses"])
        self.grad_norms.extend(saved["grad_norms"])
        self.consecutive = int(saved["consecutive"])
