"""Learning-rate and weight-decay schedule of a run (megatron's ``OptimizerParamScheduler`` for now).

Counts optimizer steps. Issue 4 replaces it with K2's token-based multi-phase WSD schedule.
"""

from __future__ import annotations


def build_lr_scheduler(cfg, optimizer):
    """megatron ``OptimizerParamScheduler``: linear warmup over ``optim.lr_warmup_iters`` steps to
    ``optim.lr``, then ``optim.lr_decay_style`` decay to ``optim.min_lr`` at ``train.iters``; constant
    weight decay ``optim.weight_decay``.
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o = cfg.optim
    iters = int(cfg.train.iters)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=min(int(o.lr_warmup_iters), iters - 1),  # megatron: warmup < decay
        lr_decay_steps=max(iters, 1),
        lr_decay_style=o.lr_decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=max(iters, 1),
        wd_incr_style="constant",
        wsd_decay_steps=o.lr_wsd_decay_iters,
        lr_wsd_decay_style="cosine" if o.lr_decay_style == "WSD" else None,
    )
