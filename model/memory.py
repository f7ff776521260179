"""Activation memory switches (config group ``memory``): validation and application to the model.

REFERENCE.md "Training system", "Activation memory": FP8-E4M3 storage of MoE up-projection inputs and
SwiGLU inputs, selective recompute (RMSNorm, SwiGLU, MLA up-projection, MoE down-projection) and CPU
offload of saved activations. Site names and the tensors they cover: ``launcher/schema.py``
(``MEMORY_FP8_SITES``, ``MEMORY_RECOMPUTE_SITES``, ``MEMORY_OFFLOAD_SITES``).
"""

from __future__ import annotations

from launcher.config import ConfigError
from launcher.schema import MEMORY_FP8_SITES, MEMORY_OFFLOAD_SITES, MEMORY_RECOMPUTE_SITES

_GROUPS = {
    "fp8_store": MEMORY_FP8_SITES,
    "recompute": MEMORY_RECOMPUTE_SITES,
    "offload": MEMORY_OFFLOAD_SITES,
}


def check_memory_config(cfg) -> None:
    """Validate ``cfg.memory`` (called by the trainer's plan, before any process group).

    Raises:
        ConfigError: an unknown or repeated site name, naming the setting and the allowed values.
    """
    for key, allowed in _GROUPS.items():
        names = list(cfg.memory[key] or [])
        for name in names:
            if name not in allowed:
                raise ConfigError(
                    f"memory.{key} has {name!r}; allowed: {', '.join(allowed)} (a list, [] = off)"
                )
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ConfigError(f"memory.{key} lists {', '.join(dup)} more than once; allowed: each site once")
