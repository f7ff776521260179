"""The allowed values of every config setting that takes one of a fixed set of names, written once.

Each is a :class:`Choice`, an ``enum.StrEnum`` whose member names equal their values: OmegaConf assigns an
``Enum`` field by member name, so a recipe's ``precision: bf16`` and the override ``train.precision=bf16``
keep working, and a value outside the set is refused while the config is composed
(:func:`k2.config.load_config` turns OmegaConf's refusal into the setting's :class:`k2.config.ConfigError`,
:func:`k2.config.validate.choice_error`). A member *is* a ``str``: ``cfg.train.precision == "bf16"``, dict
look-ups by the value, f-strings, JSON, ``OmegaConf.to_yaml`` (the run dir's ``config.yaml``) and
``repr`` (error messages) read exactly as the plain string did.

Settings whose value is a name *or* something else stay ``str`` in the schema: ``plan.hardware`` (a
profile name or a YAML path), ``optim.name`` (the Hydra choice of the ``optim`` group, one recipe per
optimizer), ``optim.muon_coefficient_type`` (emerging-optimizers' own list, read from the library), the
megatron-core settings passed through unchanged (``model.moe_*``, ``model.normalization``), and the
``memory.*`` site names (:data:`k2.config.schema.MEMORY_FP8_SITES` and its neighbours hold each name's
description).
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any

from k2.config.errors import ConfigError

__all__ = [
    "CHOICES",
    "AttentionBackend",
    "BadRecords",
    "CheckpointVerify",
    "Choice",
    "ConvertModelType",
    "Fp8Recipe",
    "LrStyle",
    "MaxLogitKernel",
    "MuonMatmulPrecision",
    "MuonScaleMode",
    "MuonZero1",
    "Output",
    "Precision",
    "ResumeMode",
    "RopeType",
    "RouterOptimizer",
    "SpikeAction",
    "SrunDistribution",
    "TextDocument",
    "WandbMode",
    "allowed",
    "check_choice",
    "choice_error",
    "choice_setting",
    "values",
]


class Choice(StrEnum):
    """A setting's allowed values. ``repr`` is the plain string's, so a message that quotes a setting
    (``train.precision='bf16'``) reads the same whether the value came from the config or a literal."""

    __repr__ = str.__repr__


def values(choice: type[Choice]) -> tuple[str, ...]:
    """``("fp32", "bf16")``: the values of ``choice`` as plain strings, in declaration order."""
    return tuple(member.value for member in choice)


def allowed(choice: type[Choice]) -> str:
    """``"fp32, bf16"``: the values of ``choice`` in declaration order, as error messages list them."""
    return ", ".join(values(choice))


class Precision(Choice):
    """``train.precision`` (model weights and compute) and ``convert.dtype`` (an export's tensors)."""

    fp32 = "fp32"
    bf16 = "bf16"


class Fp8Recipe(Choice):
    """``train.fp8_recipe``: the GEMMs' FP8 scaling, megatron-core's ``fp8_recipe`` values that Transformer
    Engine runs: ``blockwise`` (DeepSeek-V3's fine-grained scaling: a scale per 1 x 128 tile of the
    activations and gradients, per 128 x 128 block of the weights, arXiv 2412.19437 section 3.3.2; Hopper
    and later), ``mxfp8`` (OCP microscaling: an 8-bit power-of-two scale per 32 consecutive elements,
    Blackwell's tensor cores)."""

    blockwise = "blockwise"
    mxfp8 = "mxfp8"


class RouterOptimizer(Choice):
    """``optim.router_optimizer``: the MoE router weight's optimizer under MuonClip."""

    muon = "muon"
    adamw = "adamw"


class MuonZero1(Choice):
    """``optim.muon_zero1``: how ZeRO-1 shards the Muon matrices (``k2.optim.build``)."""

    byte_range = "byte_range"
    layer_wise = "layer_wise"


class MuonScaleMode(Choice):
    """``optim.muon_scale_mode``: emerging-optimizers' scale of the orthogonalized update."""

    spectral = "spectral"
    shape_scaling = "shape_scaling"
    unit_rms_norm = "unit_rms_norm"


class MuonMatmulPrecision(Choice):
    """``optim.muon_fp32_matmul_prec``: torch's float32 matmul precision of Newton-Schulz."""

    medium = "medium"
    high = "high"
    highest = "highest"


class RopeType(Choice):
    """``model.rope_type`` and ``schedule.phases.<i>.rope_type``: the rotary position embedding (plain RoPE
    while pretraining at 4K, YaRN for the 128K extension; ``k2.model.rope.rope_fields``)."""

    rope = "rope"
    yarn = "yarn"


class LrStyle(Choice):
    """``schedule.phases.<i>.lr_style``: a phase's learning-rate rule between ``lr_start`` and ``lr_end``:
    ``constant``, megatron-core's decay curves (``OptimizerParamScheduler``: ``linear``, ``cosine``,
    ``exponential``, ``minus_sqrt``; ``k2.schedules.wsd.decay_coefficient``), or ``continue`` (the previous
    phase's rule goes on)."""

    constant = "constant"
    linear = "linear"
    cosine = "cosine"
    exponential = "exponential"
    minus_sqrt = "minus_sqrt"
    # ``continue`` is a Python keyword, so no statement can name it, and OmegaConf assigns a member by its
    # name, so the name must be the value a recipe writes: set through the class body's namespace (Enum's
    # own, which makes it a member like the others; LrStyle["continue"] reads it)
    locals()["continue"] = "continue"


class AttentionBackend(Choice):
    """``model.attention_backend``: auto = sdpa on CUDA (te only when set), eager on CPU
    (``k2.model.backends``)."""

    auto = "auto"
    sdpa = "sdpa"
    eager = "eager"
    te = "te"


class MaxLogitKernel(Choice):
    """``model.max_logit_kernel``: how the sdpa backend gets QK-Clip's per-head max logit."""

    torch = "torch"
    triton = "triton"


class WandbMode(Choice):
    """``run.wandb.mode`` (wandb's own ``mode``)."""

    offline = "offline"
    online = "online"
    disabled = "disabled"


class Output(Choice):
    """``output=``: ``k2-plan`` takes all three, ``k2-bench`` text and json."""

    text = "text"
    table = "table"
    json = "json"


class ResumeMode(Choice):
    """``resume.mode`` (``resume`` is a plain mapping, ``from`` being a Python keyword:
    :func:`k2.config.validate.resume_settings` checks it)."""

    auto = "auto"
    never = "never"


class CheckpointVerify(Choice):
    """``checkpoint.verify``: what resume checks against a checkpoint's manifest
    (``k2.launcher.checkpointing.manifest``)."""

    checksum = "checksum"
    size = "size"
    none = "none"


class SpikeAction(Choice):
    """``train.spike.action``: what a loss or gradient-norm spike does (``k2.launcher.training.spike``)."""

    log = "log"
    skip = "skip"
    stop = "stop"


class ConvertModelType(Choice):
    """``convert.model_type``: config.json's ``model_type`` of an export (``k2.launcher.hf.hf_config``)."""

    deepseek_v3 = "deepseek_v3"
    kimi_k2 = "kimi_k2"


class TextDocument(Choice):
    """``prepare.text_document``: what one document of a plain-text input is."""

    file = "file"
    paragraph = "paragraph"


class BadRecords(Choice):
    """``prepare.bad_records``: what a record that cannot be read does."""

    error = "error"
    skip = "skip"


class SrunDistribution(Choice):
    """``submit.distribution``: srun's node-level ``--distribution``."""

    block = "block"
    cyclic = "cyclic"


_ALLOWED = "{setting}={value!r}; allowed: {allowed}"
#: every Enum-typed setting: its :class:`k2.config.choices.Choice` and the message that refuses a value
#: outside it (``{setting}``, ``{value}``, ``{allowed}`` filled in). The same message whether the section
#: check finds the value or OmegaConf refuses it while the config is composed (``k2.config.load``).
CHOICES: dict[str, tuple[type[Choice], str]] = {
    "model.attention_backend": (AttentionBackend, _ALLOWED + " (auto = sdpa on CUDA, eager on CPU)"),
    "model.max_logit_kernel": (MaxLogitKernel, _ALLOWED),
    "model.rope_type": (RopeType, _ALLOWED),
    "schedule.phases.<i>.lr_style": (LrStyle, _ALLOWED),
    "schedule.phases.<i>.rope_type": (
        RopeType,
        _ALLOWED + " or null (the previous phase's; the first phase: model.rope_type)",
    ),
    "train.precision": (Precision, _ALLOWED),
    "train.fp8_recipe": (Fp8Recipe, _ALLOWED + " or null (GEMMs in train.precision)"),
    "train.spike.action": (SpikeAction, _ALLOWED),
    "checkpoint.verify": (CheckpointVerify, _ALLOWED),
    "convert.model_type": (ConvertModelType, _ALLOWED),
    "convert.dtype": (Precision, _ALLOWED + " or null (the checkpoint's dtype)"),
    "run.wandb.mode": (WandbMode, _ALLOWED),
    "optim.router_optimizer": (RouterOptimizer, _ALLOWED),
    "optim.muon_scale_mode": (MuonScaleMode, _ALLOWED),
    "optim.muon_zero1": (MuonZero1, _ALLOWED),
    "optim.muon_fp32_matmul_prec": (MuonMatmulPrecision, _ALLOWED + " (medium = Newton-Schulz in bf16)"),
    "prepare.text_document": (TextDocument, _ALLOWED),
    "prepare.bad_records": (BadRecords, _ALLOWED),
    "submit.distribution": (
        SrunDistribution,
        "{setting}={value!r} is not one of {allowed} or null (Slurm's default, block)",
    ),
    "output": (Output, _ALLOWED),
}


def choice_setting(key: str) -> str | None:
    """The key of :data:`CHOICES` that the setting ``key`` is: itself, or the list item's pattern
    (``schedule.phases.2.lr_style`` -> ``schedule.phases.<i>.lr_style``); None for a key of no Enum-typed
    setting."""
    pattern = re.sub(r"\[\d+\]|\.\d+(?=\.)", ".<i>", key)
    return key if key in CHOICES else pattern if pattern in CHOICES else None


def _choice_of(setting: str) -> tuple[type[Choice], str]:
    """``CHOICES``'s entry of ``setting`` (:func:`choice_setting`).

    Raises:
        KeyError: ``setting`` is no Enum-typed setting.
    """
    key = choice_setting(setting)
    if key is None:
        raise KeyError(f"{setting} takes no Enum's values (k2.config.choices.CHOICES)")
    return CHOICES[key]


def choice_error(setting: str, value: Any) -> ConfigError:
    """The error for ``value`` outside the allowed values of the Enum-typed ``setting`` (a key of
    :data:`CHOICES`, or a list item of one: ``schedule.phases.2.lr_style``), naming the setting and every
    allowed value. OmegaConf's ``schedule.phases[2].lr_style`` is named as the override a user writes,
    ``schedule.phases.2.lr_style``."""
    setting = re.sub(r"\[(\d+)\]", r".\1", setting)
    choice, message = _choice_of(setting)
    return ConfigError(message.format(setting=setting, value=value, allowed=allowed(choice)))


def check_choice(section: Any, key: str, setting: str) -> None:
    """``section.key`` is one of the values of ``setting``'s Enum (null allowed where the schema says
    ``Optional``: the caller skips it)."""
    value = section[key]
    if value not in values(_choice_of(setting)[0]):
        raise choice_error(setting, value)
