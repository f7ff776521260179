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

Memory: the HF side streams (one tensor at a time, plus its scales); the checkpoint is written by one
megatron ``dist_checkpointing.save``, which takes the whole state dict, so the converted weights of the
whole model are in host memory at once (in ``train.precision``). A converter that writes the
checkpoint group by group needs a save that resolves tensors lazily (torch DCP's planner can; megatron's
writer collects all tensors before writing) -- not done.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

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
from k2.launcher.checkpointing.store import use_in_process_write_results
from k2.launcher.hf.dist import ensure_process_group
from k2.launcher.hf.fp8 import FP8_DTYPES, SCALE_SUFFIX, block_size, dequantize
from k2.launcher.hf.hf_config import check_hf_config
from k2.launcher.hf.mapping import DTYPE_NAMES, INDEX_FILE, Tensor, tensor_groups

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
        raise ConfigError(f"hf={hf_dir}: config.json is missing; an HF checkpoint directory holds "
                          f"config.json and {INDEX_FILE} with its safetensors shards")
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
    """Reads one HF tensor at a time (``safe_open`` per shard, kept open), FP8 dequantised."""

    def __init__(self, hf_dir: Path, weight_map: dict, block: tuple[int, int]):
        self.hf_dir, self.weight_map, self.block = hf_dir, weight_map, block
        self.files: dict = {}
        self.fp8 = 0

    def _open(self, shard: str):
        from safetensors import safe_open

        if shard not in self.files:
            self.files[shard] = safe_open(str(self.hf_dir / shard), framework="pt")
        return self.files[shard]

    def read(self, t: Tensor, dtype) -> torch.Tensor:
        """HF tensor ``t`` as ``dtype`` (FP32 for the expert bias).

        Raises:
            ConfigError: the tensor (or its FP8 scales) is missing, or its shape is not the model's.
        """
        shard = self.weight_map.get(t.hf)
        if shard is None:
            raise ConfigError(f"hf={self.hf_dir}: tensor {t.hf} is missing from the checkpoint's index "
                              "(the model config expects it)")
        f = self._open(shard)
        x = f.get_tensor(t.hf)
        if tuple(x.shape) != t.shape:
            raise ConfigError(f"hf={self.hf_dir}: tensor {t.hf} in {shard} has shape {list(x.shape)}, the "
                              f"model config expects {list(t.shape)}")
        if x.dtype in FP8_DTYPES:
            scale_name = t.hf + SCALE_SUFFIX
            scale_shard = self.weight_map.get(scale_name)
            if scale_shard is None:
                raise ConfigError(f"hf={self.hf_dir}: FP8 tensor {t.hf} has no {scale_name}")
            try:
                x = dequantize(x, self._open(scale_shard).get_tensor(scale_name), self.block, torch.float32)
            except ValueError as e:
                raise ConfigError(f"hf={self.hf_dir}: {scale_name}: {e}") from None
            self.fp8 += 1
        return x.to(torch.float32 if t.fp32 else dtype)


def _sharded_dict(groups, reader: _Reader, dtype, num_experts: int) -> tuple[dict, int]:
    """megatron's sharded state dict of the model, from the HF tensors: ``{name: ShardedTensor |
    ShardedObject}`` and its bytes. ``[gate; up]`` halves are concatenated (dim -2) into ``linear_fc1``;
    expert ``e`` becomes the ``[1, ...]`` slice ``e`` of its ``[E, ...]`` key; every linear layer gets the
    (empty) ``._extra_state`` object its model asks for."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    sd, nbytes = {}, 0
    for _, tensors in groups:
        halves: dict = {}
        for t in tensors:
            x = reader.read(t, dtype)
            slot = (t.key, t.expert)
            if t.part is not None:
                halves.setdefault(slot, {})[t.part] = x
                if len(halves[slot]) < 2:
                    continue
                x = torch.cat([halves[slot]["gate"], halves.pop(slot)["up"]], dim=-2)
            name = t.key if t.expert is None else f"{t.key}/{t.expert}"
            if t.expert is None:
                sd[name] = ShardedTensor.from_rank_offsets(t.key, x, replica_id=0)
            else:
                sd[name] = ShardedTensor.from_rank_offsets(t.key, x.unsqueeze(0), (0, t.expert, num_experts),
                                                           replica_id=0)
            nbytes += x.numel() * x.element_size()
            if t.linear:
                extra = t.key.rsplit(".", 1)[0] + "._extra_state"
                shape, offset = ((num_experts,), (t.expert,)) if t.expert is not None else ((1,), (0,))
                sd[f"{extra}/{offset[0]}"] = ShardedObject(extra, None, shape, offset, replica_id=0)
    return sd, nbytes


def import_hf(hf_dir, cfg, world_size: int) -> ImportReport:
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
    from megatron.core import dist_checkpointing

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
    sd, nbytes = _sharded_dict(groups, reader, dtype, int(cfg.model.num_moe_experts or 0))
    final = root / iter_name(0)
    partial = root / (iter_name(0) + PARTIAL_SUFFIX)
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    ensure_process_group()
    use_in_process_write_results()
    dist_checkpointing.save({"model": sd}, str(partial), validate_access_integrity=True)
    del sd
    state = {"step": 0, "weights_only": True, "source": str(hf_dir.resolve()), "consumed_tokens": 0,
             "layout": {"pp": dims.pp, "vpp": dims.vpp, "ep": dims.ep, "dp": dims.dp,
                        "world_size": world_size},
             "optimizer": None, "reason": "k2-convert import", "manifest": True}
    (partial / STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")
    (partial / CONFIG_FILE).write_text(to_yaml(cfg))
    write_manifest(partial, file_entries(partial, checkpoint_files(partial)))  # last: marks it complete
    os.replace(partial, final)
    tmp = root / (LATEST + ".tmp")
    tmp.write_text(final.name + "\n")
    os.replace(tmp, root / LATEST)
    return ImportReport(final, sum(len(ts) for _, ts in groups), reader.fp8, nbytes)
