"""The command-line contract every k2-launcher tool shares (the entry modules call :func:`run_main`).

* A bad setting (:class:`k2.config.ConfigError`) prints one line ``<tool>: error: <message>`` on stderr
  and exits with :data:`BAD_SETTING_EXIT` (2), before any process group or heavy work starts.
* A run that saved a checkpoint and stopped for preemption exits with
  :data:`k2.launcher.training.preemption.REQUEUE_EXIT_CODE` (42; the Slurm script requeues on it).
* Library messages that carry no action for a user are filtered (:mod:`k2.launcher.quiet`).
"""

from __future__ import annotations

import sys
from typing import Callable, Optional, Sequence

from k2.config import ConfigError
from k2.launcher.quiet import quiet_libraries
from k2.launcher.training.preemption import REQUEUE_EXIT_CODE

__all__ = ["BAD_SETTING_EXIT", "REQUEUE_EXIT_CODE", "error", "quiet_libraries", "run_main"]

#: Exit status of a tool given a bad setting (argparse's convention).
BAD_SETTING_EXIT = 2


def error(prog: str, message: object) -> None:
    """The one error line of a tool: ``<prog>: error: <message>`` on stderr."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)


def run_main(prog: str, body: Callable[[list[str]], int], argv: Optional[Sequence[str]] = None) -> int:
    """Run a tool's ``body(args) -> exit status`` under the shared contract.

    Args:
        prog: the tool's name for the error line (``k2-plan``).
        body: the tool; it may raise :class:`ConfigError` for a bad setting.
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        ``body``'s status, or :data:`BAD_SETTING_EXIT` after printing the error line of a ConfigError.
    """
    quiet_libraries()
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        return int(body(args))
    except ConfigError as e:
        error(prog, e)
        return BAD_SETTING_EXIT
