"""``checkpoint.export_hf=true``: the checkpoint saved at the end of a run, exported as a Hugging Face
directory ``<run.dir>/hf/iter_NNNNNNN`` (:mod:`k2.launcher.hf.export`).

The export runs as ``k2-convert export`` in a child process of global rank 0, after every rank has
finished the save: megatron's dist-checkpointing reads collectively over the default process group,
which here is the training job's; the child reads the checkpoint in a process group of its own (one
rank) and the other ranks are not held up. A failed export is reported and leaves the run's result
(its checkpoint, exit status 0) as it is; ``k2-convert export`` can be re-run by hand.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from k2.parallel.processes import child_env


def export_dir(run_dir, checkpoint: Path) -> Path:
    """``<run.dir>/hf/<checkpoint name>``: where the export of ``checkpoint`` goes."""
    return Path(run_dir) / "hf" / Path(checkpoint).name


def export_checkpoint(run_dir, checkpoint: Path, model_type: str) -> str:
    """Run ``k2-convert export`` of ``checkpoint`` into :func:`export_dir`; returns the line to log (the
    tool's summary, or a warning with the last line of its error output)."""
    out = export_dir(run_dir, checkpoint)
    cmd = [
        sys.executable,
        "-m",
        "k2.launcher.convert",
        "export",
        f"checkpoint={checkpoint}",
        f"out={out}",
        f"convert.model_type={model_type}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
    if proc.returncode == 0:
        return (proc.stdout.strip().splitlines() or [f"k2-convert: exported {checkpoint} -> {out}"])[-1]
    last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    return f"k2-train: warning: checkpoint.export_hf: exporting {checkpoint} failed: {last}"
