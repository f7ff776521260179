"""Activation bytes per GPU before a job runs: what one microbatch's forward keeps for its backward on each
virtual stage, on the GPU and offloaded to host memory, with the ``memory.*`` switches (FP8 storage,
recompute, offload). (The training state, the other part of GPU memory, is :mod:`k2.launcher.planning.memory`.)

Per layer the saved tensors come from :func:`k2.launcher.planning.activation_bytes.layer_saved` (the whole-layer
recompute keeps :func:`~k2.launcher.planning.activation_bytes.layer_recompute_saved` instead), the embedding and
the loss from :func:`~k2.launcher.planning.activation_bytes.stage_saved`, the switches from
:func:`~k2.launcher.planning.activation_bytes.apply_switches`. :func:`stage_activations` sums them per virtual
stage; what the pipeline holds of them is :func:`k2.launcher.planning.pipeline_sim.simulate`'s, which tracks, per
PP rank, the activations of every (model chunk, microbatch) from the end of its forward to the end of its backward
and reports the peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

from k2.launcher.planning.activation_bytes import apply_switches, layer_recompute_saved, layer_saved, stage_saved
from k2.launcher.planning.host_pinned import pinned_block_bytes
from k2.model.build import moe_layer_pattern

if TYPE_CHECKING:
    from k2.config.schema import MemoryConfig, ModelConfig

__all__ = ["StageActivations", "stage_activations"]


@dataclass(frozen=True)
class StageActivations:
    """Activation bytes of one microbatch on one virtual stage.

    Attributes:
        gpu: bytes kept on the GPU for the backward: saved tensors after FP8 storage / recompute /
            offload, plus, when ``attn_input`` is offloaded, the stage's received input, which megatron's
            schedule keeps until the backward (the stage's output it frees once sent:
            ``deallocate_pipeline_outputs``, on in ``k2-train``).
        host: bytes offloaded to host memory.
        offload_staging: the largest offloaded bytes of one layer of the stage (a layer's tensors are on
            the GPU while they are copied out or back in).
        recompute_working: with whole-layer recompute (``memory.recompute`` site ``layer``), the bytes
            one layer's re-run holds during its backward (the largest layer of the stage); else 0.
        layer_gpu_max: the GPU bytes of the stage's largest layer (what a combined 1F1B pair holds beyond
            its microbatches: :func:`k2.launcher.planning.pipeline_sim.simulate`'s ``pair_transient_bytes``).
        host_pinned: ``host`` as pinned buffers hold it on a GPU (one per offloaded tensor,
            :func:`k2.launcher.planning.host_pinned.pinned_block_bytes`).
    """

    gpu: float
    host: float
    offload_staging: float
    recompute_working: float = 0.0
    host_pinned: float = 0.0
    layer_gpu_max: float = 0.0


def stage_activations(
    model_cfg: ModelConfig,
    dims,
    *,
    seq_length: int,
    micro_batch_size: int,
    precision: str,
    memory_cfg: MemoryConfig | dict | None = None,
    fused_kernels: bool = True,
) -> list[StageActivations]:
    """Per virtual stage (pipeline order ``vpp_stage * pp + pp_rank``) the activation bytes of one microbatch.

    Args:
        model_cfg: ``cfg.model``.
        dims: :class:`k2.parallel.dims.ParallelDims`.
        seq_length, micro_batch_size: the microbatch (tokens per sequence, sequences).
        precision: ``train.precision``.
        memory_cfg: ``cfg.memory`` (``fp8_store`` / ``recompute`` / ``offload`` site lists) or None (off).
        fused_kernels: GPU kernels (fused RMSNorm, SDPA); False = the CPU proxy's composite ones.

    Raises:
        ValueError: an unknown ``memory.*`` site.
    """

    sw = _switches(memory_cfg)
    pattern = moe_layer_pattern(model_cfg)
    per_kind, working, pinned = {}, {}, {}
    whole_layer = "layer" in sw["recompute"]
    for kind in set(pattern):
        saved = layer_saved(model_cfg, bool(kind), seq_length, micro_batch_size, precision, fused_kernels)
        if whole_layer:  # the layer input alone; the re-run in backward holds the rest, unswitched
            kept = layer_recompute_saved(model_cfg, seq_length, micro_batch_size, precision)
            per_kind[kind] = apply_switches(kept, offload=sw["offload"])
            pinned[kind] = apply_switches(kept, offload=sw["offload"], host_block=pinned_block_bytes)[1]
            # the re-run: FP8 storage and the selective recompute sites act, offload does not
            working[kind] = apply_switches(
                saved, fp8_store=sw["fp8_store"], recompute=[x for x in sw["recompute"] if x != "layer"]
            )[0]
        else:
            per_kind[kind] = apply_switches(saved, **sw)
            pinned[kind] = apply_switches(saved, **sw, host_block=pinned_block_bytes)[1]
    B = 2 if precision == "bf16" else 4
    hidden_bytes = seq_length * micro_batch_size * int(model_cfg.hidden_size) * B
    out = []
    for v in range(dims.vpp):
        for r in range(dims.pp):
            emb, loss = dims.stage_has_embedding(r, v), dims.stage_has_loss(r, v)
            ends = stage_saved(model_cfg, seq_length, micro_batch_size, precision, fused_kernels, emb, loss)
            gpu, host = apply_switches(ends, **sw)
            host_pinned = apply_switches(ends, **sw, host_block=pinned_block_bytes)[1]
            staging = rerun = largest = 0.0
            for i in dims.stage_layers[r][v]:
                g, h = per_kind[pattern[i]]
                gpu, host, staging, largest = gpu + g, host + h, max(staging, h), max(largest, g)
                host_pinned += pinned[pattern[i]]
                rerun = max(rerun, working.get(pattern[i], 0.0))
            # the stage's output is not counted: megatron's schedule frees its data once it is sent
            # (deallocate_pipeline_outputs, on in k2-train as in Megatron-LM's training)
            if not emb and "attn_input" in sw["offload"]:
                gpu += hidden_bytes  # the received input stays in the schedule's list though offloaded
            # TP with sequence parallelism splits every saved tensor over the TP ranks (Korthikanti et al.,
            # arXiv 2205.05198, table 2: 34 s b h / t + 5 a s^2 b / t per layer; with expert TP 1 a rank's
            # routed tokens are T k / t)
            t = dims.tp
            out.append(StageActivations(gpu / t, host / t, staging / t, rerun / t, host_pinned / t, largest / t))
    return out


class _Switches(TypedDict):
    """The ``memory.*`` site lists, the keywords of :func:`~k2.launcher.planning.activation_bytes.apply_switches`."""

    fp8_store: list[str]
    recompute: list[str]
    offload: list[str]


def _switches(memory_cfg: MemoryConfig | dict | None) -> _Switches:
    """The site lists of ``memory_cfg`` (``cfg.memory`` or a mapping of its lists); empty where unset or None."""

    def sites(key: str) -> list[str]:
        if memory_cfg is None:
            return []
        return list((memory_cfg[key] if isinstance(memory_cfg, dict) else getattr(memory_cfg, key)) or [])

    return _Switches(fp8_store=sites("fp8_store"), recompute=sites("recompute"), offload=sites("offload"))
