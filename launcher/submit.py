"""``k2-submit``: check a config for a Slurm cluster, render its batch script and submit it.

Example (prints the script, submits nothing)::

    k2-submit model=kimi_k2 parallel=k2_256gpu cluster.nodes=32 run.dir=/shared/runs/k2 submit.dry_run=true

``k2-submit`` takes the same Hydra overrides as ``k2-train`` and validates them for the world size
``cluster.nodes * cluster.gpus_per_node`` exactly as ``k2-train`` does
(:func:`k2.launcher.training.prepare.prepare_run`: layout, schedule, data, the checkpoint a used
``run.dir`` resumes from), writes ``<run.dir>/pretrain.sbatch`` (:func:`k2.launcher.tools.sbatch.render_sbatch`)
and runs ``sbatch`` on it from the current directory; the job id goes to stdout. ``submit.*`` keys set the
``#SBATCH`` lines. With ``-m`` (a sweep, :mod:`k2.launcher.tools.sweep_submit`): k2-plan's check that every
run of the grid fits and its GPU-hours, then one job per unfinished trunk and per unfinished branch, each
branch after its trunk's job (``--dependency=afterok``); every run is checked before anything is submitted.

Exit status: 0 submitted (or ``submit.dry_run=true``: the script on stdout); 1 ``sbatch`` missing or
refused; 2 a bad setting (``k2-submit: error: ...`` on stderr, naming it).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from k2.config import load_config
from k2.launcher.cli import run_main
from k2.launcher.tools.sbatch import check_submittable, defaults_notes, render_sbatch, submit_script

PROG = "k2-submit"

USAGE = """usage: k2-submit [-m] [HYDRA_OVERRIDE ...]

Check k2-train's overrides for cluster.nodes x cluster.gpus_per_node ranks, write
<run.dir>/pretrain.sbatch and submit it with sbatch (the job id goes to stdout). submit.dry_run=true
prints the script and submits nothing. The job holds its nodes exclusively with all their memory
(--mem=0; submit.mem=500G asks for less). submit.time, submit.partition, submit.account, submit.qos,
submit.constraint, submit.reservation, submit.job_name, submit.signal_seconds and submit.cpus_per_task
(also OMP_NUM_THREADS) set the #SBATCH lines; "submit.extra_args=['--mail-type=END']" adds others.
submit.cpu_bind / submit.gpu_bind bind the ranks (srun --cpu-bind / --gpu-bind); submit.distribution=cyclic
lays them round-robin over the nodes; submit.container_image / submit.container_mounts run them in a
pyxis container; submit.python is the interpreter written into the script (default: this one; it must
exist on every node); submit.setup=FILE is sourced first (module loads), "+submit.env.NAME=VALUE" exported.
Notes on stderr say which defaults the job gets (interpreter, partition, account, time limit). A job of
more than one node or with GPUs needs data.path (or submit.embedded_corpus=true). -m submits one job per
unfinished run of a sweep's grid (trunks, then their branches after them). Exit status 1: sbatch
missing or refused.

examples:
  k2-submit model=kimi_k2 parallel=k2_256gpu cluster.nodes=32 data.path=/shared/data/corpus_text_document \\
      data.tokenizer=/shared/data/tokenizer.json run.dir=/shared/runs/k2 submit.cpus_per_task=16 \\
      submit.cpu_bind=cores submit.gpu_bind=closest submit.qos=high submit.dry_run=true
  k2-submit ... 'submit.container_image="nvcr.io#nvidia/pytorch:24.10-py3"' submit.container_mounts=[/shared:/shared]
  k2-submit -m +experiment=sparsity_sweep
"""


def _submit(args: list[str]) -> int:
    # imported here: --help does not wait for torch (the run checks import the model's backends)
    from k2.launcher.tools.sweep import split_multirun
    from k2.launcher.training.prepare import prepare_run

    multirun, overrides = split_multirun(args)
    if multirun:  # the sweep's grid: its cost, then every unfinished trunk and branch
        from k2.launcher.tools.sweep_submit import submit_sweep

        return submit_sweep(overrides, PROG)
    cfg = load_config(overrides)
    prepare_run(cfg, check_submittable(cfg))  # also decides the resume of a used run.dir
    jobs = [(cfg, overrides)]
    texts = [render_sbatch(cfg, ovr) for cfg, ovr in jobs]
    for note in defaults_notes(jobs[0][0]) if jobs else ():
        print(f"{PROG}: note: {note}", file=sys.stderr)
    if jobs and jobs[0][0].submit.dry_run:
        sys.stdout.write("\n".join(texts))
        return 0
    for (cfg, _), text in zip(jobs, texts):
        rc = submit_script(cfg, text)
        if rc:
            return rc
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``k2-submit [-m] [HYDRA_OVERRIDE ...]``; the exit status of the module docstring."""
    return run_main(PROG, _submit, argv, usage=USAGE)


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
