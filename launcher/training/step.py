"""One global batch through megatron's pipeline schedule: the forward step, the loss, its reduction over
ranks, the validation loss, and the divergence check of a step's loss and gradient norm."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from k2.launcher.progress import moved
from k2.launcher.training.phase_data import microbatch_iterators


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of token losses and token count (megatron ``calculate_per_token_loss`` convention).

    Args:
        loss_mask: ``[b, s]`` 1 for tokens that count.
        output_tensor: ``[b, s]`` per-token cross-entropy from GPTModel.

    Returns:
        ``(loss_sum, num_tokens, {"lm loss": [loss_sum, num_tokens]})``.
    """
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """megatron's ``forward_step_func``: the next microbatch through one model chunk.

    Args:
        data_iterator: yields dicts of ``tokens`` / ``labels`` / ``loss_mask`` / ``position_ids``,
            ``[micro_batch_size, seq_length]`` each (:class:`k2.launcher.datasets.microbatches.MicrobatchIterator`).
        model: one (DDP-wrapped) model chunk; with ``return_schedule_plan`` the unwrapped ``GPTModel``.
        return_schedule_plan: megatron's combined-1F1B schedule (``pipeline.ep_overlap``,
            ``k2.schedules.ep_overlap``) asks for the chunk's schedule plan instead of its output
            (``GPTModel.build_schedule_plan``, same inputs); the schedule runs the plan's nodes itself.

    Returns:
        ``(output, loss function)``: the chunk's output (per-token cross-entropy ``[b, s]`` on the last
        stage, hidden states elsewhere) -- or its schedule plan -- and :func:`loss_func` bound to the
        microbatch's loss mask.
    """
    batch = next(data_iterator)
    dev = next(model.parameters()).device
    tokens = batch["tokens"].to(dev, non_blocking=True)
    labels = batch["labels"].to(dev, non_blocking=True)
    loss_mask = batch["loss_mask"].to(dev, non_blocking=True)
    position_ids = batch["position_ids"].to(dev, non_blocking=True)
    if return_schedule_plan:
        output = model.build_schedule_plan(tokens, position_ids, None, labels=labels)
    else:
        output = model(tokens, position_ids, None, labels=labels)
    return output, partial(loss_func, loss_mask)


def run_microbatches(forward_backward, iters: list, model: list, phase, forward_only: bool) -> list:
    """One global batch through megatron's schedule (interleaved 1F1B when there are several model
    chunks): ``phase.num_microbatches`` microbatches of ``phase.micro_batch_size`` x
    ``phase.seq_length`` tokens per DP rank. Returns the last stage's per-microbatch loss reports."""
    return forward_backward(
        forward_step_func=forward_step,
        data_iterator=iters,
        model=model,
        num_microbatches=phase.num_microbatches,
        seq_length=phase.seq_length,
        micro_batch_size=phase.micro_batch_size,
        decoder_seq_length=phase.seq_length,
        forward_only=forward_only,
    )


def reduce_lm_loss(losses: list) -> tuple[float, int]:
    """Global per-token loss: sum the last stage's ``[loss_sum, tokens]`` over microbatches and over
    all ranks (ranks off the last stage contribute zeros)."""
    import torch.distributed as dist

    acc = torch.zeros(2, dtype=torch.float64)
    for d in losses:
        acc += d["lm loss"].detach().to("cpu", torch.float64)
    if dist.is_initialized():
        dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        acc_d = acc.to(dev)
        dist.all_reduce(acc_d)
        acc = acc_d.cpu()
    tokens = int(acc[1].item())
    return (acc[0].item() / max(tokens, 1)), tokens


def evaluate(eval_iters: int, plan, phase, model, forward_backward, valid_ds, dp_rank: int) -> float:
    """Per-token validation loss over ``eval_iters`` (``train.eval_iters``) global batches of ``phase``'s
    shape (the same batches at every evaluation within one context length, so values are comparable
    across steps); each batch reports progress to the hang watchdog. Collective: every rank calls it."""
    iters = microbatch_iterators(valid_ds, phase, plan, dp_rank)
    for m in model:
        m.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for _ in range(eval_iters):
            losses = run_microbatches(forward_backward, iters, model, phase, forward_only=True)
            loss, n = reduce_lm_loss(losses)
            total += loss * n
            tokens += n
            moved()  # a batch done: a long evaluation is not a hang (k2.launcher.progress)
    for m in model:
        m.train()
    return total / max(tokens, 1)


class TrainingDiverged(RuntimeError):
    """A step's loss or gradient norm is NaN or infinite; the message names the step, its LR and the last
    checkpoint. ``k2-train`` prints it as its one error line and exits with
    :data:`k2.launcher.cli.DIVERGED_EXIT`."""


def check_finite(
    step: int, lr: float, loss: float, grad_norm: float | None, last_checkpoint: Callable[[], Path | None]
) -> None:
    """Stop the run when ``loss`` or ``grad_norm`` (both global: the same on every rank) is not finite.

    Args:
        step: the step just run (1-based); lr: its learning rate; loss: its per-token loss;
        grad_norm: its global gradient norm (None when the optimizer reports none);
        last_checkpoint: returns the newest complete checkpoint of the run, or None (called only for a
            diverged step).

    Raises:
        TrainingDiverged: a NaN / inf value; nothing of this step is saved.
    """
    bad = [
        f"{name} {value}"
        for name, value in (("loss", loss), ("gradient norm", grad_norm))
        if value is not None and not math.isfinite(value)
    ]
    if not bad:
        return
    last = last_checkpoint()
    where = (
        f"the last checkpoint is {last}"
        if last is not None
        else "no checkpoint was saved before it (train.save_interval)"
    )
    raise TrainingDiverged(
        f"training diverged at step {step} (lr {lr:.6g}): {', '.join(bad)}; the step is not saved; {where}"
    )
