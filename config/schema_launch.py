"""The ``launch``, ``submit``, ``prepare`` and ``sweep`` sections of the config schema (:mod:`k2.config.schema`):
how ``k2-train`` starts its local ranks, how ``k2-submit`` renders and submits a Slurm job, how ``k2-data``
prepares a corpus (on one machine or as a Slurm array), and the grid of runs ``k2-train -m`` launches for a
sparsity sweep.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from k2.config.choices import BadRecords, SrunDistribution, TextDocument


@dataclass
class LaunchConfig:
    """Local process launch: ``k2-train`` spawns this many ranks itself when not under torchrun/srun."""

    nproc_per_node: int = 1
    master_port: int | None = None  # None = a free port
    # seconds every rank of a multi-rank launch waits at the rendezvous (MASTER_ADDR:MASTER_PORT) for the
    # others, e.g. a node that starts late; then the ranks that came stop with an error naming the
    # missing ranks and nodes (k2.parallel.rendezvous)
    rendezvous_timeout_s: int = 600
    # PYTORCH_CUDA_ALLOC_CONF of the ranks: k2-train sets it unless the environment does (null: never).
    # Expandable segments grow in place instead of leaving gaps between fixed-size segments, what k2-plan's
    # plan.gpu_overheads.fragmentation assumes (PyTorch "CUDA semantics"; launcher/training/cuda_env.py)
    cuda_alloc_conf: str | None = "expandable_segments:True"


@dataclass
class SubmitConfig:
    """``k2-submit`` (launcher/tools/sbatch.py): renders ``<run.dir>/pretrain.sbatch`` and submits it with sbatch."""

    dry_run: bool = False  # print the rendered script, write and submit nothing
    time: str = "24:00:00"  # sbatch --time (wall-clock limit of one (re)start), e.g. "24:00:00"
    partition: str | None = None  # sbatch --partition; null = the cluster's default
    account: str | None = None  # sbatch --account; null = the user's default
    job_name: str = "k2"  # sbatch --job-name
    signal_seconds: int = 120  # sbatch --signal=USR1@N: seconds before the time limit the ranks get USR1
    # --gpus-per-node=cluster.gpus_per_node (one task per GPU); false for CPU-only nodes (the CPU proxy,
    # the one-node test cluster), where cluster.gpus_per_node is the number of tasks per node
    request_gpus: bool = True
    # srun --distribution: how the ranks (SLURM_PROCID) are laid over the nodes. null = Slurm's default,
    # block (ranks 0..gpus_per_node-1 on the first node, ...: with PP outermost in megatron's rank order,
    # a pipeline stage's TP/EP/DP ranks share a node); cyclic deals them round-robin (rank r on node
    # r % nodes: the ranks of one stage on different nodes)
    distribution: SrunDistribution | None = None
    # sbatch --mem per node; null = --mem=0, all of each (exclusive) node's memory: offloaded optimizer
    # states / activations live there (k2-plan), and Slurm's memory cgroups give a job only what it asks
    mem: str | None = None
    cpus_per_task: int | None = None  # sbatch/srun --cpus-per-task and OMP_NUM_THREADS; null = Slurm's
    cpu_bind: str = "none"  # srun --cpu-bind: none, cores, threads, sockets, ldoms, rank, map_cpu:..., ...
    gpu_bind: str | None = None  # srun --gpu-bind: null (no option), closest, none, single:N, map_gpu:...
    qos: str | None = None  # sbatch --qos
    constraint: str | None = None  # sbatch --constraint (node features, e.g. "h100&ib")
    reservation: str | None = None  # sbatch --reservation
    # more #SBATCH options, "--option[=value]" each (quoted for Hydra: "submit.extra_args=['--mail-type=END']");
    # the ones k2-submit sets from other settings are refused (their setting is named)
    extra_args: list[str] = field(default_factory=list)
    # pyxis/enroot: srun --container-image (it must hold k2-launcher) and --container-mounts, one
    # "SRC[:DST[:FLAGS]]" each (run.dir and the data must be visible inside); null / [] = no container
    container_image: str | None = None
    container_mounts: list[str] = field(default_factory=list)
    # the Python written into the script; null = the one running k2-submit, python3 in a container (it
    # must exist at that path on every node: a checkout's .venv on a node-local disk does not)
    python: str | None = None
    # site set-up: a bash file the job sources before anything else (module loads, a conda or venv
    # activation, the site's own variables); it must exist when k2-submit runs, at the same path on the
    # nodes. null = none
    setup: str | None = None
    # environment variables the job exports after submit.setup, e.g. NCCL or network settings
    # ("+submit.env.NCCL_SOCKET_IFNAME=ib0"); quoted as written, never run
    env: dict[str, str] = field(default_factory=dict)
    # a job of several nodes or with GPUs and data.path=null is refused unless this says the embedded
    # standard-library test corpus is meant
    embedded_corpus: bool = False


@dataclass
class SweepCooldownConfig:
    """How every budget of a sweep ends: a cooldown branch of its trunk (Hagele et al. 2024, arXiv
    2405.18392: a 1-sqrt decay over ~20% of the tokens matches a cosine run of that length; MiniCPM, arXiv
    2404.06395: 10% of the tokens is the least that does)."""

    style: str = "minus_sqrt"  # the decay curve (schedules/wsd.py): minus_sqrt | linear | cosine | exponential
    fraction: float = 0.2  # of the budget's tokens spent in the decay; 0.1 <= fraction < 1
    lr_end: float = 0.0  # the LR at the budget's last token


@dataclass
class SweepConfig:
    """Sparsity sweep grid (``k2-train -m +experiment=sparsity_sweep``, launcher/tools/sweep.py and
    sweep_grid.py): per arm (sparsity = experts / top-k at fixed activated parameters; 1 = every expert
    active, the dense arm), size and seed one trunk at the schedule's constant LR up to the last branch point,
    and per budget one cooldown branch from the trunk's checkpoint; run dirs under ``dir``."""

    name: str = "none"
    sparsities: list[int] = field(default_factory=list)  # experts / top-k (K2: 8, 16, 32, 48)
    seeds: list[int] = field(default_factory=list)  # run.seed of each trunk (model init); [] = [run.seed]
    # training tokens of each budget (a branch's end); [] = one budget, where the schedule ends
    budgets_tokens: list[int] = field(default_factory=list)
    cooldown: SweepCooldownConfig = field(default_factory=SweepCooldownConfig)
    # optional size ladder: size name -> overrides of that size (e.g. [model.hidden_size=96]); {} = one size
    sizes: dict[str, list[str]] = field(default_factory=dict)
    # a cell whose median moe_load_max_over_mean after warm-up is above this is "collapsed" (kept out of fits):
    # most tokens of some MoE layer go to a few experts (the ceiling is experts / top-k; the CPU proxy with
    # K2's bias rate sat at 3.6-3.9 of 4.0, balanced runs at 1.3-2.4 with 8-64 experts)
    collapsed_load: float = 3.0
    jobs: int = 1  # cells trained at once on this machine (k2-train -m); each is one k2-train
    dir: str = "runs/sweeps/${sweep.name}"


@dataclass
class PrepareConfig:
    """``k2-data prepare.input=...``: tokenize a raw-text corpus into megatron indexed datasets
    (``launcher/datasets/preprocess.py``). The tokenizer is ``data.tokenizer`` or, when that is null, a
    byte-level BPE of ``data.vocab_size`` ids trained on the input."""

    input: Any | None = None  # files, directories or globs (JSONL[.gz|.zst], Parquet, .txt); null = off
    output: str | None = None  # dataset prefix: PREFIX.bin/.idx (or PREFIX_00000.bin/.idx, ... shards)
    text_key: str = "text"  # the JSONL field / Parquet column holding the document
    # plain text: file = one document per file; paragraph = per blank-line block
    text_document: TextDocument = TextDocument.file
    workers: int = 1  # tokenizing processes (the output bytes are the same for any number)
    # error = stop at the first bad record (file:line); skip = report and skip
    bad_records: BadRecords = BadRecords.error
    shard_documents: int | None = None  # documents per output shard; null = one PREFIX.bin/.idx
    chunk_documents: int = 2048  # records per encode_batch_fast call and per committed chunk (resume granularity)
    # ... and a chunk ends early once its records hold this many bytes of input (1 MiB), so that a chunk's
    # memory (its text, and ~100 bytes per token of tokenizer output) is bounded whatever the document size
    chunk_bytes: int = 1 << 20
    progress: bool = True  # progress bar on stderr (documents/s, tokens/s, ETA)
    # across machines (launcher/datasets/array_build.py): the input is cut into pieces of shard_bytes at
    # record boundaries, one output shard PREFIX_NNNNN each, built by `tasks` tasks (task t: pieces t,
    # t + tasks, ...); the bytes do not depend on the task count. null = one build in this process
    tasks: int | None = None
    task: int | None = None  # with tasks: build only this task's pieces (an array task: $SLURM_ARRAY_TASK_ID)
    submit: bool = False  # with tasks: plan here, then sbatch an array of the unfinished tasks (submit.*)
    shard_bytes: int = 1 << 30  # with tasks: input bytes per piece (and output shard); 1 GiB
    # with tasks and data.tokenizer=null: bytes of input the BPE is trained on, from the start of every piece
    tokenizer_sample_bytes: int = 1 << 30
