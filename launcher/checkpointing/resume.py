"""Which checkpoint a run continues from, decided before any process group exists (:func:`plan_resume`),
and whether it may: a resume must not silently change what training computes, and the optimizer formats
reshard over DP only (:func:`check_resume_compatible`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from k2.config.errors import ConfigError
from k2.config.validate import resume_settings
from k2.launcher.checkpointing.branch import check_branch_schedule
from k2.launcher.checkpointing.manifest import MANIFEST_FILE, REQUIRED, STATE_FILE
from k2.launcher.checkpointing.paths import (
    CHECKPOINTS,
    CONFIG_FILE,
    LATEST,
    check_checkpoint_files,
    read_state,
    resume_point,
    saved_checkpoint_names,
    unsafe_checkpoint_error,
)
from k2.launcher.checkpointing.run_lock import OWNER_LOCK
from k2.launcher.checkpointing.unpickle import metadata_problem

if TYPE_CHECKING:
    from k2.config.schema import K2Config

#: config sections whose change alters what training computes; refused on resume unless resume.force.
GUARDED = ("model", "schedule", "optim", "data", "run.seed", "train.precision")
#: the dataset paths among them (and a blend's items): not compared as strings
_DATA_PATH_KEY = re.compile(r"(schedule\.phases\.\d+\.)?data\.(path|valid_path)(\.\d+)?")


def _select(container: dict, dotted: str) -> Any:
    node = container
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


_ABSENT = "<absent>"


def _diff(a: Any, b: Any, prefix: str) -> list[str]:
    """``["key: old -> new", ...]`` for every leaf that differs, with dotted keys and list items by
    index (``schedule.phases.1.steps: 100 -> 120``); a key or item on one side only shows ``<absent>``."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            out += _diff(a.get(k, _ABSENT), b.get(k, _ABSENT), f"{prefix}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        out = []
        for i in range(max(len(a), len(b))):
            out += _diff(a[i] if i < len(a) else _ABSENT, b[i] if i < len(b) else _ABSENT, f"{prefix}.{i}")
        return out
    if a == b:
        return []
    return [f"{prefix}: {_show(a)} -> {_show(b)}"]


def _show(value: Any) -> str:
    return value if value is _ABSENT else repr(value)


def check_resume_compatible(
    state: dict,
    saved_cfg: dict,
    cfg: dict,
    layout: dict,
    force: bool,
    path: str | Path,
    unguarded: tuple[str, ...] = (),
) -> list[str]:
    """Refuse a resume that would silently change training or that the checkpoint cannot serve.

    A weights-only checkpoint (``"weights_only": true`` in ``k2_state.json``, written by ``k2-convert
    import``) is checked for the ``model`` settings alone: it holds no optimizer or schedule state, and
    megatron reshards model tensors for any layout.

    Args:
        state: the checkpoint's ``k2_state.json``.
        saved_cfg / cfg: the resolved configs (dicts) of the checkpoint's run and of this run.
        layout: this run's ``{"pp", "vpp", "ep", "dp", "world_size"}``.
        force: ``resume.force``: accept changes of guarded settings (never a layout change).
        unguarded: guarded sections left to another check (a branch's ``schedule``:
            :func:`k2.launcher.checkpointing.branch.check_branch_schedule`).

    Returns:
        The accepted changes of guarded settings (to be logged), empty when none.

    Raises:
        ConfigError: PP, VPP or EP differ (the optimizer formats reshard over DP only), the DP size
            differs with the layer-wise (Muon) optimizer, or a guarded setting (:data:`GUARDED`) differs
            and ``force`` is false.
    """
    if state.get("weights_only"):  # model weights alone (k2-convert import): any layout, a fresh run
        changes = _diff(_select(saved_cfg, "model"), _select(cfg, "model"), "model")
        if changes and not force:
            raise ConfigError(
                f"{path} holds the weights of another model config: {'; '.join(changes[:8])}. Use the "
                "model settings it was imported with, or accept the change with resume.force=true"
            )
        return changes
    saved = state["layout"]
    fixed = [k for k in ("pp", "vpp", "ep") if saved[k] != layout[k]]
    if fixed:
        raise ConfigError(
            f"checkpoint {path} was written with PP={saved['pp']} VPP={saved['vpp']} EP={saved['ep']} "
            f"(DP={saved['dp']}); this run has PP={layout['pp']} VPP={layout['vpp']} EP={layout['ep']}. "
            f"Compatible layouts: parallel.pp={saved['pp']}, parallel.vpp={saved['vpp']}, "
            f"parallel.ep={saved['ep']} with any DP that divides the run; the optimizer "
            "checkpoint formats reshard over DP only"
        )
    if saved["dp"] != layout["dp"] and state.get("optimizer_dp_fixed"):
        raise ConfigError(
            f"checkpoint {path} holds the layer-wise (Muon) optimizer state of DP={saved['dp']}; megatron's "
            f"LayerWiseDistributedOptimizer checkpoints are for a fixed DP size: run with world size "
            f"{saved['world_size']} (DP={saved['dp']})"
        )
    changes = []
    for key in (k for k in GUARDED if k not in unguarded):
        changes += _diff(_select(saved_cfg, key), _select(cfg, key), key)
    # the datasets' paths are compared by contents instead (k2.launcher.training.resume_data)
    changes = [c for c in changes if not _DATA_PATH_KEY.fullmatch(c.split(":", 1)[0])]
    if changes and not force:
        raise ConfigError(
            f"resuming from {path} would change training: {'; '.join(changes[:8])}"
            f"{f'; ... ({len(changes) - 8} more)' if len(changes) > 8 else ''}. Restore those settings, "
            "start a new run.dir, or accept the change with resume.force=true"
        )
    return changes


#: what ``resume.from`` may name
_FROM_ALLOWED = (
    "allowed: a checkpoint (checkpoints/iter_NNNNNNN), a checkpoints/ directory (its latest) or a "
    "run dir (its checkpoints/latest)"
)


def resume_from_path(raw: str | Path) -> Path:
    """The checkpoint ``resume.from=raw`` names: ``raw`` itself, the one a ``checkpoints/`` directory's
    ``latest`` names, or a run dir's ``checkpoints/latest``.

    Raises:
        ConfigError: naming ``resume.from``: ``raw`` does not exist, is a file, or is a directory that is
            none of the three (e.g. a dataset directory); a damaged checkpoint is left to :func:`read_state`
            and :func:`check_checkpoint_files`, which name its files.
    """
    path = Path(str(raw))
    if not path.exists():
        raise ConfigError(f"resume.from={raw}: no such directory; {_FROM_ALLOWED}")
    if not path.is_dir():
        raise ConfigError(f"resume.from={raw} is a file, not a directory; {_FROM_ALLOWED}")
    # a checkpoints/ directory or a run dir: its latest, or the newest checkpoint that verifies when
    # latest is missing, empty or dangling (resume_point)
    if (path / LATEST).exists() or saved_checkpoint_names(path):
        return resume_point(None, root=path)[0] or path
    if (path / CHECKPOINTS).is_dir():
        return resume_point(path)[0] or path
    # a checkpoint, complete or not (its own files say what is wrong with it), or something else
    if path.name.startswith("iter_") or any((path / f).exists() for f in (*REQUIRED, MANIFEST_FILE)):
        return path
    raise ConfigError(
        f"resume.from={raw} is not a checkpoint (no {STATE_FILE}, metadata.json or "
        f"{MANIFEST_FILE} in it, no latest, no {CHECKPOINTS}/{LATEST}); {_FROM_ALLOWED}"
    )


def plan_resume(cfg: K2Config, layout: dict[str, int]) -> Path | None:
    """Decide, before any process group exists, which checkpoint this run resumes from.

    ``resume.from=PATH`` -> that checkpoint; ``resume=auto`` (default) -> ``<run.dir>/checkpoints/latest``
    when it exists, the newest checkpoint that verifies when ``latest`` is missing, empty or names
    nothing complete (:func:`k2.launcher.checkpointing.paths.resume_point`); otherwise
    ``resume.branch_from=PATH``'s checkpoint when set (a cooldown branch of another run:
    :mod:`k2.launcher.checkpointing.branch`; its schedule may differ after the checkpoint's step only);
    otherwise a fresh start, also in a run dir whose run was killed before its first save
    (``resume=never`` refuses any non-empty run dir).

    Raises:
        ConfigError: see :func:`k2.config.validate.resume_settings`, :func:`read_state`,
            :func:`check_resume_compatible`; a checkpoint whose files disagree with its manifest
            (:func:`k2.launcher.checkpointing.paths.check_checkpoint_files`) or whose ``.metadata`` names code
            outside the allow-list (:func:`k2.launcher.checkpointing.unpickle.metadata_problem`); a ``latest``
            that names nothing usable with no checkpoint that verifies (:func:`resume_point`).
    """
    from omegaconf import OmegaConf

    settings = resume_settings(cfg.resume)
    run_dir = Path(cfg.run.dir)
    if settings["mode"] == "never":
        # (the owner's lock file, k2.launcher.checkpointing.run_lock, is not a previous run)
        if run_dir.exists() and any(p.name != OWNER_LOCK for p in run_dir.iterdir()):
            raise ConfigError(
                f"resume=never and run.dir={run_dir} is not empty; choose a new run.dir "
                "or drop resume=never to resume from its latest checkpoint"
            )
        return None
    branch = False
    path: Path | None
    if settings["from"] is not None:
        path = resume_from_path(settings["from"])
    else:
        # a run killed before its first save (metrics.jsonl, no checkpoint) starts afresh: the trainer
        # sets its records aside and counts their time as lost (k2.launcher.training.goodput)
        path, _ = resume_point(run_dir)
        if path is None and settings["branch_from"] is not None:  # a branch's first start
            path, branch = resume_from_path(settings["branch_from"]), True
        if path is None:
            return None
    state = read_state(path)
    check_checkpoint_files(path, str(cfg.checkpoint.verify))
    unsafe = metadata_problem(path)  # whatever checkpoint.verify says: safety, not integrity
    if unsafe:
        raise unsafe_checkpoint_error(path, [unsafe])
    saved = OmegaConf.load(path / CONFIG_FILE)
    saved_cfg, run_cfg = OmegaConf.to_container(saved, resolve=True), OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(saved_cfg, dict) and isinstance(run_cfg, dict)  # (configs are mappings)
    check_resume_compatible(
        state, saved_cfg, run_cfg, layout, bool(settings["force"]), path, unguarded=("schedule",) if branch else ()
    )
    if branch:
        check_branch_schedule(cfg, saved.schedule, int(state["step"]), path)
    return path


def is_branch_start(cfg: K2Config, resume_from: Path | None) -> bool:
    """True when ``resume_from`` (from :func:`plan_resume`) is ``resume.branch_from``'s checkpoint: the run
    starts as a branch (not from a checkpoint of its own run dir)."""
    if resume_from is None or resume_settings(cfg.resume)["branch_from"] is None:
        return False
    own = (Path(cfg.run.dir) / CHECKPOINTS).resolve()
    return not Path(resume_from).resolve().is_relative_to(own)
