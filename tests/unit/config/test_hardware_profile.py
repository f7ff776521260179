"""The hardware profile as a structured section (config/schema_hardware.py, config/hardware.py): the shipped
profiles load through the schema, the left-out figures are filled in, and a bad key of a profile file is
one ConfigError naming plan.hardware, the file and the key."""

from __future__ import annotations

import pytest
import yaml

from k2.config import ConfigError
from k2.config.hardware import HARDWARE_DIR, available_profiles, load_hardware_profile
from k2.config.schema_hardware import CommStream, HardwareProfileConfig


def _shipped() -> dict:
    return yaml.safe_load((HARDWARE_DIR / "h800.yaml").read_text())


#: the shipped profiles' dense BF16 peaks (datasheets; NVIDIA dgxc-benchmarking README's peak table for the
#: Blackwell parts) and GPUs per host and per NVLink domain
SHIPPED = {
    "h800": (989.4, 8, 8),
    "h100": (989.4, 8, 8),
    "h200": (989.4, 8, 8),
    "b200": (2250, 8, 8),
    "b300": (2250, 8, 8),
    "gb200_nvl72": (2450, 4, 72),
    "gb300_nvl72": (2450, 4, 72),
}


def test_shipped_profiles_load_as_the_section():
    from k2.launcher.planning.hardware import load_profile

    assert set(available_profiles()) == set(SHIPPED)
    for name, (peak, host, domain) in SHIPPED.items():
        p = load_hardware_profile(name)
        assert isinstance(p, HardwareProfileConfig) and p.name == name
        assert p.peak_bf16_tflops == pytest.approx(peak) and p.comm_stream == CommStream.device
        assert (p.gpus_per_host, load_profile(name).domain_gpus) == (host, domain)
        assert p.host_memory_gib and p.gpu_memory_gib and 0 < p.alltoall_comm_units < p.compute_units


def test_an_nvl72_rack_is_18_hosts_of_4_gpus_on_one_nvlink_domain():
    """GB200 NVL72: a compute tray (host: host memory, Slurm node) carries 4 GPUs, the NVLink domain 72;
    an HGX B200 node is both at once (8)."""
    gb = load_hardware_profile("gb200_nvl72")
    assert (gb.gpus_per_host, gb.nvlink_domain_gpus, gb.host_memory_gib) == (4, 72, 960)
    b = load_hardware_profile("b200")
    assert (b.gpus_per_host, b.nvlink_domain_gpus) == (8, None)


def test_left_out_figures_are_filled_in(tmp_path):
    d = {
        k: v for k, v in _shipped().items() if k not in ("name", "peak_fp8_tflops", "gemm_fp8_tflops", "gpu_memory_gib")
    }
    d.update(gemm_fp32_tflops=0, comm_stream="host_thread")
    path = tmp_path / "measured.yaml"
    path.write_text(yaml.safe_dump(d))
    p = load_hardware_profile(str(path))
    assert p.name == "measured"  # the file's stem
    assert p.peak_fp8_tflops == 2 * p.peak_bf16_tflops and p.gemm_fp8_tflops == 2 * p.gemm_bf16_tflops
    assert p.gemm_fp32_tflops is None and p.gpu_memory_gib is None and p.compute_units == 132
    assert p.comm_stream == CommStream.host_thread == "host_thread"
    assert p.network_loaded_latency_us is None  # (not given: k2-plan takes network_latency_us)


@pytest.mark.parametrize(
    "change,needles",
    [
        ({"memory_gbps": "fast"}, ["'memory_gbps'", "must be a number > 0"]),
        ({"nvlink_gbps": 0}, ["'nvlink_gbps'", "must be a number > 0"]),
        ({"host_gbps": None}, ["'host_gbps'", "got None"]),
        ({"gemm_tile": "big"}, ["'gemm_tile'", "'big'"]),
        ({"operator_us": {"loss": "slow"}}, ["'operator_us.loss'", "'slow'"]),
        ({"memory_gbsp": 3350}, ["unknown key 'memory_gbsp'", "memory_gbps"]),
        ({"comm_stream": "gpu"}, ["'comm_stream'", "allowed: device, host_thread"]),
        ({"alltoall_host_cpu_share": 1.0}, ["'alltoall_host_cpu_share'", ">= 0 and < 1", "got 1.0"]),
        ({"alltoall_host_cpu_share": -0.1}, ["'alltoall_host_cpu_share'", ">= 0 and < 1"]),
        ({"network_loaded_latency_us": 5}, ["'network_loaded_latency_us'", ">= network_latency_us", "got 5"]),
        ({"network_loaded_latency_us": float("nan")}, ["'network_loaded_latency_us'", "null or a number"]),
        ({"gpus_per_node": 8}, ["unknown key 'gpus_per_node'", "now gpus_per_host"]),
        ({"gpus_per_host": 0}, ["'gpus_per_host'", "integer >= 1"]),
        ({"gpus_per_host": 4, "nvlink_domain_gpus": 70}, ["'nvlink_domain_gpus'", "multiple of gpus_per_host=4"]),
        ({"nvlink_domain_gpus": -8}, ["'nvlink_domain_gpus'", "null or a number > 0"]),
        ({"host_memory_gib": 0}, ["'host_memory_gib'", "null or a number > 0"]),
        ({"alltoall_comm_units": 132}, ["'alltoall_comm_units'", "below compute_units=132", "got 132"]),
        ({"deepep_comm_units": -1}, ["'deepep_comm_units'", "integer >= 0"]),
        ({"host_forward_operator_us": -1.0}, ["'host_forward_operator_us'", "number >= 0", "got -1.0"]),
        ({"host_backward_operator_us": "slow"}, ["'host_backward_operator_us'", "'slow'"]),
        ({"fp8_recipes": ["nvfp4"]}, ["'fp8_recipes'", "allowed: null or a list of blockwise, mxfp8"]),
        ({"fp8_recipes": []}, ["'fp8_recipes'", "a list of"]),
    ],
)
def test_a_bad_key_is_one_error_naming_the_file_and_the_key(tmp_path, change, needles):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**_shipped(), **change}))
    with pytest.raises(ConfigError) as e:
        load_hardware_profile(str(path))
    msg = str(e.value)
    assert "\n" not in msg and f"plan.hardware={path}" in msg
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_a_misspelt_required_key_is_named_with_the_key_it_resembles(tmp_path):
    """A required key written wrongly: the error names the misspelt key (not the required one it then lacks)
    and the key it resembles."""
    data = _shipped()
    data["gemm_bf16_tflop"] = data.pop("gemm_bf16_tflops")
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"unknown key 'gemm_bf16_tflop'; did you mean 'gemm_bf16_tflops'\?"):
        load_hardware_profile(str(path))


def test_an_unknown_name_lists_the_shipped_profiles():
    with pytest.raises(
        ConfigError,
        match=r"plan.hardware='h900': not a profile \(allowed: b200, b300, gb200_nvl72, gb300_nvl72, "
        r"h100, h200, h800",
    ):
        load_hardware_profile("h900")


def test_mfu_peak_is_the_profiles_unless_cluster_peak_tflops_overrides():
    """MFU's device peak (k2-train on a GPU, k2-plan): plan.hardware's BF16 peak, cluster.peak_tflops where
    set (no recipe pins it: K2's on a B200 is measured against the B200's 2,250); on CPU
    cluster.cpu_peak_tflops or no MFU."""
    from k2.config import load_config
    from k2.config.hardware import peak_tflops
    from k2.launcher.training.metrics import step_mfu

    assert peak_tflops(load_config([])) == pytest.approx(989.4)
    assert peak_tflops(load_config(["parallel=k2_256gpu", "model=kimi_k2"])) == pytest.approx(989.4)
    assert peak_tflops(load_config(["parallel=k2_256gpu", "model=kimi_k2", "plan.hardware=b200"])) == 2250.0
    assert peak_tflops(load_config(["cluster.peak_tflops=500", "plan.hardware=h200"])) == 500.0
    cfg = load_config([])
    tflops, mfu = step_mfu(2e15, 2.0, 4, cfg, on_gpu=True)
    assert tflops == pytest.approx(2e15 / 2.0 / 4 / 1e12) and mfu == pytest.approx(tflops / 989.4)
    assert step_mfu(2e15, 2.0, 4, cfg, on_gpu=False)[1] is None
    with pytest.raises(ConfigError, match="cluster.peak_tflops"):
        load_config(["cluster.peak_tflops=0"])


def test_a_rewritten_profile_is_read_again_and_each_load_is_its_own_object(tmp_path):
    """Loads parse a file once (k2-plan's search loads the profile twice per layout) but read it every
    time: a bench that rewrites the file is seen at once, and a caller's change to one load is not in the
    next."""
    import time

    from k2.config import hardware

    path = tmp_path / "link.yaml"
    path.write_text(yaml.safe_dump({**_shipped(), "network_gbps": 12.5}))
    first = load_hardware_profile(str(path))
    first.operator_us["embedding"] = 1.0
    first.network_gbps = 0.0
    again = load_hardware_profile(str(path))
    assert again.network_gbps == 12.5 and "embedding" not in (again.operator_us or {})
    path.write_text(yaml.safe_dump({**_shipped(), "network_gbps": 25.0}))
    assert load_hardware_profile(str(path)).network_gbps == 25.0
    hardware._parse_profile.cache_clear()
    t0 = time.process_time()
    for _ in range(20):
        load_hardware_profile(str(path))
    assert hardware._parse_profile.cache_info().misses == 1 and time.process_time() - t0 < 0.5
