"""A run that starts as a branch of another run's checkpoint (``resume.branch_from=PATH``).

A WSD schedule (constant LR, then a decay) makes every budget of a scaling sweep cheap: one trunk trains at
the constant LR and saves at the branch points; each budget is a *cooldown branch* that starts from the
trunk's checkpoint at ``(1 - f) x budget`` tokens and decays over the last ``f`` of its tokens (Hagele et al.
2024, arXiv 2405.18392, section 3: a 1-sqrt decay over ~20% matches a cosine run of that length).

The branch is a run dir of its own with its own schedule; only its decay differs from the trunk's. What makes
it exact:

* the checkpoint (model, optimizer, schedule position, data position, RNG) is the trunk's, loaded as any
  resume loads one (:mod:`k2.launcher.checkpointing.resume`);
* the branch's schedule must give every step up to the branch point the trunk's LR, context length and batch
  (:func:`check_branch_schedule`), so the branch *is* the trunk up to there; every other guarded setting
  (model, optimizer, data, seed, precision) must be the trunk's, as for any resume;
* the branch's ``metrics.jsonl`` starts with the trunk's records up to the branch point, byte for byte
  (:func:`seed_branch_run_dir`), and ``branch.json`` says which trunk and step it came from;
* it logs to a wandb run of its own (the trunk's id is not continued).

``resume.branch_from`` applies only while the branch's run dir has no checkpoint of its own: a branch that
was stopped resumes from its own latest checkpoint like any run.

Why our own: megatron-core's ``OptimizerParamScheduler`` has the WSD decay but no notion of starting a
second schedule from a first run's checkpoint; torchtitan and Megatron-Bridge load a checkpoint into a new
run only as an initialisation (a fresh optimizer or schedule), which is not a cooldown branch.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from k2.config.errors import ConfigError

#: the branch's record of where it came from, in its run dir
BRANCH_FILE = "branch.json"
_METRICS = "metrics.jsonl"

__all__ = ["BRANCH_FILE", "check_branch_schedule", "seed_branch_run_dir"]


def check_branch_schedule(cfg, trunk_schedule_cfg, step: int, checkpoint) -> None:
    """Refuse a branch whose schedule differs from the trunk's at any step up to the branch point.

    Args:
        cfg: this run's validated config (its ``schedule`` is the branch's).
        trunk_schedule_cfg: the trunk's ``schedule`` section (from the checkpoint's ``config.yaml``).
        step: the checkpoint's step (the branch point).
        checkpoint: its path (for the message).

    Raises:
        ConfigError: naming the first step whose LR, context length or global batch differs, both values,
            and the checkpoint.
    """
    from omegaconf import OmegaConf

    from k2.schedules.resolve import resolve_schedule

    trunk_cfg = OmegaConf.merge(cfg, {"schedule": OmegaConf.to_container(trunk_schedule_cfg, resolve=True)})
    trunk, ours = resolve_schedule(trunk_cfg), resolve_schedule(cfg)
    if trunk.global_batch_tokens != ours.global_batch_tokens:
        raise ConfigError(
            f"resume.branch_from={checkpoint}: schedule.global_batch_tokens={ours.global_batch_tokens:,}, the trunk "
            f"trained {trunk.global_batch_tokens:,} tokens per step; a branch keeps the trunk's batch"
        )
    for s in range(1, int(step) + 1):
        a, b = trunk.step_phase(s), ours.step_phase(s)
        lr_a, lr_b = trunk.step_lr(s), ours.step_lr(s)
        if a is None or b is None or a.seq_length != b.seq_length or not math.isclose(lr_a, lr_b, rel_tol=1e-12):
            raise ConfigError(
                f"resume.branch_from={checkpoint}: at step {s} (before the branch point, step {step}) this "
                f"schedule trains LR {lr_b:.6g} at context {getattr(b, 'seq_length', None)}, the trunk trained LR "
                f"{lr_a:.6g} at context {getattr(a, 'seq_length', None)}; a branch must follow the trunk's "
                "schedule up to the branch point and may differ only after it (e.g. its decay)"
            )


def seed_branch_run_dir(run_dir, checkpoint, step: int) -> bool:
    """Rank 0, before the metrics logger opens, at a branch's first start: copy the trunk's ``metrics.jsonl``
    records of steps ``<= step`` into the branch's (the same bytes), and write ``branch.json``.

    The trunk's run dir is the checkpoint's ``../..`` (``<trunk>/checkpoints/iter_NNNNNNN``). A branch dir
    that already has its metrics (a second start) is left alone. The file is written beside and renamed
    into place, so a kill never leaves a half-copied one.

    Returns:
        True when it seeded the dir.
    """
    run_dir, checkpoint = Path(run_dir), Path(checkpoint).resolve()
    if (run_dir / _METRICS).exists():
        return False
    trunk_dir = checkpoint.parent.parent
    lines = []
    src = trunk_dir / _METRICS
    if src.exists():
        with open(src, "rb") as fh:
            for raw in fh:
                try:
                    rec = json.loads(raw)
                except ValueError:  # a torn last record of a killed trunk: past its checkpoints anyway
                    continue
                if int(rec.get("step", -1)) <= step:
                    lines.append(raw if raw.endswith(b"\n") else raw + b"\n")
    run_dir.mkdir(parents=True, exist_ok=True)
    info = {
        "trunk_dir": str(trunk_dir),
        "trunk_checkpoint": str(checkpoint),
        "trunk_step": int(step),
        "copied_records": len(lines),
    }
    _write_atomic(run_dir / BRANCH_FILE, (json.dumps(info, indent=1) + "\n").encode())
    _write_atomic(run_dir / _METRICS, b"".join(lines))
    return True


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
