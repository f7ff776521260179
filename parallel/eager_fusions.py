"""Without CUDA, the functions megatron-core and emerging-optimizers decorate with ``torch.compile`` at
import time are left as they are (eager).

megatron-core's ``jit_fuser`` (``megatron.core.jit``) is ``torch.compile``, applied when its fusion modules
are imported (bias-dropout-add, bias-GeLU, SwiGLU, ...), and emerging-optimizers decorates its Adam update
with ``@torch.compile``. Each decoration builds inductor's backend, which imports torch's inductor and
dynamo stacks: about half of the CPU time of ``import megatron.core`` (measured with ``python -X
importtime``), paid by every process that imports it: each rank, each tool, each test interpreter. On CPU
that buys nothing: :mod:`k2.parallel.cpu_backend` disables dynamo (its patch 10), so the decorated
functions run eagerly anyway. While a module of those two packages executes, :func:`install`'s import
hook makes ``torch.compile`` return the function unchanged (megatron's ``jit_fuser`` then keeps that
eager decorator, as megatron itself does where ``torch.compile`` is unavailable). Same functions, same
numbers, a cheaper start.

Nothing changes where CUDA is available (there ``torch.compile`` is wanted), for ``torch.compile`` called
anywhere else, or when those packages were imported before :func:`install` ran (then cpu_backend's patch
10 still makes the functions eager). ``import k2.parallel`` installs the hook.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

__all__ = ["install"]

#: top-level packages whose import-time ``torch.compile`` decorations are left eager
PACKAGES = ("megatron", "emerging_optimizers")


def _eager_compile(model=None, **_options):
    """``torch.compile``'s signature, returning ``model`` itself (or, as a decorator factory, the function)."""
    if model is None:
        return lambda fn: fn
    return model


@functools.cache
def _without_cuda() -> bool:
    """Decided once, at the first module of :data:`PACKAGES` (the CPU backend's own test)."""
    from k2.parallel.cpu_backend import cuda_available

    return not cuda_available()


class _EagerCompileOnImport(importlib.abc.MetaPathFinder):
    """Finds the modules of :data:`PACKAGES` as the path finder would, with a loader that runs each one
    while ``torch.compile`` is :func:`_eager_compile` (only without CUDA); answers nothing else."""

    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] not in PACKAGES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module  # (the loader object is this spec's own)

        def exec_module(module):
            if not _without_cuda():
                return run_module(module)
            import torch

            compile_, torch.compile = torch.compile, _eager_compile
            try:
                run_module(module)
            finally:
                torch.compile = compile_

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Add the import hook (module docstring); a no-op when it is already in place."""
    if not any(isinstance(f, _EagerCompileOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _EagerCompileOnImport())
