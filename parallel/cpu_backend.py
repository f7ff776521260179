"""CPU backend for megatron-core: run the real megatron code path on CPU under gloo.

megatron-core has no CPU path: it calls ``torch.cuda.current_device()``, allocates with
``device="cuda"``, uses CUDA streams/events/RNG, compares ``tensor.type()`` with ``"torch.cuda.*Tensor"``
and assumes Transformer Engine symbols exist. This module patches exactly those places so that the
production code (GPTModel with MLA + MoE, PP/VPP schedules, EP all-to-all, the distributed optimizer)
runs on CPU for tests and the CPU proxy. It is

* active only when CUDA is unavailable (:func:`enable` is a no-op on a GPU machine),
* version-guarded: on any megatron-core other than :data:`SUPPORTED_MEGATRON` it raises, because every
  patch below names a place in that version's source,
* one module, each patch numbered as in ``docs/megatron_on_cpu.md`` (items 1-6), plus 9
  (gloo has no ReduceOp.AVG) and 10 (eager jit_fuser). Item 7 of the notes (DotProductAttention rejects
  MLA's k/v channels) is covered by our own core attention (``model/attention.py``) and item 8 does not
  arise (no ``moe_act`` recompute; QK-Clip is our own, ``optim/qk_clip.py``).

Call :func:`enable` before importing megatron model code (the launcher does so in every entry point).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys

import torch

SUPPORTED_MEGATRON = "0.19.2"
_ENABLED = False
log = logging.getLogger(__name__)


def cuda_available() -> bool:
    """True when a CUDA device is usable (then this module does nothing)."""
    return torch.cuda.is_available()


def is_enabled() -> bool:
    """True when the CPU patches are active in this process."""
    return _ENABLED


# --- 1. torch.cuda device/stream/event API -> host stand-ins ------------------------------------------


class _InertStream:
    """Stand-in for ``torch.cuda.Stream``: work on CPU is synchronous, so every method is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, event=None):
        return event if event is not None else _InertEvent()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _InertEvent:
    """Stand-in for ``torch.cuda.Event``; ``elapsed_time`` uses the host clock."""

    def __init__(self, *args, **kwargs):
        self._t = None

    def record(self, stream=None):
        import time

        self._t = time.perf_counter()

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        if self._t is None or other._t is None:
            return 0.0
        return (other._t - self._t) * 1000.0


def _patch_cuda_api() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: torch.device("cpu")
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda *a, **k: None
    cuda.Stream = _InertStream
    cuda.Event = _InertEvent
    _default_stream = _InertStream()
    cuda.current_stream = lambda *a, **k: _default_stream
    cuda.default_stream = lambda *a, **k: _default_stream
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.set_stream = lambda *a, **k: None
    cuda.is_current_stream_capturing = lambda: False
    # (megatron's combined-1F1B nodes mark the tensors they hand between streams; host memory has no
    # stream to mark, and torch refuses a non-CUDA stream there)
    torch.Tensor.record_stream = lambda self, stream: None
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.memory_reserved = lambda *a, **k: 0
    cuda.max_memory_reserved = lambda *a, **k: 0
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    cuda.memory_stats = lambda *a, **k: {}
    if hasattr(cuda, "nvtx"):
        cuda.nvtx.range_push = lambda *a, **k: None
        cuda.nvtx.range_pop = lambda *a, **k: None


# --- 2. device="cuda" / device=<int> in factory calls and .to()/.cuda() -> host -----------------------


def _host_device(dev):
    if dev is None:
        return None
    if isinstance(dev, int):
        return torch.device("cpu")
    if isinstance(dev, str) and dev.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(dev, torch.device) and dev.type == "cuda":
        return torch.device("cpu")
    return dev


#: where torch exposes the functions whose ``device`` argument is rewritten (module attributes replaced)
_DEVICE_OWNERS = (
    "torch",
    "torch.Tensor",
    "torch.nn.functional",
    "torch.linalg",
    "torch.fft",
    "torch.special",
    "torch.sparse",
    "torch.nested",
)


def _with_host_device(func):
    """``func`` with a CUDA ``device`` keyword (and, for ``Tensor.to``, a positional one) made the host's."""
    if func is torch.Tensor.to:

        @functools.wraps(func)
        def to(self, *args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _host_device(kwargs["device"])
            if args and isinstance(args[0], (str, int, torch.device)) and not isinstance(args[0], bool):
                args = (_host_device(args[0]), *args[1:])
            return func(self, *args, **kwargs)

        return to

    @functools.wraps(func)
    def call(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None:
            kwargs["device"] = _host_device(device)
        return func(*args, **kwargs)

    return call


def _device_functions() -> set:
    """Every torch function with a ``device`` parameter: among torch's overridable functions those whose
    stand-in (``torch.overrides.get_testing_overrides``, one per function with its signature) has one; among
    the others (``get_ignored_functions``: the factories, ``Tensor.new_*``) those whose documentation
    describes one; and ``Tensor.to``."""
    import inspect
    import re

    out = {torch.Tensor.to}
    for func, stand_in in torch.overrides.get_testing_overrides().items():
        try:
            if "device" in inspect.signature(stand_in).parameters:
                out.add(func)
        except (TypeError, ValueError):
            continue
    documented = re.compile(r"\bdevice=|\bdevice \(")
    out.update(f for f in torch.overrides.get_ignored_functions() if documented.search(getattr(f, "__doc__", "") or ""))
    return out


def _patch_device_args() -> None:
    """Rewrite CUDA ``device`` arguments to the host's in every torch function that takes one.

    Why not a process-wide ``TorchFunctionMode`` (the general tool for this): it runs a Python call for
    every torch operation, ~3 us each, which doubled the Python-level cost of the small operators a
    CPU-sized model is made of; these wrappers cost only the factory calls and ``.to()``."""
    import importlib

    import torch.utils._device as device_context

    torch.Tensor.cuda = lambda self, *a, **k: self
    wanted = _device_functions()
    # ``with torch.device("meta"):`` (transformers builds its models so) adds the device to the calls of a
    # set of torch's factories that it builds once, by identity, from the torch namespace and compares
    # with the function a call reaches it with -- torch's own, which each wrapper below calls: the set
    # is built now, before the wrappers replace those names (after, a factory would ignore the context)
    device_context._device_constructors()
    for owner_name in _DEVICE_OWNERS:
        mod, _, attr = owner_name.rpartition(".")
        owner = getattr(importlib.import_module(mod), attr) if mod else importlib.import_module(owner_name)
        for name in dir(owner):
            try:
                obj = getattr(owner, name)
                hit = obj in wanted
            except Exception:  # a lazy attribute that fails, or an object whose == raises
                continue
            if hit:
                setattr(owner, name, _with_host_device(obj))


# --- 3. Tensor.type() string checks in megatron's optimizers -----------------------------------------

_CPU_TO_CUDA_TYPE = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _patch_tensor_type() -> None:
    orig = torch.Tensor.type

    @functools.wraps(orig)
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = orig(self)
            return _CPU_TO_CUDA_TYPE.get(name, name)
        return orig(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_


# --- 4. CUDA RNG -> the CPU generator ------------------------------------------------------------------


def _patch_rng() -> None:
    import megatron.core.tensor_parallel.random as mrandom

    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # (torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator directly)
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = lambda seed: None
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    torch.cuda.random.set_rng_state = torch.cuda.set_rng_state
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    # megatron's tracker stores states from torch.cuda.get_rng_state(); with one CPU generator the
    # EP/TP/data-parallel streams share it. Tests that restore RNG per stream account for this.
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()


# --- 5. Places that assume Transformer Engine is importable ------------------------------------------


def _patch_missing_te() -> None:
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.multi_latent_attention as mla

    class _NoTE:  # a real class so that isinstance(x, TELinear) is simply False
        pass

    if getattr(mla, "TELinear", None) is None or not isinstance(mla.TELinear, type):
        mla.TELinear = _NoTE
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    # CheckpointWithoutOutput(fp8=False) still enters the fp8 branch; give it inert stand-ins.
    if not hasattr(mrandom, "FP8GlobalStateManager"):

        class FP8GlobalStateManager:
            @staticmethod
            def is_fp8_enabled():
                return False

            @staticmethod
            def get_fp8_recipe():
                return None

        mrandom.FP8GlobalStateManager = FP8GlobalStateManager
    if not hasattr(mrandom, "fp8_autocast"):
        mrandom.fp8_autocast = lambda *a, **k: contextlib.nullcontext()
    if not hasattr(mrandom, "activation_recompute_forward"):
        mrandom.activation_recompute_forward = lambda *a, **k: contextlib.nullcontext()


# --- 6. moe_utils.maybe_move_tensor_to_cpu only converts when tensor.is_cuda ------------------------


def _patch_moe_split_sizes() -> None:
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    orig = moe_utils.maybe_move_tensor_to_cpu

    @functools.wraps(orig)
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        out = orig(tensor, as_numpy=as_numpy, record_stream=record_stream)
        if isinstance(out, torch.Tensor) and as_numpy:
            return out.numpy()
        return out

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    if hasattr(token_dispatcher, "maybe_move_tensor_to_cpu"):
        token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


# --- 9. gloo has no ReduceOp.AVG (megatron's MoE metrics tracker averages over DP with it) ----------


def _patch_gloo_avg() -> None:
    import torch.distributed as dist

    orig = dist.all_reduce

    @functools.wraps(orig)
    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op == dist.ReduceOp.AVG:
            work = orig(tensor, op=dist.ReduceOp.SUM, group=group, async_op=False)
            tensor.div_(dist.get_world_size(group))
            return work
        return orig(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = all_reduce


# --- 10. megatron's jit_fuser is torch.compile: on CPU, inductor's C++ codegen costs ~15 s per process --
#         at the first step for microsecond-scale fusions. Run those functions eagerly instead.


def _patch_compile() -> None:
    # (without importing dynamo when nothing imported it yet: k2.parallel.eager_fusions leaves
    # megatron-core's import-time decorations eager, and importing dynamo costs ~1 s of CPU per process;
    # its config reads TORCH_COMPILE_DISABLE when it is first imported)
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].config.disable = True
    else:
        os.environ["TORCH_COMPILE_DISABLE"] = "1"


# --- entry point ---------------------------------------------------------------------------------------


def check_megatron_version() -> str:
    """Return megatron-core's version.

    Raises:
        RuntimeError: on any version other than :data:`SUPPORTED_MEGATRON` (the patches name places
            in that version's source; re-check them before widening the guard).
    """
    from importlib.metadata import version

    # (megatron's package_info.__version__ appends the git hash of the *current directory*)
    __version__ = version("megatron-core")
    if __version__ != SUPPORTED_MEGATRON:
        raise RuntimeError(
            f"parallel.cpu_backend supports megatron-core=={SUPPORTED_MEGATRON}, found {__version__}; "
            "re-check every patch in parallel/cpu_backend.py against the new source first"
        )
    return __version__


def enable() -> bool:
    """Activate the CPU compatibility layer when CUDA is unavailable.

    Returns:
        True if the layer is (now) active, False on a CUDA machine (nothing is patched there).

    Raises:
        RuntimeError: megatron-core is not the supported version.
    """
    global _ENABLED
    if _ENABLED:
        return True
    if cuda_available():
        return False
    check_megatron_version()
    _patch_cuda_api()
    _patch_device_args()
    _patch_tensor_type()
    _patch_rng()
    _patch_missing_te()
    _patch_moe_split_sizes()
    _patch_gloo_avg()
    _patch_compile()
    _ENABLED = True
    log.debug("megatron-core CPU backend enabled")
    return True
