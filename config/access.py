"""One setting of a config node, whichever form the node has: an OmegaConf ``DictConfig`` (what
:func:`k2.config.load_config` returns), a plain ``dict`` (a Hugging Face ``config.json``, a test's
literal), a schema dataclass or a ``SimpleNamespace``."""

from __future__ import annotations

from typing import Any

__all__ = ["setting"]


def setting(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg[key]`` for a ``dict``, else ``getattr(cfg, key)``; ``default`` where the key is absent."""
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)
