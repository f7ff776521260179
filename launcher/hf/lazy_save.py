"""A megatron-core ``torch_dist`` checkpoint written from tensors produced one at a time, on demand.

megatron-core's ``dist_checkpointing.save`` takes a sharded state dict whose ``ShardedTensor`` objects
hold their data, and its writer (``FileSystemWriterAsync.prepare_write_data`` / ``preload_tensors``)
copies every tensor before it writes the first byte: the whole state in host memory. A converter does
not have the state; it can make each tensor when it is needed. So :func:`save_lazily` still calls
megatron's own ``dist_checkpointing.save`` -- its validation of the sharding, its ``common_state``
object and ``metadata.json`` are those of every other checkpoint -- with the ``ShardedTensor`` objects
holding ``meta``-device tensors (shape and dtype, no storage) and a save strategy of megatron's class
(:class:`LazyTorchDistSaveStrategy`) that hands the translated state dict (megatron's own
``mcore_to_pyt_state_dict``) to torch DCP's ``save`` with

* a planner (megatron's ``MCoreSavePlanner``) whose ``resolve_data`` -- the hook torch DCP's writer
  calls for each item right before writing it -- asks the caller's ``resolve(key, offsets)`` for the
  tensor, and
* torch DCP's ``FileSystemWriter`` with one writer thread (its ``_SerialCpuLoader`` resolves one item
  at a time), the items cut into files of at most ``file_bytes`` each.

The result is the format megatron writes (``__0_<n>.distcp`` files of ``torch.save``-serialised items,
DCP's pickled ``.metadata``, ``metadata.json``): ``dist_checkpointing.load`` reads it unchanged.

Host memory: torch DCP's writer keeps the tensors of the file it is writing until the file is
complete (torch 2.11 ``_write_files_from_queue`` collects them in a dict), so the peak is one file's
tensors -- at most ``file_bytes``, or one tensor when a tensor is larger -- plus what ``resolve`` holds
while making one tensor, plus the planning state of megatron (sharding validation) and torch DCP (plans,
metadata), which grows with the number of items, not their bytes. Never the whole state.
"""

from __future__ import annotations

import queue
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.planner import WriteItemType

#: ``resolve(key, offsets) -> tensor``: the data of the chunk of the sharded key ``key`` that starts at
#: global ``offsets`` (one per dimension), with the chunk's shape and the dtype of its meta tensor
Resolve = Callable[[str, tuple], torch.Tensor]


def _item_bytes(item) -> int:
    """Bytes of one DCP write item's tensor (0 for a serialised object)."""
    if item.tensor_data is None:
        return 0
    return (
        int(torch.Size(item.tensor_data.chunk.sizes).numel())
        * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()
    )


def file_buckets(items: list, file_bytes: int) -> list[list]:
    """Consecutive write items per file, each file at most ``file_bytes`` of tensor data (a larger
    tensor is a file alone; serialised objects count 0 bytes and go with the next tensor, or the last)."""
    buckets, cur, size = [], [], 0
    for item in items:
        b = _item_bytes(item)
        if size and size + b > file_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append(item)
        size += b
    if cur and not size and buckets:  # trailing objects: with the last tensors
        buckets[-1] += cur
    elif cur:
        buckets.append(cur)
    return buckets


class BoundedFileWriter(FileSystemWriter):
    """torch DCP's ``FileSystemWriter`` with files of at most ``file_bytes`` of tensors each.

    Own code because no writer of torch or megatron bounds a file by bytes: ``FileSystemWriter`` writes
    one file per thread (``single_file_per_rank``: the whole state for one thread, and its writer keeps
    a file's tensors until the file is closed) or one file per item (tens of thousands for a K2-sized
    model); megatron's ``FileSystemWriterAsync`` preloads everything. This ``write_data`` is the
    parent's with :func:`file_buckets` as the split, followed by the parent's serial writer loop
    (``thread_count=1``: one file at a time, one item at a time), with the parent's file names
    (``__<rank>_<n>.distcp``)."""

    def __init__(self, path, file_bytes: int):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=False)
        self.file_bytes = int(file_bytes)

    def write_data(self, plan, planner):
        prefix = plan.storage_data.prefix
        files: queue.Queue = queue.Queue()
        for n, bucket in enumerate(file_buckets(plan.items, self.file_bytes)):
            name = f"{prefix}{n}{DEFAULT_SUFFIX}"
            files.put((self.fs.concat_path(self.path, name), name, bucket))
        return self._write_data(planner, files)


class ResolvingPlanner(MCoreSavePlanner):
    """megatron's save planner whose tensors come from ``resolve(key, offsets)`` when the writer asks
    for them (serialised objects are megatron's, already in the state dict). Built as megatron's
    ``TorchDistSaveShardedStrategy`` builds its planner (main replicas only: no DCP dedup)."""

    def __init__(self, resolve: Resolve):
        super().__init__(dedup_replicated_tensors=False, flatten_state_dict=False, flatten_sharded_tensors=False)
        self.resolve = resolve

    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        chunk = write_item.tensor_data.chunk
        x = self.resolve(write_item.index.fqn, tuple(int(o) for o in chunk.offsets))
        want = (tuple(chunk.sizes), write_item.tensor_data.properties.dtype)
        if (tuple(x.shape), x.dtype) != want:
            raise RuntimeError(
                f"{write_item.index.fqn} at {tuple(chunk.offsets)}: resolved {tuple(x.shape)} "
                f"{x.dtype}, the plan says {want[0]} {want[1]}"
            )
        return x


class LazyTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
    """megatron's ``torch_dist`` save strategy (same backend name and version in ``metadata.json``)
    whose ``save`` writes through :class:`ResolvingPlanner` and :class:`BoundedFileWriter`."""

    def __init__(self, resolve: Resolve, file_bytes: int):
        super().__init__()
        self.resolve, self.file_bytes = resolve, int(file_bytes)

    def save(self, sharded_state_dict, checkpoint_dir):
        # grouped by sharded key as megatron's async_save groups them (tensors by key, objects by
        # unique key); every object is the main replica (one process)
        by_key: dict = defaultdict(list)
        for sh in nested_values(sharded_state_dict):
            by_key[sh.unique_key if isinstance(sh, ShardedObject) else sh.key].append(sh)
        pyt_state_dict = mcore_to_pyt_state_dict(dict(by_key), False)
        dcp.save(
            pyt_state_dict,
            storage_writer=BoundedFileWriter(checkpoint_dir, self.file_bytes),
            planner=ResolvingPlanner(self.resolve),
        )


def save_lazily(sharded_state_dict: dict, checkpoint_dir, resolve: Resolve, file_bytes: int) -> None:
    """Write ``sharded_state_dict`` as a megatron ``torch_dist`` checkpoint into the (empty, existing)
    directory ``checkpoint_dir``, each tensor made by ``resolve`` when it is written (module docstring).

    Args:
        sharded_state_dict: megatron's nested sharded state dict; every ``ShardedTensor``'s ``data`` a
            ``meta`` tensor of its local shape and the dtype to store (``ShardedObject`` data as usual).
        resolve: ``resolve(key, global_offsets)`` -> the CPU tensor of that chunk (that shape and dtype).
        file_bytes: the most tensor bytes per ``.distcp`` file (host memory: module docstring).

    Raises:
        whatever ``resolve`` raises (unwrapped from torch DCP's ``CheckpointException``); RuntimeError
        for a resolved tensor of another shape or dtype than planned. ``checkpoint_dir`` then holds a
        partial checkpoint (no ``metadata.json``).
    """
    try:
        dist_checkpointing.save(
            sharded_state_dict,
            str(checkpoint_dir),
            sharded_strategy=LazyTorchDistSaveStrategy(resolve, file_bytes),
            validate_access_integrity=True,
        )
    except CheckpointException as e:
        # one process: its one failure is the error (torch DCP wraps it with its traceback)
        causes = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        if len(causes) == 1 and isinstance(causes[0], BaseException):
            raise causes[0] from None
        raise
