"""``k2-sweep-report SWEEP_DIR``: the sparsity sweep grid's fits, multipliers and figures
(:mod:`k2.launcher.tools.sweep_report`)."""

from k2.launcher.tools.sweep_report import report_cli as cli
from k2.launcher.tools.sweep_report import report_main as main

__all__ = ["cli", "main"]

if __name__ == "__main__":
    cli()
