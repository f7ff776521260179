"""Hardware profiles of ``k2-plan``'s step-time model: data files with a source for every number.

``plan.hardware`` names a profile: one of ``recipes/hardware/<name>.yaml`` (``h800``, ``h100``, ``h200``) or
the path of a YAML file that ``k2-bench bench=hardware`` wrote on the machine it measured (GEMM rate by
shape, memory bandwidth, the backend's collective bandwidths). Units in the files: TFLOP/s, GB/s (1e9
bytes/s, per GPU and per direction), microseconds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from k2.config.errors import ConfigError
from k2.config.load import RECIPES_DIR
from k2.launcher.planning.kernels import KernelRates

HARDWARE_DIR = RECIPES_DIR / "hardware"

#: ``comm_stream``: how a communication stream runs beside the compute (``k2.launcher.planning.ep_overlap``):
#: ``device``, a second CUDA stream; ``host_thread``, a thread of the host process that also runs the compute
#: (``k2.parallel.comm_stream``, k2-train on CPU)
DEVICE, HOST_THREAD = "device", "host_thread"
COMM_STREAMS = (DEVICE, HOST_THREAD)

_REQUIRED = ("peak_bf16_tflops", "gemm_bf16_tflops", "attention_tflops", "memory_gbps", "nvlink_gbps",
             "nvlink_alltoall_gbps", "nvlink_collective_gbps", "network_gbps", "network_alltoall_gbps",
             "network_collective_gbps", "host_gbps")


@dataclass(frozen=True)
class HardwareProfile:
    """One device type and its node, as the step-time model reads it (file keys, same names).

    Attributes:
        name, gpu: the profile's name and the device it describes.
        gpus_per_node: devices sharing the fast intra-node links (NVLink; on a CPU machine the ranks).
        peak_bf16_tflops / peak_fp8_tflops: datasheet dense peaks (MFU is reported against the BF16 one).
        gemm_bf16_tflops / gemm_fp8_tflops: achieved GEMM ceilings (large shapes).
        gemm_fp32_tflops: achieved FP32 GEMM ceiling (CPU profiles, ``train.precision=fp32``); None = the
            BF16 figure / 2 (Hopper's TF32-less FP32 path is not modelled).
        gemm_grouped_bf16_tflops / gemm_grouped_fp8_tflops: achieved rate of grouped expert GEMMs (None =
            the dense ceiling).
        nongemm_share: the least share of the compute stream the non-GEMM kernels take (a measured
            profile's figure; 0 = the bytes-at-bandwidth estimate alone).
        attention_tflops: achieved core-attention rate (forward and backward).
        memory_gbps, memory_efficiency: memory peak and the fraction element-wise kernels reach.
        kernel_launch_us: time one kernel adds to the stream beyond its roofline time (a measured CPU
            profile: the cost of one operator of a transformer layer, ``k2-bench bench=hardware``).
        operator_us: per part (``embedding``, ``loss``, ``optimizer``) the cost of one of its operators
            where measured apart (a CPU profile: its operators move whole vocabulary-sized or parameter-
            sized tensors); a part not named costs ``kernel_launch_us``.
        microbatch_overhead_us, step_overhead_us: the training schedule's own work beyond the model's
            operators, per microbatch and virtual stage and per step (a measured CPU profile: megatron's
            forward_backward, the trainer's forward-step and loss functions, gradient finalisation;
            GPU profiles: 0, hidden behind the kernels).
        gemm_tile, compute_units: tile edge and SM count for tile / wave quantization (1 / None: off).
        nvlink_gbps, nvlink_alltoall_gbps, nvlink_collective_gbps: intra-node link peak per direction and
            what an all-to-all and a ring collective achieve on it, per GPU.
        network_gbps, network_alltoall_gbps, network_collective_gbps: the same across nodes (per GPU NIC).
        network_latency_us: per-message latency across nodes (also charged per point-to-point send).
        intra_latency_us: per-message latency inside a node (a measured CPU profile: gloo's; GPUs: 0).
        host_gbps: device <-> host copies per GPU (offload).
        comm_stream: how the EP overlap's communication stream runs (:data:`COMM_STREAMS`; default
            ``device``).
        gpu_memory_gib: memory of one device, GiB, the capacity ``k2-plan`` plans with unless
            ``cluster.gpu_memory_gib`` is set (None: not given, e.g. a CPU profile).
        sources: where the numbers come from.
    """

    name: str
    gpu: str
    gpus_per_node: int
    peak_bf16_tflops: float
    peak_fp8_tflops: float
    gemm_bf16_tflops: float
    gemm_fp8_tflops: float
    gemm_fp32_tflops: float | None
    gemm_grouped_bf16_tflops: float | None
    gemm_grouped_fp8_tflops: float | None
    nongemm_share: float
    attention_tflops: float
    memory_gbps: float
    memory_efficiency: float
    kernel_launch_us: float
    gemm_tile: int
    compute_units: int | None
    nvlink_gbps: float
    nvlink_alltoall_gbps: float
    nvlink_collective_gbps: float
    network_gbps: float
    network_alltoall_gbps: float
    network_collective_gbps: float
    network_latency_us: float
    host_gbps: float
    intra_latency_us: float
    sources: dict
    operator_us: dict = field(default_factory=dict)
    microbatch_overhead_us: float = 0.0
    step_overhead_us: float = 0.0
    comm_stream: str = DEVICE
    gpu_memory_gib: float | None = None

    def rates(self, precision: str, *, fp8_gemm: bool = False, compute_fraction: float = 1.0) -> KernelRates:
        """:class:`KernelRates` for GEMMs in ``precision`` (``bf16`` | ``fp32``; ``fp8_gemm``: FP8 GEMMs, the
        what-if of published runs), with ``compute_fraction`` of the compute units (e.g. SMs left to
        compute when others run communication kernels)."""
        if fp8_gemm:
            gemm, nbytes, grouped = self.gemm_fp8_tflops, 1.0, self.gemm_grouped_fp8_tflops
        elif precision == "fp32":
            gemm, nbytes, grouped = self.gemm_fp32_tflops or self.gemm_bf16_tflops / 2, 4.0, None
        else:
            gemm, nbytes, grouped = self.gemm_bf16_tflops, 2.0, self.gemm_grouped_bf16_tflops
        attention = self.attention_tflops if precision != "fp32" else min(self.attention_tflops, gemm)
        return KernelRates(gemm_flops=gemm * 1e12 * compute_fraction,
                           attention_flops=attention * 1e12 * compute_fraction,
                           memory_bytes=self.memory_gbps * 1e9 * self.memory_efficiency,
                           launch_s=self.kernel_launch_us * 1e-6, tile=self.gemm_tile, units=self.compute_units,
                           gemm_bytes_per_element=nbytes,
                           grouped_gemm_flops=grouped * 1e12 * compute_fraction if grouped else None)

    def part_rates(self, rates: KernelRates, part: str) -> KernelRates:
        """``rates`` with the launch cost of ``part``'s operators (:attr:`operator_us`)."""
        us = self.operator_us.get(part)
        return rates if us is None else dataclasses.replace(rates, launch_s=float(us) * 1e-6)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def available_profiles() -> list[str]:
    """Names of the profiles shipped in ``recipes/hardware/``."""
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def profile_from_dict(d: dict, origin: str) -> HardwareProfile:
    """A :class:`HardwareProfile` from a profile file's mapping.

    Raises:
        ConfigError: a required number missing or not positive, or ``comm_stream`` not one of
            :data:`COMM_STREAMS`, naming ``origin`` and the key.
    """
    for key in _REQUIRED:
        v = d.get(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"plan.hardware={origin}: '{key}' must be a number > 0 (got {v!r})")
    get = d.get
    if get("comm_stream", DEVICE) not in COMM_STREAMS:
        raise ConfigError(f"plan.hardware={origin}: 'comm_stream' is {get('comm_stream')!r}; allowed: "
                          f"{', '.join(COMM_STREAMS)}")
    return HardwareProfile(
        name=str(get("name", Path(origin).stem)), gpu=str(get("gpu", "")),
        gpus_per_node=int(get("gpus_per_node", 8)),
        peak_bf16_tflops=float(d["peak_bf16_tflops"]),
        peak_fp8_tflops=float(get("peak_fp8_tflops") or 2 * d["peak_bf16_tflops"]),
        gemm_bf16_tflops=float(d["gemm_bf16_tflops"]),
        gemm_fp8_tflops=float(get("gemm_fp8_tflops") or 2 * d["gemm_bf16_tflops"]),
        gemm_fp32_tflops=float(get("gemm_fp32_tflops")) if get("gemm_fp32_tflops") else None,
        gemm_grouped_bf16_tflops=float(get("gemm_grouped_bf16_tflops")) if get("gemm_grouped_bf16_tflops") else None,
        gemm_grouped_fp8_tflops=float(get("gemm_grouped_fp8_tflops")) if get("gemm_grouped_fp8_tflops") else None,
        nongemm_share=float(get("nongemm_share", 0.0)),
        attention_tflops=float(d["attention_tflops"]),
        memory_gbps=float(d["memory_gbps"]), memory_efficiency=float(get("memory_efficiency", 1.0)),
        kernel_launch_us=float(get("kernel_launch_us", 0.0)),
        gemm_tile=int(get("gemm_tile", 128)), compute_units=get("compute_units", 132),
        nvlink_gbps=float(d["nvlink_gbps"]), nvlink_alltoall_gbps=float(d["nvlink_alltoall_gbps"]),
        nvlink_collective_gbps=float(d["nvlink_collective_gbps"]), network_gbps=float(d["network_gbps"]),
        network_alltoall_gbps=float(d["network_alltoall_gbps"]),
        network_collective_gbps=float(d["network_collective_gbps"]),
        network_latency_us=float(get("network_latency_us", 0.0)), host_gbps=float(d["host_gbps"]),
        intra_latency_us=float(get("intra_latency_us", 0.0)),
        sources=dict(get("sources") or {}),
        operator_us={str(k): float(v) for k, v in (get("operator_us") or {}).items()},
        microbatch_overhead_us=float(get("microbatch_overhead_us", 0.0)),
        step_overhead_us=float(get("step_overhead_us", 0.0)),
        comm_stream=str(get("comm_stream", DEVICE)),
        gpu_memory_gib=float(get("gpu_memory_gib")) if get("gpu_memory_gib") else None,
    )


def load_profile(name_or_path: str) -> HardwareProfile:
    """The profile ``plan.hardware`` names: a shipped one by name, or a YAML file by path.

    Raises:
        ConfigError: neither a shipped name nor a readable YAML mapping, naming ``plan.hardware`` and the
            allowed names.
    """
    name = str(name_or_path)
    path = HARDWARE_DIR / f"{name}.yaml" if "/" not in name and not name.endswith(".yaml") else Path(name)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"plan.hardware={name!r}: not a profile (allowed: {', '.join(available_profiles())}, "
                          f"or the path of a YAML file k2-bench bench=hardware wrote; {e.__class__.__name__})"
                          ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"plan.hardware={name!r}: the file holds no mapping of profile keys")
    return profile_from_dict(data, name)
