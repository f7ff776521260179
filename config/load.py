"""Compose the Hydra config tree (``k2.recipes``) into one validated, read-only config.

``load_config(["model=k2_tiny", "parallel=cpu4", "train.iters=10"])`` returns a read-only OmegaConf
``DictConfig`` merged into the typed schema (:mod:`k2.config.schema`) and checked by
:func:`k2.config.validate.validate`. Every entry point goes through it, so an unknown key, a wrong type,
an unknown recipe or a value outside its range fails with one :class:`ConfigError` before any process
group, dataset or model is built.
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from k2.config.choices import choice_error, choice_setting
from k2.config.errors import ConfigError
from k2.config.recipes import RECIPES_DIR
from k2.config.schema import K2Config
from k2.config.validate import validate

if TYPE_CHECKING:
    from k2.config.schema import K2Config


def _allowed_keys(node: DictConfig) -> list[str]:
    return sorted(str(k) for k in node.keys())


# Keys that no longer exist, with where their setting lives now: the schedule group is the one source of
# truth for LR, weight decay, context length and global batch; the pipeline group for the wgrad split.
_MOVED = {
    **{
        f"optim.{k}": "the learning rate and weight decay of every step come from the schedule group "
        "(schedule.phases.<i>.lr_start / lr_end / lr_style, schedule.weight_decay)"
        for k in ("lr", "min_lr", "weight_decay", "lr_warmup_iters", "lr_decay_style", "lr_wsd_decay_iters")
    },
    "train.global_batch_size": "the global batch is set in tokens by schedule.global_batch_tokens "
    "(sequences per step = global_batch_tokens / the phase's seq_length)",
    "train.seq_length": "the context length is set per phase by schedule.phases.<i>.seq_length",
    # recipes/hardware and recipes/published are read by k2-plan's settings, not composed as config groups
    "hardware": "a hardware profile is chosen with plan.hardware=NAME (recipes/hardware/NAME.yaml) or "
    "plan.hardware=PATH.yaml",
    "published": "published runs are compared with plan.published=all or plan.published=NAME "
    "(recipes/published/runs.yaml)",
    "plan.optimizer_offload_fraction": "optim.offload_fraction (one setting for k2-plan and k2-train: the "
    "share of the optimizer states kept in host memory)",
    "plan.split_backward": "k2-plan plans the trainer's own setting pipeline.decouple_wgrad (decoupled weight "
    "gradients)",
}


def _schema_node(path: str) -> Any:
    """The schema node at ``path``; list items (``schedule.phases.0``) resolve to their element type."""
    node = OmegaConf.structured(K2Config)
    for part in [p for p in path.split(".") if p]:
        if isinstance(node, ListConfig):
            etype = node._metadata.element_type
            try:
                node = OmegaConf.structured(etype)
            except Exception:  # not a structured element type
                return None
            continue
        if not isinstance(node, DictConfig) or part not in node:
            return None
        node = node[part]
    return node


def _unknown_key_error(full_key: str) -> ConfigError:
    key = full_key.rsplit(".", 1)[-1]
    parent_path = full_key.rsplit(".", 1)[0] if "." in full_key else ""
    parent = _schema_node(parent_path)
    allowed = _allowed_keys(parent) if isinstance(parent, DictConfig) else []
    hint = difflib.get_close_matches(str(key), allowed, n=1)
    msg = f"unknown config key '{full_key}'"
    if full_key in _MOVED:
        msg += f": {_MOVED[full_key]}"
    elif hint:
        msg += f" (did you mean '{(parent_path + '.') if parent_path else ''}{hint[0]}'?)"
    msg += f"; allowed keys under '{parent_path or '<root>'}': {', '.join(allowed)}"
    return ConfigError(msg)


def _one_line(msg: str) -> str:
    """Hydra's multi-line messages ("Available options in 'parallel':\\n\\tcpu4\\n\\t...") as one line."""
    head, _, rest = msg.partition("\n")
    items = [ln.strip() for ln in rest.splitlines() if ln.strip()]
    if not items:
        return head.strip()
    out: list[str] = [head.strip()]
    opts: list[str] = []
    for ln in items:
        if ln.endswith(":"):
            if opts:
                out[-1] += " " + ", ".join(opts)
                opts = []
            out.append(ln[0].lower() + ln[1:])
        else:
            opts.append(ln)
    if opts:
        out[-1] += " " + ", ".join(opts)
    return "; ".join(out)


@functools.cache
def _structured_schema() -> DictConfig:
    """The schema as an OmegaConf config, built once per process (~0.1 s of CPU each time)."""
    return OmegaConf.structured(K2Config)


def _store_schema_once(store: Any) -> None:
    """Register the schema in Hydra's config store once per process (the store outlives
    ``GlobalHydra.clear()``; storing converts the dataclass again, ~0.07 s of CPU)."""
    if "k2_schema.yaml" not in store.repo:
        store.store(name="k2_schema", node=K2Config)


def load_config(overrides: Sequence[str] = (), config_name: str = "config") -> K2Config:
    """Compose ``recipes/<config_name>.yaml`` with Hydra ``overrides`` and validate it.

    Args:
        overrides: Hydra override strings, e.g. ``["parallel=cpu4", "train.iters=5"]``.
        config_name: the root config in ``recipes/``.

    Returns:
        A read-only, struct-mode ``DictConfig`` with every key of :class:`k2.config.schema.K2Config`, typed
        as that schema (its sections and values are the schema's; OmegaConf's functions take it as it is);
        calls with the same arguments in one process share one (composed once, see ``_compose``).

    Raises:
        ConfigError: an unknown key or recipe, a value of the wrong type, a Hydra parse error, or a
            value that breaks a rule of :mod:`k2.config.validate`.
    """
    _check_option_style(list(overrides))
    return _compose(tuple(overrides), config_name)


def _check_option_style(overrides: list[str]) -> None:
    """Refuse ``--key value`` / ``--key=value`` (command-line option style, which Hydra's lexer rejects with
    a parse error) with the override to write instead.

    Raises:
        ConfigError: an argument starts with ``-``.
    """
    for i, o in enumerate(overrides):
        if not o.startswith("-"):
            continue
        key = o.lstrip("-")
        if "=" in key:
            hint = key
        elif i + 1 < len(overrides) and "=" not in overrides[i + 1]:
            hint = f"{key}={overrides[i + 1]}"
        else:
            hint = f"{key}=VALUE"
        raise ConfigError(
            f"{o!r} is not an override: the k2 tools take Hydra overrides KEY=VALUE (write {hint}; "
            "--help lists the config groups and their recipes)"
        )


# One config per distinct (overrides, config name) in a process: composing costs ~0.3 s of CPU (Hydra +
# OmegaConf) and the result is read-only, so the callers share it; ranks forked after their launcher
# composed it inherit it (k2.launcher.training.fork_ranks). Errors are not cached: each call raises again.
@functools.lru_cache(maxsize=64)
def _compose(overrides: tuple[str, ...], config_name: str) -> K2Config:
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    # The schema is the base of the defaults list (recipes/config.yaml: "- k2_schema"), so every
    # declared key can be overridden from the command line and recipes are type-checked as they merge.
    _store_schema_once(ConfigStore.instance())
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(RECIPES_DIR), version_base="1.3"):
            raw = compose(config_name=config_name, overrides=list(overrides))
    except HydraException as e:  # unknown group option, bad override syntax, missing key
        refused = _choice_refused(e)
        if refused is not None:  # a value outside an Enum-typed setting's (override or recipe)
            raise refused from None
        msg = str(e).split("\nConfig search path:")[0].strip()
        if e.__cause__ is not None:  # e.g. "Value 'abc' of type 'str' could not be converted to Integer"
            msg += ": " + str(e.__cause__).split("\n")[0]
        m = re.match(r"Could not override '([^']+)'", msg)
        if m:  # an override of a key that no recipe declares
            raise _unknown_key_error(m.group(1)) from None
        raise ConfigError(f"invalid override: {_one_line(msg)}") from None
    except ConfigKeyError as e:
        raise ConfigError(f"invalid override: {e}") from None
    finally:
        GlobalHydra.instance().clear()

    schema = _structured_schema()  # (OmegaConf.merge copies its first argument: the cached one stays clean)
    raw_container = OmegaConf.to_container(raw, resolve=False)
    assert isinstance(raw_container, dict)  # (Hydra composes a mapping)
    raw_container.pop("hydra", None)
    try:
        cfg = OmegaConf.merge(schema, OmegaConf.create(raw_container))
        OmegaConf.resolve(cfg)
    except ConfigKeyError as e:
        raise _unknown_key_error(str(getattr(e, "full_key", None) or getattr(e, "key", "?"))) from None
    except OmegaConfBaseException as e:
        refused = _choice_refused(e)
        if refused is not None:
            raise refused from None
        raise ConfigError(f"invalid value for '{getattr(e, 'full_key', '?')}': {e.msg}") from None
    OmegaConf.set_readonly(cfg, True)
    OmegaConf.set_struct(cfg, True)
    typed = cast(K2Config, cfg)  # merged into the schema above: its keys and value types are K2Config's
    validate(typed)
    return typed


def _choice_refused(exc: BaseException | None) -> ConfigError | None:
    """The setting's own error (:func:`k2.config.choices.choice_error`) when ``exc`` -- or an exception it was
    raised from -- is OmegaConf refusing a scalar value of an Enum-typed setting; None for any other error
    (null, a list: OmegaConf's own message, as for a ``str`` field)."""
    while exc is not None:
        key = getattr(exc, "full_key", None)
        value = getattr(exc, "value", None)
        if (
            isinstance(exc, ValidationError)
            and key is not None
            and choice_setting(key) is not None
            and isinstance(value, (str, int, float, bool))
        ):
            # a number or a bool as the string a str field made of it (the message before the Enum)
            return choice_error(key, value if isinstance(value, str) else str(value))
        exc = exc.__cause__ or exc.__context__
    return None


def to_yaml(cfg: K2Config) -> str:
    """The resolved config as YAML (written to ``<run.dir>/config.yaml``)."""
    return OmegaConf.to_yaml(cfg, resolve=True)
