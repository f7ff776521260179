"""``k2-report RUN_DIR``: a run's curves as PNGs and its summary (:mod:`k2.launcher.training.run_report`).

Exit status: 0 done; 2 a bad argument, or ``RUN_DIR`` holds no ``metrics.jsonl`` (one line
``k2-report: error: ...`` on stderr).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from k2.launcher.cli import HELP_FLAGS, error

PROG = "k2-report"

USAGE = """usage: k2-report RUN_DIR [OUT_DIR]

Draw a finished or running run's curves from RUN_DIR/metrics.jsonl into PNGs (OUT_DIR, default
RUN_DIR/report/): loss and validation loss, LR, gradient norm, max attention logit with QK-Clip's tau,
tokens/s and MFU, MoE load balance, each against tokens with the schedule's phase boundaries marked; then
print the run's summary (steps, tokens, losses, throughput, MFU, max logit, expert balance, how to upload
the offline wandb run). k2-train writes the same at the end of a run with train.report=true.

examples:
  k2-report runs/k2_tiny-cpu4
  k2-report /shared/runs/k2 /tmp/k2-report

exit status: 0 done, 2 a bad argument or no metrics.jsonl in RUN_DIR
"""


def main(argv: Sequence[str] | None = None) -> int:
    """``k2-report RUN_DIR [OUT_DIR]``; the exit status of the module docstring."""
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in HELP_FLAGS for a in args):
        print(USAGE, end="")
        return 0
    if not 1 <= len(args) <= 2:
        error(PROG, f"expected RUN_DIR [OUT_DIR], got {len(args)} arguments (k2-report --help)")
        return 2
    run_dir = Path(args[0])
    if not (run_dir / "metrics.jsonl").is_file():
        error(PROG, f"{run_dir} holds no metrics.jsonl: not a k2-train run dir (or no step logged yet)")
        return 2
    # imported here: --help and a bad argument do not wait for matplotlib and the launcher's imports
    from k2.launcher.training.run_report import write_run_report

    print(write_run_report(run_dir, args[1] if len(args) > 1 else None).text())
    return 0


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
