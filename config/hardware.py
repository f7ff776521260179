"""Finding and reading the hardware profile ``plan.hardware`` names (the section of
:mod:`k2.config.schema_hardware`), for ``k2-plan``'s step-time model and the trainer's MFU.

``plan.hardware`` is a profile's name in ``recipes/hardware/`` (``h800``, ``h100``, ``h200``, ``b200``, ``b300``,
``gb200_nvl72``, ``gb300_nvl72``) or the path of
a YAML file ``k2-bench bench=hardware`` wrote. The file is read through
``OmegaConf.structured(HardwareProfileConfig)``; every fault is one :class:`k2.config.ConfigError` naming
``plan.hardware``, the file and the key.
"""

from __future__ import annotations

import copy
import difflib
import functools
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException

from k2.config.choices import Fp8Recipe, allowed
from k2.config.errors import ConfigError
from k2.config.recipes import RECIPES_DIR, recipe_names
from k2.config.schema_hardware import OPTIONAL_POSITIVE, REQUIRED_POSITIVE, CommStream, HardwareProfileConfig

if TYPE_CHECKING:
    from k2.config.schema import K2Config

__all__ = [
    "HARDWARE_DIR",
    "available_profiles",
    "hardware_profile_from_mapping",
    "load_hardware_profile",
    "peak_tflops",
]

HARDWARE_DIR = RECIPES_DIR / "hardware"
#: keys an older profile file may hold, and what took their place
_RENAMED = {"gpus_per_node": "gpus_per_host (the devices of one host; nvlink_domain_gpus: those joined by NVLink)"}


def available_profiles() -> list[str]:
    """Names of the profiles shipped in ``recipes/hardware/``."""
    return list(recipe_names("hardware"))


def load_hardware_profile(name_or_path: str) -> HardwareProfileConfig:
    """The profile ``plan.hardware`` names: a shipped one by name, or a YAML file by path.

    Raises:
        ConfigError: neither a shipped name nor a readable YAML mapping (naming ``plan.hardware`` and the
            allowed names), or a bad key of the file (:func:`hardware_profile_from_mapping`).
    """
    name = str(name_or_path)
    path = HARDWARE_DIR / f"{name}.yaml" if "/" not in name and not name.endswith(".yaml") else Path(name)
    try:
        text = path.read_text()
    except OSError as e:
        raise _not_a_profile(name, e) from None
    # the file is read on every call (a profile a bench rewrites is seen at once); its parse is cached:
    # k2-plan's layout search loads the profile twice per layout, and the schema merge costs ~40 ms
    return copy.deepcopy(_parse_profile(name, str(path), text))


def _not_a_profile(name: str, e: Exception) -> ConfigError:
    return ConfigError(
        f"plan.hardware={name!r}: not a profile (allowed: {', '.join(available_profiles())}, or "
        f"the path of a YAML file k2-bench bench=hardware wrote; {e.__class__.__name__})"
    )


@functools.lru_cache(maxsize=32)
def _parse_profile(name: str, path: str, text: str) -> HardwareProfileConfig:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise _not_a_profile(name, e) from None
    if not isinstance(data, dict):
        raise ConfigError(f"plan.hardware={name!r}: the file holds no mapping of profile keys")
    return hardware_profile_from_mapping(data, name, Path(path))


def hardware_profile_from_mapping(data: dict[str, Any], origin: str, path: Path | None = None) -> HardwareProfileConfig:
    """A profile file's mapping as a :class:`HardwareProfileConfig`, the left-out figures filled in
    (``name``: the stem of ``origin``; FP8 peak and GEMM rate: 2 x BF16; a zero optional rate or memory:
    null).

    Raises:
        ConfigError: an unknown key (a renamed one says its new name), a value of the wrong type, a required
            number (``REQUIRED_POSITIVE``) missing or not a finite number > 0, an optional one
            (``OPTIONAL_POSITIVE``) not null or > 0, ``comm_stream`` not one of its values, a host, NVLink
            domain or communication kernel that does not fit (:func:`_check_placement`); naming
            ``plan.hardware=origin``, the file (``path``) and the key.
    """
    where = f"plan.hardware={origin}" + (f" ({path})" if path is not None and str(path) != origin else "")
    for old, new in _RENAMED.items():
        if old in data:
            raise ConfigError(f"{where}: unknown key '{old}'; it is now {new}")
    known = HardwareProfileConfig.__dataclass_fields__
    for key in data:  # (before the required keys: a misspelt one is named, not the one it misses)
        if key not in known:
            near = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean '{near[0]}'? " if near else ""
            raise ConfigError(f"{where}: unknown key '{key}'; {hint}allowed: {', '.join(known)}")
    recipes = data.get("fp8_recipes")
    if recipes is not None and not (
        isinstance(recipes, list) and recipes and all(r in Fp8Recipe.__members__ for r in recipes)
    ):
        raise ConfigError(f"{where}: 'fp8_recipes' is {recipes!r}; allowed: null or a list of {allowed(Fp8Recipe)}")
    comm = data.get("comm_stream", CommStream.device.value)
    if comm not in CommStream.__members__:
        raise ConfigError(f"{where}: 'comm_stream' is {comm!r}; allowed: {allowed(CommStream)}")
    for key in REQUIRED_POSITIVE:  # bools are ints to Python, strings OmegaConf would convert: refused here
        v = data.get(key)
        if not _positive(v):
            raise ConfigError(f"{where}: '{key}' must be a number > 0 (got {v!r})")
    for key in OPTIONAL_POSITIVE:
        v = data.get(key)
        if v is not None and not _positive(v):
            raise ConfigError(f"{where}: '{key}' must be null or a number > 0 (got {v!r})")
    try:
        prof: HardwareProfileConfig = OmegaConf.to_object(
            OmegaConf.merge(OmegaConf.structured(HardwareProfileConfig), data)
        )
    except ConfigKeyError as e:
        raise ConfigError(
            f"{where}: unknown key '{e.full_key}'; allowed: {', '.join(HardwareProfileConfig.__dataclass_fields__)}"
        ) from None
    except (MissingMandatoryValue, OmegaConfBaseException) as e:
        raise ConfigError(f"{where}: '{e.full_key}': {str(e).splitlines()[0]}") from None
    if not 0 <= prof.alltoall_host_cpu_share < 1:
        raise ConfigError(
            f"{where}: 'alltoall_host_cpu_share' must be a number >= 0 and < 1 (the share of a "
            f"core; got {prof.alltoall_host_cpu_share!r})"
        )
    slow = prof.alltoall_beside_compute_slowdown
    if not (math.isfinite(slow) and slow >= 1):
        raise ConfigError(f"{where}: 'alltoall_beside_compute_slowdown' must be a number >= 1 (got {slow!r})")
    for key in ("alltoall_peer_wait_us", "host_forward_operator_us", "host_backward_operator_us"):
        value = getattr(prof, key)
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{where}: '{key}' must be a number >= 0 (got {value!r})")
    loaded = prof.network_loaded_latency_us
    if loaded is not None and not (math.isfinite(loaded) and loaded >= prof.network_latency_us):
        raise ConfigError(
            f"{where}: 'network_loaded_latency_us' must be null or a number >= network_latency_us "
            f"({prof.network_latency_us!r}; got {loaded!r})"
        )
    _check_placement(prof, where)
    prof.name = str(prof.name) if prof.name is not None else Path(origin).stem
    prof.peak_fp8_tflops = prof.peak_fp8_tflops or 2 * prof.peak_bf16_tflops
    prof.gemm_fp8_tflops = prof.gemm_fp8_tflops or 2 * prof.gemm_bf16_tflops
    for key in ("gemm_fp32_tflops", "gemm_grouped_bf16_tflops", "gemm_grouped_fp8_tflops", "gpu_memory_gib"):
        setattr(prof, key, getattr(prof, key) or None)
    return prof


def _positive(v: Any) -> bool:
    """A finite number > 0 (bools are ints to Python, strings OmegaConf would convert: refused)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _check_placement(prof: HardwareProfileConfig, where: str) -> None:
    """The host, the NVLink domain and the communication kernels' compute units fit together.

    Raises:
        ConfigError: ``gpus_per_host`` < 1; ``nvlink_domain_gpus`` not a multiple of it (a domain is whole
            hosts); a ``*_comm_units`` < 0 or not fewer than ``compute_units`` (without ``compute_units``
            they take nothing: :meth:`k2.launcher.planning.hardware.HardwareProfile.comm_share`).
    """
    if prof.gpus_per_host < 1:
        raise ConfigError(f"{where}: 'gpus_per_host' must be an integer >= 1 (got {prof.gpus_per_host!r})")
    domain = prof.nvlink_domain_gpus
    if domain is not None and domain % prof.gpus_per_host:
        raise ConfigError(
            f"{where}: 'nvlink_domain_gpus' must be null or a multiple of gpus_per_host="
            f"{prof.gpus_per_host} (an NVLink domain is whole hosts; got {domain!r})"
        )
    for key in ("alltoall_comm_units", "deepep_comm_units"):
        v = getattr(prof, key)
        if v is not None and prof.compute_units and not 0 <= v < prof.compute_units:
            raise ConfigError(
                f"{where}: '{key}' must be null or an integer >= 0 and below compute_units="
                f"{prof.compute_units!r} (got {v!r})"
            )


def peak_tflops(cfg: K2Config) -> float:
    """Dense BF16 peak of one device, TFLOP/s, that MFU is measured against: ``cluster.peak_tflops`` where
    set (an explicit override), else ``peak_bf16_tflops`` of the profile ``plan.hardware`` names.

    Raises:
        ConfigError: the profile cannot be read (:func:`load_hardware_profile`).
    """
    override = cfg.cluster.peak_tflops
    if override is not None:
        return float(override)
    return _profile_peak_tflops(str(cfg.plan.hardware))


@functools.lru_cache(maxsize=8)
def _profile_peak_tflops(name_or_path: str) -> float:
    """``peak_bf16_tflops`` of the profile ``name_or_path`` (read once: the trainer asks every step)."""
    return float(load_hardware_profile(name_or_path).peak_bf16_tflops)
