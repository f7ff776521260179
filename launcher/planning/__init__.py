"""The planner: what a config costs on a cluster -- memory per GPU and per node, the pipeline bubble, the
step time and its terms, FLOPs and MFU, the ranked layouts -- computed without a GPU or a process group.

**One entry point.** Everything outside this package imports the planner from here, never from its
modules: ``k2-plan`` (:mod:`k2.launcher.plan`), the benchmarks that compare it with measurement, and
``k2-train``'s checks before its ranks start. The plan itself is one function, :func:`plan_cluster`
(``cfg`` -> :class:`ClusterPlan`: the JSON record, the resolved training schedule, the simulated
pipeline); ``plan.search=true`` adds the ranked layouts to it, ``plan.published=...`` runs it on each
published run (:func:`compare_published`), and ``k2-bench bench=ep_overlap`` runs it with the overlap on
and off (:func:`predict_ep_overlap`). The names below are resolved when first used, so that the
config-only check :func:`offloads_anything` does not import the model (megatron-core, several
CPU-seconds).

**Names** (one meaning each in this package):

* *layout*: a parallel layout -- the PP / VPP / EP / DP sizes of a world and the decoder layers each
  (PP rank, virtual stage) builds (:class:`k2.parallel.dims.ParallelDims`), as ``analysis`` plans one
  and ``search`` ranks them. The placement of the layers alone is the *layer layout*: megatron's
  ``pipeline_model_parallel_layout`` string (``parallel.layout``, the report's ``layout`` key); how
  megatron lays parameters out in its gradient buffers is its *param layout* (``memory``).
* *schedule*: the training schedule in tokens (the ``schedule`` config group: phases, LR, batch;
  :class:`k2.schedules.wsd.Schedule`). Megatron's order of forwards and backwards is always qualified:
  the *pipeline schedule* (1F1B, interleaved, combined; simulated by ``pipeline_sim``). The step-time
  term keyed ``schedule`` in the record (an output key, kept) is the CPU work of the pipeline schedule
  and of the step functions (``schedule_work`` in the code).
* *memory*: bytes held on a device, GPU or pinned host memory. The ``memory.*`` config group
  (recompute, offload, FP8 storage) is the *memory settings* (``phase_settings``).

**Modules**, one role each:

* the plan: ``cluster`` (:func:`plan_cluster`), ``report`` (its text tables), ``published`` (the
  step-time model against published runs), ``overlap_prediction`` (``pipeline.ep_overlap`` on and off);
* one layout: ``analysis`` (every phase of one layout: bubble, step time, memory, fit), ``search``
  (every valid layout of a cluster, ranked);
* the step time: ``step_time`` (the outline and the pipeline), ``stage_terms`` (the per-stage terms),
  ``after_pipeline`` (DP traffic and the optimizer), ``stage_model`` (one layer's costs), ``operator_counts``
  (operators per part), ``kernels`` (one kernel's seconds), ``comm`` (one collective's seconds),
  ``ep_overlap`` (megatron's combined 1F1B), ``optimizer_time``, ``pipeline_sim`` (the pipeline schedule
  simulated; its event loop: ``pipeline_events``), ``what_if`` (published runs' settings), ``hardware``
  (profiles), ``trace_rates`` (FP8 rates from a published trace);
* memory: ``memory`` (training state per GPU), ``chunk_params`` (each model chunk's parameters as megatron
  lays them out), ``stage_activations`` (activations per virtual stage), ``activation_bytes`` (what one layer
  saves), ``device_memory`` (the fullest GPU, every term), ``host_pinned`` (pinned host blocks),
  ``phase_settings`` (the memory settings of each phase), ``checkpoint`` (checkpoint bytes, save times
  and interval).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from k2.launcher.planning.analysis import check_host_memory
    from k2.launcher.planning.cluster import ClusterPlan, plan_cluster
    from k2.launcher.planning.kernels import KernelRates, gemm_seconds
    from k2.launcher.planning.operator_counts import modelled_operators
    from k2.launcher.planning.overlap_prediction import predict_ep_overlap
    from k2.launcher.planning.phase_settings import offloads_anything
    from k2.launcher.planning.pipeline_sim import plot_timeline
    from k2.launcher.planning.published import compare_published, format_published
    from k2.launcher.planning.report import format_text

#: the public names -> the module that defines them
_ENTRY = {
    "plan_cluster": "cluster",
    "ClusterPlan": "cluster",
    "format_text": "report",
    "compare_published": "published",
    "format_published": "published",
    "plot_timeline": "pipeline_sim",
    "predict_ep_overlap": "overlap_prediction",
    "check_host_memory": "analysis",
    "offloads_anything": "phase_settings",
    "modelled_operators": "operator_counts",
    "KernelRates": "kernels",
    "gemm_seconds": "kernels",
}

__all__ = sorted(_ENTRY)


def __getattr__(name: str) -> Any:
    """A public name of the planner, imported from its module on first use (PEP 562)."""
    if name not in _ENTRY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_ENTRY[name]}"), name)
