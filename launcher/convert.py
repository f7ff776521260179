"""``k2-convert``: Hugging Face DeepSeek-V3 / Kimi K2 checkpoints in and out (:mod:`k2.launcher.hf`)."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from k2.config import ConfigError, load_config
from k2.launcher.checkpointing.paths import CHECKPOINTS, LATEST, resume_point
from k2.launcher.cli import run_main

PROG = "k2-convert"
VERBS = ("import", "export")
#: short forms of the ``convert.*`` keys on the command line
SHORT = ("hf", "out", "checkpoint")

USAGE = """usage: k2-convert {import|export} [HYDRA_OVERRIDE ...]

import: a Hugging Face DeepSeek-V3 / Kimi K2 directory (config.json + safetensors index and shards;
  BF16, FP32 or FP8 128x128 block-quantized with weight_scale_inv) -> <run.dir>/checkpoints/iter_0000000,
  the model weights for model=... (checked against config.json) in train.precision; k2-train in that
  run dir (or resume.from=it) starts a fresh run from them (step 0, new optimizer state).
export: a checkpoint of ours (checkpoint=: a checkpoint, a checkpoints/ dir or a run dir; default the
  latest of run.dir), saved with any layout -> an HF directory out=PATH that
  transformers.AutoModelForCausalLM.from_pretrained loads (DeepseekV3ForCausalLM).

examples:
  k2-convert import hf=/models/Kimi-K2-Base model=kimi_k2 train.precision=bf16 run.dir=/runs/k2-cont
  k2-convert export run.dir=runs/k2_tiny-cpu4 out=exports/k2_tiny
  k2-convert export checkpoint=runs/a/checkpoints/iter_0000300 out=exports/a convert.dtype=bf16
"""


def _overrides(args: list[str]) -> list[str]:
    return [f"convert.{a}" if a.split("=", 1)[0] in SHORT else a for a in args]


def resolve_checkpoint(where: Path) -> Path:
    """A checkpoint directory from a checkpoint, a ``checkpoints/`` directory or a run dir.

    A ``latest`` is read as resume reads it (:func:`k2.launcher.checkpointing.paths.resume_point`): it may
    name only a checkpoint of its own directory; missing, empty or dangling, the newest that verifies.

    Raises:
        ConfigError: none found there; a ``latest`` that is not a file or points outside its directory.
    """
    for root in (where, where / CHECKPOINTS):
        if (root / LATEST).exists():
            return resume_point(None, root=root)[0]
    if where.is_dir() and where.name.startswith("iter_"):
        return where
    raise ConfigError(
        f"convert.checkpoint={where}: no checkpoint there (a checkpoint iter_NNNNNNN, a "
        "checkpoints/ directory or a run dir with checkpoints/latest)"
    )


def _convert(args: list[str]) -> int:
    if not args or args[0] not in VERBS:
        raise ConfigError(
            f"k2-convert needs a verb first; allowed: {', '.join(VERBS)} (got {args[0] if args else 'nothing'!r})"
        )
    verb, cfg = args[0], load_config(_overrides(args[1:]))
    c = cfg.convert
    t0 = time.perf_counter()
    if verb == "import":
        from k2.launcher.hf.importer import import_hf

        if c.hf is None:
            raise ConfigError("k2-convert import needs hf=PATH (the Hugging Face checkpoint directory)")
        world = int(cfg.launch.nproc_per_node) * int(cfg.cluster.nodes)
        r = import_hf(c.hf, cfg, world)
        print(
            f"k2-convert: imported {r.tensors} tensors ({r.fp8_tensors} FP8 dequantized), "
            f"{r.model_bytes / 2**20:,.1f} MiB -> {r.checkpoint} in {time.perf_counter() - t0:.1f} s; "
            f"train with: k2-train run.dir={cfg.run.dir} model={cfg.model.name} ..."
        )
        return 0
    from k2.launcher.hf.export import export_hf

    if c.out is None:
        raise ConfigError("k2-convert export needs out=PATH (the Hugging Face directory to write)")
    ckpt = resolve_checkpoint(Path(c.checkpoint if c.checkpoint is not None else cfg.run.dir))
    r = export_hf(ckpt, c.out, c.model_type, int(c.shard_bytes), c.dtype, str(cfg.checkpoint.verify))
    print(
        f"k2-convert: exported {ckpt} -> {r.out}: {r.tensors} tensors in {r.shards} shards, "
        f"{r.total_bytes / 2**20:,.1f} MiB, tokenizer {r.tokenizer or 'none'}, "
        f"{time.perf_counter() - t0:.1f} s"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``k2-convert {import|export} [HYDRA_OVERRIDE ...]``: 0, or 2 for a bad setting or bad input."""
    return run_main(PROG, _convert, argv, usage=USAGE)


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
