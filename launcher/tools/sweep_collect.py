"""Reading a sparsity sweep grid for ``k2-sweep-report``: ``grid.json`` and every cell's run dir, into one
:class:`GridData` of per-cell rows (training FLOPs, final validation loss, wall-clock, tokens/s, memory,
expert load), with every missing, unfinished or unreadable cell named with its file.

The layout (written by the grid runner, :mod:`k2.launcher.tools.sweep`):

* ``<SWEEP_DIR>/grid.json``: ``name``, ``topk``, ``reference_arm``, ``cooldown``, ``collapsed_load`` (the
  threshold on ``moe_load_max_over_mean``), ``warmup_steps`` and ``cells``: one object per (arm, size, seed,
  budget) with ``cell``, ``arm``, ``sparsity``, ``experts``, ``size``, ``seed``, ``budget_tokens``,
  ``branch_step``, ``trunk_dir``, ``run_dir`` (paths relative to SWEEP_DIR);
* per cell ``run_dir``: ``config.yaml`` (the resolved ``k2-train`` config), ``metrics.jsonl`` (the trunk's
  records up to the branch step, then the branch's own; ``val_loss`` always at the last step),
  ``branch.json`` and, only once finished, ``cell.json`` (``status``, ``wall_clock_s``,
  ``trunk_wall_clock_s``, ``peak_rss_bytes``, ``final_val_loss``, ``tokens``).

Training FLOPs of a cell: the sum over its records of ``flops_per_token(cfg.model, seq_length).training``
(:mod:`k2.model.flops`: 3 x forward, router included) times the tokens of that step, each step at its own
context length. Its loss at its budget: the last ``val_loss``. Its branch point: the FLOPs at the branch step
and the loss measured there, or interpolated between two evaluations of its trunk (``<trunk_dir>/metrics.jsonl``)
around it; no loss where neither exists (never extrapolated).

Public API: :func:`collect_grid(sweep_dir) <collect_grid>` -> :class:`GridData`; :func:`read_grid_spec`;
:class:`SweepInputError` (a grid that cannot be reported at all: no grid.json, a malformed one, no readable
cell).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Cell", "CellSpec", "GridData", "GridSpec", "SweepInputError", "collect_grid", "read_grid_spec"]

#: the cells' states: finished (cell.json present, metrics read), unfinished (no cell.json yet), missing (no
#: run dir), unreadable (a file that cannot be read: named in ``Cell.problem``)
STATUSES = ("finished", "unfinished", "missing", "unreadable")

_GRID_KEYS = {
    "name": str,
    "topk": int,
    "reference_arm": str,
    "cooldown": dict,
    "collapsed_load": (int, float),
    "warmup_steps": int,
    "cells": list,
}
_CELL_KEYS = {
    "cell": str,
    "arm": str,
    "sparsity": int,
    "experts": int,
    "seed": int,
    "budget_tokens": int,
    "branch_step": int,
    "trunk_dir": str,
    "run_dir": str,
}


class SweepInputError(ValueError):
    """A sweep dir that cannot be reported: the message names the file and the setting."""


@dataclass(frozen=True)
class CellSpec:
    """One cell of ``grid.json``: an (arm, size, seed, budget) and where its run dir is."""

    cell: str
    arm: str
    sparsity: int
    experts: int
    size: str | None
    seed: int
    budget_tokens: int
    branch_step: int
    trunk_dir: str
    run_dir: str


@dataclass(frozen=True)
class GridSpec:
    """``grid.json``; ``cooldown`` as written (``style``, ``fraction``)."""

    name: str
    topk: int
    reference_arm: str
    cooldown: dict
    collapsed_load: float
    warmup_steps: int
    cells: tuple[CellSpec, ...]

    @property
    def arms(self) -> list[str]:
        """The arms, by sparsity (then name)."""
        spars = {c.arm: c.sparsity for c in self.cells}
        return sorted(spars, key=lambda a: (spars[a], a))


@dataclass
class Cell:
    """One cell's row. FLOPs are training FLOPs; losses in nats; ``curve``: ``(FLOPs, val_loss)`` at each
    evaluation after step 0; ``branch_point``: ``(FLOPs, val loss)`` at the branch step, the loss measured
    there or interpolated between two of the trunk's evaluations around it, ``None`` where neither exists
    (:func:`_branch_point`). Load: ``moe_load_max_over_mean`` (1 = balanced) over the records after ``warmup_steps``."""

    spec: CellSpec
    status: str
    problem: str | None = None
    notes: list[str] = field(default_factory=list)
    tokens: int | None = None
    flops: float | None = None
    final_val_loss: float | None = None
    curve: list[tuple[float, float]] = field(default_factory=list)
    branch_point: tuple[float, float | None] | None = None
    seq_length: int | None = None
    flops_per_token: float | None = None
    router_share: float | None = None
    params_total: int | None = None
    params_active: int | None = None
    wall_clock_s: float | None = None
    trunk_wall_clock_s: float | None = None
    peak_rss_bytes: int | None = None
    tokens_per_s: float | None = None
    load_median: float | None = None
    load_max: float | None = None
    collapsed: bool | None = None

    @property
    def label(self) -> str:
        return self.spec.cell


@dataclass
class GridData:
    """A collected grid: its spec, one :class:`Cell` per grid.json cell (its order), where it was read."""

    spec: GridSpec
    cells: list[Cell]
    sweep_dir: str

    def cells_of(self, arm: str, status: str | None = None) -> list[Cell]:
        return [c for c in self.cells if c.spec.arm == arm and (status is None or c.status == status)]

    @property
    def incomplete(self) -> list[Cell]:
        """The cells that are not finished (missing, unfinished, unreadable)."""
        return [c for c in self.cells if c.status != "finished"]


def _check_keys(obj: dict, keys: dict, where: str) -> None:
    for k, t in keys.items():
        if k not in obj:
            raise SweepInputError(f"{where}: missing key '{k}'")
        if not isinstance(obj[k], t) or isinstance(obj[k], bool):
            raise SweepInputError(
                f"{where}: '{k}'={obj[k]!r} has the wrong type (expected {getattr(t, '__name__', 'a number')})"
            )


def read_grid_spec(sweep_dir) -> GridSpec:
    """``<sweep_dir>/grid.json``, checked: every key present with its type, distinct cell names, one
    sparsity and expert count per arm, ``reference_arm`` one of the arms, ``collapsed_load`` > 1.

    Raises:
        SweepInputError: naming the file and the key.
    """
    path = Path(sweep_dir) / "grid.json"
    if not path.is_file():
        raise SweepInputError(f"{path}: no such file (is {sweep_dir} a sweep dir written by the grid runner?)")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SweepInputError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise SweepInputError(f"{path}: expected a JSON object")
    _check_keys(data, _GRID_KEYS, str(path))
    cells = []
    for i, c in enumerate(data["cells"]):
        where = f"{path} cells[{i}]"
        if not isinstance(c, dict):
            raise SweepInputError(f"{where}: expected a JSON object")
        _check_keys(c, _CELL_KEYS, where)
        size = c.get("size")
        if size is not None and not isinstance(size, str):
            raise SweepInputError(f"{where}: 'size'={size!r}; allowed: null or a size name")
        cells.append(CellSpec(size=size, **{k: c[k] for k in _CELL_KEYS}))
    names = [c.cell for c in cells]
    if len(set(names)) != len(names):
        raise SweepInputError(f"{path}: cell names repeat: {sorted({n for n in names if names.count(n) > 1})}")
    if not cells:
        raise SweepInputError(f"{path}: 'cells' is empty")
    for arm in {c.arm for c in cells}:
        if len({(c.sparsity, c.experts) for c in cells if c.arm == arm}) != 1:
            raise SweepInputError(f"{path}: arm '{arm}' has cells of different sparsity or expert counts")
    arms = sorted({c.arm for c in cells})
    if data["reference_arm"] not in arms:
        raise SweepInputError(f"{path}: reference_arm='{data['reference_arm']}'; allowed: {', '.join(arms)}")
    if not data["collapsed_load"] > 1:
        raise SweepInputError(
            f"{path}: collapsed_load={data['collapsed_load']}; allowed: a number > 1 (1 = perfectly balanced experts)"
        )
    return GridSpec(
        name=data["name"],
        topk=data["topk"],
        reference_arm=data["reference_arm"],
        cooldown=data["cooldown"],
        collapsed_load=float(data["collapsed_load"]),
        warmup_steps=data["warmup_steps"],
        cells=tuple(cells),
    )


def read_records(path: Path, rel: str, finished: bool) -> tuple[list[dict], list[str]]:
    """The JSON records of ``metrics.jsonl`` and notes. The last line of an unfinished cell may be torn (a
    write cut by a kill): skipped with a note. Any other bad line raises ValueError naming ``rel:line``."""
    lines = path.read_text().splitlines()
    numbered = [(i + 1, s) for i, s in enumerate(lines) if s.strip()]
    records, notes = [], []
    for j, (n, s) in enumerate(numbered):
        try:
            rec = json.loads(s)
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise ValueError("not a record with an integer 'step'")
        except ValueError as e:  # (json.JSONDecodeError is a ValueError)
            if j == len(numbered) - 1 and not finished:
                notes.append(f"{rel}:{n}: torn last line skipped ({e})")
                continue
            raise ValueError(f"{rel}:{n}: not a valid metrics record ({e})") from None
        records.append(rec)
    return records, notes


def _flops_curve(records: list[dict], model_cfg, flops_of: Callable) -> tuple[list[float], int, int | None]:
    """Cumulative training FLOPs after each record (``flops_of(model_cfg, seq)[0]`` per token times the
    record's new tokens), the tokens, the last context length. Raises ValueError on a decreasing
    ``consumed_tokens``."""
    total, prev, cum, seq, per_token = 0.0, 0, [], None, {}
    for r in records:
        if r["step"] > 0:
            tokens, seq = int(r["consumed_tokens"]), int(r["seq_length"])
            if tokens < prev:
                raise ValueError(f"consumed_tokens decreases at step {r['step']}")
            if seq not in per_token:
                per_token[seq] = flops_of(model_cfg, seq)[0]
            total += per_token[seq] * (tokens - prev)
            prev = tokens
        cum.append(total)
    return cum, prev, seq


def _median_after(records: list[dict], key: str, warmup: int) -> tuple[float | None, float | None]:
    vals = [float(r[key]) for r in records if r["step"] > warmup and r.get(key) is not None]
    return (statistics.median(vals), max(vals)) if vals else (None, None)


def _evaluations(records: list[dict], cum: list[float]) -> list[tuple[int, float, float]]:
    """``(step, FLOPs, val_loss)`` of each evaluation after step 0, in step order."""
    evals = [(r["step"], f, float(r["val_loss"])) for r, f in zip(records, cum) if r["step"] > 0 and "val_loss" in r]
    return sorted(evals)


def _branch_point(
    cell: Cell, records: list[dict], cum: list[float], trunk: list[tuple[int, float, float]]
) -> tuple[float, float | None] | None:
    """``(FLOPs, val loss)`` at the branch step, ``None`` where the records do not reach it.

    The loss is measured, never extrapolated: the evaluation at the branch step, else the loss interpolated
    in ln FLOPs strictly between the trunk's last evaluation before the step and its first after it
    (``trunk``: the trunk's own evaluations; the cell's records after the branch step are the cooldown's,
    another LR schedule, and are not used). Where no evaluation precedes the step or the trunk has none
    after it, the loss is ``None``: the point is known in FLOPs only, and the figure draws no marker."""
    step = cell.spec.branch_step
    at = [f for r, f in zip(records, cum) if r["step"] == step]
    if not at or at[0] <= 0:
        return None
    evals = [e for e in _evaluations(records, cum) if e[0] <= step] + [e for e in trunk if e[0] > step]
    exact = [loss for s, _, loss in evals if s == step]
    before, after = [e for e in evals if e[0] < step], [e for e in evals if e[0] > step]
    if exact:
        return at[0], exact[0]
    if not before or not after:
        return at[0], None
    (_, f0, l0), (_, f1, l1) = before[-1], after[0]
    t = (math.log(at[0]) - math.log(f0)) / (math.log(f1) - math.log(f0)) if f1 > f0 else 0.0
    return at[0], l0 + t * (l1 - l0)


class _Trunks:
    """Each trunk's evaluations (:func:`_evaluations` of ``<trunk_dir>/metrics.jsonl``), read once per trunk
    (a trunk has one branch per budget): a branch point between two of them gets its loss from the trunk's
    own curve. A trunk that is absent or cannot be read gives none (its branch points then have a loss only
    where the branch's records evaluate at the branch step)."""

    def __init__(self, sweep_dir: Path):
        self._dir = sweep_dir
        self._evals: dict[str, list[tuple[int, float, float]]] = {}

    def evaluations(self, trunk_dir: str, model) -> list[tuple[int, float, float]]:
        if trunk_dir not in self._evals:
            try:
                records, _ = read_records(self._dir / trunk_dir / "metrics.jsonl", trunk_dir, finished=False)
                self._evals[trunk_dir] = _evaluations(records, _flops_curve(records, model, _flops_of)[0])
            except (OSError, ValueError, KeyError, TypeError):
                self._evals[trunk_dir] = []
        return self._evals[trunk_dir]


def _fill_from_metrics(
    cell: Cell, records: list[dict], model, flops_of: Callable, warmup: int, trunk: list[tuple[int, float, float]]
) -> None:
    cum, cell.tokens, cell.seq_length = _flops_curve(records, model, flops_of)
    cell.flops = cum[-1] if cum else 0.0
    cell.curve = [(f, float(r["val_loss"])) for r, f in zip(records, cum) if r["step"] > 0 and "val_loss" in r]
    cell.final_val_loss = cell.curve[-1][1] if cell.curve else None
    cell.branch_point = _branch_point(cell, records, cum, trunk)
    if cell.seq_length:
        cell.flops_per_token, cell.router_share = flops_of(model, cell.seq_length)
    cell.tokens_per_s = _median_after(records, "tokens_per_s", warmup)[0]
    cell.load_median, cell.load_max = _median_after(records, "moe_load_max_over_mean", warmup)


class _Configs:
    """The cells' ``config.yaml``: the model section for the FLOPs, and one parameter count per distinct model
    (a grid has a few models and many cells).

    Parsed by pyyaml's C parser (``yaml.CSafeLoader``, the pure-Python one where libyaml is absent), not
    ``OmegaConf.load``: reading 60 cells of k2_tiny took 0.36 s of CPU instead of 2.4 s (measured on a
    2-core Xeon), which a grid of hundreds of cells feels. The values are the same for a config written by
    ``OmegaConf.save`` (as ``k2-train`` writes it): its floats always carry a '.', which YAML 1.1 needs.
    """

    def __init__(self, params_of: Callable):
        import yaml

        self._loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        self._params_of = params_of
        self._models: dict[str, tuple] = {}

    def load(self, path: Path) -> tuple[object, tuple[int, int]]:
        """``(cfg.model as a DictConfig, (total, active) parameters)`` of one config.yaml."""
        import yaml
        from omegaconf import OmegaConf

        data = yaml.load(path.read_text(), Loader=self._loader)
        if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
            raise ValueError("no 'model' section")
        key = json.dumps(data["model"], sort_keys=True, default=str)
        if key not in self._models:
            self._models[key] = (OmegaConf.create(data["model"]), self._params_of(OmegaConf.create(data)))
        return self._models[key]


def _read_done(cell: Cell, path: Path) -> None:
    """``cell.json`` of a finished cell into ``cell``. Raises on a status other than finished."""
    done = json.loads(path.read_text())
    if done.get("status") != "finished":
        raise ValueError(f"status={done.get('status')!r}; expected 'finished'")
    cell.wall_clock_s, cell.trunk_wall_clock_s = done["wall_clock_s"], done.get("trunk_wall_clock_s")
    cell.peak_rss_bytes = done.get("peak_rss_bytes")
    if cell.final_val_loss is None:
        raise ValueError("finished, but metrics.jsonl has no val_loss")


def _trained_to_budget(spec: CellSpec, records: list[dict]) -> bool:
    """The cell's last record is its budget's last step, evaluated: finished, though no ``cell.json`` says so
    (``k2-train -m`` writes that file; a cell run by ``k2-submit -m``'s Slurm jobs has none)."""
    last = records[-1] if records else {}
    return last.get("consumed_tokens") == spec.budget_tokens and last.get("val_loss") is not None


def _wall_clock(spec: CellSpec, records: list[dict]) -> tuple[float | None, float | None]:
    """The branch's own wall-clock and the trunk's up to the branch point, from the goodput clock of the
    records (the branch's clock continues the trunk's checkpointed one)."""
    at_branch = next((r for r in records if r.get("step") == spec.branch_step), {})
    trunk_s, end_s = at_branch.get("time_total_s"), records[-1].get("time_total_s")
    return (end_s - trunk_s if trunk_s is not None and end_s is not None else None), trunk_s


def _read_cell(spec: CellSpec, sweep_dir: Path, grid: GridSpec, configs: _Configs, trunks: _Trunks) -> Cell:
    """One cell's row; a file that cannot be read makes the cell ``unreadable`` with ``problem`` naming it."""
    d = sweep_dir / spec.run_dir
    if not d.is_dir():
        return Cell(spec, "missing", problem=f"{spec.run_dir}/: no such directory")
    done_path = d / "cell.json"
    finished = done_path.is_file()
    if not finished and not (d / "metrics.jsonl").is_file():
        return Cell(spec, "unfinished", problem=f"{spec.run_dir}/metrics.jsonl: absent (not started)")
    cell = Cell(
        spec,
        "finished" if finished else "unfinished",
        problem=None if finished else f"{spec.run_dir}/cell.json: absent (not finished)",
    )
    current = "config.yaml"
    try:
        model, (cell.params_total, cell.params_active) = configs.load(d / "config.yaml")
        current = "metrics.jsonl"
        records, cell.notes = read_records(d / "metrics.jsonl", f"{spec.run_dir}/metrics.jsonl", finished)
        trunk = trunks.evaluations(spec.trunk_dir, model)
        _fill_from_metrics(cell, records, model, _flops_of, grid.warmup_steps, trunk)
        if finished:
            current = "cell.json"
            _read_done(cell, done_path)
        elif _trained_to_budget(spec, records):  # a run that ended outside k2-train -m (e.g. a Slurm job)
            cell.status, cell.problem = "finished", None
            cell.wall_clock_s, cell.trunk_wall_clock_s = _wall_clock(spec, records)
    except Exception as e:  # any failure to read one cell is reported with its file; the grid goes on
        where = str(e) if str(e).startswith(spec.run_dir) else f"{spec.run_dir}/{current}: {type(e).__name__}: {e}"
        return Cell(spec, "unreadable", problem=where)
    if cell.load_median is not None:
        cell.collapsed = cell.load_median > grid.collapsed_load
    return cell


def _flops_of(model_cfg, seq: int) -> tuple[float, float]:
    """Training FLOPs per token of ``model_cfg`` at context ``seq`` and the router's share of them."""
    from k2.model.flops import flops_per_token

    f = flops_per_token(model_cfg, seq)
    return f.training, f.terms()["router"] / f.forward


def _count_params(cfg) -> tuple[int, int]:
    """``(total, active)`` parameters of ``cfg.model`` (:func:`k2.model.params.count_params`)."""
    from k2.model.params import count_params  # (megatron's import: only once a cell is read)

    p = count_params(cfg)
    return int(p.total), int(p.active)


def collect_grid(sweep_dir, *, params_of: Callable | None = None) -> GridData:
    """Read ``grid.json`` and every cell of it (see the module docstring).

    Args:
        sweep_dir: the sweep's directory.
        params_of: cfg -> ``(total, active)`` parameters, called once per distinct ``cfg.model``; default
            :func:`k2.model.params.count_params` (builds the model on the meta device: imports megatron-core).

    Returns:
        :class:`GridData`; cells that are missing, unfinished or unreadable are in it with ``problem``
        naming the file.

    Raises:
        SweepInputError: no or a malformed grid.json, or not one cell readable.
    """
    spec = read_grid_spec(sweep_dir)
    configs = _Configs(params_of or _count_params)
    trunks = _Trunks(Path(sweep_dir))
    cells = [_read_cell(c, Path(sweep_dir), spec, configs, trunks) for c in spec.cells]
    if not any(c.status in ("finished", "unfinished") for c in cells):
        problems = "; ".join(c.problem for c in cells[:3] if c.problem)
        raise SweepInputError(
            f"{sweep_dir}: no readable cell among the {len(cells)} of grid.json ({problems}"
            + (", ..." if len(cells) > 3 else "")
            + ")"
        )
    return GridData(spec=spec, cells=cells, sweep_dir=str(sweep_dir))
