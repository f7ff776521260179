"""Per-step metrics: ``<run.dir>/metrics.jsonl``, wandb, and a progress bar (rank 0 only).

``metrics.jsonl`` holds one JSON object per optimizer step with at least ``step``, ``consumed_tokens``, ``lr``,
``loss``, ``grad_norm``, ``tokens_per_s``, ``model_tflops_per_gpu`` and ``mfu`` (model FLOPs of the step,
``model/flops.py``, on a GPU against ``plan.hardware``'s BF16 peak or ``cluster.peak_tflops`` where set; on CPU
against ``cluster.cpu_peak_tflops``, null when that is null: :func:`step_mfu`), and ``val_loss`` on validation
steps. A fresh run with validation on starts with one record ``{"step": 0, "consumed_tokens": 0, "phase",
"seq_length", "val_loss"}``: the validation loss before training (no ``loss``; readers of training steps skip
step 0). wandb runs offline unless ``run.wandb.mode`` says otherwise (``disabled`` turns it off); it never makes
a network call in offline mode.

A logger never costs a checkpoint: any failure of wandb (its service killed by a job manager's SIGTERM,
a lost connection, a full disk) prints one warning, turns wandb off for the rest of the process and
training, saving and ``metrics.jsonl`` go on.

Resume policy. A resumed run appends to the same ``metrics.jsonl`` and continues the same wandb
run (its id is stored in the checkpoint; ``resume="must"`` online, ``"allow"`` offline, where there is no
server to ask). When it resumes from a checkpoint older than the last logged step (preempted between two
saves), the steps after the checkpoint are computed again: their earlier records are moved from
``metrics.jsonl`` to ``metrics.replayed.jsonl`` (so ``metrics.jsonl`` holds one record per step, the
one whose weights the run continued from), and the new records carry ``"replayed": true``. wandb's own
step counter must increase, so the x-axis of every wandb chart is the metric ``step`` (``define_metric``)
and wandb's internal counter is left alone: a replayed step appears as a second point at the same
``step``, marked ``replayed``, never silently dropped.

Torn records. A process killed while it appends a record leaves its text cut, without a newline; the next
start would append after it, leaving the torn text between valid records, where a reader that parses the
file line by line (``pandas.read_json(lines=True)``, ``jq``) fails. Before a start reads or appends to the
run's append-only records (``metrics.jsonl``, ``metrics.replayed.jsonl``), every line of them that is not
a JSON object is moved to ``<name>.torn`` with a note (:func:`set_aside_torn_records`).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, SupportsFloat, cast

if TYPE_CHECKING:
    from k2.config.schema import K2Config, WandbConfig
    from k2.schedules.wsd import Phase


def step_record(
    step: int,
    phase: Phase,
    *,
    consumed_tokens: int,
    lr: float,
    loss: float,
    grad_norm: SupportsFloat | None,
    update_ok: bool,
    seconds: float,
    tokens_per_step: int,
    attn: Mapping[str, Any],
    mfu: tuple[float, float | None],
    extra: Iterable[Mapping[str, Any]] = (),
    saved_bytes_per_microbatch: float | None = None,
    replayed: bool = False,
) -> dict[str, Any]:
    """The record of optimizer step ``step`` in ``metrics.jsonl`` (module docstring), its keys in this order:
    ``step``, ``consumed_tokens``, the phase's ``phase`` / ``seq_length`` / ``global_batch_size`` /
    ``num_microbatches`` / ``layer_recompute``, ``lr``, ``loss``, ``grad_norm``, ``tokens_per_s``,
    ``step_time_s``, ``update_successful``, ``attn``'s keys, ``model_tflops_per_gpu``, ``mfu``, each
    ``extra``'s keys, then ``saved_bytes_per_microbatch`` and ``replayed`` where they apply.

    Args:
        step: the optimizer step (1-based); phase: the schedule phase it ran in.
        consumed_tokens: tokens trained on after the step; lr: the step's learning rate.
        loss: the step's global per-token loss; grad_norm: the global gradient norm (None: not measured).
        update_ok: the optimizer applied the update (megatron's ``update_successful``).
        seconds: the step's wall time; tokens_per_step: tokens of one step (``tokens_per_s`` from both).
        attn: QK-Clip's ``max_attn_logit``, ``max_attn_logit_per_layer``, ``qk_clipped_heads``.
        mfu: ``(model TFLOP/s per rank, MFU)``, :func:`step_mfu`.
        extra: more fields, in order (the MoE routing of :mod:`k2.launcher.training.moe_metrics`, the
            pipeline's ``wgrad_deferred_peak_bytes``).
        saved_bytes_per_microbatch: bytes kept for backward per microbatch (``train.measure_saved_bytes``).
        replayed: the step is re-run after a resume (its first record is in :data:`REPLAYED_METRICS`).
    """
    record = {
        "step": step,
        "consumed_tokens": consumed_tokens,
        "phase": phase.name,
        "seq_length": phase.seq_length,
        "global_batch_size": phase.global_batch_size,
        "num_microbatches": phase.num_microbatches,
        "layer_recompute": "layer" in (phase.memory or {}).get("recompute", ()),
        "lr": lr,
        "loss": loss,
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
        "tokens_per_s": tokens_per_step / seconds,
        "step_time_s": seconds,
        "update_successful": update_ok,
        **attn,
    }
    record["model_tflops_per_gpu"], record["mfu"] = mfu
    for fields in extra:
        record.update(fields)
    if saved_bytes_per_microbatch is not None:
        record["saved_bytes_per_microbatch"] = saved_bytes_per_microbatch
    if replayed:
        record["replayed"] = True
    return record


def step_mfu(flops: float, seconds: float, num_ranks: int, cfg: K2Config, on_gpu: bool) -> tuple[float, float | None]:
    """``(model TFLOP/s per rank, MFU)`` of a step against the peak of the device the run used: on a GPU
    the BF16 peak of ``plan.hardware``'s profile, or ``cluster.peak_tflops`` where set
    (:func:`k2.config.hardware.peak_tflops`); on CPU ``cluster.cpu_peak_tflops`` (a GEMM rate of one rank),
    or no MFU (None) when that is null -- a GPU's BF16 peak would give a meaningless 1e-6 on a CPU.

    Args:
        flops: model FLOPs of the step (``k2.model.flops.step_flops``); seconds: its wall time;
        num_ranks: the world size; cfg: the run's config; on_gpu: the run's ranks use CUDA devices.

    Raises:
        ConfigError: on a GPU, ``plan.hardware`` names no readable profile.
    """
    from k2.config.hardware import peak_tflops
    from k2.model.flops import mfu

    peak = peak_tflops(cfg) if on_gpu else cfg.cluster.cpu_peak_tflops
    tflops, fraction = mfu(flops, seconds, num_ranks, float(peak) if peak is not None else 1.0)
    return tflops, (fraction if peak is not None else None)


#: where the records of steps re-run after a resume go (see the module docstring)
REPLAYED_METRICS = "metrics.replayed.jsonl"


#: the run's append-only JSONL records that a start reads or rewrites (module docstring: torn records)
APPEND_ONLY_RECORDS = ("metrics.jsonl", REPLAYED_METRICS)
TORN_SUFFIX = ".torn"


def _is_record(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:  # (JSONDecodeError, and UnicodeDecodeError of cut multi-byte text)
        return False


def set_aside_torn_records(run_dir: str | Path) -> list[str]:
    """Rank 0, before anything reads or appends to :data:`APPEND_ONLY_RECORDS`: move every line of them
    that is not a JSON object (a record cut by a kill, or such a text an earlier start left between
    records) to ``<name>.torn`` (appended, a line each) and rewrite the file without it (atomically); a
    complete record without its newline is kept. Returns one note per file repaired."""
    notes = []
    for name in APPEND_ONLY_RECORDS:
        path = Path(run_dir) / name
        if not path.is_file():
            continue
        lines = [line for line in path.read_bytes().split(b"\n") if line.strip()]
        torn = [line for line in lines if not _is_record(line)]
        if not torn:
            continue
        with open(path.with_name(name + TORN_SUFFIX), "ab") as fh:
            fh.write(b"".join(line + b"\n" for line in torn))
        tmp = path.with_name(name + ".tmp")
        tmp.write_bytes(b"".join(line + b"\n" for line in lines if _is_record(line)))
        os.replace(tmp, path)
        notes.append(
            f"k2-train: {path} held {len(torn)} torn record{'s' if len(torn) > 1 else ''} "
            f"({sum(map(len, torn))} bytes: a process killed while writing it), moved to "
            f"{name + TORN_SUFFIX}: the file parses line by line again"
        )
    return notes


def set_aside_replayed_metrics(run_dir: str | Path, resume_step: int) -> int:
    """Move the records of steps after ``resume_step`` from ``metrics.jsonl`` to
    :data:`REPLAYED_METRICS` (appended). Returns the last step that had a record (``resume_step`` when
    none is moved). Rank 0, before the logger opens the file."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return resume_step
    keep: list[str] = []
    moved: list[str] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill: not a record
            continue
        (moved if int(rec.get("step", 0)) > resume_step else keep).append(line)
    if moved:
        with open(Path(run_dir) / REPLAYED_METRICS, "a") as fh:
            fh.write("\n".join(moved) + "\n")
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)
    return max([resume_step] + [int(json.loads(line)["step"]) for line in moved])


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _teardown_wandb() -> None:
    """After a wandb failure: release its service connection, which also unregisters wandb's exit hook
    (that hook would otherwise print a second traceback of the same lost connection at exit)."""
    try:
        import wandb

        wandb.teardown()
    except Exception:
        pass


class MetricsLogger:
    """Writes metrics on the logging rank; a no-op elsewhere. Made before the run's checkpoint is restored
    (its console lines: :meth:`message`), opened after it (:meth:`open`: ``metrics.jsonl``, wandb and the
    progress bar continue the run from the checkpoint's step and wandb run).

    Args:
        run_dir: the run directory (created by :meth:`open` if missing).
        enabled: True on global rank 0.
    """

    def __init__(self, run_dir: str | Path, enabled: bool):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._wandb: Any = None
        self._bar: Any = None
        self._fh: Any = None
        self._total = 0
        self._plain_every = 0
        self._wandb_id: str | None = None

    def open(
        self,
        total_steps: int,
        wandb_cfg: WandbConfig | None = None,
        config: dict | None = None,
        progress: bool = True,
        start_step: int = 0,
        log_interval: int = 10,
        wandb_run_id: str | None = None,
    ) -> MetricsLogger:
        """Open ``metrics.jsonl`` (appended), the wandb run and the progress bar. Returns this logger.

        Args:
            total_steps: for the progress bar.
            wandb_cfg: ``cfg.run.wandb``.
            config: resolved config (dict) to store with the wandb run.
            progress: show a tqdm bar on a terminal; elsewhere (a log file, CI) a plain line every
                ``log_interval`` steps instead.
            start_step: steps already done (>0 on resume).
            log_interval: steps between plain log lines when stderr is not a terminal.
            wandb_run_id: continue this wandb run (from the checkpoint) instead of starting one.
        """
        self._total = total_steps
        self._wandb_id = wandb_run_id
        if not self.enabled:
            return self
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        if wandb_cfg is not None and wandb_cfg.mode != "disabled":
            self._call_wandb("init", self._init_wandb, wandb_cfg, config, wandb_run_id)
        if progress and not sys.stderr.isatty():
            self._plain_every = max(1, int(log_interval))
        elif progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
        return self

    def _init_wandb(self, wandb_cfg: WandbConfig, config: dict | None, wandb_run_id: str | None) -> None:
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        resume: Literal["must", "allow"] | None = None
        if wandb_run_id is not None:
            resume = "must" if wandb_cfg.mode == "online" else "allow"
        self._wandb = wandb.init(
            mode=cast(Literal["online", "offline", "disabled"], str(wandb_cfg.mode)),  # (WandbMode's values)
            project=wandb_cfg.project,
            entity=wandb_cfg.entity,
            name=wandb_cfg.name,
            group=getattr(wandb_cfg, "group", None),  # (a section written before the key existed: none)
            dir=str(self.run_dir),
            config=config,
            reinit="finish_previous",
            id=wandb_run_id,
            resume=resume,
        )
        self._wandb_id = self._wandb.id
        self._wandb.define_metric("step")
        self._wandb.define_metric("*", step_metric="step")

    def _call_wandb(self, what: str, fn: Callable[..., Any], *args: Any) -> None:
        """Run one wandb call; on any exception warn once, stop using wandb, and carry on."""
        try:
            fn(*args)
        except Exception as e:
            self._wandb = None
            _teardown_wandb()
            print(
                f"k2-train: warning: wandb failed in {what} ({type(e).__name__}: {e}); wandb logging is off "
                f"for the rest of this process, training and {self.run_dir / 'metrics.jsonl'} go on",
                file=sys.stderr,
                flush=True,
            )

    @property
    def wandb_run_id(self) -> str | None:
        """The wandb run's id (kept in checkpoints so that a resume continues it); None without wandb.
        Still the run's id after wandb failed, so that the next start continues the same run."""
        return self._wandb_id

    def log(self, record: dict) -> None:
        """Append one step's record (``record["step"]`` is the 1-based optimizer step)."""
        if not self.enabled:
            return
        rec = {k: _jsonable(v) for k, v in record.items()}
        self._fh.write(json.dumps(rec) + "\n")
        if self._wandb is not None:  # x-axis: the "step" metric (module docstring: resume policy)
            self._call_wandb("log", self._wandb.log, rec)
        if self._bar is not None:
            self._bar.update(1)
            post = {"loss": f"{rec.get('loss', float('nan')):.4f}", "tok/s": f"{rec.get('tokens_per_s', 0):.0f}"}
            if "val_loss" in rec:
                post["val"] = f"{rec['val_loss']:.4f}"
                self._bar.write(
                    f"step {rec['step']}: loss {rec.get('loss', float('nan')):.4f} val_loss {rec['val_loss']:.4f}"
                )
            self._bar.set_postfix(post)
        elif self._plain_every and (
            rec["step"] % self._plain_every == 0 or "val_loss" in rec or rec["step"] == self._total
        ):
            line = (
                f"step {rec['step']}/{self._total} | loss {rec.get('loss', float('nan')):.4f} | "
                f"lr {rec.get('lr', 0.0):.3g} | grad_norm {rec.get('grad_norm') or 0.0:.3f} | "
                f"{rec.get('tokens_per_s', 0.0):,.0f} tok/s"
            )
            if "val_loss" in rec:
                line += f" | val_loss {rec['val_loss']:.4f}"
            print(line, file=sys.stderr, flush=True)

    def log_before_training(self, record: dict) -> None:
        """Append the record of the evaluation before step 1 (``"step": 0``, ``val_loss``) to
        ``metrics.jsonl`` and wandb; the progress bar does not move."""
        if not self.enabled:
            return
        rec = {k: _jsonable(v) for k, v in record.items()}
        self._fh.write(json.dumps(rec) + "\n")
        if self._wandb is not None:
            self._wandb.log(rec)

    def message(self, text: str) -> None:
        """A line of text for the console that does not break the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        """Close the progress bar, ``metrics.jsonl`` and the wandb run (a wandb failure only warns)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        if self._fh is not None:
            self._fh.close()
        if self._wandb is not None:
            self._call_wandb("finish", self._wandb.finish)
            self._wandb = None
