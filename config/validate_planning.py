"""The ``cluster`` and ``plan`` sections' checks (:mod:`k2.config.validate` runs them with every other
section's): the target cluster of ``k2-plan`` / ``k2-submit`` with the peak MFU is measured against, and
``k2-plan``'s own numbers (the sections of :mod:`k2.config.schema_planning`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from k2.config.errors import ConfigError, finite, require

if TYPE_CHECKING:
    from k2.config.schema_planning import ClusterConfig, PlanConfig


#: the ``cluster.*`` numbers that are either null or > 0, each with what its error names as allowed
_OPTIONAL_POSITIVE = (
    ("gpu_memory_gib", "a number > 0 (GiB), or null (the GPU memory of plan.hardware's profile)"),
    ("peak_tflops", "a number > 0 (dense BF16 TFLOP/s per GPU), or null (plan.hardware's profile's peak)"),
    ("cpu_peak_tflops", "a number > 0 (GEMM TFLOP/s of one CPU rank), or null (no MFU on CPU)"),
    ("host_memory_gib", "a number > 0 (GiB of host memory per node, e.g. 2048), or null (the hardware profile's)"),
    ("mtbf_hours", "hours > 0, or null (Llama 3's failure rate for the cluster's GPUs)"),
)


def check_cluster(c: ClusterConfig) -> None:
    """``cluster.*``: the target cluster of ``k2-plan`` / ``k2-submit`` and the MFU peak."""
    for key in ("nodes", "gpus_per_node"):
        if getattr(c, key) < 1:
            raise ConfigError(f"cluster.{key}={getattr(c, key)} must be an integer >= 1")
    if c.segment_nodes is not None and (c.segment_nodes < 1 or c.nodes % c.segment_nodes):
        raise ConfigError(
            f"cluster.segment_nodes={c.segment_nodes}: allowed: null or a divisor of cluster.nodes={c.nodes} "
            "(Slurm's --segment: the job's nodes come in whole segments)"
        )
    for key, allowed in _OPTIONAL_POSITIVE:
        v = getattr(c, key)
        if v is not None:
            require(finite(v) and v > 0, f"cluster.{key}", v, allowed)
    require(
        finite(c.checkpoint_write_gbps) and c.checkpoint_write_gbps > 0,
        "cluster.checkpoint_write_gbps",
        c.checkpoint_write_gbps,
        "a number > 0 (GB/s one node writes to storage)",
    )


def check_plan(p: PlanConfig) -> None:
    """``plan.*``: ``k2-plan``'s numbers."""
    require(
        finite(p.compute_efficiency) and 0 < p.compute_efficiency <= 1,
        "plan.compute_efficiency",
        p.compute_efficiency,
        "0 < value <= 1",
    )
    if p.step_time_s is not None:
        require(finite(p.step_time_s) and p.step_time_s > 0, "plan.step_time_s", p.step_time_s, "seconds > 0, or null")
    require(
        p.what_if.pipeline_flushes >= 1, "plan.what_if.pipeline_flushes", p.what_if.pipeline_flushes, "an integer >= 1"
    )
    require(p.what_if.mtp_layers >= 0, "plan.what_if.mtp_layers", p.what_if.mtp_layers, "an integer >= 0")
    if p.what_if.node_limit is not None:
        require(p.what_if.node_limit >= 1, "plan.what_if.node_limit", p.what_if.node_limit, "an integer >= 1, or null")
    o = p.gpu_overheads
    for key in ("cuda_context_gib", "nccl_gib_per_communicator", "workspace_gib"):
        v = getattr(o, key)
        require(finite(v) and v >= 0, f"plan.gpu_overheads.{key}", v, "GiB >= 0")
    require(
        finite(o.fragmentation) and 0 <= o.fragmentation < 1,
        "plan.gpu_overheads.fragmentation",
        o.fragmentation,
        "0 <= fraction < 1",
    )
