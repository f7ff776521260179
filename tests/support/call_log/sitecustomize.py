"""Put on ``PYTHONPATH`` by a test: every Python process of the run (``k2-train``, its rank launcher, the
ranks forked from it) appends ``<pid> <function>`` to the file ``$K2_TEST_CALL_LOG`` names each time it
composes the config (``k2.config.load.load_config``) or plans the run
(``k2.launcher.training.prepare.prepare_run``), so that a test can count where they ran.

The functions are wrapped when their modules are first imported (an import hook: importing them here
would cost every process of the run, wandb's included, the imports up front)."""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys

#: module -> the functions of it to log
WATCHED = {"k2.config.load": ("load_config",), "k2.launcher.training.prepare": ("prepare_run",)}


def _logged(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with open(os.environ["K2_TEST_CALL_LOG"], "a") as f:
            f.write(f"{os.getpid()} {fn.__name__}\n")
        return fn(*args, **kwargs)

    return wrapper


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        for name in WATCHED[module.__name__]:
            setattr(module, name, _logged(getattr(module, name)))


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in WATCHED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None:  # (an editable install's own finder, further down sys.meta_path)
            for finder in sys.meta_path:
                if finder is not self and hasattr(finder, "find_spec"):
                    spec = finder.find_spec(fullname, path, target)
                    if spec is not None:
                        break
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if os.environ.get("K2_TEST_CALL_LOG"):
    sys.meta_path.insert(0, _Finder())
