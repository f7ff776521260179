"""``k2-submit``: render a Slurm batch script for a config and submit it; Slurm helpers for that script.

Example (prints the script, submits nothing)::

    k2-submit model=kimi_k2 parallel=k2_256gpu cluster.nodes=32 run.dir=/shared/runs/k2 submit.dry_run=true

``k2-submit`` takes the same Hydra overrides as ``k2-train``, validates them for world size
``cluster.nodes * cluster.gpus_per_node`` with the same plan check (:func:`launcher.train.make_plan`),
writes ``<run.dir>/pretrain.sbatch`` (:func:`render_sbatch`) and runs ``sbatch`` on it from the
repository root; the job id goes to stdout. ``submit.*`` keys (``launcher.schema.SubmitConfig``) set the
``#SBATCH`` lines. Errors: a bad setting prints ``k2-submit: error: ...`` naming it and exits 2; a
missing ``sbatch`` or a refused submission exits 1.

The rendered script runs one task per GPU (``srun``), sets ``MASTER_ADDR`` to the first host of the
allocation (``scontrol show hostnames``, else ``python -m launcher.slurm first-host``) and
``MASTER_PORT`` from the job id (:func:`master_port`), and starts ``python -m launcher.train`` with the
submitted overrides and a fixed absolute ``run.dir``, so every (re)start of the job uses the same run
directory. Requeue convention: a trainer that exits with :data:`REQUEUE_EXIT_CODE` asks to be continued;
the script then runs ``scontrol requeue $SLURM_JOB_ID`` (the job is submitted with ``--requeue``).

``python -m launcher.slurm first-host NODELIST`` and ``python -m launcher.slurm master-port JOBID`` print
one line each (used by the script).
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]

#: Exit status with which a trainer rank asks for the job to be requeued (e.g. after it saved a checkpoint
#: on the ``USR1`` sent ``submit.signal_seconds`` before the time limit). The batch script runs
#: ``scontrol requeue $SLURM_JOB_ID`` when ``srun`` returns it; any other status ends the job with it.
#: 42 collides with no status of Python (1, 2), a signal (128+N) or srun's own failures (1, 255).
REQUEUE_EXIT_CODE = 42

#: Ports derived from job ids: ``MASTER_PORT_BASE + job_id % MASTER_PORT_SPAN`` = 20000..29999, above
#: the privileged ports (< 1024) and below Linux's ephemeral range (32768-60999, where the kernel picks
#: outgoing ports and a collision with a live connection would be possible).
MASTER_PORT_BASE = 20000
MASTER_PORT_SPAN = 10000

_PROG = "k2-submit"


# --- hostlists ------------------------------------------------------------------------------------------


def _split_top_level(s: str, original: str) -> list[str]:
    """``s`` split on commas outside brackets; raises ValueError on unbalanced or nested brackets."""
    items, depth, cur = [], 0, []
    for ch in s:
        if ch == "[":
            if depth:
                raise ValueError(f"invalid hostlist {original!r}: nested '['")
            depth = 1
        elif ch == "]":
            if not depth:
                raise ValueError(f"invalid hostlist {original!r}: ']' without '['")
            depth = 0
        if ch == "," and not depth:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ValueError(f"invalid hostlist {original!r}: '[' without ']'")
    items.append("".join(cur))
    return items


def _expand_brackets(body: str, original: str) -> list[str]:
    """The numbers of one bracket group (``"001,003"``, ``"01-03,7"``) as strings, padding kept."""
    out: list[str] = []
    for part in body.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(
                f"invalid hostlist {original!r}: bracket item {part!r} is not N or N-M (digits)"
            )
        lo_s, hi_s = m.group(1), m.group(2)
        if hi_s is None:
            out.append(lo_s)
            continue
        lo, hi = int(lo_s), int(hi_s)
        if lo > hi:
            raise ValueError(f"invalid hostlist {original!r}: reversed range {part!r}")
        width = len(lo_s)  # Slurm keeps the zero padding of the range's start: [008-010]
        out.extend(str(i).zfill(width) for i in range(lo, hi + 1))
    return out


def expand_hostlist(s: str) -> list[str]:
    """Expand a Slurm hostlist expression (``SLURM_JOB_NODELIST``) into host names, in order.

    Grammar (Slurm's hostlist format): items separated by commas outside brackets; an item is a name
    with zero or more bracket groups ``[a,b-c,...]`` of decimal numbers and ranges. A range keeps the
    zero padding of its start (``gpu[008-010]`` -> gpu008, gpu009, gpu010); several groups in one name
    expand as a cartesian product, the last group varying fastest (``rack[0-1]_blade[0-1]`` -> rack0_blade0,
    rack0_blade1, rack1_blade0, rack1_blade1). Duplicates are kept.

    Args:
        s: e.g. ``"nodeA,nodeB[001,003],nodeC"``.

    Returns:
        Host names, e.g. ``["nodeA", "nodeB001", "nodeB003", "nodeC"]``.

    Raises:
        ValueError: empty input or an empty item, unbalanced or nested brackets, an empty bracket group,
            a bracket item that is not ``N`` / ``N-M`` or a reversed range ``M-N`` with ``M > N``; the
            message names the input.
    """
    if not isinstance(s, str) or not s.strip():
        raise ValueError(f"invalid hostlist {s!r}: empty")
    hosts: list[str] = []
    for item in _split_top_level(s.strip(), s):
        item = item.strip()
        if not item:
            raise ValueError(f"invalid hostlist {s!r}: empty item")
        choices: list[list[str]] = []
        for literal, body in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", item):
            if literal:
                choices.append([literal])
            if body:
                choices.append(_expand_brackets(body, s))
        if re.search(r"\[\s*\]", item):
            raise ValueError(f"invalid hostlist {s!r}: empty brackets in {item!r}")
        hosts.extend("".join(p) for p in itertools.product(*choices))
    return hosts


def first_host(nodelist: str) -> str:
    """The first host of ``nodelist`` (the rendezvous host, ``MASTER_ADDR``).

    Uses ``scontrol show hostnames`` when ``scontrol`` is on ``PATH`` and succeeds (Slurm's own order);
    otherwise :func:`expand_hostlist`.

    Raises:
        ValueError: ``nodelist`` is malformed (from :func:`expand_hostlist`).
    """
    if shutil.which("scontrol"):
        try:
            r = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                               text=True, timeout=30)
            lines = r.stdout.split()
            if r.returncode == 0 and lines:
                return lines[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return expand_hostlist(nodelist)[0]


def master_port(job_id: int) -> int:
    """The rendezvous TCP port of Slurm job ``job_id``: ``20000 + job_id % 10000`` (20000..29999).

    Deterministic, so every (re)start of a job (a requeue keeps the job id) and every node compute the
    same port without talking to each other; below Linux's ephemeral range (32768-60999) and above the
    privileged ports. Two jobs share a node and a port only when their ids are equal modulo 10000.

    Raises:
        ValueError: ``job_id`` is negative or not an integer.
    """
    if isinstance(job_id, bool) or not isinstance(job_id, int) or job_id < 0:
        raise ValueError(f"invalid Slurm job id {job_id!r}: must be an integer >= 0")
    return MASTER_PORT_BASE + job_id % MASTER_PORT_SPAN


# --- the batch script -----------------------------------------------------------------------------------


def _key_of(override: str) -> str:
    """The dotted key an override sets (``++run.dir=x`` -> ``run.dir``; ``model=kimi_k2`` -> ``model``)."""
    return override.lstrip("+~").split("=", 1)[0].strip()


def train_overrides(cfg, overrides: Sequence[str]) -> list[str]:
    """The overrides every rank of the job gets: the submitted ones without ``submit.*`` and ``run.dir``,
    then ``run.dir=<absolute run.dir>`` (resolved now, so a requeued job writes to the same directory)."""
    kept = [o for o in overrides if not (_key_of(o) == "submit" or _key_of(o).startswith("submit.")
                                         or _key_of(o) == "run.dir")]
    return kept + [f"run.dir={run_dir(cfg)}"]


def run_dir(cfg) -> str:
    """``run.dir`` as an absolute path (relative paths are taken from the current directory)."""
    return os.path.abspath(os.path.expanduser(str(cfg.run.dir)))


def render_sbatch(cfg, overrides: Sequence[str] = ()) -> str:
    """The text of ``<run.dir>/pretrain.sbatch`` for ``cfg`` (composed from ``overrides``).

    ``#SBATCH`` lines: ``--nodes=cluster.nodes``, ``--ntasks-per-node`` = ``--gpus-per-node`` =
    ``cluster.gpus_per_node`` (one task per GPU), ``--time=submit.time``, ``--job-name=submit.job_name``,
    ``--requeue``, ``--signal=USR1@submit.signal_seconds`` (to the ranks, seconds before the time limit),
    ``--output=<run.dir>/slurm-%j.out`` (appended to across requeues), and ``--partition`` /
    ``--account`` when set. The body builds the embedded corpus once when ``data.path`` is null, sets
    ``MASTER_ADDR`` / ``MASTER_PORT``, runs ``srun python -m launcher.train`` with
    :func:`train_overrides` and requeues the job when the ranks exit with :data:`REQUEUE_EXIT_CODE`.
    The script ``cd``s to ``$K2_REPO`` (default: the submit directory, the repository root under
    ``k2-submit``) and runs ``$K2_PYTHON`` (default: ``.venv/bin/python`` there).

    Args:
        cfg: the validated config (``load_config(overrides)``).
        overrides: the Hydra overrides it was composed from.

    Raises:
        ValueError: ``run.dir`` or ``submit.job_name`` contains whitespace (not expressible in an
            ``#SBATCH`` line).
    """
    sub, cl = cfg.submit, cfg.cluster
    rdir = run_dir(cfg)
    for key, value in (("run.dir", rdir), ("submit.job_name", str(sub.job_name))):
        if re.search(r"\s", value):
            raise ValueError(f"{key}={value!r} contains whitespace, which #SBATCH lines cannot hold")
    args = train_overrides(cfg, overrides)
    quoted = " ".join(shlex.quote(a) for a in args)
    sbatch = [
        f"--job-name={sub.job_name}",
        f"--nodes={cl.nodes}",
        f"--ntasks-per-node={cl.gpus_per_node}",
        *([f"--gpus-per-node={cl.gpus_per_node}"] if sub.request_gpus else []),
        "--exclusive",
        f"--time={sub.time}",
        "--requeue",
        f"--signal=USR1@{sub.signal_seconds}",
        "--open-mode=append",
        f"--output={rdir}/slurm-%j.out",
    ]
    if sub.partition:
        sbatch.append(f"--partition={sub.partition}")
    if sub.account:
        sbatch.append(f"--account={sub.account}")
    shown = " ".join(shlex.quote(o) for o in overrides if _key_of(o) != "submit.dry_run")
    lines = [
        "#!/bin/bash",
        "# Generated by k2-submit (launcher/slurm.py); do not edit: change the overrides and render again:",
        f"#   k2-submit {shown}".rstrip(),
        "# One task per GPU; every task runs `python -m launcher.train` with the same overrides and the same",
        "# absolute run.dir on every (re)start of the job (never derived from the Slurm job id).",
        *(f"#SBATCH {a}" for a in sbatch),
        "#",
        f"# Requeue convention: the ranks get USR1 {sub.signal_seconds} s before the time limit (and SIGTERM on",
        "# scancel/requeue/preemption); they agree on a step, save a checkpoint, and exit with status",
        f"# {REQUEUE_EXIT_CODE} (launcher.slurm.REQUEUE_EXIT_CODE), rank 0 leaving <run.dir>/requeue. Either asks",
        "# for a continuation: the script runs `scontrol requeue $SLURM_JOB_ID`, and the job restarts from the top",
        "# with the same job id, run.dir and log file (SLURM_RESTART_COUNT counts the restarts) and resumes from",
        "# <run.dir>/checkpoints/latest. Any other status ends the job.",
        "set -euo pipefail",
        "",
        'cd "${K2_REPO:-$SLURM_SUBMIT_DIR}"',
        'PYTHON="${K2_PYTHON:-$PWD/.venv/bin/python}"',
        '[[ -x "$PYTHON" ]] || { echo "pretrain.sbatch: $PYTHON not found; run scripts/k2 setup in $PWD" >&2; exit 1; }',
        "",
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null | head -n1 || true)"',
        'if [[ -z "$MASTER_ADDR" ]]; then',
        '  MASTER_ADDR="$("$PYTHON" -m launcher.slurm first-host "$SLURM_JOB_NODELIST")"',
        "fi",
        "export MASTER_ADDR",
        'MASTER_PORT="$("$PYTHON" -m launcher.slurm master-port "$SLURM_JOB_ID")"',
        "export MASTER_PORT",
        'export OMP_NUM_THREADS="${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-8}}"',
        "",
    ]
    if cfg.data.path is None:
        lines += [
            "# The embedded corpus (data.path is null) is built once here, not by every rank (idempotent).",
            f"\"$PYTHON\" -c 'from launcher.data import cli; cli()' {quoted}",
            "",
        ]
    lines += [
        'echo "pretrain.sbatch: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NUM_NODES nodes,"'
        ' "master $MASTER_ADDR:$MASTER_PORT"',
        "rc=0",
        f"srun --kill-on-bad-exit=1 --cpu-bind=none \"$PYTHON\" -m launcher.train {quoted} || rc=$?",
        # srun --kill-on-bad-exit may report a signal instead of 42 when it stops the ranks that had not
        # exited yet; rank 0 writes the marker only after every rank finished the checkpoint
        f"if [[ $rc -eq {REQUEUE_EXIT_CODE} || -f {shlex.quote(rdir + '/requeue')} ]]; then",
        '  echo "pretrain.sbatch: the trainer asked for a requeue (exit status $rc); requeueing job $SLURM_JOB_ID"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "  exit 0",
        "fi",
        'exit "$rc"',
        "",
    ]
    return "\n".join(lines)


# --- entry points ---------------------------------------------------------------------------------------


def _check_submit(cfg) -> int:
    """Validate ``cluster.*`` and ``submit.*``; returns the world size. Raises ConfigError."""
    from launcher.config import ConfigError

    for key in ("nodes", "gpus_per_node"):
        value = cfg.cluster[key]
        if value < 1:
            raise ConfigError(f"cluster.{key}={value} must be an integer >= 1")
    sub = cfg.submit
    if sub.signal_seconds < 1:
        raise ConfigError(f"submit.signal_seconds={sub.signal_seconds} must be an integer >= 1 (seconds)")
    if not re.fullmatch(r"(\d+-)?\d+(:\d+){0,2}", str(sub.time)):
        raise ConfigError(
            f"submit.time={sub.time!r} is not a Slurm time limit; allowed forms: MM, MM:SS, HH:MM:SS, "
            "D-HH, D-HH:MM, D-HH:MM:SS (e.g. 24:00:00)"
        )
    for key in ("job_name", "partition", "account"):
        value = sub[key]
        if value is not None and (not str(value) or re.search(r"\s", str(value))):
            raise ConfigError(f"submit.{key}={value!r} must be a non-empty string without whitespace")
    if re.search(r"\s", run_dir(cfg)):
        raise ConfigError(f"run.dir={cfg.run.dir!r} must not contain whitespace (it goes into #SBATCH --output)")
    return cfg.cluster.nodes * cfg.cluster.gpus_per_node


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``k2-submit`` (Hydra overrides in ``argv``). Returns the exit status.

    0: submitted (job id on stdout) or dry run (script on stdout); 1: ``sbatch`` missing or failed;
    2: a bad setting (``k2-submit: error: ...`` on stderr, naming it). With ``-m`` (a sweep,
    launcher/sweep.py): one job per unfinished point, each with its own run dir; every point is checked
    before anything is submitted.
    """
    from launcher.config import ConfigError, load_config
    from launcher.sweep import split_multirun

    multirun, overrides = split_multirun(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in overrides):
        print(__doc__.split("\n\nThe rendered script")[0])
        return 0
    try:
        if multirun:
            jobs = _sweep_jobs(overrides)
        else:
            cfg = load_config(overrides)
            world = _check_submit(cfg)
            from launcher.train import make_plan

            make_plan(cfg, world)  # also decides the resume (a used run.dir resumes from its checkpoint)
            jobs = [(cfg, overrides)]
        texts = [render_sbatch(cfg, ovr) for cfg, ovr in jobs]
    except (ConfigError, ValueError) as e:
        print(f"{_PROG}: error: {e}", file=sys.stderr)
        return 2
    if jobs and jobs[0][0].submit.dry_run:
        sys.stdout.write("\n".join(texts))
        return 0
    for (cfg, _), text in zip(jobs, texts):
        rc = _submit(cfg, text)
        if rc:
            return rc
    return 0


def _sweep_jobs(overrides: Sequence[str]) -> list:
    """``(cfg, overrides)`` of every sweep point not finished yet (all points validated first)."""
    from launcher.config import load_config
    from launcher.sweep import check_points, point_status, sweep_points

    _, points = sweep_points(overrides)
    cfgs = {p.name: load_config(list(p.overrides)) for p in points}
    for p in points:
        _check_submit(cfgs[p.name])
    plans = check_points(points, lambda c: c.cluster.nodes * c.cluster.gpus_per_node)
    todo = [(cfgs[p.name], list(p.overrides)) for p in points if point_status(p, plans[p.name]) != "finished"]
    for p in points:
        if point_status(p, plans[p.name]) == "finished":
            print(f"{_PROG}: {p.name}: finished, not submitted", file=sys.stderr)
    return todo


def _submit(cfg, text: str) -> int:
    """Write ``<run.dir>/pretrain.sbatch`` and ``sbatch`` it; the job id goes to stdout."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        print(f"{_PROG}: error: sbatch not found on PATH; run k2-submit on a Slurm login node, or add "
              "submit.dry_run=true to print the script", file=sys.stderr)
        return 1
    rdir = Path(run_dir(cfg))
    try:
        rdir.mkdir(parents=True, exist_ok=True)
        script = rdir / "pretrain.sbatch"
        script.write_text(text)
    except OSError as e:
        print(f"{_PROG}: error: cannot write the script into run.dir={rdir}: {e}", file=sys.stderr)
        return 1
    r = subprocess.run([sbatch, "--parsable", str(script)], cwd=REPO_ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"{_PROG}: error: sbatch {script} failed (exit {r.returncode}): {r.stderr.strip()}",
              file=sys.stderr)
        return 1
    job_id = r.stdout.strip().split(";")[0]
    print(job_id)
    print(f"{_PROG}: submitted job {job_id}: script {script}, log {rdir}/slurm-{job_id}.out", file=sys.stderr)
    return 0


def cli() -> None:
    sys.exit(main())


def _module_main(argv: Sequence[str]) -> int:
    """``python -m launcher.slurm first-host NODELIST | master-port JOBID``: one line on stdout; exit 2
    with ``launcher.slurm: error: ...`` on bad arguments."""
    usage = "usage: python -m launcher.slurm first-host NODELIST | master-port JOBID"
    if len(argv) != 2 or argv[0] not in ("first-host", "master-port"):
        print(usage, file=sys.stderr)
        return 2
    try:
        if argv[0] == "first-host":
            print(first_host(argv[1]))
        else:
            if not re.fullmatch(r"\d+", argv[1].strip()):
                raise ValueError(f"invalid Slurm job id {argv[1]!r}: must be an integer >= 0")
            print(master_port(int(argv[1])))
    except ValueError as e:
        print(f"launcher.slurm: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_module_main(sys.argv[1:]))
