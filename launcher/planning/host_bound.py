"""The ``host`` term of ``k2-plan``'s step-time model: the time the GPU waits for the CPU that issues its work.

An eager PyTorch step (megatron-core, no CUDA graphs) runs every operator on one host thread: megatron's
module code, torch's dispatcher, autograd's bookkeeping and the allocator, then the CUDA launch call; the
GPU runs the kernels asynchronously, so the host may run ahead of the GPU, and its time is hidden, until it
has to wait for a result. megatron-core's dropless MoE dispatchers make it wait once in every MoE layer's
forward: the ``alltoall`` dispatcher copies the token counts per expert (the all-to-all's split sizes) to
the host and synchronises with that copy before the all-to-all (megatron-core 0.19.2
``transformer/moe/token_dispatcher.py``: ``MoEAlltoAllTokenDispatcher.preprocess`` sets ``cuda_sync_point``
``before_ep_alltoall``, ``_maybe_dtoh_and_synchronize`` calls ``d2h_event.synchronize()``;
``before_permutation_1`` with token dropping, ``before_finish`` / ``before_permutation_2`` without EP; only
``moe_pad_expert_input_to_capacity`` runs without a sync), and Transformer Engine's ``GroupedLinear`` takes
the per-expert token counts as a host list (``m_splits``). The backward reuses the split sizes already on
the host: it does not wait. A whole-layer or ``moe`` recompute runs the dispatcher's forward again, with
its wait, inside the backward.

Rule (per virtual stage and microbatch, seconds): between two waits the host issues ``H`` seconds of
operators and the GPU runs ``G`` seconds of kernels, starting together (the wait drained the queue), so
that stretch takes ``max(H, G)``. The forward waits once per MoE layer: ``sum over its MoE layers of
max(H_F, G_F)``, plus ``max(H, G)`` over what has no wait (dense layers, embedding, loss); the backward
(input and weight gradients) is one stretch, ``max(H_B, G_B)`` over the stage, or per MoE layer when a
recompute site waits in it (``layer``, ``moe``). The term is what this adds to the GPU's time:
``sum of max(H, G) - G``, 0 wherever each stretch's GPU work exceeds its host work (large GEMMs per
kernel), so it vanishes for the large microbatches and grouped GEMMs of most runs.

``H`` of a part = its operators (:func:`k2.launcher.planning.operator_counts.modelled_operators`, counted on
k2-train's megatron-core modules, forward and backward apart) x the profile's ``host_forward_operator_us``
/ ``host_backward_operator_us`` (the host's own time per operator of megatron-core's layer code, measured
by ``k2-bench bench=hardware``'s sibling ``bench=host_cost`` on a CPU running the same Python, dispatcher
and modules: :mod:`k2.launcher.benchmarks.host_cost`), plus the CUDA launch call of each of its
kernel-launching operators (:data:`KERNEL_SHARE` of them) at the profile's ``kernel_launch_us``. What this
leaves out: Transformer Engine's modules issue fewer, fused operators with more Python each than
megatron's local modules counted here; the TP collectives' and the pipeline's own host calls; a host CPU
other than the one measured (no published single-thread figure relates a Grace CPU to an x86 host for this
work, so every profile takes the one measured figure). Full-iteration CUDA graphs (the
``plan.what_if.cuda_graphs`` setting) replay the step without the host: no term.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from k2.launcher.planning.operator_counts import modelled_operators

if TYPE_CHECKING:
    from k2.config.schema import ModelConfig
    from k2.launcher.planning.hardware import HardwareProfile
    from k2.launcher.planning.stage_model import StageModel

__all__ = [
    "EXPERT_GEMM_LAUNCHES",
    "HOST_TERM",
    "KERNEL_SHARE",
    "SYNC_RECOMPUTE",
    "add_host_term",
    "host_seconds",
    "exposed",
]

HOST_TERM = "host"
#: the share of the counted operators that launch a kernel on a GPU (the rest are views: metadata only),
#: forward / backward: ``k2-bench bench=host_cost`` counts them on k2-train's MoE and dense layers
#: (torch's ``OpOverload.is_view``): 264 of 472 forward, 407 of 714 backward (0.56, 0.57)
KERNEL_SHARE = (0.56, 0.57)
#: GEMM launches of one local expert in the forward / the backward (fc1 and fc2: one forward GEMM each, an
#: input- and a weight-gradient GEMM each)
EXPERT_GEMM_LAUNCHES = (2, 4)
#: ``memory.recompute`` sites that run a MoE layer's dispatcher again in the backward, with its wait
SYNC_RECOMPUTE = ("layer", "moe")


def host_seconds(ops: tuple[float, float], profile: HardwareProfile) -> tuple[float, float]:
    """Host seconds to issue ``ops`` (forward, backward) operators: each costs the profile's
    ``host_forward_operator_us`` / ``host_backward_operator_us`` and, for :data:`KERNEL_SHARE` of them,
    a CUDA launch call of ``kernel_launch_us``."""
    launch = profile.kernel_launch_us
    forward = ops[0] * (profile.host_forward_operator_us + KERNEL_SHARE[0] * launch) * 1e-6
    backward = ops[1] * (profile.host_backward_operator_us + KERNEL_SHARE[1] * launch) * 1e-6
    return forward, backward


def exposed(host_s: float, gpu_s: float) -> float:
    """What one stretch between two waits adds to the GPU's ``gpu_s``: ``max(host, gpu) - gpu``."""
    return max(0.0, host_s - gpu_s)


def _part_seconds(model: StageModel, model_cfg: ModelConfig, part: str, profile: HardwareProfile) -> tuple:
    """Host seconds of ``part``'s forward and backward (recompute left out): its operators with the experts
    as one module call (megatron's ``TEGroupedMLP``: Transformer Engine's ``GroupedLinear`` for each of the
    two expert linears), and where the experts are not one grouped GEMM (``model.moe_grouped_gemm`` false:
    TE runs one cuBLAS GEMM per local expert from its C++ loop) each local expert's GEMM launches beyond the
    one counted: :data:`EXPERT_GEMM_LAUNCHES` per expert at ``kernel_launch_us``."""
    f, b = host_seconds(modelled_operators(model_cfg, part, 0), profile)
    if part == "moe_layer" and not model.grouped:
        extra = max(1, model.s["E"] // model.dims.ep) - 1
        f += extra * EXPERT_GEMM_LAUNCHES[0] * profile.kernel_launch_us * 1e-6
        b += extra * EXPERT_GEMM_LAUNCHES[1] * profile.kernel_launch_us * 1e-6
    return f, b


def _gpu(part: dict) -> tuple[float, float]:
    """GPU seconds of a part's forward and of its backward (input + weight gradients)."""
    return sum(part["F"].values()), sum(part["B"].values()) + sum(part["W"].values())


def add_host_term(
    stages: list[dict], model: StageModel, model_cfg: ModelConfig, dims, profile: HardwareProfile, cuda_graphs: bool
) -> None:
    """The ``host`` term (module docstring) into each virtual stage's ``F`` and ``B`` (index ``v * pp +
    rank``, as :func:`k2.launcher.planning.step_time.compute_terms` builds them); nothing where the profile
    gives no host cost (a measured CPU profile: its operators' cost is already the compute) or under
    full-iteration CUDA graphs."""
    if cuda_graphs or (profile.host_forward_operator_us <= 0 and profile.host_backward_operator_us <= 0):
        return
    recompute = model.recompute
    cache: dict = {}

    def part(key, build, ops_part):
        if key not in cache:
            p = build()
            h_f, h_b = _part_seconds(model, model_cfg, ops_part, profile)
            if "layer" in recompute and ops_part in ("moe_layer", "dense_layer"):
                h_b += h_f  # the whole forward again in the backward
            elif "moe" in recompute and ops_part == "moe_layer":
                h_b += h_f - _part_seconds(model, model_cfg, "dense_layer", profile)[0]  # (its MoE part)
            cache[key] = (h_f, h_b, *_gpu(p))
        return cache[key]

    waits_in_backward = bool(recompute & set(SYNC_RECOMPUTE))
    for v in range(dims.vpp):
        for r in range(dims.pp):
            segments = []  # (waits, host F, host B, GPU F, GPU B)
            for i in dims.stage_layers[r][v]:
                moe = bool(model.fl.moe_pattern[i])
                kind = "moe_layer" if moe else "dense_layer"
                segments.append((moe, *part(("layer", moe), lambda i=i: model.layer(i), kind)))
            if dims.stage_has_embedding(r, v):
                segments.append((False, *part("embedding", model.embedding, "embedding")))
            if dims.stage_has_loss(r, v):
                segments.append((False, *part("loss", model.loss, "loss")))
                for _ in range(model.wi.mtp_layers):  # an MTP module: one MoE block and the head again
                    h = part(("layer", True), lambda: model.layer(_first_moe(model)), "moe_layer")
                    segments.append((True, *h))
                    segments.append((False, *part("loss", model.loss, "loss")))
            stage = stages[v * dims.pp + r]
            stage["F"][HOST_TERM] = _stretches(segments, 1, 3, lambda s: s[0])
            stage["B"][HOST_TERM] = _stretches(segments, 2, 4, lambda s: s[0] and waits_in_backward)


def _stretches(segments: list[tuple], host_at: int, gpu_at: int, waits) -> float:
    """The host's exposed seconds of one pass: each waiting segment its own stretch, the rest pooled."""
    alone = sum(exposed(s[host_at], s[gpu_at]) for s in segments if waits(s))
    rest = [s for s in segments if not waits(s)]
    return alone + exposed(sum(s[host_at] for s in rest), sum(s[gpu_at] for s in rest))


def _first_moe(model: StageModel) -> int:
    moe = [i for i, x in enumerate(model.fl.moe_pattern) if x]
    return moe[0] if moe else 0
