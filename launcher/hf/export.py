"""``k2-convert export``: a k2-launcher checkpoint, saved with any layout -> a Hugging Face directory.

Output (``transformers``' sharded format): ``config.json`` (:func:`k2.launcher.hf.hf_config.hf_config`),
``model-0000k-of-0000n.safetensors`` shards, ``model.safetensors.index.json`` (``weight_map``: tensor ->
shard, ``metadata.total_size`` in bytes), ``generation_config.json``, and ``tokenizer.json`` +
``tokenizer_config.json`` when the run's tokenizer is a ``tokenizer.json`` (``data.tokenizer``, or the
embedded corpus's). ``transformers.AutoModelForCausalLM.from_pretrained(out)`` loads it without custom
code (``DeepseekV3ForCausalLM``).

Streaming: the shards are planned from the table's shapes before anything is read; each shard's tensors
are read from the checkpoint in one megatron ``dist_checkpointing.load`` of exactly those slices (an
expert's rows of the ``[E, 2F, H]`` stack, not the stack), written, and dropped before the next. Host
memory: about twice the largest shard (the tensors, and safetensors' serialized copy of them), where a
shard is at most ``convert.shard_bytes`` or one tensor group (a layer's attention + norms + router +
shared expert, or one routed expert) when that is larger -- never the whole model.

Atomicity: everything is written into ``<out>.partial`` and renamed to ``<out>`` last, so an interrupted
export leaves no directory that looks complete; an existing ``<out>`` is refused.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from k2.config.errors import ConfigError
from k2.launcher.checkpointing.manifest import checkpoint_files, verify
from k2.launcher.checkpointing.paths import CONFIG_FILE, damaged_checkpoint_error, read_state, unsafe_checkpoint_error
from k2.launcher.checkpointing.unpickle import pickle_problems, restricted_unpickling
from k2.launcher.hf.dist import ensure_process_group
from k2.launcher.hf.hf_config import hf_config
from k2.launcher.hf.mapping import DTYPE_NAMES, INDEX_FILE, Tensor, numel, tensor_groups

if TYPE_CHECKING:
    from k2.config.schema import K2Config

PARTIAL_SUFFIX = ".partial"


@dataclass
class ExportReport:
    """What an export wrote. Sizes in bytes."""

    out: Path
    shards: int
    tensors: int
    total_bytes: int
    largest_shard_bytes: int
    largest_group_bytes: int
    tokenizer: str | None


def checkpoint_config(path: Path, verify_level: str = "checksum"):
    """The resolved config (OmegaConf) a checkpoint was written with, after checking it against its
    manifest at ``verify_level`` (``checkpoint.verify``: ``checksum`` reads every file, as resume does;
    ``size``; ``none``).

    Raises:
        ConfigError: ``path`` is a partial save, not a checkpoint, its files disagree with its
            manifest (naming each damaged file), or a pickled part names code outside the allow-list of
            :mod:`k2.launcher.checkpointing.unpickle` (naming each).
    """
    from omegaconf import OmegaConf

    state = read_state(path)
    problems = verify(path, verify_level)
    if problems:
        raise damaged_checkpoint_error(path, problems)
    unsafe = pickle_problems(path, checkpoint_files(path))  # at every level: safety, not integrity
    if unsafe:
        raise unsafe_checkpoint_error(path, unsafe)
    return OmegaConf.load(path / CONFIG_FILE), state


def rope_type_at(cfg: K2Config, step: int) -> str:
    """``rope`` | ``yarn``: what the schedule of ``cfg`` trains step ``step`` with (step 0: the first).
    At the end of the schedule it is the last phase's, also when that phase has no tokens: K2's schedule
    ends with a zero-length YaRN phase whose settings are the result (YaRN, factor 32 over 4,096)."""
    from k2.schedules.resolve import resolve_schedule

    schedule = resolve_schedule(cfg)
    if int(step) >= schedule.total_steps:
        return schedule.phases[-1].rope_type
    phase = schedule.step_phase(max(1, int(step)))
    return phase.rope_type if phase is not None else str(cfg.model.rope_type)


def _plan_shards(groups, elem_bytes, shard_bytes: int) -> list[list[Tensor]]:
    """Consecutive whole groups per shard, up to ``shard_bytes`` (a larger group is a shard alone)."""
    shards, cur, size = [], [], 0
    for _, ts in groups:
        b = sum(numel(t.shape) * elem_bytes(t) for t in ts)
        if cur and size + b > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur += ts
        size += b
    if cur:
        shards.append(cur)
    return shards


def _check_keys(meta: dict, tensors: list[Tensor], path: Path) -> None:
    for t in tensors:
        if t.key not in meta:
            raise ConfigError(
                f"checkpoint {path} has no tensor {t.key} (needed for {t.hf}); it was not written by this model config"
            )
        got = tuple(meta[t.key].global_shape)
        if got != t.key_shape:
            raise ConfigError(
                f"checkpoint {path}: tensor {t.key} has shape {list(got)}, the model config "
                f"in its config.yaml says {list(t.key_shape)}"
            )


def _read_shard(path: Path, meta: dict, tensors: list[Tensor], dtype) -> dict:
    """The HF tensors ``tensors`` read from our checkpoint: one megatron load of their slices."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    request, slot = {}, {}
    for t in tensors:
        name = t.key if t.expert is None else f"{t.key}/{t.expert}"
        if name not in request:
            md = meta[t.key]
            if t.expert is None:
                data = torch.empty(t.key_shape, dtype=md.dtype)
                request[name] = ShardedTensor.from_rank_offsets(t.key, data, replica_id=0)
            else:
                data = torch.empty((1, *t.key_shape[1:]), dtype=md.dtype)
                request[name] = ShardedTensor.from_rank_offsets(
                    t.key, data, (0, t.expert, t.key_shape[0]), replica_id=0
                )
        slot[t.hf] = name
    with restricted_unpickling():
        loaded = dist_checkpointing.load({"k2_export": request}, str(path), validate_access_integrity=False)
    loaded = loaded["k2_export"]
    out = {}
    for t in tensors:
        x = loaded[slot[t.hf]]
        if t.expert is not None:
            x = x[0]
        if t.part is not None:
            half = x.shape[-2] // 2
            x = x[..., :half, :] if t.part == "gate" else x[..., half:, :]
        x = x.contiguous()
        out[t.hf] = x.to(dtype) if dtype is not None and not t.fp32 else x
    return out


def _tokenizer_files(cfg: K2Config, out: Path) -> tuple[str | None, dict]:
    """Copy the run's ``tokenizer.json`` (if it has one) and write ``tokenizer_config.json``.

    Returns:
        (the source path or None, the token ids for ``config.json``).
    """
    from k2.launcher.datasets.corpus import stdlib_corpus_dir
    from k2.launcher.datasets.tokenizer import HFTokenizer

    src = (
        cfg.data.tokenizer
        if cfg.data.tokenizer is not None
        else (os.path.join(stdlib_corpus_dir(cfg.data), "tokenizer.json") if cfg.data.path is None else None)
    )
    if src is None or not str(src).endswith(".json") or not os.path.isfile(str(src)):
        return None, {}
    tok = HFTokenizer(str(src))
    shutil.copyfile(str(src), out / "tokenizer.json")
    eos = tok.eos
    eos_token = tok.inv_vocab[eos]
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": eos_token,
                "bos_token": eos_token,
                "model_max_length": int(cfg.model.max_position_embeddings),
                "clean_up_tokenization_spaces": False,
            },
            indent=1,
        )
        + "\n"
    )
    return str(src), {"bos_token_id": eos, "eos_token_id": eos}


def export_hf(
    checkpoint,
    out,
    model_type: str = "deepseek_v3",
    shard_bytes: int = 2 << 30,
    dtype: str | None = None,
    verify_level: str = "checksum",
) -> ExportReport:
    """Write the HF directory ``out`` for the k2-launcher checkpoint ``checkpoint`` (module docstring).

    Args:
        checkpoint: an ``iter_NNNNNNN`` directory (any PP / VPP / EP / DP it was saved with).
        out: the directory to create (must not exist).
        model_type: ``config.json``'s ``model_type`` (:mod:`k2.launcher.hf.hf_config`).
        shard_bytes: target bytes per safetensors shard.
        dtype: ``fp32`` | ``bf16`` to cast the weights to; None keeps the checkpoint's dtype.
        verify_level: how the checkpoint is checked against its manifest first (:func:`checkpoint_config`).

    Raises:
        ConfigError: the checkpoint is partial or damaged, a tensor the model config needs is missing
            or has another shape, ``out`` exists, or the model cannot be expressed in this format.
    """
    from megatron.core import dist_checkpointing
    from safetensors.torch import save_file

    path, out = Path(checkpoint), Path(out)
    cfg, state = checkpoint_config(path, verify_level)
    if out.exists():
        raise ConfigError(f"convert.out={out} exists; choose a new directory (an export never overwrites)")
    m = cfg.model
    cast = getattr(torch, DTYPE_NAMES[dtype]) if dtype is not None else None
    ensure_process_group()
    with restricted_unpickling():
        meta = dist_checkpointing.load_tensors_metadata(str(path))
    groups = tensor_groups(m)
    all_tensors = [t for _, ts in groups for t in ts]
    _check_keys(meta, all_tensors, path)

    def elem_bytes(t: Tensor) -> int:
        d = cast if cast is not None and not t.fp32 else meta[t.key].dtype
        return torch.empty((), dtype=d).element_size()

    group_bytes = max(sum(numel(t.shape) * elem_bytes(t) for t in ts) for _, ts in groups)
    shards = _plan_shards(groups, elem_bytes, int(shard_bytes))
    tmp = out.with_name(out.name + PARTIAL_SUFFIX)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    umask = os.umask(0)
    os.umask(umask)
    weight_map, total, largest = {}, 0, 0
    for k, shard in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = _read_shard(path, meta, shard, cast)
        size = sum(x.numel() * x.element_size() for x in tensors.values())
        save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        os.chmod(tmp / name, 0o666 & ~umask)  # (safetensors creates 0600; the other files follow the umask)
        del tensors
        weight_map.update({t.hf: name for t in shard})
        total += size
        largest = max(largest, size)
    (tmp / INDEX_FILE).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n"
    )
    tokenizer, token_ids = _tokenizer_files(cfg, tmp)
    precision = dtype or str(cfg.train.precision)
    config = hf_config(m, rope_type_at(cfg, int(state["step"])), precision, model_type, token_ids)
    (tmp / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    (tmp / "generation_config.json").write_text(json.dumps({**token_ids, "do_sample": False}, indent=1) + "\n")
    os.replace(tmp, out)
    return ExportReport(out, len(shards), len(all_tensors), total, largest, group_bytes, tokenizer)
