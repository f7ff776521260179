"""The Slurm batch script of a run: :func:`render_sbatch` writes it, :func:`submit_script` submits it.

The rendered script runs one task per GPU (``srun``), sets ``MASTER_ADDR`` to the first host of the
allocation (``scontrol show hostnames``, else ``python -m k2.parallel.hostlist first-host``) and
``MASTER_PORT`` from the job id (:func:`k2.parallel.hostlist.master_port`), and starts ``python -m
k2.launcher.train`` with the submitted overrides and a fixed absolute ``run.dir``, so every (re)start of
the job uses the same run directory. Requeue convention: a trainer that exits with
:data:`REQUEUE_EXIT_CODE` asks to be continued; the script then runs ``scontrol requeue $SLURM_JOB_ID``
(the job is submitted with ``--requeue``).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from k2.config import ConfigError
from k2.launcher.training.preemption import REQUEUE_EXIT_CODE
from k2.parallel.hostlist import MASTER_PORT_BASE, MASTER_PORT_SPAN

if TYPE_CHECKING:
    from k2.config.schema import K2Config

_PROG = "k2-submit"


def _key_of(override: str) -> str:
    """The dotted key an override sets (``++run.dir=x`` -> ``run.dir``; ``model=kimi_k2`` -> ``model``)."""
    return override.lstrip("+~").split("=", 1)[0].strip()


def train_overrides(cfg: K2Config, overrides: Sequence[str]) -> list[str]:
    """The overrides every rank of the job gets: the submitted ones without ``submit.*`` and ``run.dir``,
    then ``run.dir=<absolute run.dir>`` (resolved now, so a requeued job writes to the same directory)."""
    kept = [
        o
        for o in overrides
        if not (_key_of(o) == "submit" or _key_of(o).startswith("submit.") or _key_of(o) == "run.dir")
    ]
    return kept + [f"run.dir={run_dir(cfg)}"]


def run_dir(cfg: K2Config) -> str:
    """``run.dir`` as an absolute path (relative paths are taken from the current directory)."""
    return os.path.abspath(os.path.expanduser(str(cfg.run.dir)))


def interpreter(cfg: K2Config) -> str:
    """The Python the batch script runs: ``submit.python``; else ``python3`` inside
    ``submit.container_image``; else the interpreter running ``k2-submit`` (it has k2-launcher installed
    and must be on a file system the nodes see). Written into the script, so a script submitted by hand or
    under ``SBATCH_EXPORT=NONE`` runs the same Python."""
    sub = cfg.submit
    if sub.python is not None:
        return str(sub.python)
    return "python3" if sub.container_image is not None else sys.executable


def shell_word(value) -> str:
    """``value`` as one bash word that stays on its line: ``shlex.quote`` for printable text, else bash's
    ANSI-C quoting ``$'...'`` with every character that is not printable (newline, carriage return, tab,
    other control and format characters, a line or paragraph separator) written as the ``\\xHH`` escapes of
    its UTF-8 bytes. The one rule for every value that reaches an executable line or a comment of the batch
    script: no value can end a comment, start a line (an ``#SBATCH`` directive or a command) or run
    anything (``$(...)``, backticks, ``;``, quotes are literal inside either quoting)."""
    text = str(value)
    if text.isprintable():
        return shlex.quote(text)
    out = []
    for ch in text:
        if ch in "\\'":
            out.append("\\" + ch)
        elif ch.isprintable():
            out.append(ch)
        else:  # exactly two hex digits each: bash reads at most two
            out.extend(f"\\x{b:02x}" for b in ch.encode("utf-8", "surrogateescape"))
    return "$'" + "".join(out) + "'"


#: what sbatch's directive parser does not take literally (it splits at whitespace, strips quotes, reads
#: a backslash as an escape and an unescaped '#' as the start of a comment: src/sbatch/opt.c, _get_argument)
_DIRECTIVE_SPECIAL = re.compile(r"[\s'\"\\#]")


def directive_problem(option: str) -> str | None:
    """Why ``option`` cannot be written as is into an ``#SBATCH`` line, or None: a character that is not
    printable (a newline would end the directive and start a new line), whitespace, a quote, a backslash
    or a '#' (sbatch would split, unquote, unescape or cut the value)."""
    if not option.isprintable():
        return "it holds a character that is not printable (e.g. a newline)"
    bad = _DIRECTIVE_SPECIAL.search(option)
    if bad:
        return f"sbatch would split or unquote it at {bad.group()!r}"
    return None


def directive(setting: str, option: str) -> str:
    """``option`` for an ``#SBATCH`` line, refused (naming ``setting``) when sbatch cannot read it as is."""
    why = directive_problem(option)
    if why is not None:
        value = option.split("=", 1)[1] if "=" in option else option
        raise ConfigError(
            f"{setting}={value!r} cannot be written into an #SBATCH line: {why}; allowed: "
            "printable characters without whitespace, quotes, backslashes or '#'"
        )
    return option


def sbatch_options(cfg: K2Config) -> list[str]:
    """The ``#SBATCH`` options of ``cfg``'s job, in the order they are written (see :func:`render_sbatch`).

    Raises:
        ConfigError: a value sbatch cannot read as written (:func:`directive_problem`), naming its setting.
    """
    sub, cl = cfg.submit, cfg.cluster
    opts = [
        ("submit.job_name", f"--job-name={sub.job_name}"),
        ("cluster.nodes", f"--nodes={cl.nodes}"),
        ("cluster.gpus_per_node", f"--ntasks-per-node={cl.gpus_per_node}"),
        # the job's nodes in whole NVLink segments (Slurm's topology/block plugin; k2-plan places by them)
        *([("cluster.segment_nodes", f"--segment={cl.segment_nodes}")] if cl.segment_nodes is not None else []),
        *([("cluster.gpus_per_node", f"--gpus-per-node={cl.gpus_per_node}")] if sub.request_gpus else []),
        *([("submit.cpus_per_task", f"--cpus-per-task={sub.cpus_per_task}")] if sub.cpus_per_task is not None else []),
        ("", "--exclusive"),
        # all of each (exclusive) node's memory unless submit.mem names a size: see SubmitConfig.mem
        ("submit.mem", f"--mem={0 if sub.mem is None else sub.mem}"),
        ("submit.time", f"--time={sub.time}"),
        ("", "--requeue"),
        ("submit.signal_seconds", f"--signal=USR1@{sub.signal_seconds}"),
        ("", "--open-mode=append"),
        ("run.dir", f"--output={run_dir(cfg)}/slurm-%j.out"),
    ]
    for key in ("partition", "account", "qos", "constraint", "reservation"):
        if sub[key] is not None:
            opts.append((f"submit.{key}", f"--{key}={sub[key]}"))
    opts += [(f"submit.extra_args[{i}]", str(a)) for i, a in enumerate(sub.extra_args)]
    return [directive(setting, option) for setting, option in opts]


def srun_options(cfg: K2Config) -> list[str]:
    """The ``srun`` options of the training step: kill the step when one rank fails, the CPU / GPU binding,
    the cores per rank (srun does not inherit sbatch's ``--cpus-per-task`` since Slurm 22.05), the rank
    distribution and the pyxis container."""
    sub = cfg.submit
    opts = ["--kill-on-bad-exit=1", f"--cpu-bind={sub.cpu_bind}"]
    if sub.gpu_bind is not None:
        opts.append(f"--gpu-bind={sub.gpu_bind}")
    if sub.cpus_per_task is not None:
        opts.append(f"--cpus-per-task={sub.cpus_per_task}")
    if sub.distribution:
        opts.append(f"--distribution={sub.distribution}")
    return opts + _container_options(cfg)


def _container_options(cfg: K2Config) -> list[str]:
    sub = cfg.submit
    if sub.container_image is None:
        return []
    opts = [f"--container-image={sub.container_image}"]
    if sub.container_mounts:
        opts.append(f"--container-mounts={','.join(str(m) for m in sub.container_mounts)}")
    return opts


def site_setup_lines(cfg: K2Config) -> list[str]:
    """The script's site set-up: ``submit.setup`` sourced (with ``set -u`` off: module and conda scripts
    read unset variables), then ``submit.env`` exported; every value quoted (:func:`shell_word`)."""
    sub = cfg.submit
    lines = []
    if sub.setup is not None:
        setup = shell_word(sub.setup)
        lines += [
            "# Site set-up (submit.setup): module loads, environments, the site's variables",
            "set +u",
            f'source {setup} || {{ echo "pretrain.sbatch: sourcing submit.setup failed" >&2; exit 1; }}',
            "set -u",
        ]
    if sub.env:
        lines.append("# submit.env")
        lines += [f"export {name}={shell_word(value)}" for name, value in sub.env.items()]
    return lines


def defaults_notes(cfg: K2Config) -> list[str]:
    """Lines for ``k2-submit``'s stderr about what the job will get from defaults a new user should
    check: the interpreter written into the script (a path on this machine), Slurm's partition and
    account, the time limit."""
    from k2.config.schema import SubmitConfig

    sub, notes = cfg.submit, []
    if sub.python is None and sub.container_image is None:
        notes.append(
            f"the job runs {sys.executable} (the Python running k2-submit): it must exist at that path on "
            "every node (a .venv on a node-local disk does not); submit.python=PATH names another, "
            "submit.setup=FILE loads modules or activates an environment first"
        )
    unset = [k for k in ("partition", "account") if sub[k] is None]
    if unset:
        notes.append(
            f"no {' / '.join('submit.' + k for k in unset)}: Slurm's default for your user applies "
            "(many clusters require an account)"
        )
    if str(sub.time) == SubmitConfig.time:
        notes.append(
            f"time limit {sub.time} (the default submit.time; a partition's limit may be lower: the job "
            "is then refused or requeued at it)"
        )
    return notes


def render_sbatch(cfg: K2Config, overrides: Sequence[str] = ()) -> str:
    """The text of ``<run.dir>/pretrain.sbatch`` for ``cfg`` (composed from ``overrides``).

    ``#SBATCH`` lines (:func:`sbatch_options`): ``--nodes=cluster.nodes``, ``--ntasks-per-node`` =
    ``--gpus-per-node`` = ``cluster.gpus_per_node`` (one task per GPU), ``--cpus-per-task`` when
    ``submit.cpus_per_task`` is set, ``--exclusive``, ``--mem=0`` (or ``submit.mem``), ``--time=submit.time``,
    ``--job-name=submit.job_name``, ``--requeue``, ``--signal=USR1@submit.signal_seconds`` (to the ranks,
    seconds before the time limit), ``--output=<run.dir>/slurm-%j.out`` (appended to across requeues),
    ``--partition`` / ``--account`` / ``--qos`` / ``--constraint`` / ``--reservation`` when set, then
    ``submit.extra_args``. The body runs the site set-up (:func:`site_setup_lines`), states the
    interpreter (:func:`interpreter`), builds the embedded corpus
    once when ``data.path`` is null, sets ``MASTER_ADDR`` / ``MASTER_PORT`` and ``OMP_NUM_THREADS`` (=
    ``submit.cpus_per_task`` when set), runs ``srun`` (:func:`srun_options`) ``python -m k2.launcher.train``
    with :func:`train_overrides`, and requeues the job when the ranks exit with :data:`REQUEUE_EXIT_CODE`.
    With ``submit.container_image`` the Python steps on the batch node run in the container too (``srun
    --ntasks=1``). The script ``cd``s to ``$K2_WORKDIR`` (default: the submit directory, where ``k2-submit``
    ran).

    Args:
        cfg: the validated config (``load_config(overrides)``).
        overrides: the Hydra overrides it was composed from.

    Every value that reaches the script is either written into an ``#SBATCH`` line as it is, when sbatch
    reads it literally (:func:`directive_problem`), or refused; or quoted by :func:`shell_word`, in the
    executable lines and in the comment that repeats the command: no value starts a line of its own.

    Raises:
        ConfigError: a value that an ``#SBATCH`` line cannot hold (:func:`sbatch_options`), naming its
            setting.
    """
    directives = sbatch_options(cfg)  # (refuses what an #SBATCH line cannot hold)
    quoted = " ".join(shell_word(a) for a in train_overrides(cfg, overrides))
    shown = " ".join(shell_word(o) for o in overrides if _key_of(o) != "submit.dry_run")
    lines = [*_header_lines(cfg, shown, directives), *_setup_lines(cfg)]
    if cfg.data.path is None:
        lines += [
            "# The embedded corpus (data.path is null) is built once here, not by every rank (idempotent).",
            f"k2py -m k2.launcher.data {quoted}",
            "",
        ]
    return "\n".join(lines + _run_lines(cfg, quoted))


def _header_lines(cfg: K2Config, shown: str, directives: Sequence[str]) -> list[str]:
    """The script's comment header (the command that renders it again, the requeue convention) and its
    ``#SBATCH`` lines."""
    return [
        "#!/bin/bash",
        "# Generated by k2-submit (k2.launcher.tools.sbatch); do not edit: change the overrides (submit.* sets",
        "# every #SBATCH and srun option; submit.extra_args adds others) and render again:",
        f"#   k2-submit {shown}".rstrip(),
        "# One task per GPU; every task runs `python -m k2.launcher.train` with the same overrides and the same",
        "# absolute run.dir on every (re)start of the job (never derived from the Slurm job id).",
        *(f"#SBATCH {a}" for a in directives),
        "#",
        f"# Requeue convention: the ranks get USR1 {cfg.submit.signal_seconds} s before the time limit (and SIGTERM on",
        "# scancel/requeue/preemption); they agree on a step, save a checkpoint, and exit with status",
        f"# {REQUEUE_EXIT_CODE} (k2.launcher.cli.REQUEUE_EXIT_CODE), rank 0 leaving <run.dir>/requeue. Either asks",
        "# for a continuation: the script runs `scontrol requeue $SLURM_JOB_ID`, and the job restarts from the top",
        "# with the same job id, run.dir and log file (SLURM_RESTART_COUNT counts the restarts) and resumes from",
        "# <run.dir>/checkpoints/latest. Any other status ends the job.",
        "set -euo pipefail",
        "",
    ]


def _setup_lines(cfg: K2Config) -> list[str]:
    """The site set-up, the interpreter (``k2py`` runs it, in the container when one is set), the
    rendezvous address and port, and ``OMP_NUM_THREADS``."""
    sub = cfg.submit
    container = " ".join(shell_word(o) for o in _container_options(cfg))
    if container:
        run_python = [
            "# Python on the batch node runs in the container as well (one task).",
            f'k2py() {{ srun --ntasks=1 --nodes=1 {container} "$PYTHON" "$@"; }}',
        ]
    else:
        run_python = [
            'command -v "$PYTHON" >/dev/null || { echo "pretrain.sbatch: $PYTHON not found; set submit.python'
            ' to a Python with k2-launcher installed" >&2; exit 1; }',
            'k2py() { "$PYTHON" "$@"; }',
        ]
    omp = (
        f"export OMP_NUM_THREADS={sub.cpus_per_task}  # submit.cpus_per_task"
        if sub.cpus_per_task is not None
        else 'export OMP_NUM_THREADS="${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-8}}"'
    )
    return [
        'cd "${K2_WORKDIR:-$SLURM_SUBMIT_DIR}"',
        *site_setup_lines(cfg),
        f"PYTHON={shell_word(interpreter(cfg))}  # submit.python",
        *run_python,
        "",
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null | head -n1 || true)"',
        'if [[ -z "$MASTER_ADDR" ]]; then',
        '  MASTER_ADDR="$(k2py -m k2.parallel.hostlist first-host "$SLURM_JOB_NODELIST")"',
        "fi",
        "export MASTER_ADDR",
        "# = k2.parallel.hostlist.master_port($SLURM_JOB_ID): the same on every node and every restart",
        f"export MASTER_PORT=$(({MASTER_PORT_BASE} + SLURM_JOB_ID % {MASTER_PORT_SPAN}))",
        omp,
        "",
    ]


def _run_lines(cfg: K2Config, quoted: str) -> list[str]:
    """``srun`` of the ranks and the requeue when they ask for one (exit status or marker file)."""
    srun = " ".join(shell_word(o) for o in srun_options(cfg))
    marker = shell_word(run_dir(cfg) + "/requeue")
    return [
        'echo "pretrain.sbatch: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NUM_NODES nodes,"'
        ' "master $MASTER_ADDR:$MASTER_PORT"',
        "rc=0",
        f'srun {srun} "$PYTHON" -m k2.launcher.train {quoted} || rc=$?',
        # srun --kill-on-bad-exit may report a signal instead of 42 when it stops the ranks that had not
        # exited yet; rank 0 writes the marker only after every rank finished the checkpoint
        f"if [[ $rc -eq {REQUEUE_EXIT_CODE} || -f {marker} ]]; then",
        '  echo "pretrain.sbatch: the trainer asked for a requeue (exit status $rc); requeueing job $SLURM_JOB_ID"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "  exit 0",
        "fi",
        'exit "$rc"',
        "",
    ]


def check_submittable(cfg: K2Config) -> int:
    """The world size ``cluster.nodes x cluster.gpus_per_node`` of a job; ``run.dir`` must go into an
    ``#SBATCH --output`` line, and a cluster-size job must name its data.

    Raises:
        ConfigError: a value that an ``#SBATCH`` line cannot hold (:func:`sbatch_options`: ``run.dir``
            goes into ``--output``); ``submit.setup`` names no file; ``data.path`` is null (the embedded
            18 MB standard-library corpus) for a job of more than one node or with GPUs, without
            ``submit.embedded_corpus=true``.
    """
    sbatch_options(cfg)
    if cfg.submit.setup is not None and not Path(str(cfg.submit.setup)).is_file():
        raise ConfigError(
            f"submit.setup={cfg.submit.setup!r}: no such file here; allowed: the path of a bash file "
            "the job sources first, on a file system the nodes see (or null)"
        )
    big = cfg.cluster.nodes > 1 or cfg.submit.request_gpus
    if cfg.data.path is None and cfg.prepare.input is None and big and not cfg.submit.embedded_corpus:
        gpus = f" x {cfg.cluster.gpus_per_node} GPUs" if cfg.submit.request_gpus else ""
        what = f"{cfg.cluster.nodes} node(s){gpus}"
        raise ConfigError(
            f"data.path is null: this job ({what}) would train on the embedded 18 MB standard-library "
            "test corpus; set data.path to a k2-data dataset prefix, or submit.embedded_corpus=true "
            "if that corpus is meant"
        )
    return cfg.cluster.nodes * cfg.cluster.gpus_per_node


def submit_script(cfg: K2Config, text: str) -> int:
    """Write ``<run.dir>/pretrain.sbatch`` and ``sbatch`` it from the current directory (the job's working
    directory); the job id goes to stdout.

    Returns:
        0 when submitted; 1 when ``sbatch`` is missing, the script cannot be written, or sbatch refuses it.
    """
    return 0 if submit_job(cfg, text) is not None else 1


def submit_job(cfg: K2Config, text: str, after: Sequence[str] = ()) -> str | None:
    """:func:`submit_script`, returning the job id (None when it failed, the reason on stderr).

    Args:
        after: job ids this job starts after, each finished successfully (``sbatch --dependency=afterok:...``;
            a job requeued after preemption keeps its id, so the dependency waits for its final end).
    """
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        print(
            f"{_PROG}: error: sbatch not found on PATH; run k2-submit on a Slurm login node, or add "
            "submit.dry_run=true to print the script",
            file=sys.stderr,
        )
        return None
    rdir = Path(run_dir(cfg))
    try:
        rdir.mkdir(parents=True, exist_ok=True)
        script = rdir / "pretrain.sbatch"
        script.write_text(text)
    except OSError as e:
        print(f"{_PROG}: error: cannot write the script into run.dir={rdir}: {e}", file=sys.stderr)
        return None
    dependency = [f"--dependency=afterok:{':'.join(after)}"] if after else []
    r = subprocess.run([sbatch, "--parsable", *dependency, str(script)], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"{_PROG}: error: sbatch {script} failed (exit {r.returncode}): {r.stderr.strip()}", file=sys.stderr)
        return None
    job_id = r.stdout.strip().split(";")[0]
    print(job_id)
    waits = f", after job {', '.join(after)}" if after else ""
    print(f"{_PROG}: submitted job {job_id}{waits}: script {script}, log {rdir}/slurm-{job_id}.out", file=sys.stderr)
    return job_id
