"""The command-line contract every k2-launcher tool shares (the entry modules call :func:`run_main`).

* A bad setting (:class:`k2.config.ConfigError`) prints one line ``<tool>: error: <message>`` on stderr
  and exits with :data:`BAD_SETTING_EXIT` (2), before any process group or heavy work starts.
* A training run whose loss or gradient norm became NaN / inf exits with :data:`DIVERGED_EXIT` (3) after
  one line naming the step, its LR and the last checkpoint.
* A run that saved a checkpoint and stopped for preemption exits with
  :data:`k2.launcher.training.preemption.REQUEUE_EXIT_CODE` (42; the Slurm script requeues on it).
* Ctrl-C (SIGINT) that reaches a tool outside its own handling prints one line ``<tool>: interrupted
  (Ctrl-C)`` and exits with :data:`INTERRUPT_EXIT` (130), without a traceback.
* ``-h`` / ``--help`` anywhere in the arguments prints the tool's usage (:func:`help_text`: what it does,
  its examples, where the config tree is and which recipes each group offers) and exits 0, before the
  arguments reach Hydra.
* Library messages that carry no action for a user are filtered (:mod:`k2.launcher.quiet`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from k2.config import ConfigError
from k2.launcher.quiet import quiet_libraries
from k2.launcher.training.preemption import INTERRUPT_EXIT, REQUEUE_EXIT_CODE

__all__ = [
    "BAD_SETTING_EXIT",
    "DIVERGED_EXIT",
    "HELP_FLAGS",
    "INTERRUPT_EXIT",
    "REQUEUE_EXIT_CODE",
    "error",
    "help_text",
    "quiet_libraries",
    "run_main",
]

#: Exit status of a tool given a bad setting (argparse's convention).
BAD_SETTING_EXIT = 2

#: Exit status of ``k2-train`` when the loss or gradient norm became NaN / inf (nothing of that step saved).
DIVERGED_EXIT = 3


def error(prog: str, message: object) -> None:
    """The one error line of a tool: ``<prog>: error: <message>`` on stderr."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)


#: Arguments that ask a tool for its usage instead of running it.
HELP_FLAGS = ("-h", "--help")


#: folders of the config tree that are not config groups: read by a setting instead (``group=name`` does not
#: pick them), each with the setting
_NOT_GROUPS = {"hardware": "plan.hardware", "published": "plan.published"}


def _recipe_groups() -> tuple[Path, dict[str, list[str]]]:
    """The config tree's directory and, per config group, its recipe names (sorted)."""
    from k2.config.recipes import RECIPES_DIR, recipe_names

    groups = {
        d.name: list(names)
        for d in sorted(RECIPES_DIR.iterdir())
        if d.name not in _NOT_GROUPS and (names := recipe_names(d.name))
    }
    return RECIPES_DIR, groups


def help_text(prog: str, usage: str) -> str:
    """The ``--help`` text of a tool: its own ``usage`` (what it does, examples), then the part every tool
    shares: how overrides are written, where the config tree and the schema are, the recipes per group.

    Args:
        prog: the tool's name (``k2-plan``).
        usage: the tool's own lines, starting with a ``usage: ...`` line.
    """
    from k2.config.hardware import available_profiles

    root, groups = _recipe_groups()
    width = max(len(g) for g in groups)
    group_lines = "\n".join(f"  {g:<{width}}  {', '.join(names)}" for g, names in groups.items())
    group_lines += f"\nhardware profiles (plan.hardware=NAME, or a PATH.yaml): {', '.join(available_profiles())}"
    return (
        f"{usage.strip()}\n\n"
        "overrides (Hydra syntax, any number, in any order):\n"
        "  group=name          pick a recipe of a config group (model=kimi_k2)\n"
        "  group.key=value     change one setting (train.iters=50, run.dir=runs/try1)\n"
        "  +group=name         add a group the defaults do not load (+experiment=sparsity_sweep)\n\n"
        f"config tree: {root} (config.yaml composes one recipe of each group)\n"
        "every key, its default and units: config/schema.py of k2-launcher (k2.config.schema)\n"
        f"recipes per group:\n{group_lines}\n\n"
        f"exit status: 0 done, {BAD_SETTING_EXIT} a bad setting (one line '{prog}: error: ...' on "
        "stderr)\n"
    )


def run_main(
    prog: str, body: Callable[[list[str]], int], argv: Sequence[str] | None = None, usage: str | None = None
) -> int:
    """Run a tool's ``body(args) -> exit status`` under the shared contract.

    Args:
        prog: the tool's name for the error line (``k2-plan``).
        body: the tool; it may raise :class:`ConfigError` for a bad setting.
        argv: the arguments (default ``sys.argv[1:]``).
        usage: the tool's own part of its ``--help`` text (:func:`help_text`); default: a usage line.

    Returns:
        0 after printing the help text when an argument is ``-h`` / ``--help``; otherwise ``body``'s
        status, :data:`BAD_SETTING_EXIT` after printing the error line of a ConfigError, or
        :data:`INTERRUPT_EXIT` after a line for a KeyboardInterrupt (Ctrl-C).
    """
    quiet_libraries()
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in HELP_FLAGS for a in args):
        print(help_text(prog, usage or f"usage: {prog} [HYDRA_OVERRIDE ...]"), end="")
        return 0
    try:
        return int(body(args))
    except ConfigError as e:
        error(prog, e)
        return BAD_SETTING_EXIT
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        return INTERRUPT_EXIT
