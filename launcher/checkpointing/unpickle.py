"""Reading the pickled parts of a checkpoint without running code from them.

Two parts of a megatron ``torch_dist`` checkpoint are pickles, and a pickle can name any callable of the
process and call it while it is read:

* ``.metadata``, torch distributed checkpointing's (DCP) index of every tensor and object: written with
  ``pickle.dump`` and read with ``pickle.load`` (``torch.distributed.checkpoint.filesystem``, which
  megatron's dist-checkpointing and torchtitan share);
* megatron's sharded objects (every rank's RNG state, the optimizer's common state, the modules' extra
  state): ``torch.save`` payloads stored as byte items inside the ``.distcp`` files and read with
  ``torch.load(weights_only=False)`` (DCP's ``DefaultLoadPlanner.load_bytes``); older megatron versions
  also wrote a ``common.pt``.

The manifest (:mod:`k2.launcher.checkpointing.manifest`) finds a changed file, but its checksums are not
keyed: whoever can write the directory can rewrite the manifest to match. Checksums give integrity, not
authenticity. So every read of these parts admits only the classes a checkpoint consists of -- the
model is torch's ``weights_only`` loading with its safe-globals allow-list:

* ``.metadata``: :class:`CheckpointUnpickler`, a ``pickle.Unpickler`` whose ``find_class`` returns only
  :data:`METADATA_GLOBALS` (DCP's metadata dataclasses, ``torch.Size``, dtypes and layouts). torch's own
  ``weights_only`` unpickler cannot read it: it takes the protocol-2 stream of ``torch.save`` and stops at
  the framing of protocol 4, which DCP writes (torch 2.11: "Unsupported operand 149").
* ``torch.save`` payloads: ``torch.load(weights_only=True)`` with :data:`TORCH_SAFE_GLOBALS` (NumPy's
  array reconstruction, for the NumPy RNG state) added to torch's defaults.

:func:`restricted_unpickling` applies both to every such read of megatron's and DCP's loading code while
it is active (resume, ``k2-convert export``); :func:`pickle_problems` reads the parts ahead of a load to
refuse a checkpoint in one line before any model is built, and :func:`metadata_problem` reads
``.metadata`` that way before any rank starts, without importing torch. A name outside the lists is refused, never
called: the price of the rule is that a checkpoint of a later megatron or torch that pickles a new class
is refused until the class is added here (the error names it).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "METADATA_GLOBALS",
    "CheckpointUnpickler",
    "UnsafePickle",
    "load_metadata",
    "metadata_problem",
    "load_errors",
    "pickle_problems",
    "raise_if_refused",
    "refusal_in",
    "restricted_unpickling",
]

METADATA_FILE = ".metadata"
LEGACY_COMMON_FILE = "common.pt"  # megatron's common state before it moved into the .distcp files
_FORCE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"  # torch.load's documented switch: weights_only even when False is passed
_FORCE_NOT = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"

#: the classes and functions DCP's ``.metadata`` is made of (torch 2.11, megatron-core 0.19.2), by
#: (module, name) as the pickle names them
METADATA_GLOBALS = frozenset(
    {
        *(
            ("torch.distributed.checkpoint.metadata", n)
            for n in (
                "Metadata",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "MetadataIndex",
                "StorageMeta",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a layout from its name (torch.strided)
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id of a save given a Path (k2-convert import's)
        ("collections", "OrderedDict"),
        ("_codecs", "encode"),  # bytes in protocol-2 pickles
    }
)


class UnsafePickle(pickle.UnpicklingError):
    """A pickled part of a checkpoint names a global outside the allow-list (it was not written by
    k2-launcher's megatron and torch, or it was altered)."""


def _torch_dtype(module: str, name: str):
    if module != "torch":
        return None
    import torch

    value = getattr(torch, name, None)
    return value if isinstance(value, torch.dtype) else None


class CheckpointUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only :data:`METADATA_GLOBALS` and torch dtypes (Python's
    documented way to restrict what a pickle may call: "Restricting Globals" in the ``pickle`` docs).

    Raises:
        UnsafePickle: from :meth:`load`, naming the first global outside the list.
    """

    def find_class(self, module: str, name: str):
        dtype = _torch_dtype(module, name)
        if dtype is not None:
            return dtype
        if (module, name) not in METADATA_GLOBALS:
            raise UnsafePickle(f"it names {module}.{name}, which is not part of a checkpoint's metadata")
        return super().find_class(module, name)


#: torch's dtypes by the names a pickle uses for them (``torch.float32`` pickles as GLOBAL torch float32)
_DTYPE_NAMES = frozenset(
    {
        "float16",
        "half",
        "float32",
        "float",
        "float64",
        "double",
        "bfloat16",
        "complex32",
        "chalf",
        "complex64",
        "cfloat",
        "complex128",
        "cdouble",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "int8",
        "int16",
        "short",
        "int32",
        "int",
        "int64",
        "long",
        "bool",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
    }
)


class _Inert:
    """What :class:`_NamesOnly` gives for every admitted global: constructs, calls and takes state as
    anything would, and does nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


class _NamesOnly(pickle.Unpickler):
    """Reads a pickle through to its end with every admitted global replaced by :class:`_Inert`: which
    globals it would call, exactly as ``find_class`` is asked for them, without importing torch (for the
    check before any rank starts, in a process that has not imported torch)."""

    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_GLOBALS or (module == "torch" and name in _DTYPE_NAMES):
            return _Inert
        raise UnsafePickle(f"it names {module}.{name}, which is not part of a checkpoint's metadata")


def metadata_problem(path) -> str | None:
    """``".metadata: <why>"`` when DCP's metadata of the checkpoint at ``path`` names a global outside
    :data:`METADATA_GLOBALS`, else None (also when it is missing or damaged: the manifest check and the
    load report that); nothing in it is called and torch is not imported (:class:`_NamesOnly`)."""
    try:
        with open(Path(path) / METADATA_FILE, "rb") as f:
            _NamesOnly(f).load()
    except Exception as e:
        why = _refusal(e)
        return f"{METADATA_FILE}: {why}" if why else None
    return None


def _pickle_proxy():
    """What DCP's filesystem module calls ``pickle`` while :func:`restricted_unpickling` is active:
    ``load`` through :class:`CheckpointUnpickler`, everything else (``dump``) the real module."""

    class RestrictedPickle:
        @staticmethod
        def load(file, **kwargs):
            return CheckpointUnpickler(file, **kwargs).load()

        def __getattr__(self, name):
            return getattr(pickle, name)

    return RestrictedPickle()


def torch_safe_globals() -> list:
    """What ``torch.load(weights_only=True)`` admits beyond torch's defaults for a checkpoint's
    ``torch.save`` payloads: NumPy's array reconstruction (NumPy's RNG state is an ``ndarray``)."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # NumPy 1.x
        from numpy.core.multiarray import _reconstruct
    return [
        _reconstruct,
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),
        type(np.dtype(np.int64)),
        type(np.dtype(np.float64)),
    ]


@contextlib.contextmanager
def restricted_unpickling():
    """Within it, DCP's ``.metadata`` reads go through :class:`CheckpointUnpickler` and every
    ``torch.load`` (DCP's byte items, megatron's ``common.pt``) is ``weights_only`` with
    :func:`torch_safe_globals`, whatever its caller passes (torch's ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``).
    For the loads of a checkpoint (not reentrant, not for concurrent loads of untrusted files elsewhere
    in the process: the switches are process-wide while it is active)."""
    import torch
    from torch.distributed.checkpoint import filesystem

    saved = filesystem.pickle, os.environ.get(_FORCE), os.environ.pop(_FORCE_NOT, None)
    filesystem.pickle = _pickle_proxy()
    os.environ[_FORCE] = "1"
    try:
        with torch.serialization.safe_globals(torch_safe_globals()):
            yield
    finally:
        filesystem.pickle = saved[0]
        for name, value in ((_FORCE, saved[1]), (_FORCE_NOT, saved[2])):
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def load_metadata(path):
    """DCP's metadata of the checkpoint at ``path``, read with :class:`CheckpointUnpickler`.

    Raises:
        UnsafePickle: a global outside the allow-list; OSError / pickle.UnpicklingError: unreadable.
    """
    with open(Path(path) / METADATA_FILE, "rb") as f:
        return CheckpointUnpickler(f).load()


def _refusal(e: BaseException) -> str | None:
    """Why a read was refused for naming a global outside the allow-lists; None for any other failure
    (a damaged or truncated part runs nothing: the manifest check or the load reports it)."""
    if isinstance(e, UnsafePickle):
        return str(e)
    text = str(e)
    if isinstance(e, pickle.UnpicklingError) and "GLOBAL " in text:  # torch's weights_only refusal
        return f"it names {text.split('GLOBAL ', 1)[1].split(' ', 1)[0]}, which is not part of a checkpoint's data"
    return None


def refusal_in(error: BaseException) -> str | None:
    """Why a load failed, when the allow-list refused a pickled part somewhere in ``error`` (its causes,
    or the per-rank failures of DCP's ``CheckpointException``); else None."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        why = _refusal(e)
        if why:
            return why
        todo += [e.__cause__, e.__context__]
        todo += [f[0] for f in getattr(e, "failures", {}).values() if isinstance(f, tuple) and f]
    return None


def raise_if_refused(path, error: BaseException) -> None:
    """Raise the one-line refusal of the checkpoint at ``path`` (:func:`k2.launcher.checkpointing.paths.
    unsafe_checkpoint_error`) when its load failed because the allow-list refused a pickled part (one
    changed after the check before the load); return otherwise."""
    from k2.launcher.checkpointing.paths import unsafe_checkpoint_error

    why = refusal_in(error)
    if why:
        raise unsafe_checkpoint_error(path, [why]) from None


def load_errors() -> tuple:
    """What a failed DCP load raises: any ``Exception``, and DCP's ``CheckpointException`` (a
    ``BaseException``) that gathers the ranks' read failures."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def pickle_problems(path, names: Iterable[str]) -> list[str]:
    """Read the pickled parts among the files ``names`` of the checkpoint at ``path`` as a load would,
    without running anything from them: ``.metadata`` (:class:`CheckpointUnpickler`), the byte items
    that ``.metadata`` places in the ``.distcp`` files among ``names`` and a ``common.pt``
    (``torch.load(weights_only=True)`` with :func:`torch_safe_globals`). Tensors are not read.

    Returns:
        ``"<file>: <why>"`` for each part that names a global outside the allow-lists (empty: nothing in
        them can run code; a part that is damaged otherwise is left to the manifest check and the load).
        The byte items are located through ``.metadata``; when it cannot be read, they are not.
    """
    import torch

    path, names = Path(path), set(names)
    problems = []

    def attempt(where: str, read) -> None:
        try:
            read()
        except Exception as e:
            why = _refusal(e)
            if why:
                problems.append(f"{where}: {why}")

    shards = {n for n in names if n.endswith(".distcp")}
    meta = []
    if METADATA_FILE in names or shards:
        attempt(METADATA_FILE, lambda: meta.append(load_metadata(path)))
        if METADATA_FILE not in names:  # another rank's share: it reports it
            problems.clear()
    with torch.serialization.safe_globals(torch_safe_globals()):
        if meta and shards:
            for index, info in _byte_items(meta[0], shards):
                attempt(
                    f"{info.relative_path} (the object {index.fqn})",
                    lambda info=info: torch.load(
                        io.BytesIO(_read_range(path / info.relative_path, info)), weights_only=True
                    ),
                )
        if LEGACY_COMMON_FILE in names:
            attempt(
                LEGACY_COMMON_FILE, lambda: torch.load(path / LEGACY_COMMON_FILE, map_location="cpu", weights_only=True)
            )
    return problems


def _byte_items(meta, shards: set) -> list:
    """``(MetadataIndex, _StorageInfo)`` of every byte item (a ``torch.save`` payload) that DCP's
    metadata places in one of the files ``shards``, by file and offset."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    byte_keys = {k for k, v in meta.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    items = [(i, s) for i, s in meta.storage_data.items() if i.fqn in byte_keys and s.relative_path in shards]
    return sorted(items, key=lambda item: (item[1].relative_path, item[1].offset))


def _read_range(file: Path, info) -> bytes:
    with open(file, "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)
