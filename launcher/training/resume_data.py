"""The data check of a resume: the datasets the checkpoint trained on against this run's, by contents
(:func:`k2.launcher.datasets.fingerprint.dataset_fingerprint`), not by ``data.path`` strings."""

from __future__ import annotations

from pathlib import Path

from k2.config.errors import ConfigError
from k2.launcher.datasets.fingerprint import dataset_fingerprint


def check_resume_data(checkpoint: Path, state: dict, phase_data: tuple, phase_names: list, force: bool) -> None:
    """Refuse a resume whose current phase would read other data than the checkpoint trained on.

    The checkpoint's ``k2_state.json`` records the prefixes of the phase it stopped in (``data_path``) and
    their fingerprints (``data_fingerprint``, written since fingerprints exist; an older checkpoint is not
    checked here). This run's prefixes of the same phase (by name) must have the same fingerprints, in
    order: the same files under another path (relative, a symlink) pass; other files behind the same path
    do not.

    Args:
        checkpoint: its directory (for the message); state: its ``k2_state.json``.
        phase_data: this run's resolved data per phase (``RunPlan.phase_data``); phase_names: the phases'
            names, same order.
        force: ``resume.force``: accept the change.

    Raises:
        ConfigError: the datasets differ (naming the phase, both prefixes and what differs) and not
            ``force``.
    """
    saved = state.get("data_fingerprint")
    if force or not saved or state.get("phase") not in phase_names:
        return
    data = phase_data[phase_names.index(state["phase"])]
    ours = list(data.train_blend[0])
    theirs = list(state.get("data_path") or saved)
    problems = []
    if len(ours) != len(theirs):
        problems.append(f"{len(theirs)} dataset prefixes then, {len(ours)} now")
    for old, new in zip(theirs, ours):
        try:
            now = dataset_fingerprint(new)
        except OSError as e:
            problems.append(f"{new}: unreadable ({e})")
            continue
        if saved.get(old) != now:
            problems.append(f"{old} then ({_show(saved.get(old))}) vs {new} now ({_show(now)})")
    if problems:
        raise ConfigError(
            f"resuming from {checkpoint} would train phase '{state['phase']}' on other data: "
            + "; ".join(problems)
            + ". Restore the dataset, start a new run.dir, or accept the change "
            "with resume.force=true"
        )


def _show(fp) -> str:
    if not fp:
        return "not recorded"
    return f"{fp['bin_bytes']:,} + {fp['idx_bytes']:,} bytes, sha256 {fp['sha256'][:12]}"
