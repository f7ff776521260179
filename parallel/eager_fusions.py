"""megatron-core's and emerging-optimizers' import-time ``torch.compile`` decorations are left as they are
(eager), on every machine.

megatron-core's ``jit_fuser`` (``megatron.core.jit``) is ``torch.compile``, applied when its fusion modules
are imported (bias-dropout-add, bias-GeLU, SwiGLU, the router's expert-bias update, ...), and
emerging-optimizers decorates its scalar optimizers' updates with ``@torch.compile``. While a module of
those two packages executes, :func:`install`'s import hook makes ``torch.compile`` return the function
unchanged (megatron's ``jit_fuser`` then keeps that eager decorator, as megatron itself does where
``torch.compile`` is unavailable).

Why on GPUs too: on K2's path the only decorated function that runs is the router's expert-bias update
(``TopKRouter._apply_expert_bias``: a sum over the ``[tokens, experts]`` routing map per layer and
microbatch; our MLPs, norms and attention are not megatron's fused ones, and the optimizers are torch's
AdamW and our Muon). Compiled, it costs every rank an inductor compilation at its first step (with a C
compiler on the node for Triton's launcher), another for the evaluation's no-grad branch and another when
a schedule phase changes the context length, each on the training's critical path and under the hang
watchdog's allowance. Eager it is a handful of small kernels. On CPU the decorations also cost about half
of ``import megatron.core``'s CPU time (inductor and dynamo imports, ``python -X importtime``), paid by
every process; :mod:`k2.parallel.cpu_backend`'s patch 10 keeps functions decorated before :func:`install`
ran eager there. Same functions, same numbers. ``torch.compile`` called anywhere else is untouched.
``import k2.parallel`` installs the hook.
"""

from __future__ import annotations

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


class _EagerCompileOnImport(importlib.abc.MetaPathFinder):
    """Finds the modules of :data:`PACKAGES` as the path finder would, with a loader that runs each one
    while ``torch.compile`` is :func:`_eager_compile`; answers nothing else."""

    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] not in PACKAGES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module  # (the loader object is this spec's own)

        def exec_module(module):
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
