"""Process groups, DDP wrapping and the ZeRO-1 distributed optimizer, all megatron-core's.

Order of use (one direction): :func:`dist_env` (who am I: torchrun or Slurm variables) ->
:func:`init_distributed` (torch.distributed + megatron ``parallel_state`` for a validated
``ParallelDims``) -> :func:`wrap_model` (megatron DDP with contiguous grad buffers) ->
:func:`k2.optim.build.build_optimizer` (megatron's distributed optimizer = ZeRO-1 over DP; its LR and
weight decay per step come from ``k2.schedules.lr.TokenLRScheduler``).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

from k2.parallel import cpu_backend
from k2.parallel.rendezvous import rendezvous


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job (from torchrun's or Slurm's environment)."""

    rank: int
    world_size: int
    local_rank: int
    launched: bool  # True when under torchrun/srun (RANK or SLURM_PROCID present)
    local_world_size: int = 1  # ranks on this node (LOCAL_WORLD_SIZE; Slurm: this node's task count)

    @property
    def spawned_by_k2_train(self) -> bool:
        """True for ranks that ``k2-train`` spawned itself (it already prepared the data)."""
        return os.environ.get("K2_SPAWNED") == "1"


def dist_env() -> DistEnv:
    """Read rank / world size from torchrun (``RANK``...) or Slurm (``SLURM_PROCID``...) variables.

    Under Slurm without torchrun, ``MASTER_ADDR`` must be exported by the sbatch script (see
    ``slurm/k2_train.sbatch``); ``MASTER_PORT`` defaults to 29500.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return DistEnv(
            int(os.environ["RANK"]),
            int(os.environ["WORLD_SIZE"]),
            int(os.environ.get("LOCAL_RANK", 0)),
            True,
            int(os.environ.get("LOCAL_WORLD_SIZE") or _slurm_tasks_on_this_node() or 1),
        )
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:
        env = DistEnv(
            int(os.environ["SLURM_PROCID"]),
            int(os.environ["SLURM_NTASKS"]),
            int(os.environ.get("SLURM_LOCALID", 0)),
            True,
            _slurm_tasks_on_this_node() or 1,
        )
        os.environ.setdefault("RANK", str(env.rank))
        os.environ.setdefault("WORLD_SIZE", str(env.world_size))
        os.environ.setdefault("LOCAL_RANK", str(env.local_rank))
        os.environ.setdefault("MASTER_PORT", "29500")
        return env
    return DistEnv(0, 1, 0, False)


def _slurm_tasks_on_this_node() -> int:
    """This node's task count from Slurm's ``SLURM_STEP_TASKS_PER_NODE`` (or ``SLURM_TASKS_PER_NODE``),
    e.g. ``8(x4)`` or ``2,1``, at ``SLURM_NODEID``; 0 when not under Slurm or unreadable."""
    spec = os.environ.get("SLURM_STEP_TASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return 0
    counts = []
    for part in spec.split(","):
        n, _, times = part.partition("(x")
        try:
            counts += [int(n)] * (int(times.rstrip(")")) if times else 1)
        except ValueError:
            return 0
    node = int(os.environ.get("SLURM_NODEID", 0))
    return counts[node] if node < len(counts) else 0


def local_device_index(local_rank: int, local_world_size: int, visible: int, position=None) -> int:
    """The CUDA device (index among this process's visible ones) of a rank.

    * one GPU visible: it (the launcher bound one GPU to each rank: ``srun --gpus-per-task=1``,
      ``--gpu-bind=single:1``, or ``CUDA_VISIBLE_DEVICES`` per rank);
    * at least as many visible as ranks on the node: the one at ``local_rank`` (every rank sees the
      node's GPUs: torchrun, ``k2-train``'s own ranks, ``--gpu-bind=none``);
    * a subset of several (``srun --gpu-bind=closest``: the GPUs of the rank's socket): the one at
      ``position``, the rank's place among the node's ranks that see the same devices
      (:func:`_gpu_position`). ``local_rank`` modulo the count, used before, puts two ranks on one GPU
      when the ranks are dealt to the sockets round-robin.

    Raises:
        ConfigError: a subset without a ``position`` (no rendezvous store), more ranks on a subset than it
            has GPUs, or no GPU visible.
    """
    from k2.config import ConfigError

    if visible == 1:
        return 0
    if visible >= local_world_size and 0 <= local_rank < visible:
        return local_rank
    if position is not None and 0 <= position < visible:
        return position
    raise ConfigError(
        f"local rank {local_rank} of {local_world_size} ranks on this node sees {visible} CUDA devices "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
        + (f", shared with {position} lower local ranks" if position is not None else "")
        + ": each rank needs one GPU of its own; allowed: one GPU bound per rank (srun --gpus-per-task=1 or "
        "--gpu-bind=single:1), a binding that gives each GPU of a rank's set to one rank (--gpu-bind=closest "
        "with as many ranks as GPUs per socket), or all of the node's GPUs visible to every rank "
        "(--gpu-bind=none, torchrun)"
    )


def _gpu_position(store, env: DistEnv) -> int:
    """This rank's place among the lower local ranks of its node that see the same ``CUDA_VISIBLE_DEVICES``
    (exchanged through the rendezvous ``store``; waits for those ranks' keys)."""
    from k2.parallel.rendezvous import node_name

    mine = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    prefix = f"k2/gpus/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{node_name()}/"
    store.set(prefix + str(env.local_rank), mine)
    lower = [prefix + str(r) for r in range(env.local_rank)]
    if lower:
        store.wait(lower)
    return sum(store.get(k).decode() == mine for k in lower)


def _cuda_device(env: DistEnv, store=None):
    """This rank's CUDA device, made current (:func:`local_device_index`; ``store``: the rendezvous store,
    for a rank that sees a subset of its node's GPUs); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    visible = torch.cuda.device_count()
    position = _gpu_position(store, env) if store is not None and 1 < visible < env.local_world_size else None
    device = torch.device("cuda", local_device_index(env.local_rank, env.local_world_size, visible, position))
    torch.cuda.set_device(device)
    return device


def init_distributed(env: DistEnv, dims, seed: int, timeout_s: int = 600, rendezvous_timeout_s: float = 600) -> None:
    """Initialise torch.distributed (gloo on CPU, NCCL on GPU) and megatron's parallel_state.

    Args:
        env: from :func:`dist_env`.
        dims: a validated :class:`k2.parallel.dims.ParallelDims`.
        seed: base seed; megatron derives its TP/EP/data-parallel RNG-tracker streams from it.
        timeout_s: every process group's timeout (seconds a collective may wait for a peer): the default
            group's and that of each group megatron creates (PP, EP, DP, model-parallel, ...; megatron's
            own default for those is ``distributed_timeout_minutes=30``). One value for all, so the hang
            watchdog, whose allowance stays below it, ends a hang before any NCCL group aborts the
            process (NCCL's async error handling kills it: no requeue exit, no marker).
        rendezvous_timeout_s: seconds every rank of a launched job waits for the others to arrive
            (:func:`k2.parallel.rendezvous.rendezvous`, ``launch.rendezvous_timeout_s``).

    Raises:
        k2.parallel.rendezvous.RendezvousTimeout: not every rank arrived in time (names the missing
            ranks and nodes).
        k2.config.ConfigError: the GPUs this rank sees do not tell which one is its own
            (:func:`local_device_index`).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    cpu_backend.enable()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if not env.launched:  # a lone process: any free port (several local runs may coexist)
            from k2.parallel.processes import free_port

            os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.setdefault("MASTER_PORT", "29500")
        store = None
        if env.launched and env.world_size > 1:
            store = rendezvous(env.rank, env.world_size, rendezvous_timeout_s, timeout_s)
        device = _cuda_device(env, store)
        dist.init_process_group(
            backend="nccl" if device is not None else "gloo",
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            store=store,
            # NCCL: the communicator is bound to this rank's GPU and created now, not guessed from the
            # current device at the first collective (torch warns about the guess and may pick wrong)
            device_id=device,
        )
    else:  # (a process group made by the caller: the device is still this rank's own)
        _cuda_device(env)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp if dims.vpp > 1 else None,
        expert_model_parallel_size=dims.ep,
        distributed_timeout_minutes=timeout_s / 60,  # (megatron passes it to timedelta(minutes=...))
    )
    # megatron-core 0.19.2 creates its expert-DP gloo group without a timeout (torch's 30 min default):
    # megatron's own setter gives every group it created the run's timeout (a barrier first)
    ps.update_pg_timeout(datetime.timedelta(seconds=timeout_s))
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    from megatron.core.rerun_state_machine import RerunMode, initialize_rerun_state_machine

    initialize_rerun_state_machine(mode=RerunMode.DISABLED)  # explicit: no "implicit init" warning


def all_reduce_int(value: int, op: str = "max") -> int:
    """Collective: ``value`` reduced over the default process group (``op``: ``"max"`` or ``"sum"``);
    ``value`` itself without a group of more than one rank. The tensor lives on the current CUDA device
    when there is one (NCCL reduces device tensors only), else on the host (gloo)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return int(value)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    t = torch.tensor([int(value)], dtype=torch.int64, device=dev)
    dist.all_reduce(t, op={"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}[op])
    return int(t.item())


def destroy_distributed() -> None:
    """Tear down megatron's parallel_state and the default process group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def ddp_config(use_distributed_optimizer: bool, delay_wgrad_compute: bool = False):
    """megatron ``DistributedDataParallelConfig`` of ``k2-train`` (also what ``k2-plan`` lays the buffers out
    with, launcher/planning/memory.py): FP32 gradient buffers, ZeRO-1 over DP with ``use_distributed_optimizer``,
    no overlapped gradient reduction (so one bucket per buffer); ``delay_wgrad_compute`` for
    ``pipeline.decouple_wgrad`` (model/wgrad.py)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
        # off: the trainer checks each step's loss and global gradient norm itself and stops with the
        # step, its LR and the last checkpoint (k2.launcher.training.step.check_finite); megatron's check
        # fails inside the pipeline schedule, naming neither
        check_for_nan_in_grad=False,
        delay_wgrad_compute=delay_wgrad_compute,
    )


def wrap_model(
    chunks: list, tcfg, use_distributed_optimizer: bool, layer_wise: bool = False, delay_wgrad_compute: bool = False
) -> list:
    """Wrap each model chunk in megatron's DDP (fp32 contiguous grad buffers, reduce-scatter for
    ZeRO-1). bf16 chunks go through megatron's ``Float16Module`` first.

    Args:
        chunks: this rank's model chunks.
        tcfg: megatron ``TransformerConfig``.
        use_distributed_optimizer: ZeRO-1 (``k2.parallel.use_distributed_optimizer``).
        layer_wise: lay the grad/param buffers out for megatron's layer-wise distributed optimizer
            (MuonClip under ZeRO-1, :mod:`k2.optim.build`): the parameters tagged
            ``is_managed_by_layer_wise_optimizer`` (by :func:`k2.optim.params.tag_parameters`) are
            bin-packed whole into the DP shards, so no matrix straddles a shard boundary; the others
            keep the byte-range layout.
        delay_wgrad_compute: megatron DDP registers the grad-ready hooks of parameters marked
            ``skip_backward_post_hook`` on their module (``register_wgrad_accumulation_and_reduce_hooks``)
            instead of on autograd's accumulator; set when :func:`k2.model.wgrad.decouple_linear_wgrad`
            split the chunks' linear layers (``pipeline.decouple_wgrad``).

    Returns:
        ``list[megatron.core.distributed.DistributedDataParallel]``, one per chunk.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
    from megatron.core.transformer.module import Float16Module

    ddp_cfg = ddp_config(use_distributed_optimizer, delay_wgrad_compute)
    out = []
    for i, chunk in enumerate(chunks):
        if tcfg.bf16:
            chunk = Float16Module(tcfg, chunk)
        layout = None
        if layer_wise and use_distributed_optimizer:
            # bucket_size None: overlap_grad_reduce is off, so DDP uses one bucket per buffer
            layout = LayerWiseDistributedOptimizer.compute_full_param_layout(
                [p for p in chunk.parameters() if p.requires_grad],
                None,
                ps.get_data_parallel_world_size(with_context_parallel=True),
                ddp_cfg,
                expert_data_parallel_world_size=ps.get_expert_data_parallel_world_size(),
            )
        out.append(
            DistributedDataParallel(
                config=tcfg,
                ddp_config=ddp_cfg,
                module=chunk,
                disable_bucketing=(i > 0),
                full_param_layout=layout,
            )
        )
    return out
