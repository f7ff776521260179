"""The ``launch`` and ``submit`` sections' checks (:mod:`k2.config.validate` runs them with every other
section's): how ``k2-train`` starts local ranks and what ``k2-submit`` may write into a Slurm batch script
(the values a batch script takes literally, the options k2-submit writes itself).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from k2.config.choices import check_choice
from k2.config.errors import ConfigError

if TYPE_CHECKING:
    from k2.config.schema_launch import LaunchConfig, SubmitConfig


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
