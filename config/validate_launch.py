"""The ``launch``, ``submit``, ``prepare`` and ``sweep`` sections' checks (:mod:`k2.config.validate` runs them
with every other section's; the sections of :mod:`k2.config.schema_launch`): how ``k2-train`` starts local
ranks, what ``k2-submit`` may write into a Slurm batch script (the values a batch script takes literally, the
options k2-submit writes itself), how ``k2-data`` prepares a corpus, and the grid of a sparsity sweep.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from k2.config.choices import check_choice
from k2.config.errors import ConfigError, require

if TYPE_CHECKING:
    from k2.config.schema_launch import LaunchConfig, PrepareConfig, SubmitConfig, SweepConfig


#: ``sweep.cooldown.style``: the decay curves of schedules/wsd.py
SWEEP_COOLDOWN_STYLES = ("minus_sqrt", "linear", "cosine", "exponential")
#: Slurm's time-limit forms: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
_SLURM_TIME = re.compile(r"(\d+-)?\d+(:\d+){0,2}")
#: sbatch --mem: an integer with an optional unit suffix (K, M, G, T; M when none)
_SLURM_MEM = re.compile(r"\d+[KMGT]?")
#: srun --cpu-bind / --gpu-bind values (srun(1)), optionally preceded by "verbose,"
_CPU_BIND = re.compile(
    r"(verbose,)?(none|cores|threads|sockets|ldoms|rank|rank_ldom"
    r"|(map_cpu|mask_cpu|map_ldom|mask_ldom):[0-9a-fA-Fx*,]+)"
)
_GPU_BIND = re.compile(r"(verbose,)?(closest|none|(single|per_task):\d+|(map_gpu|mask_gpu):[0-9a-fA-Fx*,]+)")
#: the #SBATCH options k2-submit writes itself (from the setting named; None: always): not accepted in
#: submit.extra_args
SBATCH_OPTIONS_SET = {
    "--job-name": "submit.job_name",
    "--nodes": "cluster.nodes",
    "--ntasks-per-node": "cluster.gpus_per_node",
    "--ntasks": "cluster.nodes and cluster.gpus_per_node",
    "--gpus-per-node": "cluster.gpus_per_node",
    "--time": "submit.time",
    "--signal": "submit.signal_seconds",
    "--output": "run.dir",
    "--error": "run.dir",
    "--open-mode": "run.dir",
    "--requeue": None,
    "--no-requeue": None,
    "--exclusive": None,
    "--mem": "submit.mem",
    "--mem-per-cpu": "submit.mem",
    "--mem-per-gpu": "submit.mem",
    "--cpus-per-task": "submit.cpus_per_task",
    "--partition": "submit.partition",
    "--account": "submit.account",
    "--qos": "submit.qos",
    "--constraint": "submit.constraint",
    "--reservation": "submit.reservation",
    "--container-image": "submit.container_image",
    "--container-mounts": "submit.container_mounts",
}


def check_launch(la: LaunchConfig) -> None:
    """``launch.*``: the rendezvous of a multi-rank launch."""
    if la.rendezvous_timeout_s < 1:
        raise ConfigError(f"launch.rendezvous_timeout_s={la.rendezvous_timeout_s} must be an integer >= 1 (seconds)")


def check_submit(s: SubmitConfig) -> None:
    """``submit.*``: the ``#SBATCH`` settings of ``k2-submit``."""
    if s.signal_seconds < 1:
        raise ConfigError(f"submit.signal_seconds={s.signal_seconds} must be an integer >= 1 (seconds)")
    if not _SLURM_TIME.fullmatch(str(s.time)):
        raise ConfigError(
            f"submit.time={s.time!r} is not a Slurm time limit; allowed forms: MM, MM:SS, "
            "HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS (e.g. 24:00:00)"
        )
    if s.distribution is not None:
        check_choice(s, "distribution", "submit.distribution")
    for key in ("job_name", "partition", "account", "qos", "constraint", "reservation", "container_image", "python"):
        value = s[key]
        if value is not None and (not str(value) or re.search(r"\s", str(value))):
            raise ConfigError(f"submit.{key}={value!r} must be a non-empty string without whitespace")
    if s.mem is not None and not _SLURM_MEM.fullmatch(str(s.mem)):
        raise ConfigError(
            f"submit.mem={s.mem!r} is not a Slurm memory size; allowed: null (--mem=0, all of "
            "each node's memory), or an integer with an optional K/M/G/T suffix (e.g. 500G)"
        )
    if s.cpus_per_task is not None and (isinstance(s.cpus_per_task, bool) or s.cpus_per_task < 1):
        raise ConfigError(f"submit.cpus_per_task={s.cpus_per_task} must be an integer >= 1 (cores per rank), or null")
    if not _CPU_BIND.fullmatch(str(s.cpu_bind)):
        raise ConfigError(
            f"submit.cpu_bind={s.cpu_bind!r} is not an srun --cpu-bind value; allowed: none, "
            "cores, threads, sockets, ldoms, rank, rank_ldom, map_cpu:<list>, mask_cpu:<list>, "
            "map_ldom:<list>, mask_ldom:<list> (optionally 'verbose,' first)"
        )
    if s.gpu_bind is not None and not _GPU_BIND.fullmatch(str(s.gpu_bind)):
        raise ConfigError(
            f"submit.gpu_bind={s.gpu_bind!r} is not an srun --gpu-bind value; allowed: null, "
            "closest, none, single:<n>, per_task:<n>, map_gpu:<list>, mask_gpu:<list> "
            "(optionally 'verbose,' first)"
        )
    for i, arg in enumerate(s.extra_args):
        where = f"submit.extra_args[{i}]={arg!r}"
        if not re.fullmatch(r"--[A-Za-z][\w-]*(=\S+)?", str(arg)):
            raise ConfigError(
                f"{where} is not one #SBATCH option; allowed: --option or --option=value, "
                "no whitespace (e.g. --mail-type=END)"
            )
        name = str(arg).split("=", 1)[0]
        if name in SBATCH_OPTIONS_SET:
            setting = SBATCH_OPTIONS_SET[name]
            raise ConfigError(
                f"{where}: k2-submit sets {name} itself"
                + (f"; use {setting}" if setting else " (every job is exclusive and requeueable)")
            )
    for i, mount in enumerate(s.container_mounts):
        if not str(mount) or re.search(r"[\s,]", str(mount)):
            raise ConfigError(
                f"submit.container_mounts[{i}]={mount!r}; allowed: SRC[:DST[:FLAGS]] without "
                "whitespace or commas (one mount per list item)"
            )
    for name in s.env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(name)):
            raise ConfigError(
                f"submit.env.{name}: not an environment variable name; allowed: letters, digits and "
                "'_', not starting with a digit (e.g. NCCL_SOCKET_IFNAME)"
            )
    if s.setup is not None and not str(s.setup):
        raise ConfigError("submit.setup='' names no file; allowed: the path of a bash file, or null")
    if s.container_mounts and s.container_image is None:
        raise ConfigError(
            "submit.container_mounts is set but submit.container_image is null; set the image "
            "too, or submit.container_mounts=[]"
        )


def check_prepare(p: PrepareConfig) -> None:
    """``prepare.*`` (``k2-data prepare.input=...``): the values alone; the input files are checked by
    ``k2.launcher.datasets.sources``."""
    if p.input is None:
        return
    if p.output is None or not str(p.output).strip():
        raise ConfigError(
            "prepare.input is set but prepare.output is null: give the dataset prefix to write "
            "(prepare.output=/data/corpus_text_document -> .bin/.idx)"
        )
    require(bool(str(p.text_key).strip()), "prepare.text_key", p.text_key, "a JSONL field / Parquet column name")
    check_choice(p, "text_document", "prepare.text_document")
    check_choice(p, "bad_records", "prepare.bad_records")
    require(p.workers >= 1, "prepare.workers", p.workers, "an integer >= 1 (tokenizing processes)")
    require(p.chunk_documents >= 1, "prepare.chunk_documents", p.chunk_documents, "an integer >= 1")
    require(p.chunk_bytes >= 1, "prepare.chunk_bytes", p.chunk_bytes, "an integer >= 1")
    require(
        p.shard_documents is None or p.shard_documents >= 1,
        "prepare.shard_documents",
        p.shard_documents,
        "null (one dataset) or an integer >= 1 (documents per shard)",
    )
    require(
        p.tasks is None or p.tasks >= 1,
        "prepare.tasks",
        p.tasks,
        "null (one build in this process) or an integer >= 1 (tasks of an array build)",
    )
    if p.tasks is None:
        for key, given in (("task", p.task is not None), ("submit", bool(p.submit))):
            if given:
                raise ConfigError(f"prepare.{key}={p[key]} needs prepare.tasks (the tasks of an array build)")
        return
    require(
        p.task is None or 0 <= p.task < p.tasks,
        "prepare.task",
        p.task,
        f"null (every task here) or 0..{p.tasks - 1} (one task of prepare.tasks={p.tasks})",
    )
    if p.task is not None and p.submit:
        raise ConfigError(
            "prepare.task and prepare.submit=true together: submit plans and sbatches the array, "
            "each of whose tasks runs one prepare.task; give one or the other"
        )
    if p.shard_documents is not None:
        raise ConfigError(
            f"prepare.shard_documents={p.shard_documents} with prepare.tasks: an array build "
            "writes one shard per piece of prepare.shard_bytes of input; set one or the other"
        )
    require(p.shard_bytes >= 1, "prepare.shard_bytes", p.shard_bytes, "an integer >= 1 (input bytes per shard)")
    require(
        p.tokenizer_sample_bytes >= 1,
        "prepare.tokenizer_sample_bytes",
        p.tokenizer_sample_bytes,
        "an integer >= 1 (input bytes the BPE is trained on)",
    )


def check_sweep(s: SweepConfig) -> None:
    """``sweep.*``: distinct sparsities >= 1 (empty = no sweep), distinct seeds, distinct budgets > 0, a cooldown
    of 10% to under 100% of each budget (MiniCPM, arXiv 2404.06395: shorter decays lose) on a known decay curve,
    a positive collapse threshold and job count, and each size's overrides a list of ``key=value``."""
    sparsities = list(s.sparsities or [])
    if sparsities and (min(sparsities) < 1 or len(set(sparsities)) != len(sparsities)):
        raise ConfigError(f"sweep.sparsities={sparsities}; allowed: distinct integers >= 1")
    seeds = list(s.seeds or [])
    require(len(set(seeds)) == len(seeds), "sweep.seeds", seeds, "distinct integers ([] = [run.seed])")
    budgets = list(s.budgets_tokens or [])
    require(
        len(set(budgets)) == len(budgets) and all(isinstance(b, int) and b > 0 for b in budgets),
        "sweep.budgets_tokens",
        budgets,
        "distinct token counts > 0 ([] = where the schedule ends)",
    )
    c = s.cooldown
    require(
        0.1 <= c.fraction < 1.0,
        "sweep.cooldown.fraction",
        c.fraction,
        "0.1 <= fraction < 1 (a decay over less than 10% of a budget's tokens ends above its loss)",
    )
    require(c.style in SWEEP_COOLDOWN_STYLES, "sweep.cooldown.style", c.style, ", ".join(SWEEP_COOLDOWN_STYLES))
    require(c.lr_end >= 0, "sweep.cooldown.lr_end", c.lr_end, "an LR >= 0")
    require(
        s.collapsed_load > 1.0, "sweep.collapsed_load", s.collapsed_load, "a load max/mean > 1 (1 = perfectly balanced)"
    )
    require(isinstance(s.jobs, int) and s.jobs >= 1, "sweep.jobs", s.jobs, "an integer >= 1")
    for name, overrides in dict(s.sizes or {}).items():
        require(
            all(isinstance(o, str) and "=" in o for o in overrides),
            f"sweep.sizes.{name}",
            list(overrides),
            "a list of key=value overrides",
        )
