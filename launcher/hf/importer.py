"""``k2-convert import``: a Hugging Face DeepSeek-V3 / Kimi K2 directory -> a k2-launcher checkpoint.

Input: ``config.json`` (checked against ``cfg.model``: :func:`k2.launcher.hf.hf_config.check_hf_config`)
and the weights as ``model.safetensors.index.json`` + shards (or one ``model.safetensors``), in BF16,
FP32 or FP8-E4M3 with 128 x 128 ``weight_scale_inv`` blocks (:mod:`k2.launcher.hf.fp8`). Every tensor
is read on its own with safetensors' ``safe_open`` (memory-mapped; nothing else of the shard is read).

Output: ``<run.dir>/checkpoints/iter_0000000`` (and ``latest``), a megatron dist-checkpoint holding the
model weights only, in ``train.precision``: the keys every layout's model asks for (global layer
numbers, experts by global index), so the same checkpoint serves any PP / VPP / EP / DP
(``parallel=...`` is validated and recorded; megatron reshards model tensors on load). Its
``k2_state.json`` says ``"weights_only": true`` and ``"step": 0``: ``k2-train`` in that run dir (or with
``resume.from=`` it) starts a fresh run from these weights (step 0, new optimizer state, the schedule
from its start) and checks only the ``model`` settings against it. The manifest and the atomic
``.partial`` -> rename protocol are the trainer's (:mod:`k2.launcher.checkpointing`).

Streaming: the checkpoint's structure (keys, global shapes, expert chunks, dtypes) is planned from the
table alone (``meta`` tensors, no storage); every HF tensor's presence and shape (and FP8 scales) are
checked from the shard headers before anything is written; then megatron's torch_dist writer asks for
the tensors one at a time (:func:`k2.launcher.hf.lazy_save.save_lazily`) and each is read from its HF
shard (opened for that read and closed after it: safetensors memory-maps a shard, and the pages read
stay resident while it is open), FP8-dequantised, cast, ``[gate; up]`` concatenated, written. The
``.distcp`` files hold at most ``convert.shard_bytes`` of tensors each. Host memory bound (bytes):
``max(convert.shard_bytes, T) + 3 * T_read + P``, where ``T`` is the largest stored tensor (an
expert's ``[1, 2F, H]`` ``linear_fc1`` chunk, the embedding, ...), ``T_read`` the largest tensor as read
and converted (FP8: the FP32 dequantised copy and its scale grid), and ``P`` megatron's and torch DCP's
planning state, which grows with the number of checkpoint items (tensor chunks and ``_extra_state``
objects), not their bytes: ~13 MB for 658 items measured, i.e. ~20 KB an item (Kimi K2: ~10^5 items,
about 2 GB, against 2 TB of BF16 weights). Never the whole model: ``k2-bench bench=hf_convert``
measures it, tests/unit/launcher/hf/test_hf_convert.py keeps it.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from k2.config import to_yaml
from k2.config.errors import ConfigError
from k2.launcher.checkpointing.manifest import STATE_FILE, checkpoint_files, file_entries, write_manifest
from k2.launcher.checkpointing.paths import (
    CONFIG_FILE,
    LATEST,
    PARTIAL_SUFFIX,
    checkpoints_dir,
    iter_name,
    saved_checkpoint_names,
)
from k2.launcher.hf.dist import ensure_process_group
from k2.launcher.hf.fp8 import FP8_DTYPES, FP8_HEADER_DTYPES, SCALE_SUFFIX, block_size, dequantize, scale_shape
from k2.launcher.hf.hf_config import check_hf_config
from k2.launcher.hf.mapping import DTYPE_NAMES, INDEX_FILE, Tensor, numel, tensor_groups

if TYPE_CHECKING:
    from k2.config.schema import K2Config

SINGLE_FILE = "model.safetensors"


@dataclass
class ImportReport:
    """What an import wrote: the checkpoint, how many HF tensors (FP8 ones among them), bytes written."""

    checkpoint: Path
    tensors: int
    fp8_tensors: int
    model_bytes: int


def read_hf_dir(hf_dir: Path) -> tuple[dict, dict]:
    """``(config.json, weight_map)`` of an HF directory; ``weight_map`` is tensor name -> shard file.

    Raises:
        ConfigError: no directory, no ``config.json``, no index (nor one ``model.safetensors``), an
            unreadable JSON file, or a shard the index names that is missing.
    """
    from safetensors import safe_open

    if not hf_dir.is_dir():
        raise ConfigError(f"hf={hf_dir}: no such directory")
    cfg_file = hf_dir / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(
            f"hf={hf_dir}: config.json is missing; an HF checkpoint directory holds "
            f"config.json and {INDEX_FILE} with its safetensors shards"
        )
    try:
        config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{cfg_file} is not valid JSON ({e})") from None
    index = hf_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ConfigError(f"{index} is not a safetensors index ({type(e).__name__}: {e})") from None
    elif (hf_dir / SINGLE_FILE).is_file():
        with safe_open(str(hf_dir / SINGLE_FILE), framework="pt") as f:
            weight_map = {k: SINGLE_FILE for k in f.keys()}
    else:
        raise ConfigError(f"hf={hf_dir}: {INDEX_FILE} is missing (and there is no single {SINGLE_FILE})")
    for shard in sorted(set(weight_map.values())):
        if not (hf_dir / shard).is_file():
            raise ConfigError(f"{index}: shard {shard} is missing from {hf_dir}")
    return config, weight_map


class _Reader:
    """Reads HF tensors on demand, FP8 dequantised; each read opens the shard(s) it needs with
    ``safe_open`` and closes them after (a shard kept open keeps every page read from it resident)."""

    def __init__(self, hf_dir: Path, weight_map: dict, block: tuple[int, int]):
        self.hf_dir, self.weight_map, self.block = hf_dir, weight_map, block

    def _shard(self, name: str, needed_by: str | None = None) -> str:
        shard = self.weight_map.get(name)
        if shard is None:
            if needed_by is not None:
                raise ConfigError(f"hf={self.hf_dir}: FP8 tensor {needed_by} has no {name}")
            raise ConfigError(
                f"hf={self.hf_dir}: tensor {name} is missing from the checkpoint's index (the model config expects it)"
            )
        return shard

    def _open(self, shard: str):
        """``safe_open`` of ``shard`` (a context manager).

        Raises:
            ConfigError: the file is not a readable safetensors file (truncated, damaged header).
        """
        from safetensors import SafetensorError, safe_open

        try:
            return safe_open(str(self.hf_dir / shard), framework="pt")
        except (SafetensorError, OSError) as e:
            raise ConfigError(
                f"hf={self.hf_dir}: shard {shard} is not a readable safetensors file ({type(e).__name__}: {e})"
            ) from None

    def check(self, tensors: list[Tensor]) -> int:
        """Every tensor of ``tensors`` is in the index and its shard with the model's shape, and every FP8
        one has a scale tensor of one entry per block; read from the shard headers only (no tensor
        data). Returns how many are FP8.

        Raises:
            ConfigError: a tensor (or its FP8 scales) is missing, or its shape is not the model's.
        """
        by_shard: dict = {}
        for t in tensors:
            by_shard.setdefault(self._shard(t.hf), []).append(t)
        fp8, scales = 0, {}
        for shard, ts in sorted(by_shard.items()):
            with self._open(shard) as f:
                names = set(f.keys())
                for t in ts:
                    if t.hf not in names:
                        raise ConfigError(
                            f"hf={self.hf_dir}: tensor {t.hf} is listed for {shard} by the "
                            "index but is not in that file"
                        )
                    x = f.get_slice(t.hf)
                    if tuple(x.get_shape()) != t.shape:
                        raise ConfigError(
                            f"hf={self.hf_dir}: tensor {t.hf} in {shard} has shape "
                            f"{list(x.get_shape())}, the model config expects {list(t.shape)}"
                        )
                    if x.get_dtype() in FP8_HEADER_DTYPES:
                        fp8 += 1
                        name = t.hf + SCALE_SUFFIX
                        want = (name, scale_shape(t.shape, self.block))
                        scales.setdefault(self._shard(name, t.hf), []).append(want)
        for shard, want in sorted(scales.items()):
            with self._open(shard) as f:
                for name, shape in want:
                    got = tuple(f.get_slice(name).get_shape())
                    if got != shape:
                        raise ConfigError(
                            f"hf={self.hf_dir}: {name}: scale shape {got}, expected {shape} "
                            f"({self.block[0]} x {self.block[1]} blocks)"
                        )
        return fp8

    def read(self, t: Tensor, dtype) -> torch.Tensor:
        """HF tensor ``t`` (shape ``t.shape``) as ``dtype`` (FP32 for the expert bias), FP8 dequantised."""
        shard = self._shard(t.hf)
        with self._open(shard) as f:
            x = f.get_tensor(t.hf)
        if x.dtype in FP8_DTYPES:
            name = t.hf + SCALE_SUFFIX
            with self._open(self._shard(name, t.hf)) as f:
                scale = f.get_tensor(name)
            x = dequantize(x, scale, self.block, torch.float32)
        return x.to(torch.float32 if t.fp32 else dtype)


def _sharded_dict(groups, dtype, num_experts: int) -> tuple[dict, int]:
    """megatron's sharded state dict of the model, planned from the table: ``{name: ShardedTensor |
    ShardedObject}`` with ``meta`` tensors (shape and dtype, no data), and the model's bytes. A
    ``[gate; up]`` pair is one ``linear_fc1`` tensor; expert ``e`` is the ``[1, ...]`` chunk ``e`` of its
    ``[E, ...]`` key; every linear layer gets the (empty) ``._extra_state`` object its model asks for."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    sd, nbytes = {}, 0
    for _, tensors in groups:
        for t in tensors:
            if t.part == "up":  # the gate row stands for the whole [gate; up] tensor
                continue
            d = torch.float32 if t.fp32 else dtype
            if t.expert is None:
                name = t.key
                sd[name] = ShardedTensor.from_rank_offsets(
                    t.key, torch.empty(t.key_shape, dtype=d, device="meta"), replica_id=0
                )
            else:
                name = f"{t.key}/{t.expert}"
                data = torch.empty((1, *t.key_shape[1:]), dtype=d, device="meta")
                sd[name] = ShardedTensor.from_rank_offsets(t.key, data, (0, t.expert, num_experts), replica_id=0)
            nbytes += numel(sd[name].local_shape) * sd[name].data.element_size()
            if t.linear:
                extra = t.key.rsplit(".", 1)[0] + "._extra_state"
                shape, offset = ((num_experts,), (t.expert,)) if t.expert is not None else ((1,), (0,))
                sd[f"{extra}/{offset[0]}"] = ShardedObject(extra, None, shape, offset, replica_id=0)
    return sd, nbytes


def _resolver(groups, reader: _Reader, dtype):
    """``resolve(key, offsets)`` for :func:`k2.launcher.hf.lazy_save.save_lazily`: the tensor (chunk) of
    our key ``key`` at global ``offsets`` made from its HF tensor(s): ``[gate; up]`` halves written into
    one tensor (dim -2), an expert's chunk ``[1, ...]`` (its index is ``offsets[0]``)."""
    slots: dict = {}
    for _, tensors in groups:
        for t in tensors:
            slots.setdefault((t.key, t.expert), {})[t.part] = t
    expert_keys = {key for key, e in slots if e is not None}

    def resolve(key: str, offsets: tuple) -> torch.Tensor:
        expert = offsets[0] if key in expert_keys else None
        parts = slots[(key, expert)]
        if None in parts:
            x = reader.read(parts[None], dtype)
        else:
            gate = parts["gate"]
            half = gate.shape[-2]
            x = torch.empty((*gate.shape[:-2], 2 * half, gate.shape[-1]), dtype=torch.float32 if gate.fp32 else dtype)
            x[..., :half, :] = reader.read(gate, dtype)
            x[..., half:, :] = reader.read(parts["up"], dtype)
        return x.unsqueeze(0) if expert is not None else x

    return resolve


def import_hf(hf_dir, cfg: K2Config, world_size: int) -> ImportReport:
    """Convert the HF directory ``hf_dir`` into ``<cfg.run.dir>/checkpoints/iter_0000000`` (module
    docstring).

    Args:
        hf_dir: the HF checkpoint directory.
        cfg: a validated config: ``model`` (checked against ``config.json``), ``parallel`` (the layout,
            validated for ``world_size``), ``train.precision`` (the dtype written), ``run.dir``.
        world_size: ranks of the layout the checkpoint is recorded for.

    Raises:
        ConfigError: bad input (module docstring of :func:`read_hf_dir`, :meth:`_Reader.read`,
            :func:`check_hf_config`), a layout that does not divide, or a run dir that already holds
            checkpoints. Nothing that looks complete is left behind on any error.
    """
    from k2.launcher.hf.lazy_save import save_lazily
    from k2.parallel.dims import ParallelDims

    hf_dir = Path(hf_dir)
    hf, weight_map = read_hf_dir(hf_dir)
    check_hf_config(hf, cfg.model, str(hf_dir / "config.json"))
    dims = ParallelDims.from_config(cfg.parallel, cfg.model, world_size)
    root = checkpoints_dir(cfg.run.dir)
    if saved_checkpoint_names(root) or (root / LATEST).exists():
        raise ConfigError(f"run.dir={cfg.run.dir} already holds checkpoints; import into a new run.dir")
    dtype = getattr(torch, DTYPE_NAMES[str(cfg.train.precision)])
    reader = _Reader(hf_dir, weight_map, block_size(hf))
    groups = tensor_groups(cfg.model)
    fp8 = reader.check([t for _, ts in groups for t in ts])
    sd, nbytes = _sharded_dict(groups, dtype, int(cfg.model.num_moe_experts or 0))
    final = root / iter_name(0)
    partial = root / (iter_name(0) + PARTIAL_SUFFIX)
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    ensure_process_group()
    try:
        save_lazily({"model": sd}, partial, _resolver(groups, reader, dtype), int(cfg.convert.shard_bytes))
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    state = {
        "step": 0,
        "weights_only": True,
        "source": str(hf_dir.resolve()),
        "consumed_tokens": 0,
        "layout": dims.checkpoint_layout(),
        "optimizer": None,
        "reason": "k2-convert import",
        "manifest": True,
    }
    (partial / STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")
    (partial / CONFIG_FILE).write_text(to_yaml(cfg))
    write_manifest(partial, file_entries(partial, checkpoint_files(partial)))  # last: marks it complete
    os.replace(partial, final)
    tmp = root / (LATEST + ".tmp")
    tmp.write_text(final.name + "\n")
    os.replace(tmp, root / LATEST)
    return ImportReport(final, sum(len(ts) for _, ts in groups), fp8, nbytes)
