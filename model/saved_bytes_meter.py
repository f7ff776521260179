"""The saved-tensor meter: bytes kept for backward per site, on the device and on the host, and the most of
them alive at once, measured from what the hooks of :mod:`k2.model.saved_tensors` hold (not estimated).
Used by ``k2-bench bench=memory``, ``train.measure_saved_bytes`` and the planner's tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from k2.model.saved_tensors import SavedTensorScope, active_meter, set_active_meter

__all__ = ["SavedBytesMeter"]


class SavedBytesMeter:
    """Counts the bytes saved for backward, per site, as the scopes commit (``k2-bench bench=memory``), and
    the most of them alive at once (the pipeline schedule's peak in flight).

    Use ``with meter.measure(): <one forward>``: it opens a root :class:`SavedTensorScope` so that saved
    tensors outside any layer scope are counted too (under the site ``other``). Per saved tensor:

    * kept as is: its storage's bytes, each storage counted once (two views, or a tensor saved twice,
      cost one storage);
    * FP8: the tiles' bytes (1 per element + 4 per 128-element tile);
    * offloaded: 0 on device, its storage's (or the FP8 tiles') bytes on host, each storage once;
    * recomputed (:func:`mark_recompute`): 0.

    Parameters are never counted (the hooks of :mod:`k2.model.saved_tensors` skip them). The meter holds
    no storage (weak references, ``torch.multiprocessing.reductions.StorageWeakRef``): what backward frees
    is freed, so a whole training step (forwards and backwards interleaved by the pipeline schedule) can
    be measured, and a freed address that a later saved tensor reuses counts as a new storage.

    Alive bytes (:meth:`alive`, ``peak_device`` / ``peak_host``, taken at every commit, where they grow):
    on the device, the storages counted on the device plus those of offloaded tensors that something else
    still holds (e.g. a pipeline stage's received input, kept by megatron's schedule until its backward);
    on the host, the offloaded copies.

    Attributes:
        device_bytes: ``{site: bytes}`` kept on the device.
        host_bytes: ``{site: bytes}`` offloaded to host memory.
        forwards: number of ``measure()`` blocks run.
        peak_device, peak_host: the most saved bytes alive at once on the device / on the host.
    """

    def __init__(self):
        self.device_bytes: dict[str, int] = {}
        self.host_bytes: dict[str, int] = {}
        self.forwards = 0
        self.peak_device = self.peak_host = 0
        self._counted: dict[tuple, StorageWeakRef] = {}  # (offloaded, address) -> the storage counted there
        self._alive: dict[tuple, tuple] = {}  # ("device" | "host", address) -> (weak ref, bytes, serial)
        self.serial = 0  # storages held so far (:meth:`alive`'s ``since``)

    @staticmethod
    def active() -> SavedBytesMeter | None:
        return active_meter()

    @contextlib.contextmanager
    def measure(self, root: bool = True) -> Iterator[None]:
        """Count what the scopes committing inside the block keep. ``root=False``: only the layer scopes
        (no root scope: tensors saved outside the layers are not counted; ``k2-train``'s
        ``train.measure_saved_bytes`` measures a whole training step so)."""
        if active_meter() is not None:
            raise RuntimeError("SavedBytesMeter.measure() blocks cannot nest")
        set_active_meter(self)
        try:
            with SavedTensorScope("root") if root else contextlib.nullcontext():
                yield
            self.forwards += 1
        finally:
            set_active_meter(None)
            self._counted.clear()

    @staticmethod
    def _new(table: dict, key: tuple) -> bool:
        """True when no live storage was seen at ``key`` (an address whose storage died is new again)."""
        hit = table.get(key)
        ref = hit[0] if isinstance(hit, tuple) else hit
        return ref is None or ref.expired()

    def _hold(self, where: str, storage: torch.UntypedStorage) -> None:
        key = (where, storage.data_ptr())
        if storage.nbytes() and self._new(self._alive, key):
            self._alive[key] = (StorageWeakRef(storage), storage.nbytes(), self.serial)
            self.serial += 1

    def count(self, saved: list, offloaded: set) -> None:
        """Count one committing scope's saved tensors (``offloaded``: ids of those going to host)."""
        for s in saved:
            site = s.policy.site if s.policy is not None else "other"
            if s.view is not None or s.released():  # recomputed in backward: nothing kept
                continue
            to_host = id(s) in offloaded
            where = self.host_bytes if to_host else self.device_bytes
            for t in s.payload():
                storage = t.untyped_storage()
                self._hold("device", storage)  # an offloaded one only while something else holds it
                key = (to_host, storage.data_ptr())
                if self._new(self._counted, key):  # each storage once
                    self._counted[key] = StorageWeakRef(storage)
                    where[site] = where.get(site, 0) + storage.nbytes()

    def hold_host(self, storages: list) -> None:
        """The host copies of one scope's offloaded storages (after :meth:`count`); updates the peaks."""
        for storage in storages:
            self._hold("host", storage)
        self.update_peak()

    def alive(self, since: int = 0) -> tuple[int, int]:
        """``(device, host)`` bytes of the counted storages alive now (see the class docstring); with
        ``since`` (an earlier :attr:`serial`), only those held since then (e.g. one microbatch's forward,
        whatever earlier ones backward freed meanwhile)."""
        dev = host = 0
        for key, (ref, n, serial) in list(self._alive.items()):
            if ref.expired():
                del self._alive[key]
            elif serial < since:
                continue
            elif key[0] == "device":
                dev += n
            else:
                host += n
        return dev, host

    def update_peak(self) -> None:
        dev, host = self.alive()
        self.peak_device, self.peak_host = max(self.peak_device, dev), max(self.peak_host, host)

    def per_forward(self) -> dict:
        """``{"device": {site: bytes}, "host": {site: bytes}, "device_total": .., "host_total": ..}``,
        averaged over the measured forwards."""
        n = max(self.forwards, 1)
        dev = {k: v / n for k, v in sorted(self.device_bytes.items())}
        host = {k: v / n for k, v in sorted(self.host_bytes.items())}
        return {"device": dev, "host": host, "device_total": sum(dev.values()), "host_total": sum(host.values())}
