"""Which compute path the model takes on this machine: core-attention backend and routed-experts module.

Config keys (``config/schema.py``): ``k2.model.attention_backend`` (``auto`` | ``sdpa`` | ``eager`` | ``te``)
and ``k2.model.moe_grouped_gemm`` (null = auto | true | false). ``auto`` is resolved per process from what
is present: CUDA, Transformer Engine (the ``gpu`` extra), the precision. :func:`check_backend_config` is the
trainer's validation (``k2.launcher.training.prepare.prepare_run``), before any process group. This module imports no
megatron (it runs in the plan).

GPU path (docs/gpu.md), whether or not Transformer Engine is installed: BF16 through megatron's
mixed-precision wrapper (``Float16Module``, ``parallel/distributed.py``), core attention on SDPA with cuDNN
first (``model/attention.py``), routed experts as grouped GEMMs (``model/grouped_mlp.py``), torch's AdamW
(:func:`k2.optim.build.use_torch_adam`). TE's fused attention with ``return_max_logit``
(:func:`k2.model.attention.te_core_attention_class`) runs only when ``model.attention_backend=te`` is set:
it has not run in this project yet, so ``auto`` does not pick it even where TE imports (every NGC
container). The rest of the model stays on megatron's local modules (TE linears, norms and TE's grouped
experts are not wired).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from k2.config import ConfigError
from k2.config.choices import AttentionBackend, values

if TYPE_CHECKING:
    from k2.config.schema import K2Config

#: ``model.attention_backend``'s values (:class:`k2.config.choices.AttentionBackend`)
ATTENTION_BACKENDS = values(AttentionBackend)


def te_available() -> bool:
    """True when Transformer Engine's PyTorch module imports."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a broken install (missing CUDA libraries)
        return False
    return True


def resolve_attention_backend(setting: str, cuda: bool | None = None) -> str:
    """The core-attention backend for ``k2.model.attention_backend``: ``auto`` -> ``sdpa`` on CUDA (with
    or without Transformer Engine: ``te`` is chosen only explicitly, module docstring), ``eager`` on CPU;
    others as given.

    Raises:
        ValueError: an unknown setting.
    """
    if setting not in ATTENTION_BACKENDS:
        raise ValueError(f"model.attention_backend={setting!r}; allowed: {', '.join(ATTENTION_BACKENDS)}")
    if setting != "auto":
        return setting
    cuda = torch.cuda.is_available() if cuda is None else cuda
    return "sdpa" if cuda else "eager"


def resolve_grouped_experts(setting: bool | None, precision: str, cuda: bool | None = None) -> bool:
    """``k2.model.moe_grouped_gemm``: True/False as given; None (auto) = grouped on CUDA in bf16, megatron's
    sequential experts otherwise. The CPU proxy keeps ``SequentialMLP`` by default: its order of
    operations is what the bitwise-equality tests of other features (offload, wgrad split, parallel
    layouts) compare against, and on CPU ``torch._grouped_mm`` is itself a loop over the experts."""
    if setting is not None:
        return bool(setting)
    cuda = torch.cuda.is_available() if cuda is None else cuda
    return bool(cuda) and precision == "bf16"


def check_backend_config(cfg: K2Config) -> None:
    """Check that this machine can run ``k2.model.attention_backend``, ``k2.model.max_logit_kernel`` and
    ``k2.model.moe_grouped_gemm`` (their allowed values are :mod:`k2.config.validate`'s).

    Raises:
        ConfigError: ``train.fp8_recipe`` this machine cannot run (:func:`check_fp8_recipe`); a recompute
            site k2-train does not run (:func:`check_recompute_sites`);
            ``pipeline.ep_overlap`` on CUDA without bf16; ``te`` without Transformer Engine or CUDA;
        the Triton max-logit kernel without
            Triton and CUDA or with another backend than sdpa;
            grouped experts with widths ``torch._grouped_mm`` cannot take (``k2.model.hidden_size`` and
            ``k2.model.moe_ffn_hidden_size`` must be multiples of 8: 16-byte rows in bf16) or with
            ``parallel.tp > 1`` (expert tensor parallelism), or a torch without ``_grouped_mm``.
    """
    m = cfg.model
    check_fp8_recipe(cfg)
    check_recompute_sites(cfg)
    if cfg.pipeline.ep_overlap and cfg.train.precision != "bf16" and torch.cuda.is_available():
        raise ConfigError(
            f"pipeline.ep_overlap=true on GPUs needs train.precision=bf16 (megatron-core's combined-"
            f"1F1B rule), got {cfg.train.precision}; allowed: train.precision=bf16, or "
            "pipeline.ep_overlap=false"
        )
    if m.max_logit_kernel == "triton":
        from k2.model.max_logit_kernel import triton as _triton

        if _triton is None or not torch.cuda.is_available():
            raise ConfigError("model.max_logit_kernel=triton needs Triton and a CUDA device; allowed here: torch")
        if resolve_attention_backend(m.attention_backend) != "sdpa":
            raise ConfigError(
                f"model.max_logit_kernel=triton is the sdpa backend's; model.attention_backend="
                f"{m.attention_backend} resolves to {resolve_attention_backend(m.attention_backend)}; "
                "allowed: model.attention_backend=sdpa (or auto on CUDA)"
            )
    if m.attention_backend == "te" and not (torch.cuda.is_available() and te_available()):
        raise ConfigError(
            "model.attention_backend=te needs Transformer Engine (the gpu extra) and a CUDA "
            "device; allowed here: auto, sdpa, eager"
        )
    if not m.num_moe_experts or not resolve_grouped_experts(m.moe_grouped_gemm, cfg.train.precision):
        return
    why = "model.moe_grouped_gemm=true" if m.moe_grouped_gemm else "model.moe_grouped_gemm=null (auto: CUDA, bf16)"
    if not hasattr(torch, "_grouped_mm"):
        raise ConfigError(f"{why} needs torch._grouped_mm (torch >= 2.8); allowed: model.moe_grouped_gemm=false")
    for key in ("hidden_size", "moe_ffn_hidden_size"):
        if int(m[key]) % 8:
            raise ConfigError(
                f"{why} needs model.{key} a multiple of 8 (16-byte rows for torch._grouped_mm), "
                f"got {m[key]}; allowed: such a width, or model.moe_grouped_gemm=false"
            )
    if cfg.parallel.tp > 1:
        raise ConfigError(
            f"{why} does not support expert tensor parallelism (parallel.tp={cfg.parallel.tp}); "
            "allowed: parallel.tp=1, or model.moe_grouped_gemm=false"
        )


#: the least CUDA compute capability (major) each ``train.fp8_recipe`` runs on: Transformer Engine's blockwise
#: FP8 from Hopper (9.0), MXFP8 on Blackwell's tensor cores (10.0)
FP8_RECIPE_MIN_CAPABILITY = {"blockwise": 9, "mxfp8": 10}


def check_fp8_recipe(
    cfg: K2Config, cuda: bool | None = None, te: bool | None = None, capability: int | None = None
) -> None:
    """``train.fp8_recipe`` on this machine: the GEMMs in FP8 through Transformer Engine's recipe need a CUDA
    device of the recipe's generation (:data:`FP8_RECIPE_MIN_CAPABILITY`), Transformer Engine (the ``gpu``
    extra; its linears then replace megatron's local ones, :func:`k2.model.fp8.te_linear_classes`) and
    megatron's sequential experts (K2's grouped experts run ``torch._grouped_mm``, which the recipe does not
    reach). ``cuda``, ``te``, ``capability``: this machine's, unless given.

    Raises:
        ConfigError: one line naming ``train.fp8_recipe``, what is missing and the allowed values.
    """
    recipe = cfg.train.fp8_recipe
    if recipe is None:
        return
    cuda = torch.cuda.is_available() if cuda is None else cuda
    te = te_available() if te is None else te
    if not (cuda and te):
        missing = " and ".join(
            x for x, ok in (("a CUDA device", cuda), ("Transformer Engine (the gpu extra)", te)) if not ok
        )
        raise ConfigError(
            f"train.fp8_recipe={recipe} runs the GEMMs through Transformer Engine's FP8 recipe on "
            f"GPUs; this machine lacks {missing}; allowed here: train.fp8_recipe=null (k2-plan "
            "prices FP8 GEMMs on any machine)"
        )
    major = torch.cuda.get_device_capability()[0] if capability is None else capability
    need = FP8_RECIPE_MIN_CAPABILITY[str(recipe)]
    if major < need:
        allowed = [r for r, c in FP8_RECIPE_MIN_CAPABILITY.items() if major >= c]
        raise ConfigError(
            f"train.fp8_recipe={recipe} needs a GPU of compute capability {need}.0 or later, this one "
            f"is {major}.x; allowed here: {', '.join(allowed + ['null'])}"
        )
    if resolve_grouped_experts(cfg.model.moe_grouped_gemm, cfg.train.precision, cuda) and cfg.model.num_moe_experts:
        raise ConfigError(
            f"train.fp8_recipe={recipe} needs megatron's sequential experts (K2's grouped experts run "
            "torch._grouped_mm in BF16, which Transformer Engine's recipe does not reach); allowed: "
            "model.moe_grouped_gemm=false, or train.fp8_recipe=null"
        )


def check_recompute_sites(cfg: K2Config) -> None:
    """``memory.recompute`` (and each schedule phase's) holds no site that only ``k2-plan`` plans
    (:data:`k2.config.schema.PLANNED_ONLY_RECOMPUTE`: megatron's ``core_attn``, ``mlp`` and ``moe`` module
    recompute, which the K2 layers do not run yet).

    Raises:
        ConfigError: one line naming the setting, the site and what k2-train runs.
    """
    from k2.config.schema import MEMORY_RECOMPUTE_SITES, PLANNED_ONLY_RECOMPUTE

    lists = [("memory.recompute", cfg.memory.recompute)]
    for i, phase in enumerate(list(cfg.schedule.phases or [])):
        lists.append((f"schedule.phases.{i}.memory.recompute", (phase.get("memory") or {}).get("recompute")))
    for setting, sites in lists:
        planned = [x for x in (sites or ()) if x in PLANNED_ONLY_RECOMPUTE]
        if planned:
            runs = [x for x in MEMORY_RECOMPUTE_SITES if x not in PLANNED_ONLY_RECOMPUTE]
            raise ConfigError(
                f"{setting} has {', '.join(planned)}: megatron's module recompute, which k2-plan plans "
                f"and k2-train does not run yet; allowed for k2-train: {', '.join(runs)}"
            )
