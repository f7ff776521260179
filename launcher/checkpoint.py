"""Checkpoints and resume: megatron-core dist-checkpointing (``torch_dist``) plus the run's own state.

Layout of ``<run.dir>/checkpoints/``::

    iter_0000004/            a complete checkpoint (only complete ones carry this name)
        *.distcp, .metadata  megatron dist-checkpointing (torch_dist): model chunks, optimizer
        common.pt, metadata.json
        k2_state.json        step, tokens, schedule/data position, layout, wandb run id (rank 0)
        config.yaml          the resolved config of the run that wrote it
    iter_0000008.partial/    a save in progress (or killed mid-way): never loaded, removed on start
    latest                   text: the directory name of the newest complete checkpoint

Visibility protocol (REFERENCE: a killed job must never leave a checkpoint that looks complete): every
rank writes into ``iter_N.partial``; after megatron's save returns on all ranks (its own barriers) and
one more barrier, rank 0 writes ``k2_state.json`` and ``config.yaml``, renames the directory to
``iter_N`` (atomic on one file system) and only then replaces ``latest`` (write-to-temp + rename). A
crash at any point before the rename of ``latest`` leaves the previous checkpoint as latest.

What is in a checkpoint (issue 5): model parameters of every chunk (megatron sharded state dict: global
layer numbers, experts by global index), the optimizer (megatron's ``DistributedOptimizer`` in the
``dp_reshardable`` format: fp32 master weights, Adam moments; Muon momentum through the layer-wise
optimizer), the LR/schedule position (``schedules.lr.TokenLRScheduler`` state: tokens consumed, steps),
the data position (the step: global batch ``j`` of a context stretch reads samples ``[jG, (j+1)G)``, see
``launcher.train._PhaseData``), the RNG state of every rank (torch CPU/CUDA generators, Python,
NumPy, megatron's model-parallel RNG-tracker streams) and the wandb run id.

Resharding: megatron's dist-checkpointing reshards model tensors for any layout; its optimizer formats
that work here reshard over DP only (``dp_reshardable``; the layer-wise Muon optimizer: the same DP).
So a resume may change the DP size (AdamW) but not PP, VPP or EP; :func:`check_resume_compatible`
says so before any process starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Optional

import torch

from launcher.config import ConfigError
from optim.build import leaf_optimizers

CHECKPOINTS = "checkpoints"
LATEST = "latest"
STATE_FILE = "k2_state.json"
CONFIG_FILE = "config.yaml"
PARTIAL_SUFFIX = ".partial"
#: megatron ``DistributedOptimizer`` format: each rank saves its own flat shards; reshards over DP.
OPTIM_SHARDING = "dp_reshardable"
#: config sections whose change alters what training computes; refused on resume unless resume.force.
GUARDED = ("model", "schedule", "optim", "data", "run.seed", "train.precision")
#: ``resume.*`` keys and their defaults (``resume`` is a plain mapping because ``from`` is a Python
#: keyword and cannot be a dataclass field).
RESUME_KEYS = {"mode": "auto", "from": None, "force": False}
RESUME_MODES = ("auto", "never")


def iter_name(step: int) -> str:
    """``iter_0000042`` for step 42 (Megatron-LM's naming)."""
    return f"iter_{step:07d}"


def checkpoints_dir(run_dir) -> Path:
    return Path(run_dir) / CHECKPOINTS


def latest_checkpoint(run_dir) -> Optional[Path]:
    """The checkpoint ``<run.dir>/checkpoints/latest`` names, or None when there is none.

    Raises:
        ConfigError: ``latest`` names a directory that is not a complete checkpoint.
    """
    pointer = checkpoints_dir(run_dir) / LATEST
    if not pointer.exists():
        return None
    path = checkpoints_dir(run_dir) / pointer.read_text().strip()
    read_state(path)  # complete?
    return path


def read_state(path) -> dict:
    """``k2_state.json`` of the checkpoint at ``path`` (written last, so its presence marks a complete
    checkpoint).

    Raises:
        ConfigError: ``path`` is missing, a partial save, or not a k2-launcher checkpoint.
    """
    path = Path(path)
    if path.name.endswith(PARTIAL_SUFFIX):
        raise ConfigError(f"checkpoint {path} is a partial save (killed mid-way); resume from a "
                          f"complete one: {', '.join(_complete_names(path.parent)) or 'none exists'}")
    state_file = path / STATE_FILE
    if not path.is_dir():
        raise ConfigError(f"checkpoint {path} does not exist")
    if not state_file.exists() or not (path / "metadata.json").exists():
        raise ConfigError(f"{path} is not a complete k2-launcher checkpoint (no {STATE_FILE} or "
                          "metadata.json); complete ones in its directory: "
                          f"{', '.join(_complete_names(path.parent)) or 'none'}")
    try:
        return json.loads(state_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"checkpoint {path}: {STATE_FILE} is corrupt ({e})") from None


def _complete_names(root: Path) -> list[str]:
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir()
                  if p.is_dir() and p.name.startswith("iter_") and (p / STATE_FILE).exists())


def resume_settings(cfg) -> dict:
    """``cfg.resume`` with defaults filled in and checked.

    Raises:
        ConfigError: an unknown key or mode.
    """
    raw = cfg.get("resume") or {}
    if isinstance(raw, str):
        raw = {"mode": raw}
    settings = dict(RESUME_KEYS)
    for k, v in dict(raw).items():
        if k not in RESUME_KEYS:
            raise ConfigError(f"unknown setting resume.{k}; allowed: {', '.join('resume.' + n for n in RESUME_KEYS)}")
        settings[k] = v
    if settings["mode"] not in RESUME_MODES:
        raise ConfigError(f"resume={settings['mode']!r}; allowed: {', '.join(RESUME_MODES)} "
                          "(or resume.from=PATH to resume from a given checkpoint)")
    if settings["mode"] == "never" and settings["from"] is not None:
        raise ConfigError("resume=never contradicts resume.from; set one of them")
    return settings


def _select(container: dict, dotted: str):
    node = container
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _diff(a, b, prefix: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{prefix}.{k}")
        return out
    return [] if a == b else [f"{prefix}: {a!r} -> {b!r}"]


def check_resume_compatible(state: dict, saved_cfg: dict, cfg: dict, layout: dict, force: bool,
                            path) -> list[str]:
    """Refuse a resume that would silently change training or that the checkpoint cannot serve.

    Args:
        state: the checkpoint's ``k2_state.json``.
        saved_cfg / cfg: the resolved configs (dicts) of the checkpoint's run and of this run.
        layout: this run's ``{"pp", "vpp", "ep", "dp", "world_size"}``.
        force: ``resume.force``: accept changes of guarded settings (never a layout change).

    Returns:
        The accepted changes of guarded settings (to be logged), empty when none.

    Raises:
        ConfigError: PP, VPP or EP differ (the optimizer formats reshard over DP only), the DP size
            differs with the layer-wise (Muon) optimizer, or a guarded setting (:data:`GUARDED`) differs
            and ``force`` is false.
    """
    saved = state["layout"]
    fixed = [k for k in ("pp", "vpp", "ep") if saved[k] != layout[k]]
    if fixed:
        raise ConfigError(
            f"checkpoint {path} was written with PP={saved['pp']} VPP={saved['vpp']} EP={saved['ep']} "
            f"(DP={saved['dp']}); this run has PP={layout['pp']} VPP={layout['vpp']} EP={layout['ep']}. "
            f"Compatible layouts: parallel.pp={saved['pp']}, parallel.vpp={saved['vpp']}, "
            f"parallel.ep={saved['ep']} with any DP that divides the run (AdamW); the optimizer "
            "checkpoint formats reshard over DP only"
        )
    if saved["dp"] != layout["dp"] and state.get("optimizer_dp_fixed"):
        raise ConfigError(
            f"checkpoint {path} holds the layer-wise (Muon) optimizer state of DP={saved['dp']}; megatron's "
            f"LayerWiseDistributedOptimizer checkpoints are for a fixed DP size: run with world size "
            f"{saved['world_size']} (DP={saved['dp']})"
        )
    changes = []
    for key in GUARDED:
        changes += _diff(_select(saved_cfg, key), _select(cfg, key), key)
    if changes and not force:
        raise ConfigError(
            f"resuming from {path} would change training: {'; '.join(changes[:6])}"
            f"{' ...' if len(changes) > 6 else ''}. Restore those settings, start a new run.dir, or "
            "accept the change with resume.force=true"
        )
    return changes


def plan_resume(cfg, layout: dict) -> Optional[Path]:
    """Decide, before any process group exists, which checkpoint this run resumes from.

    ``resume.from=PATH`` -> that checkpoint; ``resume=auto`` (default) -> ``<run.dir>/checkpoints/latest``
    when it exists; otherwise a fresh start, which needs a run dir without a previous run (``resume=never``
    refuses any non-empty run dir).

    Raises:
        ConfigError: see :func:`resume_settings`, :func:`read_state`, :func:`check_resume_compatible`;
            a fresh start into a run dir that holds metrics but no checkpoint.
    """
    from omegaconf import OmegaConf

    settings = resume_settings(cfg)
    run_dir = Path(cfg.run.dir)
    if settings["mode"] == "never":
        if run_dir.exists() and any(run_dir.iterdir()):
            raise ConfigError(f"resume=never and run.dir={run_dir} is not empty; choose a new run.dir "
                              "or drop resume=never to resume from its latest checkpoint")
        return None
    if settings["from"] is not None:
        path = Path(str(settings["from"]))
        if path.is_dir() and (path / LATEST).exists():  # a checkpoints/ directory: its latest
            path = path / (path / LATEST).read_text().strip()
        elif path.is_dir() and (path / CHECKPOINTS / LATEST).exists():  # a run dir: its latest
            path = latest_checkpoint(path)
    else:
        path = latest_checkpoint(run_dir)
        if path is None:
            if (run_dir / "metrics.jsonl").exists():
                raise ConfigError(
                    f"run.dir={run_dir} holds a run (metrics.jsonl) but no complete checkpoint to resume "
                    "from; choose a new run.dir, delete the old one, or set train.save_interval"
                )
            return None
    state = read_state(path)
    saved_cfg = OmegaConf.to_container(OmegaConf.load(path / CONFIG_FILE), resolve=True)
    check_resume_compatible(state, saved_cfg, OmegaConf.to_container(cfg, resolve=True), layout,
                            bool(settings["force"]), path)
    return path


# --- RNG ------------------------------------------------------------------------------------------------


def rng_state() -> dict:
    """This rank's generators: Python, NumPy, torch CPU, CUDA (when present), megatron's RNG tracker
    (the model-parallel / expert-parallel / data-parallel streams, ``tensor_parallel.random``)."""
    import numpy as np
    from megatron.core import tensor_parallel

    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: dict) -> None:
    """Inverse of :func:`rng_state`."""
    import numpy as np
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


# --- save / load ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _fp32_params_visible_to_checkpointing(optimizer):
    """Let megatron's mixed-precision optimizer wrapper checkpoint fp32 model parameters.

    ``Float16OptimizerWithFloat16Params.sharded_state_dict`` (megatron-core 0.19.2) maps optimizer state to
    model tensors through its ``float16_groups`` only; parameters that are fp32 in the model sit in
    ``fp32_from_fp32_groups`` and fail with "Param id 0 does not match any model sharded param". The
    MuonClip path always uses that wrapper, also for an fp32 model (optim/build.py: megatron's
    layer-wise optimizer needs it), so for a wrapper that holds no 16-bit parameter at all the fp32 groups
    -- the same tensors, in the same order as its inner optimizer's parameters -- stand in for the
    float16 groups while the state dict is built.
    """
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    swapped = []
    for opt in leaf_optimizers(optimizer):
        if (isinstance(opt, Float16OptimizerWithFloat16Params)
                and not any(opt.float16_groups) and any(opt.fp32_from_fp32_groups)):
            swapped.append((opt, opt.float16_groups))
            opt.float16_groups = opt.fp32_from_fp32_groups
    try:
        yield
    finally:
        for opt, groups in swapped:
            opt.float16_groups = groups


def _sharded_state_dict(model: list, optimizer, is_loading: bool, with_rng: bool) -> dict:
    """Megatron-LM's checkpoint structure: ``model`` (one chunk) or ``model0..``, ``optimizer``, and one
    ``rng_state`` object per global rank."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    sd: dict = {}
    if len(model) == 1:
        sd["model"] = model[0].module.sharded_state_dict()
    else:
        for i, chunk in enumerate(model):
            sd[f"model{i}"] = chunk.module.sharded_state_dict()
    # the optimizer finds its parameters in the model tensors of ALL chunks (as Megatron-LM passes its
    # whole state dict); a flat merge would lose chunk 0's entries to chunk 1's equal local names
    model_sd = dict(sd)
    with _fp32_params_visible_to_checkpointing(optimizer):
        sd["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": OPTIM_SHARDING})
    if with_rng:
        world, rank = dist.get_world_size(), dist.get_rank()
        sd["rng_state"] = ShardedObject("rng_state", rng_state() if not is_loading else None,
                                        (world,), (rank,), replica_id=0)
    return sd


def _in_process_write_results() -> None:
    """Make megatron's torch_dist writer report its write results through an in-process queue.

    megatron-core 0.19.2 (``filesystem_async.get_write_results_queue``) hands the writer's results back
    through a ``multiprocessing`` Manager queue, i.e. a helper process started with ``spawn`` on the first
    save of every rank. For a synchronous save (ours) the writer runs in the rank's own threads, so a
    plain ``queue.Queue`` carries the same results. The helper process is harmful here: Slurm sends
    SIGTERM to every process of a job step on requeue/preemption, which kills it and with it the very
    save the signal asked for (found by tests/test_slurm_real.py); it also costs a Python start per rank
    and makes any script that wraps the trainer need an ``if __name__ == "__main__"`` guard.
    """
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _before_commit(step: int) -> None:
    """Runs on every rank after its tensors are written and before the checkpoint is made visible. A
    no-op; tests replace it to kill a rank mid-save (tests/scripts/crash_in_save_train.py)."""


def save_checkpoint(run_dir, step: int, model: list, optimizer, state: dict, config_yaml: str,
                    keep_last: int, keep_every: Optional[int]) -> Path:
    """Write checkpoint ``iter_<step>`` on every rank and make it ``latest`` once all ranks are done.

    Args:
        run_dir: ``run.dir``.
        step: the optimizer step just completed (1-based).
        model: the DDP-wrapped model chunks; optimizer: the megatron optimizer.
        state: JSON-able run state for ``k2_state.json`` (rank 0's value is written).
        config_yaml: the resolved config.
        keep_last / keep_every: retention (see :func:`prune`).

    Returns:
        The path of the complete checkpoint.

    Collective: every rank must call it at the same step.
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    root = checkpoints_dir(run_dir)
    final = root / iter_name(step)
    partial = root / (iter_name(step) + PARTIAL_SUFFIX)
    if dist.get_rank() == 0:
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
    dist.barrier()
    sd = _sharded_state_dict(model, optimizer, is_loading=False, with_rng=True)
    _in_process_write_results()
    dist_checkpointing.save(sd, str(partial), validate_access_integrity=True)
    _before_commit(step)
    dist.barrier()  # every rank's shards are on disk
    if dist.get_rank() == 0:
        (partial / STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")
        (partial / CONFIG_FILE).write_text(config_yaml)
        if final.exists():  # re-save of the same step (e.g. after a resume that replayed it)
            shutil.rmtree(final)
        os.replace(partial, final)
        tmp = root / (LATEST + ".tmp")
        tmp.write_text(final.name + "\n")
        os.replace(tmp, root / LATEST)
        prune(root, keep_last, keep_every)
    dist.barrier()
    return final


def prune(root: Path, keep_last: int, keep_every: Optional[int]) -> list[str]:
    """Delete complete checkpoints except the newest ``keep_last`` and every step that is a multiple of
    ``keep_every``; the one ``latest`` names is always kept. Returns the names removed."""
    root = Path(root)
    latest = (root / LATEST).read_text().strip() if (root / LATEST).exists() else None
    names = _complete_names(root)
    keep = set(names[-keep_last:]) if keep_last > 0 else set()
    if keep_every:
        keep |= {n for n in names if int(n.split("_")[1]) % keep_every == 0}
    if latest:
        keep.add(latest)
    removed = [n for n in names if n not in keep]
    for n in removed:
        shutil.rmtree(root / n, ignore_errors=True)
    return removed


def remove_partial_saves(run_dir) -> list[str]:
    """Delete ``iter_*.partial`` leftovers of killed saves (rank 0, before training). Returns their names."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    gone = [p.name for p in root.iterdir() if p.name.endswith(PARTIAL_SUFFIX)]
    for n in gone:
        shutil.rmtree(root / n, ignore_errors=True)
    return gone


def _materialise_optimizer_state(optimizer) -> None:
    """Give every parameter of a fresh optimizer its (zero) state before a load.

    megatron-core 0.19.2's ``DistributedOptimizer.sharded_state_dict(is_loading=True)`` first calls its
    ``state_dict()``, which without Apex/Transformer Engine reads ``state[p]["step"]`` of every parameter
    and asserts they agree -- it fails (assert / KeyError 'step') on a fresh optimizer, i.e. on every
    resume on CPU or on a GPU without TE. Megatron's own remedy (``_init_optimizer_states_with_dummy_values``)
    runs an optimizer step, which applies weight decay to the parameters; here the state is created in
    place instead (zeros and step 0, every value overwritten by the load), through megatron's
    ``init_state_fn`` where the optimizer has one (Adam moments, Muon momentum).
    """
    for opt in leaf_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        init_fn = getattr(opt, "init_state_fn", None)
        if init_fn is not None:
            init_fn(inner, getattr(opt, "config", None))
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state[p]
                if isinstance(inner, torch.optim.Adam) or isinstance(inner, torch.optim.AdamW):
                    st.setdefault("exp_avg", torch.zeros_like(p, memory_format=torch.preserve_format))
                    st.setdefault("exp_avg_sq", torch.zeros_like(p, memory_format=torch.preserve_format))
                    st.setdefault("step", torch.tensor(0.0, dtype=torch.float32))


def _restore_step_counts(optimizer) -> None:
    """Give each parameter its own, correct Adam ``step`` after a load.

    megatron-core 0.19.2's ``DistributedOptimizer.load_state_dict`` on the path without Apex/TE (i)
    puts ONE ``step`` tensor into the state of every parameter, which torch's Adam then increments in
    place once per parameter, and (ii) copies the per-parameter ``step`` of the ``dp_reshardable``
    parameter state over it, which loads as 0. Either way the bias correction of every later update
    differs from an uninterrupted run (found by the bitwise-resume test, tests/test_checkpoint.py). The
    step megatron keeps in each param group (restored correctly) is the true count.
    """
    for opt in leaf_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            step = group.get("step")
            for p in group["params"]:
                st = inner.state.get(p)
                if st and isinstance(st.get("step"), torch.Tensor):
                    st["step"] = (torch.tensor(float(step), dtype=st["step"].dtype,
                                               device=st["step"].device)
                                  if step is not None else st["step"].detach().clone())


def load_checkpoint(path, model: list, optimizer, same_world: bool) -> dict:
    """Load model chunks, optimizer and (when the world size is the checkpoint's) this rank's RNG state.

    Returns:
        The checkpoint's ``k2_state.json``.

    Collective: every rank calls it. Megatron's dist-checkpointing reads each rank's tensors, resharding
    the model for the current layout and the optimizer for the current DP size.
    """
    from megatron.core import dist_checkpointing

    path = Path(path)
    state = read_state(path)
    _materialise_optimizer_state(optimizer)
    sd = _sharded_state_dict(model, optimizer, is_loading=True, with_rng=same_world)
    loaded = dist_checkpointing.load(sd, str(path))
    if len(model) == 1:
        model[0].module.load_state_dict(loaded["model"], strict=True)
    else:
        for i, chunk in enumerate(model):
            chunk.module.load_state_dict(loaded[f"model{i}"], strict=True)
    with torch.no_grad():
        optimizer.load_state_dict(loaded["optimizer"])
    _restore_step_counts(optimizer)
    if same_world:
        set_rng_state(loaded["rng_state"])
    return state
