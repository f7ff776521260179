"""Hardware profiles of ``k2-plan``'s step-time model: data files with a source for every number.

``plan.hardware`` names a profile: one of ``recipes/hardware/<name>.yaml`` (``h800``, ``h100``, ``h200``, ``b200``,
``b300``, ``gb200_nvl72``, ``gb300_nvl72``) or
the path of a YAML file that ``k2-bench bench=hardware`` wrote on the machine it measured (GEMM rate by
shape, memory bandwidth, the backend's collective bandwidths). The file's keys, their units (TFLOP/s, GB/s
= 1e9 bytes/s per GPU and per direction, microseconds) and its reading are the config's
(:mod:`k2.config.schema_hardware`, :mod:`k2.config.hardware`); here the profile gains the kernel rates
the model prices work with.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

from k2.config.hardware import HARDWARE_DIR, available_profiles, hardware_profile_from_mapping, load_hardware_profile
from k2.config.schema_hardware import CommStream, HardwareProfileConfig
from k2.launcher.planning.kernels import KernelRates

__all__ = [
    "COMM_STREAMS",
    "DEVICE",
    "HARDWARE_DIR",
    "HOST_THREAD",
    "HardwareProfile",
    "available_profiles",
    "load_profile",
    "profile_from_dict",
]

#: ``comm_stream``'s values (:class:`k2.config.schema_hardware.CommStream`)
DEVICE, HOST_THREAD = CommStream.device, CommStream.host_thread
COMM_STREAMS = tuple(CommStream)


@dataclass
class HardwareProfile(HardwareProfileConfig):
    """A read profile (:class:`k2.config.schema_hardware.HardwareProfileConfig`: its fields, units and
    defaults) with the kernel rates of :mod:`k2.launcher.planning.kernels` it gives."""

    def rates(self, precision: str, *, fp8: bool = False, compute_fraction: float = 1.0) -> KernelRates:
        """:class:`KernelRates` for GEMMs in ``precision`` (``bf16`` | ``fp32``; ``fp8``: FP8 GEMMs,
        ``train.fp8_recipe``: the profile's FP8 rates, which Blackwell's MXFP8 and Hopper's blockwise scaling
        both run at), with ``compute_fraction`` of the compute units (e.g. SMs left to compute when others
        run communication kernels)."""
        if fp8:
            gemm, nbytes, grouped = self.gemm_fp8_tflops, 1.0, self.gemm_grouped_fp8_tflops
        elif precision == "fp32":
            gemm, nbytes, grouped = self.gemm_fp32_tflops or self.gemm_bf16_tflops / 2, 4.0, None
        else:
            gemm, nbytes, grouped = self.gemm_bf16_tflops, 2.0, self.gemm_grouped_bf16_tflops
        attention = self.attention_tflops if precision != "fp32" else min(self.attention_tflops, gemm)
        return KernelRates(
            gemm_flops=gemm * 1e12 * compute_fraction,
            attention_flops=attention * 1e12 * compute_fraction,
            memory_bytes=self.memory_gbps * 1e9 * self.memory_efficiency,
            launch_s=self.kernel_launch_us * 1e-6,
            tile=self.gemm_tile,
            units=self.compute_units,
            gemm_bytes_per_element=nbytes,
            grouped_gemm_flops=grouped * 1e12 * compute_fraction if grouped else None,
        )

    @property
    def domain_gpus(self) -> int:
        """GPUs joined by NVLink: ``nvlink_domain_gpus``, else one host's ``gpus_per_host``."""
        return int(self.nvlink_domain_gpus or self.gpus_per_host)

    def alltoall_gbps(self, deepep: bool) -> tuple[float, float]:
        """The all-to-all's achieved GB/s ``(inside, across)`` an NVLink domain: NCCL's (megatron's
        ``alltoall`` dispatcher), or DeepEP's (``deepep``; where the profile gives none, NCCL's)."""
        if deepep:
            return (
                self.nvlink_alltoall_deepep_gbps or self.nvlink_alltoall_gbps,
                self.network_alltoall_deepep_gbps or self.network_alltoall_gbps,
            )
        return self.nvlink_alltoall_gbps, self.network_alltoall_gbps

    def comm_share(self, deepep: bool) -> float:
        """The share of ``compute_units`` an all-to-all kernel occupies while it runs (NCCL's
        ``alltoall_comm_units``, DeepEP's ``deepep_comm_units``; 0 where not given)."""
        units = self.deepep_comm_units if deepep else self.alltoall_comm_units
        return units / self.compute_units if units and self.compute_units else 0.0

    def part_rates(self, rates: KernelRates, part: str) -> KernelRates:
        """``rates`` with the launch cost of ``part``'s operators (:attr:`operator_us`)."""
        us = self.operator_us.get(part)
        return rates if us is None else dataclasses.replace(rates, launch_s=float(us) * 1e-6)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def load_profile(name_or_path: str) -> HardwareProfile:
    """The profile ``plan.hardware`` names: a shipped one by name, or a YAML file by path.

    Raises:
        ConfigError: as :func:`k2.config.hardware.load_hardware_profile`.
    """
    return HardwareProfile(**vars(load_hardware_profile(name_or_path)))


def profile_from_dict(d: dict[str, Any], origin: str) -> HardwareProfile:
    """A :class:`HardwareProfile` from a profile file's mapping (``origin``: its name in errors).

    Raises:
        ConfigError: as :func:`k2.config.hardware.hardware_profile_from_mapping`.
    """
    return HardwareProfile(**vars(hardware_profile_from_mapping(d, origin)))
