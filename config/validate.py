"""Every rule that depends on the config alone, run by :func:`k2.config.load_config` for every tool.

Each section checks itself (:data:`SECTION_CHECKS`: the function receives only its own section) and the
rules that span sections live in one place (:func:`check_cross_section`), as Megatron-Bridge's
``finalize()`` per section plus ``ConfigContainer.validate()`` do. The checks of the launch-side sections
(``launch``, ``submit``, ``prepare``, ``sweep``) are :mod:`k2.config.validate_launch`'s, those of ``cluster``
and ``plan`` :mod:`k2.config.validate_planning`'s; :data:`SECTION_CHECKS` runs them with the rest.
Rules that need the machine (files, CUDA, Transformer Engine) or a world size stay with the module that owns
them: the parallel layout (:class:`k2.parallel.dims.ParallelDims`), the schedule against that layout
(:func:`k2.schedules.resolve.resolve_schedule`), the data files (``k2.launcher.datasets.resolve``), the
compute backends on this machine (:func:`k2.model.backends.check_backend_config`), the checkpoint to
resume from (``k2.launcher.checkpointing.resume``).

Every error is a :class:`k2.config.ConfigError` naming the setting and the allowed values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

# re-exported: the Enum-typed settings and their messages
from k2.config.choices import CHOICES, CheckpointVerify, ResumeMode, check_choice, choice_error, values
from k2.config.errors import ConfigError, finite, require
from k2.config.recipes import recipe_names
from k2.config.schema import MEMORY_FP8_SITES, MEMORY_OFFLOAD_SITES, MEMORY_RECOMPUTE_SITES, optimizer_settings
from k2.config.validate_launch import (  # noqa: F401
    SBATCH_OPTIONS_SET,
    SWEEP_COOLDOWN_STYLES,
    check_launch,
    check_prepare,
    check_submit,
    check_sweep,
)
from k2.config.validate_planning import check_cluster, check_plan

if TYPE_CHECKING:
    from k2.config.schema import (
        CheckpointConfig,
        ConvertConfig,
        DataConfig,
        K2Config,
        MemoryConfig,
        ModelConfig,
        OptimConfig,
        PhaseMemoryConfig,
        PipelineConfig,
        RunConfig,
        ScheduleConfig,
        TrainConfig,
    )

__all__ = [
    "CHECKPOINT_VERIFY_LEVELS",
    "CHOICES",
    "MIN_EMBEDDED_VOCAB",
    "OPTIMIZERS",
    "OPTIMIZER_CHECKS",
    "RESUME_KEYS",
    "RESUME_MODES",
    "SECTION_CHECKS",
    "check_cross_section",
    "check_phase_memory",
    "check_prepare",
    "check_schedule_memory",
    "choice_error",
    "resume_settings",
    "validate",
]

#: the byte-level BPE tokenizer of the embedded corpus: 256 byte ids + <|endoftext|> + <|pad|>
MIN_EMBEDDED_VOCAB = 256 + 2
#: ``resume.*`` keys and their defaults (``resume`` is a plain mapping because ``from`` is a Python keyword
#: and cannot be a dataclass field)
RESUME_KEYS = {"mode": "auto", "from": None, "force": False, "branch_from": None}
# The allowed values of every fixed-choice setting are the Enums of k2.config.choices; as tuples of strings:
#: ``resume.mode`` (checked here: ``resume`` is no dataclass)
RESUME_MODES = values(ResumeMode)
#: ``checkpoint.verify``: what resume checks against a checkpoint's manifest
#: (k2.launcher.checkpointing.manifest)
CHECKPOINT_VERIFY_LEVELS = values(CheckpointVerify)
_MEMORY_SITES = {"fp8_store": MEMORY_FP8_SITES, "recompute": MEMORY_RECOMPUTE_SITES, "offload": MEMORY_OFFLOAD_SITES}


# --------------------------------------------------------------------------- one section each


def check_model(m: ModelConfig) -> None:
    """``model.*``: the compute-backend names (which of them this machine can run is checked by
    :func:`k2.model.backends.check_backend_config`)."""
    check_choice(m, "attention_backend", "model.attention_backend")
    check_choice(m, "max_logit_kernel", "model.max_logit_kernel")
    check_choice(m, "rope_type", "model.rope_type")
    for key in ("hidden_dropout", "attention_dropout"):
        v = getattr(m, key)
        require(finite(v) and 0.0 <= v < 1.0, f"model.{key}", v, "a probability 0 <= p < 1 (K2: 0.0)")


def check_train(t: TrainConfig) -> None:
    """``train.*``: precision (the FP8 recipe's with it), step counts, intervals."""
    check_choice(t, "precision", "train.precision")
    if t.fp8_recipe is not None:
        check_choice(t, "fp8_recipe", "train.fp8_recipe")
        if t.precision != "bf16":
            raise ConfigError(
                f"train.fp8_recipe={t.fp8_recipe} runs the GEMMs in FP8 beside BF16 weights and "
                f"activations (megatron-core's FP8 training); got train.precision={t.precision}; "
                "allowed: train.precision=bf16, or train.fp8_recipe=null"
            )
    if t.iters is not None and t.iters < 1:
        raise ConfigError(f"train.iters={t.iters} must be >= 1, or null (run to the end of the schedule)")
    # (zero validation batches would record a val_loss of 0.0 that reads as a measurement)
    require(
        t.eval_iters >= 1,
        "train.eval_iters",
        t.eval_iters,
        "an integer >= 1 (validation batches per evaluation; train.eval_interval=0 turns evaluation off)",
    )
    require(t.eval_interval >= 0, "train.eval_interval", t.eval_interval, "an integer >= 0 (steps; 0: no evaluation)")
    if t.save_interval is not None and t.save_interval < 1:
        raise ConfigError(
            f"train.save_interval={t.save_interval}; allowed: an integer >= 1 (steps), or "
            "null (save only at the end and on preemption)"
        )
    sp = t.spike
    require(sp.window >= 4, "train.spike.window", sp.window, "an integer >= 4 (steps)")
    require(finite(sp.sigma) and sp.sigma > 0, "train.spike.sigma", sp.sigma, "a number > 0 (standard deviations)")
    check_choice(sp, "action", "train.spike.action")
    require(
        sp.max_consecutive_skips >= 1, "train.spike.max_consecutive_skips", sp.max_consecutive_skips, "an integer >= 1"
    )


def check_checkpoint(c: CheckpointConfig) -> None:
    """``checkpoint.*``: retention and the verification on resume."""
    require(c.keep_last >= 1, "checkpoint.keep_last", c.keep_last, "an integer >= 1")
    require(c.keep_every is None or c.keep_every >= 1, "checkpoint.keep_every", c.keep_every, "an integer >= 1 or null")
    check_choice(c, "verify", "checkpoint.verify")
    steps = list(c.save_steps or [])
    require(
        all(isinstance(x, int) and x >= 1 for x in steps),
        "checkpoint.save_steps",
        steps,
        "a list of steps (integers >= 1)",
    )


def check_convert(c: ConvertConfig) -> None:
    """``convert.*`` (``k2-convert``): the model type, shard size and export dtype."""
    check_choice(c, "model_type", "convert.model_type")
    require(c.shard_bytes >= 1, "convert.shard_bytes", c.shard_bytes, "an integer >= 1 (bytes)")
    if c.dtype is not None:
        check_choice(c, "dtype", "convert.dtype")


def check_run(r: RunConfig) -> None:
    """``run.*``: wall-time budget, wandb mode."""
    if r.max_minutes is not None and not r.max_minutes > 0:
        raise ConfigError(f"run.max_minutes={r.max_minutes}; allowed: a number > 0, or null")
    require(
        r.hang_timeout_s is None or (finite(r.hang_timeout_s) and r.hang_timeout_s > 0),
        "run.hang_timeout_s",
        r.hang_timeout_s,
        "a number > 0 (seconds), or null (derived from the measured step time)",
    )
    require(
        finite(r.hang_startup_timeout_s) and r.hang_startup_timeout_s > 0,
        "run.hang_startup_timeout_s",
        r.hang_startup_timeout_s,
        "a number > 0 (seconds)",
    )
    check_choice(r.wandb, "mode", "run.wandb.mode")


def check_optim(o: OptimConfig) -> None:
    """``optim.*``: the optimizer (one of :data:`OPTIMIZERS`), the settings every optimizer shares, QK-Clip's tau,
    then the optimizer's own settings: its check in :data:`OPTIMIZER_CHECKS` where it has any."""
    require(o.name in OPTIMIZERS, "optim.name", o.name, ", ".join(OPTIMIZERS))
    check_choice(o, "router_optimizer", "optim.router_optimizer")
    require(
        finite(o.offload_fraction) and 0 <= o.offload_fraction <= 1,
        "optim.offload_fraction",
        o.offload_fraction,
        "0 <= value <= 1",
    )
    if o.qk_clip_tau is not None and not (finite(o.qk_clip_tau) and o.qk_clip_tau > 0):
        raise ConfigError(f"optim.qk_clip_tau={o.qk_clip_tau}; allowed: a number > 0 or null (off)")
    own = OPTIMIZER_CHECKS.get(o.name)
    if own is not None:
        own(o)


def check_optim_muonclip(o: OptimConfig) -> None:
    """``optim.*`` of ``optim=muonclip``: the Muon settings (K2 report section 2.1; the Newton-Schulz
    coefficient names are emerging-optimizers')."""
    from typing import get_args

    from emerging_optimizers.orthogonalized_optimizers.muon_utils import NSCoeffT

    coeffs = [c for c in get_args(NSCoeffT) if c != "custom"]
    require(
        o.muon_coefficient_type in coeffs, "optim.muon_coefficient_type", o.muon_coefficient_type, ", ".join(coeffs)
    )
    require(o.muon_num_ns_steps >= 1, "optim.muon_num_ns_steps", o.muon_num_ns_steps, "an integer >= 1")
    require(0.0 <= o.muon_momentum < 1.0, "optim.muon_momentum", o.muon_momentum, "0 <= value < 1")
    for key in optimizer_settings("muonclip"):  # its Enum-typed settings
        if f"optim.{key}" in CHOICES:
            check_choice(o, key, f"optim.{key}")


#: ``optim.name`` -> the check of that optimizer's own settings (:func:`k2.config.schema.optimizer_settings`),
#: for the optimizers that have any; :func:`check_optim` runs it after the shared settings
OPTIMIZER_CHECKS: dict[str, Callable[[OptimConfig], None]] = {"muonclip": check_optim_muonclip}


def check_memory(mem: MemoryConfig | PhaseMemoryConfig, prefix: str = "memory") -> None:
    """``memory.*``: known activation-memory site names (``k2.config.schema``), each at most once.
    ``prefix`` names the section in the message (a schedule phase's override:
    ``schedule.phases.<i>.memory``); keys the mapping lacks are not checked."""
    for key, allowed in _MEMORY_SITES.items():
        if key not in mem or mem[key] is None:
            continue
        names = list(mem[key])
        for name in names:
            if name not in allowed:
                raise ConfigError(f"{prefix}.{key} has {name!r}; allowed: {', '.join(allowed)} (a list, [] = off)")
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ConfigError(f"{prefix}.{key} lists {', '.join(dup)} more than once; allowed: each site once")


def check_phase_memory(overrides, key: str) -> None:
    """A schedule phase's ``memory`` override (``schedule.phases.<i>.memory``): a mapping of known
    ``memory.*`` keys (:data:`k2.config.schema.MEMORY_FP8_SITES` ... lists) with known site names.

    Raises:
        ConfigError: not a mapping, an unknown key, an unknown or repeated site, naming the setting.
    """
    if overrides is None:
        return
    if not hasattr(overrides, "keys"):
        raise ConfigError(
            f"{key}={overrides!r}; allowed: a mapping of {', '.join(_MEMORY_SITES)} (site lists), or null"
        )
    for k in overrides.keys():
        if k not in _MEMORY_SITES:
            raise ConfigError(f"unknown setting {key}.{k}; allowed: {', '.join(f'{key}.{n}' for n in _MEMORY_SITES)}")
        v = overrides[k]
        if v is not None and (isinstance(v, str) or not hasattr(v, "__iter__")):
            raise ConfigError(f"{key}.{k}={v!r}; allowed: a list of sites ([] = off), or null (the previous phase's)")
    check_memory(overrides, prefix=key)


def check_pipeline(p: PipelineConfig) -> None:
    """``pipeline.*``: the trace directory is a path (whether it names a file is checked by
    :func:`k2.schedules.pipeline.check_pipeline_config`, which looks at the file system)."""
    if p.trace is not None and not str(p.trace).strip():
        raise ConfigError("pipeline.trace=''; allowed: a directory path (created if missing) or null")


def check_data(d: DataConfig) -> None:
    """``data.*``: the embedded corpus's own settings when ``data.path`` is null (the syntax and the
    files of a user dataset are checked by ``k2.launcher.datasets.resolve``)."""
    require(
        d.index_tokens is None or (isinstance(d.index_tokens, int) and d.index_tokens > 0),
        "data.index_tokens",
        d.index_tokens,
        "a token count > 0, or null (what the schedule trains)",
    )
    if d.path is not None:
        return
    if not isinstance(d.vocab_size, int) or d.vocab_size < MIN_EMBEDDED_VOCAB:
        raise ConfigError(
            f"data.vocab_size={d.vocab_size} is too small for the byte-level BPE tokenizer of the embedded "
            f"corpus: it needs at least {MIN_EMBEDDED_VOCAB} (256 bytes + <|endoftext|> + <|pad|>)"
        )
    vf = d.valid_fraction
    if not finite(vf) or not 0.0 < float(vf) < 1.0:
        raise ConfigError(
            f"data.valid_fraction={vf} must be in (0, 1): the share of stdlib files held out for validation (e.g. 0.02)"
        )
    if d.valid_path is not None:
        raise ConfigError(
            "data.valid_path is set but data.path is null (the embedded stdlib corpus has its "
            "own validation split); set data.path too, or data.valid_path=null"
        )


def resume_settings(raw) -> dict:
    """``resume`` (a mapping, or a bare mode string) with the defaults of :data:`RESUME_KEYS` filled in.

    Raises:
        ConfigError: an unknown key or mode, or ``resume=never`` together with ``resume.from``.
    """
    if raw is None:
        raw = {}
    if isinstance(raw, str):
        raw = {"mode": raw}
    settings = dict(RESUME_KEYS)
    for k, v in dict(raw).items():
        if k not in RESUME_KEYS:
            raise ConfigError(f"unknown setting resume.{k}; allowed: {', '.join('resume.' + n for n in RESUME_KEYS)}")
        settings[k] = v
    if settings["mode"] not in RESUME_MODES:
        raise ConfigError(
            f"resume={settings['mode']!r}; allowed: {', '.join(RESUME_MODES)} "
            "(or resume.from=PATH to resume from a given checkpoint)"
        )
    if settings["mode"] == "never" and settings["from"] is not None:
        raise ConfigError("resume=never contradicts resume.from; set one of them")
    if settings["branch_from"] is not None and (settings["mode"] == "never" or settings["from"] is not None):
        raise ConfigError(
            "resume.branch_from (start as a branch of that checkpoint, then resume the branch's "
            "own) contradicts resume=never and resume.from; set one of them"
        )
    return settings


def check_schedule_memory(s: ScheduleConfig) -> None:
    """``schedule.phases.<i>.memory``: every phase's activation-memory override (:func:`check_phase_memory`;
    the rest of the schedule is checked by :func:`k2.schedules.resolve.resolve_schedule`)."""
    for i, phase in enumerate(list(s.phases or [])):
        check_phase_memory(phase.memory, f"schedule.phases.{i}.memory")


#: section name -> its check (receives only that section)
#: ``optim.name``'s allowed values: the ``optim`` recipe group, one recipe per optimizer of
#: ``k2.optim.registry`` (the config layer cannot import it; a test keeps the two equal)
OPTIMIZERS = recipe_names("optim")

SECTION_CHECKS: dict[str, Callable[[Any], None]] = {
    "model": check_model,
    "train": check_train,
    "checkpoint": check_checkpoint,
    "convert": check_convert,
    "run": check_run,
    "optim": check_optim,
    "memory": check_memory,
    "schedule": check_schedule_memory,
    "pipeline": check_pipeline,
    "data": check_data,
    "prepare": check_prepare,
    "cluster": check_cluster,
    "launch": check_launch,
    "plan": check_plan,
    "submit": check_submit,
    "resume": resume_settings,
    "sweep": check_sweep,
}


# --------------------------------------------------------------------------- rules across sections


def check_ep_overlap(cfg: K2Config) -> None:
    """The config rules of ``pipeline.ep_overlap`` (``k2.schedules.ep_overlap``): megatron-core's
    ``overlap_moe_expert_parallel_comm`` asserts in ``TransformerConfig.__post_init__``, said as settings,
    and whole-layer recompute, which would re-run the all-to-alls in backward.

    Args:
        cfg: the composed config.

    Raises:
        ConfigError: the first rule broken, naming the setting and what is allowed.
    """
    if not cfg.pipeline.ep_overlap:
        return
    m, p = cfg.model, cfg.parallel
    if not m.num_moe_experts:
        raise ConfigError(
            f"pipeline.ep_overlap=true hides the MoE all-to-all; model={m.name} has no experts "
            "(allowed: a MoE model, or pipeline.ep_overlap=false)"
        )
    if int(p.ep) <= 1:
        raise ConfigError(
            f"pipeline.ep_overlap=true needs expert parallelism: parallel.ep={p.ep} (allowed: "
            "parallel.ep >= 2, or pipeline.ep_overlap=false)"
        )
    if int(p.pp) > 1 and int(p.vpp or 1) <= 1:
        raise ConfigError(
            f"pipeline.ep_overlap=true with parallel.pp={p.pp} needs virtual pipeline stages "
            "(megatron's combined 1F1B is the interleaved schedule): allowed parallel.vpp >= 2, "
            "or parallel.pp=1"
        )
    if m.moe_token_dispatcher_type != "alltoall":
        raise ConfigError(
            f"pipeline.ep_overlap=true with model.moe_token_dispatcher_type="
            f"{m.moe_token_dispatcher_type}; allowed: alltoall"
        )
    # whole-layer recompute re-runs a layer's dispatch and combine in backward, outside the pairs: a phase
    # with it runs the plain interleaved 1F1B (k2.launcher.training.phase_memory); refused when no phase
    # would run the overlap
    top = "layer" in list(cfg.memory.recompute or [])
    layer, layer_phases = top, []
    for phase in list(cfg.schedule.phases or []):  # a phase's override holds until the next one's
        if phase.memory.recompute is not None:
            layer = "layer" in list(phase.memory.recompute)
        layer_phases.append(layer)
    if all(layer_phases or [top]):
        where = "memory.recompute" if top else "every schedule.phases.<i>.memory.recompute"
        raise ConfigError(
            f"pipeline.ep_overlap=true with {where} containing 'layer': whole-layer recompute "
            "re-runs the layer's dispatch and combine all-to-alls in backward, outside the "
            "overlapped pairs, so no step would overlap them; allowed: the selective sites "
            "(layernorm, swiglu, mla_up_proj, moe_down_proj) in at least one phase, or "
            "pipeline.ep_overlap=false"
        )


def check_cross_section(cfg: K2Config) -> None:
    """The rules that involve more than one section, all in one place."""
    check_choice(cfg, "output", "output")
    if cfg.optim.qk_clip_tau is not None and not cfg.model.record_max_logits:
        raise ConfigError(
            f"optim.qk_clip_tau={cfg.optim.qk_clip_tau} needs the per-head max logits: set "
            "model.record_max_logits=true (allowed with record_max_logits=false: optim.qk_clip_tau=null)"
        )
    if cfg.data.path is None and cfg.prepare.input is None and int(cfg.data.vocab_size) > int(cfg.model.vocab_size):
        raise ConfigError(
            f"data.vocab_size={cfg.data.vocab_size} (the embedded corpus tokenizer) exceeds "
            f"model.vocab_size={cfg.model.vocab_size}: token ids would overflow the embedding table; set "
            f"model.vocab_size={cfg.data.vocab_size} (or larger) or data.vocab_size<={cfg.model.vocab_size}"
        )
    if cfg.checkpoint.export_hf and not cfg.checkpoint.save_at_end:
        raise ConfigError(
            "checkpoint.export_hf=true exports the checkpoint saved at the end of the run: "
            "it needs checkpoint.save_at_end=true"
        )
    if cfg.optim.offload_fraction > 0 and not cfg.parallel.use_distributed_optimizer:
        raise ConfigError(
            f"optim.offload_fraction={cfg.optim.offload_fraction} needs the distributed optimizer "
            "(allowed: parallel.use_distributed_optimizer=true, or optim.offload_fraction=0)"
        )
    if cfg.optim.offload_fraction > 0 and cfg.optim.name == "muonclip" and cfg.optim.muon_zero1 != "byte_range":
        raise ConfigError(
            f"optim.offload_fraction={cfg.optim.offload_fraction} with optim=muonclip needs "
            "optim.muon_zero1=byte_range (allowed with layer_wise: optim.offload_fraction=0)"
        )
    if cfg.data.path is None and cfg.data.tokenizer is not None and cfg.prepare.input is None:
        raise ConfigError(
            f"data.tokenizer={cfg.data.tokenizer} is set but data.path is null: the embedded "
            "stdlib corpus uses the tokenizer k2-data trains; set data.tokenizer=null or give "
            "data.path (or prepare.input, to tokenize a raw-text corpus with it)"
        )
    check_ep_overlap(cfg)
    if cfg.sweep.sparsities and not cfg.model.num_moe_experts:
        raise ConfigError(
            f"sweep over sparsity needs a MoE model; model={cfg.model.name} has model.num_moe_experts=null"
        )


def validate(cfg: K2Config) -> None:
    """Run every section's check, then the cross-section rules (``load_config`` calls it).

    Raises:
        ConfigError: the first rule broken, naming the setting and the allowed values.
    """
    for name, check in SECTION_CHECKS.items():
        check(cfg[name])
    check_cross_section(cfg)
