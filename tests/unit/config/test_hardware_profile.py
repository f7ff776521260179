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


def test_shipped_profiles_load_as_the_section():
    assert set(available_profiles()) >= {"h800", "h100", "h200"}
    for name in available_profiles():
        p = load_hardware_profile(name)
        assert isinstance(p, HardwareProfileConfig) and p.name == name
        assert p.peak_bf16_tflops == pytest.approx(989.4) and p.comm_stream == CommStream.device


def test_left_out_figures_are_filled_in(tmp_path):
    d = {k: v for k, v in _shipped().items()
         if k not in ("name", "peak_fp8_tflops", "gemm_fp8_tflops", "gpu_memory_gib")}
    d.update(gemm_fp32_tflops=0, comm_stream="host_thread")
    path = tmp_path / "measured.yaml"
    path.write_text(yaml.safe_dump(d))
    p = load_hardware_profile(str(path))
    assert p.name == "measured"  # the file's stem
    assert p.peak_fp8_tflops == 2 * p.peak_bf16_tflops and p.gemm_fp8_tflops == 2 * p.gemm_bf16_tflops
    assert p.gemm_fp32_tflops is None and p.gpu_memory_gib is None and p.compute_units == 132
    assert p.comm_stream == CommStream.host_thread == "host_thread"
    assert p.network_loaded_latency_us is None  # (not given: k2-plan takes network_latency_us)


@pytest.mark.parametrize("change,needles", [
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
])
def test_a_bad_key_is_one_error_naming_the_file_and_the_key(tmp_path, change, needles):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**_shipped(), **change}))
    with pytest.raises(ConfigError) as e:
        load_hardware_profile(str(path))
    msg = str(e.value)
    assert "\n" not in msg and f"plan.hardware={path}" in msg
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_an_unknown_name_lists_the_shipped_profiles():
    with pytest.raises(ConfigError,
                       match=r"plan.hardware='h900': not a profile \(allowed: h100, h200, h800"):
        load_hardware_profile("h900")


def test_mfu_peak_is_the_profiles_unless_cluster_peak_tflops_overrides():
    """MFU's device peak (k2-train on a GPU, k2-plan): plan.hardware's BF16 peak, cluster.peak_tflops where
    set (the K2 parallel recipes set 989); on CPU cluster.cpu_peak_tflops or no MFU."""
    from k2.config import load_config
    from k2.config.hardware import peak_tflops
    from k2.launcher.training.metrics import step_mfu

    assert peak_tflops(load_config([])) == pytest.approx(989.4)
    assert peak_tflops(load_config(["parallel=k2_256gpu", "model=kimi_k2"])) == 989.0
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
