"""The sparsity sweep's grid: which runs a sweep trains and with which settings (no process starts here).

K2 chose 384 experts from a sparsity scaling law (K2 report, section 2.3, Figure 5: at fixed activated
parameters and top-8, validation loss against training FLOPs per sparsity, each curve ending in a cooldown).
A sweep here is a grid of *arms* (sparsity = experts / top-k; sparsity 1 = every expert active: the dense
model with the same activated FLOPs per token), optional model *sizes*, *seeds* and token *budgets*:

* per (arm, size, seed) one **trunk**: the schedule's warmup, then its constant LR up to the last branch
  point; it saves exactly at every branch point (``checkpoint.save_steps``);
* per budget ``T`` one **cooldown branch** (a *cell*): it starts from the trunk's checkpoint at step
  ``floor((1 - f) T / B)`` (``f = sweep.cooldown.fraction``, ``B`` tokens per step) and decays the LR
  (``sweep.cooldown.style``, 1-sqrt by default) to ``sweep.cooldown.lr_end`` at ``T``
  (``resume.branch_from``: :mod:`k2.launcher.checkpointing.branch`). Hagele et al. 2024 (arXiv 2405.18392):
  such a branch matches a separate cosine run of length ``T`` for about a third fewer FLOPs over a ladder.

Every run of the grid reads the same data in the same order (``data.seed`` fixed to the base ``run.seed``,
``data.index_tokens`` the largest budget, so megatron's sample shuffle is the same for all of them) and is
evaluated on the same held-out tokens; ``run.seed`` (the model's initialisation) is the seed.

Layout under ``sweep.dir``: ``<arm>[/<size>]/seed_<s>/trunk`` and ``.../budget_<T>`` (run dirs), and
``grid.json`` (:func:`k2.launcher.tools.sweep_state.grid_manifest`), which ``k2-sweep-report`` reads; what
of the grid is on disk (finished, partial, damaged runs) is :mod:`k2.launcher.tools.sweep_state`'s.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from k2.config.errors import ConfigError
from k2.config.load import load_config
from k2.launcher.checkpointing.paths import checkpoints_dir, iter_name

#: overrides the grid sets itself (a user's own would be silently replaced, so they are refused)
GRID_KEYS = (
    "model.num_moe_experts",
    "run.dir",
    "run.seed",
    "data.seed",
    "data.index_tokens",
    "schedule.phases",
    "train.iters",
    "checkpoint.save_steps",
    "resume.branch_from",
    "resume.from",
    "run.wandb.group",
    "run.wandb.name",
)
#: what a size of the ladder (``sweep.sizes``) may not override (a key or a section): what the grid sets, and
#: what it derives the branch steps (the schedule, its global batch), an arm's sparsity (top-k, experts), the
#: seeds or the data order from
SIZE_FORBIDDEN = (*GRID_KEYS, "schedule", "model.moe_router_topk", "sweep", "experiment")
#: settings of a size's config that must equal the base config's (a group override such as ``model=...``
#: may change them without naming them)
SIZE_FIXED = ("model.moe_router_topk", "schedule", "run.seed")
GRID_FILE = "grid.json"
CELL_FILE = "cell.json"


@dataclass(frozen=True)
class Trunk:
    """One (arm, size, seed): the constant-LR run the arm's budgets branch from.

    Attributes:
        arm: ``sparsity_<S>``; sparsity: experts / top-k; experts: ``model.num_moe_experts``.
        size: the ladder's size name, or None for a one-size grid.
        seed: its ``run.seed``.
        run_dir: ``<sweep.dir>/<arm>[/<size>]/seed_<s>/trunk``.
        branch_steps: the steps it saves at (one per budget), ascending; the last is its last step.
        overrides: the full ``k2-train`` overrides.
    """

    arm: str
    sparsity: int
    experts: int
    size: str | None
    seed: int
    run_dir: Path
    branch_steps: tuple[int, ...]
    overrides: tuple[str, ...]


@dataclass(frozen=True)
class Cell:
    """One budget of one trunk: a cooldown branch.

    Attributes:
        trunk: the trunk it branches from.
        budget_tokens: its training tokens (whole steps: the budget rounded up to a multiple of ``B``).
        branch_step: the trunk's step it starts from.
        last_step: its last step, ``budget_tokens / B``.
        run_dir: ``<trunk dir>/../budget_<budget_tokens>``.
        overrides: the full ``k2-train`` overrides.
        phases: its ``schedule.phases`` (the trunk's up to the branch point, then the cooldown).
    """

    trunk: Trunk
    budget_tokens: int
    branch_step: int
    last_step: int
    run_dir: Path
    overrides: tuple[str, ...]
    phases: tuple = ()


@dataclass(frozen=True)
class Grid:
    """A sweep's runs: ``trunks`` and their ``cells``, in the order a one-machine run trains them."""

    name: str
    dir: Path
    topk: int
    global_batch_tokens: int
    warmup_steps: int
    cooldown: dict
    collapsed_load: float
    jobs: int
    trunks: tuple[Trunk, ...]
    cells: tuple[Cell, ...] = field(default=())

    def cells_of(self, trunk: Trunk) -> list[Cell]:
        return [c for c in self.cells if c.trunk == trunk]


def hydra_value(value) -> str:
    """``value`` (None, bool, number, str, list, dict) in Hydra's override grammar."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no Hydra form for {type(value).__name__}")


def _set_fields(phase: dict) -> dict:
    """A phase as written: its non-null fields (nested sections only when something in them is set)."""
    out = {}
    for k, v in phase.items():
        if isinstance(v, dict):
            v = {a: b for a, b in v.items() if b is not None}
        if v not in (None, {}):
            out[k] = v
    return out


def split_schedule(cfg) -> tuple[list[dict], dict]:
    """The base schedule as ``(warmup phases, constant phase)``: a sweep's schedule is a warmup, then one
    constant-LR phase last (the trunk's), e.g. ``schedule=sweep_cpu``.

    Raises:
        ConfigError: the last phase is not constant (naming the schedule and its phases).
    """
    from omegaconf import OmegaConf

    phases = [_set_fields(p) for p in OmegaConf.to_container(cfg.schedule.phases, resolve=True)]
    if not phases or phases[-1].get("lr_style", "constant") != "constant":
        names = ", ".join(f"{p.get('name')} ({p.get('lr_style', 'constant')})" for p in phases)
        raise ConfigError(
            f"sweep: schedule '{cfg.schedule.name}' has phases {names}; a sweep's schedule is a warmup, then one "
            "constant-LR phase last (the trunk: every budget is a cooldown branch of it); allowed: e.g. "
            "schedule=sweep_cpu, or a schedule of that shape"
        )
    return phases[:-1], phases[-1]


def _with_constant_until(warmup: list[dict], constant: dict, tokens: int) -> list[dict]:
    const = {k: v for k, v in constant.items() if k not in ("tokens", "steps", "until_tokens")}
    return [*warmup, {**const, "until_tokens": int(tokens)}]


def _budgets(cfg, warmup_end: int, B: int, constant_end: int) -> list[tuple[int, int]]:
    """``[(budget_tokens, branch_step)]`` ascending; budgets rounded up to whole steps.

    Raises:
        ConfigError: a branch point inside the warmup.
    """
    f = float(cfg.sweep.cooldown.fraction)
    raw = list(cfg.sweep.budgets_tokens or []) or [constant_end]
    out = []
    for t in sorted(int(x) for x in raw):
        exact = -(-t // B) * B
        step = math.floor((1.0 - f) * exact / B)
        if step <= warmup_end:
            raise ConfigError(
                f"sweep.budgets_tokens: the budget {t:,} branches at step {step} (the first {1 - f:.0%} of its "
                f"{exact // B} steps of {B:,} tokens), inside the warmup (ends at step {warmup_end}); allowed: "
                f"budgets past {math.ceil((warmup_end + 1) * B / (1 - f)):,} tokens"
            )
        if out and out[-1][0] == exact:
            raise ConfigError(
                f"sweep.budgets_tokens: the budgets {out[-1][2]:,} and {t:,} both round up to {exact // B} steps of "
                f"{B:,} tokens ({exact:,} tokens: one cell); allowed: budgets at least one step ({B:,} tokens) apart"
            )
        out.append((exact, step, t))
    return [(exact, step) for exact, step, _ in out]


def _base_overrides(overrides: Sequence[str]) -> list[str]:
    """The user's overrides, with ``-m`` dropped; a key the grid sets itself is refused."""
    mine = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in GRID_KEYS]
    if mine:
        raise ConfigError(
            f"k2-train -m: {', '.join(mine)}: the sweep grid sets these itself; allowed: sweep.* "
            "(sparsities, seeds, budgets_tokens, cooldown, sizes) and any other setting"
        )
    return list(overrides)


def check_sweep_name(name) -> None:
    """``sweep.name`` is one directory name (``sweep.dir`` defaults to ``runs/sweeps/<name>``) and the runs'
    wandb group, so it may not be empty, absolute, or hold a path separator or ``..`` (which would put the
    grid into ``runs/sweeps/`` itself or outside ``runs/``).

    Raises:
        ConfigError: naming ``sweep.name`` and what is allowed.
    """
    text = "" if name is None else str(name)
    if text.strip() in ("", ".") or "/" in text or "\\" in text or ".." in text or os.path.isabs(text):
        raise ConfigError(
            f"sweep.name={text!r}: a sweep's name is one directory under runs/sweeps/ and its wandb group; "
            "allowed: a non-empty name without '/', '\\' or '..' (e.g. sparsity_sweep)"
        )


def check_sizes(cfg, base: list[str], sizes: dict) -> None:
    """Each size's overrides change the model, never what the grid owns or derives (:data:`SIZE_FORBIDDEN`):
    a size's own global batch would move its branch steps off the trunk's saves, its own top-k every arm's
    sparsity. A size is also loaded, so that a group override that changes one of :data:`SIZE_FIXED` is
    caught, and a bad setting is named with its size.

    Raises:
        ConfigError: naming the size and the key.
    """
    from omegaconf import OmegaConf

    allowed = "allowed: the model's shape (e.g. model.hidden_size=96, model.num_layers=4) and other settings"
    for size, overrides in sizes.items():
        if size is None:
            continue
        for o in overrides:
            key = o.split("=", 1)[0].lstrip("+~")
            owned = next((k for k in SIZE_FORBIDDEN if key == k or key.startswith(k + ".")), None)
            if owned is not None:
                raise ConfigError(
                    f"sweep.sizes.{size}: {o}: a size may not set {owned} (the grid sets it or derives the branch "
                    f"steps, the arms' sparsity, the seeds or the data order from it); {allowed}"
                )
        try:
            scfg = load_config([*base, *overrides])
        except ConfigError as e:
            raise ConfigError(f"sweep.sizes.{size}: {e}") from None
        for key in SIZE_FIXED:
            mine, theirs = OmegaConf.select(cfg, key), OmegaConf.select(scfg, key)
            if OmegaConf.is_config(mine):
                mine, theirs = OmegaConf.to_container(mine), OmegaConf.to_container(theirs)
            if mine != theirs:
                shown = f" ({mine} -> {theirs})" if not isinstance(mine, dict) else ""
                raise ConfigError(
                    f"sweep.sizes.{size}: {', '.join(overrides)} changes {key}{shown}, which the grid derives the "
                    f"branch steps, the arms' sparsity or the seeds from; {allowed}"
                )


def build_grid(overrides: Sequence[str]) -> tuple[object, Grid]:
    """The base config and the grid it declares (``sweep.*``), every run's overrides included.

    Raises:
        ConfigError: no ``sweep.sparsities``, a model without experts, a schedule not of the trunk's shape
            (:func:`split_schedule`), a budget branching inside the warmup, a setting the grid owns.
    """
    cfg = load_config(list(overrides))  # a bad setting is named first
    base = _base_overrides(overrides)
    sw = cfg.sweep
    if not sw.sparsities:
        raise ConfigError(
            "k2-train -m needs sweep.sparsities (e.g. +experiment=sparsity_sweep); allowed: a list of integers >= 1"
        )
    check_sweep_name(cfg.sweep.name)
    topk, B = int(cfg.model.moe_router_topk), int(cfg.schedule.global_batch_tokens)
    warmup, constant = split_schedule(cfg)
    from k2.schedules.resolve import resolve_schedule

    sched = resolve_schedule(cfg)
    warmup_end = (sched.phases[-2].last_step or 0) if len(sched.phases) > 1 else 0
    budgets = _budgets(cfg, warmup_end, B, sched.end_tokens)
    top = budgets[-1][0]
    seeds = [int(s) for s in (sw.seeds or [cfg.run.seed])]
    sizes = {str(k): list(v) for k, v in (sw.sizes or {}).items()} or {None: []}
    check_sizes(cfg, base, sizes)
    cooldown = {
        "style": str(sw.cooldown.style),
        "fraction": float(sw.cooldown.fraction),
        "lr_end": float(sw.cooldown.lr_end),
    }
    trunks, cells = [], []
    for s in sorted(int(x) for x in sw.sparsities):
        for size, size_ovr in sizes.items():
            for seed in seeds:
                t, cs = _trunk_and_cells(
                    cfg, base, size_ovr, (s, s * topk, size, seed), budgets, top, (warmup, constant, cooldown)
                )
                trunks.append(t)
                cells += cs
    grid = Grid(
        str(sw.name),
        Path(sw.dir),
        topk,
        B,
        warmup_end,
        cooldown,
        float(sw.collapsed_load),
        int(sw.jobs),
        tuple(trunks),
        tuple(cells),
    )
    return cfg, grid


def _trunk_and_cells(cfg, base: list[str], size_ovr: list[str], who: tuple, budgets, top: int, shape):
    """One trunk and its cells (see :func:`build_grid`); ``who`` = (sparsity, experts, size, seed)."""
    sparsity, experts, size, seed = who
    warmup, constant, cooldown = shape
    B = int(cfg.schedule.global_batch_tokens)
    arm = f"sparsity_{sparsity}"
    root = Path(cfg.sweep.dir) / arm / (size or "") / f"seed_{seed}"
    common = [
        *base,
        *size_ovr,
        f"model.num_moe_experts={experts}",
        f"run.seed={seed}",
        f"data.seed={int(cfg.run.seed)}",
        f"data.index_tokens={top}",
        f"run.wandb.group={cfg.sweep.name}",
    ]
    steps = tuple(step for _, step in budgets)
    label = f"{cfg.sweep.name}-{arm}{'-' + size if size else ''}-seed_{seed}"
    trunk = Trunk(
        arm,
        sparsity,
        experts,
        size,
        seed,
        root / "trunk",
        steps,
        tuple(
            [
                *common,
                f"run.dir={root / 'trunk'}",
                f"run.wandb.name={label}-trunk",
                "schedule.phases=" + hydra_value(_with_constant_until(warmup, constant, steps[-1] * B)),
                "checkpoint.save_steps=" + hydra_value(list(steps)),
            ]
        ),
    )
    cells = []
    for budget, step in budgets:
        decay = {
            "name": "cooldown",
            "until_tokens": budget,
            "lr_style": cooldown["style"],
            "lr_start": constant.get("lr_start"),
            "lr_end": cooldown["lr_end"],
        }
        run_dir = root / f"budget_{budget}"
        phases = [*_with_constant_until(warmup, constant, step * B), decay]
        cells.append(
            Cell(
                trunk,
                budget,
                step,
                budget // B,
                run_dir,
                tuple(
                    [
                        *common,
                        f"run.dir={run_dir}",
                        f"run.wandb.name={label}-budget_{budget}",
                        "schedule.phases=" + hydra_value(phases),
                        f"resume.branch_from={checkpoints_dir(trunk.run_dir) / iter_name(step)}",
                    ]
                ),
                tuple(phases),
            )
        )
    return trunk, cells
