"""``k2-train``: train a K2-family model with megatron-core's PP/VPP/EP/ZeRO-1 machinery.

Flow (one direction): config (``launcher.config``) -> plan (``parallel.dims.ParallelDims``, microbatch
count, data resolution; all validated before any process starts) -> build (process groups, model
chunks, DDP, distributed optimizer, datasets) -> train (megatron's ``get_forward_backward_func``:
interleaved 1F1B when ``parallel.vpp > 1``).

``k2-train parallel=cpu4`` spawns ``launch.nproc_per_node`` local ranks itself (through
``torch.distributed.run``) when it is not already under torchrun or srun; ``torchrun -m launcher.train
...`` and ``srun python -m launcher.train ...`` run the same code directly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Optional

import torch

from launcher.config import ConfigError, load_config, to_yaml


@dataclass
class Plan:
    """Everything decided before any process group exists."""

    dims: object  # parallel.dims.ParallelDims
    schedule: object  # schedules.wsd.Schedule: per phase seq_length, global batch, microbatches, LR
    steps: int  # optimizer steps of this run: the schedule's, capped by train.iters
    data: object  # launcher.data.ResolvedData
    tokens_per_step: int  # schedule.global_batch_tokens
    resume_from: Optional[Path] = None  # the checkpoint this run continues from (launcher.checkpoint)


def make_plan(cfg, world_size: int) -> Plan:
    """Validate the config for ``world_size`` ranks and decide the layout and the schedule.

    Every schedule phase that runs a step is checked against megatron's microbatch rule here
    (:func:`schedules.wsd.resolve_schedule` with the parallel layout).

    Raises:
        ConfigError: any setting that cannot run, naming the setting and the allowed values.
    """
    from launcher.data import resolve_data
    from model.backends import check_backend_config
    from model.memory import check_memory_config
    from optim.build import check_optim_config
    from parallel.dims import ParallelDims
    from schedules.pipeline import check_pipeline_config
    from schedules.wsd import resolve_schedule

    from launcher.checkpoint import plan_resume

    t = cfg.train
    if t.precision not in ("fp32", "bf16"):
        raise ConfigError(f"train.precision={t.precision!r}; allowed: fp32, bf16")
    if t.iters is not None and t.iters < 1:
        raise ConfigError(f"train.iters={t.iters} must be >= 1, or null (run to the end of the schedule)")
    if t.save_interval is not None and t.save_interval < 1:
        raise ConfigError(f"train.save_interval={t.save_interval}; allowed: an integer >= 1 (steps), or "
                          "null (save only at the end and on preemption)")
    if cfg.checkpoint.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last={cfg.checkpoint.keep_last}; allowed: an integer >= 1")
    if cfg.checkpoint.keep_every is not None and cfg.checkpoint.keep_every < 1:
        raise ConfigError(f"checkpoint.keep_every={cfg.checkpoint.keep_every}; allowed: an integer >= 1 "
                          "or null")
    if cfg.run.max_minutes is not None and not cfg.run.max_minutes > 0:
        raise ConfigError(f"run.max_minutes={cfg.run.max_minutes}; allowed: a number > 0, or null")
    check_optim_config(cfg)
    check_pipeline_config(cfg)  # pipeline.* (issue 8)
    check_memory_config(cfg)  # issue 6: memory.* site names (model/memory.py)
    check_backend_config(cfg)  # issue 10: attention backend, grouped experts (model/backends.py)
    if cfg.optim.qk_clip_tau is not None and not cfg.model.record_max_logits:
        raise ConfigError(
            f"optim.qk_clip_tau={cfg.optim.qk_clip_tau} needs the per-head max logits: set "
            "model.record_max_logits=true (allowed with record_max_logits=false: optim.qk_clip_tau=null)"
        )
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, world_size)
    schedule = resolve_schedule(cfg, dims)
    steps = schedule.total_steps if t.iters is None else min(int(t.iters), schedule.total_steps)
    data = resolve_data(cfg)
    layout = {"pp": dims.pp, "vpp": dims.vpp, "ep": dims.ep, "dp": dims.dp, "world_size": world_size}
    resume_from = plan_resume(cfg, layout)
    return Plan(dims, schedule, steps, data, schedule.global_batch_tokens, resume_from)


# --- forward step --------------------------------------------------------------------------------------


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
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


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    dev = next(model.parameters()).device
    tokens = batch["tokens"].to(dev, non_blocking=True)
    labels = batch["labels"].to(dev, non_blocking=True)
    loss_mask = batch["loss_mask"].to(dev, non_blocking=True)
    position_ids = batch["position_ids"].to(dev, non_blocking=True)
    output = model(tokens, position_ids, None, labels=labels)
    return output, partial(_loss_func, loss_mask)


def run_microbatches(forward_backward, iters: list, model: list, phase, forward_only: bool) -> list:
    """One global batch through megatron's schedule (interleaved 1F1B when there are several model
    chunks): ``phase.num_microbatches`` microbatches of ``phase.micro_batch_size`` x
    ``phase.seq_length`` tokens per DP rank. Returns the last stage's per-microbatch loss reports."""
    return forward_backward(
        forward_step_func=_forward_step,
        data_iterator=iters,
        model=model,
        num_microbatches=phase.num_microbatches,
        seq_length=phase.seq_length,
        micro_batch_size=phase.micro_batch_size,
        decoder_seq_length=phase.seq_length,
        forward_only=forward_only,
    )


def _reduce_lm_loss(losses: list) -> tuple[float, int]:
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


# --- MoE metrics ----------------------------------------------------------------------------------------


def _routers(model: list):
    from model.router import K2Router

    for chunk in model:
        for mod in chunk.modules():
            if isinstance(mod, K2Router):
                yield mod


def moe_step_metrics(model: list, num_layers: int, num_experts: int, num_microbatches: int,
                     moe_layer_freq) -> dict:
    """Expert-load and aux-loss metrics of the step just run (collective over all ranks).

    Returns:
        ``moe_load_max_over_mean``: max over MoE layers of (tokens of the busiest expert / mean tokens
        per expert), 1.0 = perfectly balanced; ``moe_aux_loss``: megatron's sequence-level aux loss
        averaged over MoE layers and microbatches.
    """
    import torch.distributed as dist
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    if not num_experts:
        return {}
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    counts = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=dev)
    for r in _routers(model):
        counts[r.layer_number - 1] += r.step_tokens_per_expert.to(dev, torch.float64)
        r.step_tokens_per_expert.zero_()
    dist.all_reduce(counts)
    moe_rows = counts[counts.sum(dim=1) > 0]
    out = {}
    if moe_rows.numel():
        out["moe_load_max_over_mean"] = (moe_rows.max(dim=1).values / moe_rows.mean(dim=1)).max().item()
    totals: dict = {}
    get_moe_metrics_tracker().report(
        loss_scale=1.0 / num_microbatches,
        iteration=0,
        force_initialize=True,
        track_names=["seq_load_balancing_loss"],
        num_layers=num_layers,
        moe_layer_freq=moe_layer_freq,
        total_loss_dict=totals,
    )
    if "seq_load_balancing_loss" in totals:
        out["moe_aux_loss"] = float(totals["seq_load_balancing_loss"])
    return out


# --- the run --------------------------------------------------------------------------------------------


def _microbatch_iterators(dataset, phase, plan, dp_rank: int, start_sample: int = 0) -> list:
    from launcher.data import MicrobatchIterator

    return [
        MicrobatchIterator(dataset, phase.global_batch_size, phase.micro_batch_size, dp_rank,
                           plan.dims.dp, start_sample=start_sample)
        for _ in range(plan.dims.vpp)
    ]


def evaluate(cfg, plan, phase, model, forward_backward, valid_ds, dp_rank: int) -> float:
    """Per-token validation loss over ``train.eval_iters`` global batches of ``phase``'s shape (the same
    batches at every evaluation within one context length, so values are comparable across steps)."""
    t = cfg.train
    iters = _microbatch_iterators(valid_ds, phase, plan, dp_rank)
    for m in model:
        m.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for _ in range(t.eval_iters):
            losses = run_microbatches(forward_backward, iters, model, phase, forward_only=True)
            loss, n = _reduce_lm_loss(losses)
            total += loss * n
            tokens += n
    for m in model:
        m.train()
    return total / max(tokens, 1)


class _PhaseData:
    """Datasets and microbatch iterators of the current schedule phase on this rank.

    The datasets are rebuilt (megatron's builder: a collective, every rank enters it at the same step)
    only when the sequence length changes; one build serves the whole stretch of phases at that length
    (``Schedule.context_steps``). Global batch ``j`` of the stretch reads samples ``[j*G, (j+1)*G)`` of
    it (``G`` = the phase's global batch in sequences), so a run resumed at any step reads the same
    samples.
    """

    def __init__(self, cfg, plan: Plan, dp_rank: int):
        self.cfg, self.plan, self.dp_rank = cfg, plan, dp_rank
        self.phase = None
        self.seq_length = None
        self.first_step = 1
        self.train_ds = self.valid_ds = None
        self.iters = None

    def enter(self, phase, step: int) -> bool:
        """Serve ``phase`` from ``step`` on; returns True when the datasets were rebuilt."""
        from launcher.data import build_datasets

        rebuilt = False
        if phase.seq_length != self.seq_length:
            first, last = self.plan.schedule.context_steps(phase)
            last = min(last, self.plan.steps)
            self.train_ds, self.valid_ds = build_datasets(
                self.plan.data, phase.seq_length, self.cfg.run.seed,
                train_samples=(last - first + 1) * phase.global_batch_size,
                valid_samples=max(1, self.cfg.train.eval_iters) * phase.global_batch_size,
            )
            self.seq_length, self.first_step, rebuilt = phase.seq_length, first, True
        self.phase = phase
        self.iters = _microbatch_iterators(
            self.train_ds, phase, self.plan, self.dp_rank,
            start_sample=(step - self.first_step) * phase.global_batch_size,
        )
        return rebuilt


def run(cfg, plan: Plan, env) -> dict:
    """Train on this rank (process groups are created here). Returns the final metrics record.

    Preemption (launcher/preemption.py): the SIGTERM/SIGUSR1 handlers and the ``run.max_minutes`` clock
    start first thing, so a signal during start-up (process groups, model build, checkpoint load) is
    honoured at the first step boundary -- a checkpoint and exit status 42 -- instead of killing the rank
    with the signal's default action, and the budget counts the start-up too.

    Args:
        cfg: validated config.
        plan: from :func:`make_plan` for ``env.world_size``.
        env: :class:`parallel.distributed.DistEnv`.

    The run follows ``plan.schedule`` (schedules/wsd.py): each step runs in the phase holding its first
    token; entering a phase with another sequence length rebuilds the datasets at that length and runs
    ``global_batch_tokens / seq_length`` sequences per step (microbatch count recomputed), entering one
    with another ``rope_type`` switches every MLA layer's RoPE/YaRN (``model.build.set_rope_type``); the
    LR and weight decay of each step come from ``schedules.lr.TokenLRScheduler``. The run ends after
    ``plan.steps`` steps (the end of the last phase, or ``train.iters``).
    """
    from launcher.preemption import Preemption
    from launcher.slurm import REQUEUE_EXIT_CODE

    def startup_notice(name: str) -> None:  # (replaced by the metrics logger once it exists)
        if env.rank == 0:
            print(f"k2-train: {name} received during start-up; saving a checkpoint after the first step, "
                  f"then exiting with {REQUEUE_EXIT_CODE} (requeue)", flush=True)

    preemption = Preemption(cfg.run.max_minutes, on_signal=startup_notice).install()
    try:
        return _train(cfg, plan, env, preemption)
    finally:
        preemption.uninstall()


def _train(cfg, plan: Plan, env, preemption) -> dict:
    """:func:`run` with its preemption handler installed."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from launcher.checkpoint import load_checkpoint, read_state, remove_partial_saves, save_checkpoint
    from launcher.data import prepare_stdlib_corpus
    from launcher.metrics import REPLAYED_METRICS, MetricsLogger, set_aside_replayed_metrics
    from launcher.preemption import REQUEUE_MARKER
    from launcher.slurm import REQUEUE_EXIT_CODE
    from model.build import (
        build_model_chunks,
        layout_independent_init,
        moe_layer_pattern,
        set_rope_type,
        transformer_config,
    )
    from optim.build import build_optimizer, uses_layer_wise, uses_muon
    from optim.params import format_route_table, route_table, tag_parameters
    from optim.qk_clip import QKClip
    from parallel.distributed import init_distributed, wrap_model
    from schedules.lr import build_lr_scheduler
    from schedules.pipeline import setup_pipeline

    t = cfg.train
    init_distributed(env, plan.dims, cfg.run.seed)
    rank = dist.get_rank()
    if cfg.data.path is None:  # embedded corpus: rank 0 builds it (idempotent), the rest wait
        if rank == 0:
            prepare_stdlib_corpus(cfg.data, progress=False, verbose=not env.spawned_by_k2_train)
        dist.barrier()

    sched = plan.schedule
    first_phase = sched.step_phase(1)
    rope_type = first_phase.rope_type
    tcfg = transformer_config(cfg, plan.dims, rope_type=rope_type)
    chunks = build_model_chunks(cfg, plan.dims, tcfg)
    if t.deterministic_init:
        layout_independent_init(chunks, tcfg, cfg.run.seed)
    # which parameter goes to which optimizer: decided before DDP lays out its ZeRO-1 buffers
    routes = tag_parameters(chunks, tcfg, muon=uses_muon(cfg), layer_wise=uses_layer_wise(cfg))
    # pipeline (issue 8): decoupled weight gradients are set up before DDP registers its grad hooks
    pipeline, delay_wgrad = setup_pipeline(cfg, chunks)
    model = wrap_model(chunks, tcfg, cfg.parallel.use_distributed_optimizer, layer_wise=uses_layer_wise(cfg),
                       delay_wgrad_compute=delay_wgrad)
    optimizer = build_optimizer(cfg, model, tcfg, sched)
    qk_clip = QKClip(model, optimizer, cfg.optim.qk_clip_tau, cfg.model.num_layers)
    all_routes = [None] * dist.get_world_size()
    dist.all_gather_object(all_routes, routes)
    scheduler = build_lr_scheduler(cfg, optimizer, sched)  # sets step 1's LR
    tcfg.finalize_model_grads_func = finalize_model_grads
    tcfg.grad_scale_func = optimizer.scale_loss

    dp_rank = ps.get_data_parallel_rank()
    run_dir = Path(cfg.run.dir)
    config_yaml = to_yaml(cfg)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(config_yaml)
        remove_partial_saves(run_dir)
        (run_dir / REQUEUE_MARKER).unlink(missing_ok=True)

    start_step, wandb_id, resumed_note = 0, None, None
    if plan.resume_from is not None:
        saved = read_state(plan.resume_from)
        same_world = saved["layout"]["world_size"] == env.world_size
        load_checkpoint(plan.resume_from, model, optimizer, same_world=same_world)
        scheduler.load_state_dict(saved["scheduler"])
        start_step, wandb_id = int(saved["step"]), saved.get("wandb_run_id")
        resumed_note = (f"resumed from {plan.resume_from} (step {start_step}, "
                        f"{scheduler.consumed_tokens:,} tokens"
                        f"{'' if same_world else '; world size changed: RNG streams reseeded, not restored'})")
    forward_backward = get_forward_backward_func()
    if pipeline is not None:  # pipeline (issue 8): W drained during p2p, event trace
        forward_backward = pipeline.wrap(forward_backward, tcfg, model, first_step=start_step + 1)
    phase = sched.phase_at(scheduler.consumed_tokens)
    data = _PhaseData(cfg, plan, dp_rank)
    data.enter(phase, start_step + 1)
    if phase.rope_type != rope_type:
        set_rope_type(model, tcfg, cfg.model, phase.rope_type)
        rope_type = phase.rope_type

    replayed_until = 0
    if rank == 0 and start_step:
        replayed_until = set_aside_replayed_metrics(run_dir, start_step)
    from omegaconf import OmegaConf

    logger = MetricsLogger(
        str(run_dir), enabled=rank == 0, total_steps=plan.steps, wandb_cfg=cfg.run.wandb,
        config=OmegaConf.to_container(cfg, resolve=True), progress=t.progress,
        log_interval=t.log_interval, start_step=start_step, wandb_run_id=wandb_id,
    )
    n_params = sum(p.numel() for c in chunks for p in c.parameters())
    logger.message(
        f"k2-train: world={env.world_size} PP={plan.dims.pp} VPP={plan.dims.vpp} EP={plan.dims.ep} "
        f"DP={plan.dims.dp}; schedule={sched.name}: {plan.steps} steps x {plan.tokens_per_step:,} "
        f"tokens; rank-0 params={n_params:,}; run.dir={run_dir}"
    )
    if resumed_note:
        logger.message(f"k2-train: {resumed_note}"
                       + (f"; steps {start_step + 1}..{replayed_until} are re-run (their earlier records "
                          f"moved to {REPLAYED_METRICS})" if replayed_until > start_step else ""))
    if rank == 0:  # the optimizer of every parameter of the model (all ranks'), also in the run dir
        table = format_route_table(route_table(r for rank_routes in all_routes for r in rank_routes))
        (run_dir / "optimizer_params.txt").write_text(table + "\n")
        if not start_step:
            logger.message(f"optimizer {cfg.optim.name} (qk_clip_tau={cfg.optim.qk_clip_tau}):\n{table}")

    def describe(phase) -> str:
        return (f"phase '{phase.name}': seq_length {phase.seq_length}, global batch "
                f"{phase.global_batch_size} x {phase.seq_length} = {plan.tokens_per_step:,} tokens, "
                f"{phase.num_microbatches} microbatches/DP rank of {phase.micro_batch_size}, "
                f"{phase.rope_type}")

    def save(step: int, why: str) -> None:
        t_save = time.perf_counter()
        state = {
            "step": step,
            "consumed_tokens": scheduler.consumed_tokens,
            "phase": data.phase.name,
            # data position: global batch j of the current context stretch reads samples [jG, (j+1)G)
            "consumed_samples_in_context": (step - data.first_step + 1) * data.phase.global_batch_size,
            "seq_length": data.phase.seq_length,
            "scheduler": scheduler.state_dict(),
            "layout": layout,
            "optimizer": cfg.optim.name,
            "optimizer_dp_fixed": uses_layer_wise(cfg),
            "wandb_run_id": logger.wandb_run_id,
            "reason": why,
        }
        path = save_checkpoint(run_dir, step, model, optimizer, state, config_yaml,
                               cfg.checkpoint.keep_last, cfg.checkpoint.keep_every)
        logger.message(f"step {step}: checkpoint {path} ({why}, {time.perf_counter() - t_save:.1f} s)")

    layout = {"pp": plan.dims.pp, "vpp": plan.dims.vpp, "ep": plan.dims.ep, "dp": plan.dims.dp,
              "world_size": env.world_size}
    if start_step >= plan.steps:
        logger.message(f"k2-train: the checkpoint is at step {start_step}, the run ends at step {plan.steps} "
                       "(train.iters / the schedule): nothing to do")
    else:
        logger.message(f"step {start_step + 1}: {describe(phase)}")
    pattern = moe_layer_pattern(cfg.model)
    record: dict = {}
    preemption.on_signal = lambda name: logger.message(
        f"k2-train: {name} received; saving a checkpoint at the end of this step, then exiting with "
        f"{REQUEUE_EXIT_CODE} (requeue)")
    preempted = False
    try:
        if t.eval_interval and start_step == 0:
            val0 = evaluate(cfg, plan, phase, model, forward_backward, data.valid_ds, dp_rank)
            logger.message(f"step 0: val_loss {val0:.4f} (before training)")
        for step in range(start_step + 1, plan.steps + 1):
            phase = sched.phase_at(scheduler.consumed_tokens)
            if phase.index != data.phase.index:  # a phase boundary: no restart
                data.enter(phase, step)
                if phase.rope_type != rope_type:
                    set_rope_type(model, tcfg, cfg.model, phase.rope_type)
                    rope_type = phase.rope_type
                logger.message(f"step {step}: {describe(phase)}")
            t0 = time.perf_counter()
            for m in model:
                m.zero_grad_buffer()
            optimizer.zero_grad()
            losses = run_microbatches(forward_backward, data.iters, model, phase, forward_only=False)
            update_ok, grad_norm, _ = optimizer.step()
            attn = qk_clip.step(apply=bool(update_ok))  # QK-Clip; reads and resets the max-logit windows
            lr = scheduler.lr  # this step's (set before it ran)
            scheduler.step(plan.tokens_per_step)
            loss, n_tokens = _reduce_lm_loss(losses)
            dt = time.perf_counter() - t0
            record = {
                "step": step,
                "consumed_tokens": scheduler.consumed_tokens,
                "phase": phase.name,
                "seq_length": phase.seq_length,
                "global_batch_size": phase.global_batch_size,
                "num_microbatches": phase.num_microbatches,
                "lr": lr,
                "loss": loss,
                "grad_norm": float(grad_norm) if grad_norm is not None else None,
                "tokens_per_s": plan.tokens_per_step / dt,
                "step_time_s": dt,
                "update_successful": bool(update_ok),
                **attn,  # max_attn_logit, max_attn_logit_per_layer, qk_clipped_heads
            }
            # -- MFU (issue 7): model FLOPs of the step (model/flops.py, shared with k2-plan) over peak --
            from model.flops import mfu, step_flops
            record["model_tflops_per_gpu"], record["mfu"] = mfu(step_flops(
                cfg.model, phase.seq_length, plan.tokens_per_step), dt, env.world_size, cfg.cluster.peak_tflops)
            # -- end MFU --
            record.update(moe_step_metrics(model, cfg.model.num_layers, cfg.model.num_moe_experts,
                                           phase.num_microbatches, pattern))
            if pipeline is not None:  # pipeline (issue 8): wgrad_deferred_peak_bytes
                record.update(pipeline.step_metrics())
            if t.eval_interval and (step % t.eval_interval == 0 or step == plan.steps):
                record["val_loss"] = evaluate(cfg, plan, phase, model, forward_backward, data.valid_ds,
                                              dp_rank)
            if step <= replayed_until:
                record["replayed"] = True
            logger.log(record)
            preempted = preemption.agreed()  # collective: every rank, every step, same answer
            if preempted:
                save(step, f"preempted: {preemption.reason}")
                if rank == 0:  # for launchers that see only "a rank failed" (torchrun, srun's kill)
                    (run_dir / REQUEUE_MARKER).write_text(f"{step}\n")
                dist.barrier()  # the marker exists before any rank exits
                break
            if (t.save_interval and step % t.save_interval == 0) or (
                    step == plan.steps and cfg.checkpoint.save_at_end):
                save(step, "end of run" if step == plan.steps else "train.save_interval")
    finally:
        logger.close()
    if preempted:
        record["preempted"] = preemption.reason
    return record


# --- entry points ---------------------------------------------------------------------------------------


def free_port() -> int:
    """An unused TCP port on the loopback interface (so that several local runs can coexist)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_local(cfg, overrides: list[str]) -> int:
    """Re-launch this module under ``torch.distributed.run`` with ``launch.nproc_per_node`` ranks.

    Signals: SIGTERM or SIGUSR1 sent to this process reach every rank as SIGTERM (sent to torchrun's
    worker processes directly: torchrun itself would kill them after its own 30 s grace), so the ranks
    save a checkpoint and stop (launcher.preemption); SIGINT is forwarded to torchrun, which stops the
    ranks at once. Killing ``k2-train`` by pid therefore leaves no orphaned rank behind.

    Returns:
        torchrun's exit code, or :data:`launcher.slurm.REQUEUE_EXIT_CODE` when the ranks stopped for
        preemption (torchrun reports only that its workers failed; rank 0 leaves
        ``<run.dir>/requeue``).
    """
    import signal

    import psutil

    from launcher.preemption import REQUEUE_MARKER
    from launcher.slurm import REQUEUE_EXIT_CODE

    port = cfg.launch.master_port or free_port()
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc_per_node={cfg.launch.nproc_per_node}",
        "--nnodes=1", "--master_addr=127.0.0.1", f"--master_port={port}",
        "-m", "launcher.train", *overrides,
    ]
    env = dict(os.environ)
    env["K2_SPAWNED"] = "1"  # the ranks need not re-announce what this process already did
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.launch.nproc_per_node)))
    print(f"k2-train: spawning {cfg.launch.nproc_per_node} local ranks: {' '.join(cmd[2:])}", flush=True)
    child = subprocess.Popen(cmd, env=env)

    def forward(signum, _frame):
        if signum == signal.SIGINT:
            child.send_signal(signum)
            return
        try:
            workers = psutil.Process(child.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            workers = []
        if not workers:  # not started yet (or gone): torchrun stops whatever there is
            child.send_signal(signal.SIGTERM)
        for w in workers:
            try:
                w.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
    old = {sig: signal.signal(sig, forward) for sig in handled}
    try:
        rc = child.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    marker = Path(cfg.run.dir) / REQUEUE_MARKER
    if rc != 0 and marker.exists():
        print(f"k2-train: the ranks saved step {marker.read_text().strip()} and stopped for preemption; "
              f"exit status {REQUEUE_EXIT_CODE} (requeue)", flush=True)
        return REQUEUE_EXIT_CODE
    return rc


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``k2-train`` and ``python -m launcher.train`` (Hydra overrides in ``argv``; with
    ``-m``/``--multirun`` a sweep, one run per point: launcher/sweep.py).

    Returns:
        0 when the run finished, 2 for a config error, :data:`launcher.slurm.REQUEUE_EXIT_CODE` (42) when
        it saved a checkpoint and stopped for preemption (SIGTERM/SIGUSR1 or ``run.max_minutes``).
    """
    from launcher.data import prepare_stdlib_corpus
    from launcher.slurm import REQUEUE_EXIT_CODE
    from parallel.distributed import destroy_distributed, dist_env

    from launcher.sweep import run_sweep, split_multirun

    multirun, overrides = split_multirun(sys.argv[1:] if argv is None else argv)
    env = dist_env()
    if multirun:
        if env.launched:
            print("k2-train: error: -m (a sweep) starts one run per point itself; run it outside "
                  "torchrun/srun (or submit the points with k2-submit -m)", file=sys.stderr)
            return 2
        return run_sweep(overrides)
    try:
        cfg = load_config(overrides)
        world = env.world_size if env.launched else cfg.launch.nproc_per_node
        plan = make_plan(cfg, world)
    except ConfigError as e:
        print(f"k2-train: error: {e}", file=sys.stderr)
        return 2
    if not env.launched and world > 1:
        if cfg.data.path is None:
            prepare_stdlib_corpus(cfg.data)  # once, before the ranks start
        return _spawn_local(cfg, overrides)
    try:
        record = run(cfg, plan, env)
    finally:
        destroy_distributed()
    return REQUEUE_EXIT_CODE if record.get("preempted") else 0


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
