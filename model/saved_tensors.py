"""What autograd saves for backward: FP8 storage, CPU offload, recompute and a byte meter, on one pair of
saved-tensor hooks.

docs/k2_reference.md "Training system", "Activation memory". One mechanism serves all uses:

* **FP8 storage** (``Policy.fp8``): a saved tensor is replaced by its FP8-E4M3 1 x 128 tiles
  (``model/fp8_storage.py``) when it is saved, and turned back into the compute dtype when backward
  unpacks it. Compute is untouched (BF16 on GPU, FP32 on CPU); no FP8 GEMMs.
* **CPU offload** (``Policy.offload``): a saved tensor's storage (or its FP8 tiles) is copied to host
  memory when the scope that saved it ends (:meth:`SavedTensorScope.commit`) and the device copy is
  dropped; before its backward it is copied back. On GPU both copies run on their own CUDA streams
  into/out of pinned memory, so they overlap with compute: the device-to-host copy with the next layer's
  forward, the host-to-device copy of layer ``i - 1`` with the backward of layer ``i`` (a prefetch started
  when backward reaches layer ``i``'s output, :func:`chain_prefetch`). On CPU it is a plain copy.
* **Recompute** (``Policy.recompute``, :func:`mark_recompute`): nothing is kept; backward gets the tensor
  from a function of other saved tensors (``model/recompute.py``).
* **Meter** (:class:`k2.model.saved_bytes_meter.SavedBytesMeter`): the bytes that stay saved per forward, by site,
  on device and on host, measured from what the hooks hold -- not estimated.

Which saved tensor gets which treatment is decided by *sites*: a scope (one per transformer layer, see
``model/activation_memory.py``) collects ``mark(tensor, policy)`` calls -- "any saved tensor sharing ``tensor``'s
storage belongs to this site", valid while that storage lives -- and regions
(:meth:`SavedTensorScope.push_region` / ``pop_region``) -- "everything saved meanwhile belongs to this
site". Matching by storage makes a site independent of *which* autograd
function saves the tensor (a megatron ``Linear``, a checkpoint saving its inputs, a torch op saving a
view), so a scope can wrap any module, e.g. the stored inputs of a decoupled weight-gradient computation.
Parameters are never touched.

Why our own hooks and not megatron's fine-grained activation offloading
(``megatron.core.pipeline_parallel.fine_grained_activation_offload``, megatron-core 0.19.2): it raises
without Transformer Engine (``PipelineOffloadManager.__enter__`` needs TE's ``cpu_offload``), handles CUDA
tensors only, offloads the routed experts only in ``TEGroupedMLP`` (not ``SequentialMLP``), needs its own
per-microbatch bookkeeping in the schedules, and has no FP8 storage. torch applies only the innermost
pair of saved-tensor hooks, so FP8, offload, recompute and the meter must be one pair: this module.

A saved tensor whose storage was released behind autograd's back before the scope commits (megatron's
``CheckpointWithoutOutput`` does that; it refills the storage before use) is neither offloaded nor counted.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from k2.model.fp8_storage import FP8Tiles, dequantize_tiles, quantize_tiles


@dataclass(frozen=True)
class Policy:
    """What to do with the saved tensors of one site.

    Attributes:
        site: the site name (``config/schema.py`` ``MEMORY_*_SITES``), used by the meter.
        fp8: store as FP8-E4M3 1 x 128 tiles.
        offload: move to host memory until backward.
        recompute: keep nothing; backward calls this (see :func:`mark_recompute`).
    """

    site: str
    fp8: bool = False
    offload: bool = False
    recompute: Callable[[], torch.Tensor] | None = None  # see mark_recompute

    @property
    def transforms(self) -> bool:
        return self.fp8 or self.offload or self.recompute is not None


_TLS = threading.local()


def _stack() -> list:
    s = getattr(_TLS, "scopes", None)
    if s is None:
        s = _TLS.scopes = []
    return s


_METER: dict = {}  # {"meter": the SavedBytesMeter whose measure() block is open}


def active_meter():
    """The :class:`k2.model.saved_bytes_meter.SavedBytesMeter` whose ``measure()`` block is open, or None."""
    return _METER.get("meter")


def set_active_meter(meter) -> None:
    """Open (a meter) or close (None) the metering of the scopes that commit from now on."""
    _METER["meter"] = meter


def current_scope() -> SavedTensorScope | None:
    """The innermost open scope of this thread (None outside any; backward never has one)."""
    s = _stack()
    return s[-1] if s else None


def mark(tensor: torch.Tensor | None, policy: Policy | None) -> None:
    """In the current scope, saved tensors sharing ``tensor``'s storage belong to ``policy``'s site.
    A no-op outside a scope (e.g. during a recompute in backward) or with ``policy=None``."""
    scope = current_scope()
    if scope is not None and policy is not None and tensor is not None:
        scope.mark(tensor, policy)


def mark_recompute(tensor: torch.Tensor, recompute: Callable[[], torch.Tensor], site: str) -> bool:
    """In the current scope, saved tensors sharing ``tensor``'s storage are not kept: backward gets them
    from ``recompute()`` (called under ``torch.no_grad``; it must return a tensor equal to ``tensor``, same
    shape, dtype and strides). A saved view of ``tensor`` is taken from the recomputed tensor with the
    view's shape, strides and offset.

    This is the output-discarding recompute (megatron's ``CheckpointWithoutOutput``) done through the
    saved-tensor hooks: nothing is freed or restored behind autograd's back, and the inputs the recompute
    reads may themselves be FP8-stored or offloaded.

    Returns:
        False outside a scope (then the tensor is saved as usual).
    """
    scope = current_scope()
    if scope is None:
        return False
    if not tensor.is_contiguous():
        raise ValueError("mark_recompute needs a contiguous tensor (its saved views are rebuilt by strides)")
    scope.mark(tensor, Policy(site, recompute=recompute))
    return True


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _is_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


class _Streams:
    """The two side streams of the offload copies (created on first use, one pair per process)."""

    d2h = None
    h2d = None

    @classmethod
    def get(cls):
        if cls.d2h is None:
            cls.d2h, cls.h2d = torch.cuda.Stream(), torch.cuda.Stream()
        return cls.d2h, cls.h2d


class _StorageCopy:
    """One device storage's bytes in host memory, and back. A storage is copied once however many saved
    views of it a scope holds, and each view is rebuilt on the copy, so aliasing survives the trip.

    GPU: the device-to-host copy runs on ``stream`` into pinned memory and the device storage is marked
    as in use by that stream (``record_stream``), so the caching allocator does not hand it out again
    before the copy is done; CPU: a plain copy.
    """

    def __init__(self, storage: torch.UntypedStorage, stream):
        self.device = storage.device
        self.nbytes = storage.nbytes()
        src = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
        if self.device.type == "cuda":
            self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
            with torch.cuda.stream(stream):
                self.host.copy_(src, non_blocking=True)
                src.record_stream(stream)
        else:
            self.host = src.clone()
        self.dev = None

    def reload(self, stream) -> None:
        if self.device.type == "cuda":
            self.dev = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)  # main stream
            with torch.cuda.stream(stream):
                self.dev.copy_(self.host, non_blocking=True)
                self.dev.record_stream(stream)
        else:
            self.dev = self.host

    def view(self, dtype, shape, stride, offset) -> torch.Tensor:
        return torch.empty(0, dtype=dtype, device=self.device).set_(self.dev.untyped_storage(), offset, shape, stride)


class _Saved:
    """One saved tensor as held by the hooks: the tensor, its FP8 tiles, a recompute, or host copies."""

    __slots__ = ("policy", "tensor", "fp8", "host", "group", "key", "view")

    def __init__(self, tensor: torch.Tensor, policy: Policy | None, group: SavedTensorScope):
        self.policy = policy
        self.group = group
        self.key = _storage_key(tensor)
        self.host = None  # [(storage copy, dtype, shape, stride, offset)] once offloaded
        self.view = None
        if policy is not None and policy.recompute is not None:
            self.fp8 = self.tensor = None
            self.view = (tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())
        elif (
            policy is not None
            and policy.fp8
            and tensor.is_floating_point()
            and tensor.dim() > 0
            and tensor.shape[-1] > 0
        ):
            self.fp8 = quantize_tiles(tensor)
            self.tensor = None
        else:
            self.fp8 = None
            self.tensor = tensor

    def payload(self) -> list:
        """The tensors held on the device (none for a recompute)."""
        if self.view is not None:
            return []
        return [self.fp8.data, self.fp8.scale] if self.fp8 is not None else [self.tensor]

    def released(self) -> bool:
        """True when the tensor's storage was released behind autograd's back (megatron's
        ``CheckpointWithoutOutput`` does that; it refills it before use): nothing to offload."""
        return self.tensor is not None and self.tensor.untyped_storage().size() == 0

    def offload(self, copies: dict, stream) -> None:
        host = []
        for t in self.payload():
            key = _storage_key(t)
            if key not in copies:
                copies[key] = _StorageCopy(t.untyped_storage(), stream)
            host.append((copies[key], t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset()))
        self.host = host
        self.tensor = None
        if self.fp8 is not None:
            self.fp8 = FP8Tiles(None, None, self.fp8.dtype)

    def restore(self) -> None:
        """Views on the reloaded storages (after the group's reload)."""
        if self.host is None:
            return
        out = [copy.view(dtype, shape, stride, offset) for copy, dtype, shape, stride, offset in self.host]
        if self.fp8 is not None:
            self.fp8 = FP8Tiles(out[0], out[1], self.fp8.dtype)
        else:
            self.tensor = out[0]
        self.host = None

    def get(self) -> torch.Tensor:
        """The tensor for backward (waits for its reload; dequantizes FP8; recomputes)."""
        if self.view is not None:
            if self.tensor is None:  # recomputed once, shared by every consumer that saved it
                with torch.no_grad():
                    self.tensor = self.policy.recompute()
            full = self.tensor
            shape, stride, offset = self.view
            if tuple(full.shape) == shape and tuple(full.stride()) == stride and offset == 0:
                return full
            return full.as_strided(shape, stride, offset)
        self.group._ensure_reloaded()
        self.restore()
        if self.fp8 is not None:
            return dequantize_tiles(self.fp8)
        return self.tensor


def _pack(tensor: torch.Tensor):
    scope = current_scope()
    if scope is None or isinstance(tensor, torch.nn.Parameter):
        return tensor
    return scope.pack(tensor)


def _unpack(packed):
    return packed.get() if isinstance(packed, _Saved) else packed


class SavedTensorScope:
    """One group of saved tensors (a transformer layer's forward): a context manager.

    While open, every tensor autograd saves in this thread passes through :meth:`pack`. On exit the
    group is committed: tensors of offload sites go to host memory (their storage released by a
    recompute checkpoint excepted), and the meter, if one is open, counts what stays saved.

    Args:
        name: for messages (e.g. ``"layer 3"``).
        offload: False = the offload sites stay on the device (a whole-layer recompute's re-run in backward,
            whose tensors are used right away); FP8 storage and recompute still apply.
    """

    def __init__(self, name: str = "", offload: bool = True):
        self.name = name
        self.offload_enabled = offload  # (False also keeps the group out of the meter: a backward re-run)
        self.marks: dict[int, Policy] = {}
        self.regions: list[Policy] = []
        self.saved: list[_Saved] = []
        self._dedup: dict[tuple, _Saved] = {}
        self.state = "open"  # open -> (offloaded -> reloading ->) reloaded
        self.copies: list = []
        self.d2h_event = None
        self.h2d_event = None
        self.prev: SavedTensorScope | None = None  # the group backward reaches next (prefetch)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)

    # -- forward
    def __enter__(self) -> SavedTensorScope:
        _stack().append(self)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.suspend()
        self.commit()

    def suspend(self) -> None:
        """Leave the scope without committing it: a layer whose forward runs in parts with other work in
        between (megatron's combined-1F1B schedule nodes) suspends it after each part, :meth:`resume` s it
        for the next -- on whichever thread runs that part -- and commits once, after the last."""
        self._hooks.__exit__(None, None, None)
        popped = _stack().pop()
        assert popped is self, "saved-tensor scopes closed out of order"

    def resume(self) -> None:
        """Enter a suspended scope again (this thread's saved tensors go through it)."""
        _stack().append(self)
        self._hooks.__enter__()

    def push_region(self, policy: Policy) -> None:
        """Until :meth:`pop_region`, saved tensors without a mark belong to ``policy``'s site."""
        self.regions.append(policy)

    def pop_region(self) -> None:
        self.regions.pop()

    def mark(self, tensor: torch.Tensor, policy: Policy) -> None:
        # keyed by storage address; a weak reference to the *storage* tells a live mark from one whose
        # storage died and whose memory now holds another one. Not to the tensor: the marked tensor is often
        # a view that dies while another view of its storage is still to be saved (MLA's kv latent, the
        # input of kv_layernorm, dies once a BF16 composite norm has taken its FP32 copy; the rope-key view
        # of the same storage is saved later, by the mla_up_proj checkpoint, and is the same site).
        key = _storage_key(tensor)
        hit = self.marks.get(key)
        if hit is not None and not hit[1].expired() and hit[0].recompute is not None and policy.recompute is None:
            # a recompute mark wins over a later FP8/offload mark of the same storage (e.g. the RMSNorm
            # output that recompute=layernorm drops is also the input marked by offload=mla_up_proj):
            # what can be rebuilt is kept nowhere, neither on the device nor on the host
            return
        self.marks[key] = (policy, StorageWeakRef(tensor.untyped_storage()))

    def policy_of(self, tensor: torch.Tensor) -> Policy | None:
        """The site of a saved tensor: its storage's mark, else the innermost open region, else None."""
        hit = self.marks.get(_storage_key(tensor))
        if hit is not None and not hit[1].expired():
            return hit[0]
        return self.regions[-1] if self.regions else None

    def pack(self, tensor: torch.Tensor):
        policy = self.policy_of(tensor)
        meter = active_meter() if self.offload_enabled else None
        if (policy is None or not policy.transforms) and meter is None:
            return tensor  # nothing to do: autograd keeps the tensor as usual
        key = (
            _storage_key(tensor),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
            tensor._version,
        )
        # the same tensor saved twice (e.g. by two consumers): one copy. An FP8 entry does not hold the
        # tensor, whose memory may then be reused by a new one with the same key: the weak reference
        # tells them apart.
        hit = self._dedup.get(key)
        if hit is not None and hit[1]() is not None:
            return hit[0]
        s = _Saved(tensor, policy, self)
        self._dedup[key] = (s, weakref.ref(tensor))
        self.saved.append(s)
        return s

    def commit(self) -> None:
        """End of the forward of this group: start the offload copies, report to the meter."""
        self._dedup.clear()
        self.marks.clear()
        to_host = [
            s
            for s in self.saved
            if self.offload_enabled
            and s.policy is not None
            and s.policy.offload
            and s.view is None
            and not s.released()
        ]
        meter = active_meter() if self.offload_enabled else None
        if meter is not None:
            meter.count(self.saved, offloaded=set(map(id, to_host)))
        self.saved = []  # what is not offloaded stays referenced by autograd only
        if not to_host:
            self.state = "reloaded"
            if meter is not None:
                meter.update_peak()
            return
        cuda = any(_is_cuda(t) for s in to_host for t in s.payload())
        stream = None
        if cuda:
            stream, _ = _Streams.get()
            stream.wait_stream(torch.cuda.current_stream())  # the tensors are complete on the main stream
        copies: dict = {}
        for s in to_host:
            s.offload(copies, stream)
        self.copies = list(copies.values())
        if cuda:
            self.d2h_event = torch.cuda.Event()
            self.d2h_event.record(stream)
        self.state = "offloaded"
        if meter is not None:
            meter.hold_host([c.host.untyped_storage() for c in self.copies])

    # -- backward
    def reload_async(self) -> None:
        """Start bringing this group's offloaded storages back (no wait)."""
        if self.state != "offloaded":
            return
        self.state = "reloading"
        if self.d2h_event is not None:
            _, h2d = _Streams.get()
            h2d.wait_event(self.d2h_event)
            # the device buffers are allocated on the compute stream, whose caching allocator may hand
            # out memory that kernels already queued there still read or write (freed in program order,
            # not yet executed): the copies into it start after that queued work
            h2d.wait_stream(torch.cuda.current_stream())
            for c in self.copies:
                c.reload(h2d)
            self.h2d_event = torch.cuda.Event()
            self.h2d_event.record(h2d)
        else:
            for c in self.copies:
                c.reload(None)

    def _ensure_reloaded(self) -> None:
        if self.state == "offloaded":
            self.reload_async()
        if self.state == "reloading":
            if self.h2d_event is not None:
                torch.cuda.current_stream().wait_event(self.h2d_event)
            self.state = "reloaded"
            self.copies = []  # the views hold the reloaded storages


def chain_prefetch(output: torch.Tensor, scope: SavedTensorScope) -> None:
    """Register the reload of ``scope`` and the prefetch of ``scope.prev`` on ``output``'s gradient.

    ``output`` is the tensor the group's forward produced (a transformer layer's output): its gradient
    arrives when backward reaches this group, which is when its tensors are needed; the previous group
    (``scope.prev``, the layer below in the same model chunk) is needed next, so its host-to-device copy
    starts now and overlaps with this group's backward.
    """
    if scope.state != "offloaded" and (scope.prev is None or scope.prev.state != "offloaded"):
        return
    if not (isinstance(output, torch.Tensor) and output.requires_grad):
        return
    prev = scope.prev

    def hook(*_):
        scope.reload_async()
        if prev is not None:
            prev.reload_async()
        return None

    # on the autograd node (it lives as long as the graph), not on the Python tensor object
    if output.grad_fn is not None:
        output.grad_fn.register_prehook(hook)
    else:
        output.register_hook(hook)
    scope.prev = None  # the hook holds it; no chain of references through the scopes
