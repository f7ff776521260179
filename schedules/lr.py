"""Learning rate and weight decay of every optimizer step, from the token-based schedule (schedules/wsd.py).

:class:`TokenLRScheduler` replaces megatron-core's step-based ``OptimizerParamScheduler`` (docs/k2_reference.md
"Open anchors": megatron's WSD has one decay phase counted in iterations or samples; K2's schedule is
several phases counted in tokens). It keeps what megatron's scheduler does to the optimizer: it writes
``param_group['lr']`` (filling it in place when it is a tensor) and ``param_group['weight_decay']`` of
every param group, empty ones included, honouring the per-group settings megatron's
``get_megatron_optimizer`` puts there:

* ``lr``: ``schedule LR x (group max_lr / schedule peak LR) x group lr_mult``. Megatron builds every group
  with ``max_lr`` = ``OptimizerConfig.lr`` (:func:`optimizer_lr_settings` sets that to the schedule's
  peak) unless an override (decoupled LR, muP) scales it, so a group whose ``max_lr`` is half the peak
  follows the same curve at half height. ``lr_mult`` defaults to 1.
* ``weight_decay``: ``schedule.weight_decay x group wd_mult`` (megatron sets ``wd_mult`` 0 for biases and
  norms).

State is the number of tokens consumed (and steps done); :meth:`TokenLRScheduler.load_state_dict` *sets*
it, so restoring twice does not advance the schedule twice (megatron's ``load_state_dict`` calls
``step(num_steps)``, which adds).
"""

from __future__ import annotations

from typing import Any

from k2.schedules.wsd import Schedule


def optimizer_lr_settings(schedule: Schedule) -> dict[str, float]:
    """``lr`` / ``min_lr`` / ``weight_decay`` for megatron's ``OptimizerConfig``.

    megatron copies ``lr`` and ``min_lr`` into each param group as ``max_lr`` / ``min_lr``; the scheduler
    overwrites ``lr`` and ``weight_decay`` before every step, so these only fix the reference ``max_lr``.
    """
    return {
        "lr": schedule.peak_lr,
        "min_lr": min(min(p.lr_start, p.lr_end) for p in schedule.phases),
        "weight_decay": schedule.weight_decay,
    }


class TokenLRScheduler:
    """Sets each param group's LR and weight decay for the next step from tokens consumed.

    The LR of step ``s`` is ``schedule.lr_at(s * B)`` (``B = schedule.global_batch_tokens``): after
    construction the param groups hold step 1's LR, after :meth:`step` the next step's.

    Args:
        schedule: from :func:`k2.schedules.resolve.resolve_schedule`.
        optimizer: anything with ``param_groups`` (a megatron optimizer, a ``torch.optim`` optimizer).
        consumed_tokens: tokens already trained (a resume point); 0 for a fresh run.

    Attributes:
        consumed_tokens: tokens of completed steps.
        steps: completed steps.
        lr: the schedule's LR for the next step (the value of a group with ``max_lr`` = peak and
            ``lr_mult`` 1; what metrics.jsonl logs as ``lr``).
    """

    def __init__(self, schedule: Schedule, optimizer: Any, consumed_tokens: int = 0) -> None:
        self.schedule = schedule
        self.optimizer = optimizer
        self.reference_lr = schedule.peak_lr
        self.consumed_tokens = int(consumed_tokens)
        self.steps = 0
        self.lr = 0.0
        self._apply()

    def _apply(self) -> None:
        self.lr = self.schedule.lr_at(self.consumed_tokens + self.schedule.global_batch_tokens)
        wd = self.schedule.weight_decay
        for group in self.optimizer.param_groups:
            scale = group.get("max_lr", self.reference_lr) / self.reference_lr if self.reference_lr > 0 else 1.0
            value = self.lr * scale * group.get("lr_mult", 1.0)
            if hasattr(group.get("lr"), "fill_"):
                group["lr"].fill_(value)
            else:
                group["lr"] = value
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    def step(self, tokens: int | None = None) -> None:
        """Record one finished step of ``tokens`` tokens (default ``B``) and set the next step's LR."""
        self.consumed_tokens += self.schedule.global_batch_tokens if tokens is None else int(tokens)
        self.steps += 1
        self._apply()

    def state_dict(self) -> dict:
        """``{"consumed_tokens", "steps", "global_batch_tokens", "schedule"}`` (ints and the name)."""
        return {
            "consumed_tokens": self.consumed_tokens,
            "steps": self.steps,
            "global_batch_tokens": self.schedule.global_batch_tokens,
            "schedule": self.schedule.name,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the position (idempotent: sets, never adds) and set the next step's LR.

        The LR then follows the *current* schedule at the restored token count, so a schedule edited
        between runs takes effect from the resume point.
        """
        self.consumed_tokens = int(state["consumed_tokens"])
        self.steps = int(state.get("steps", 0))
        self._apply()
