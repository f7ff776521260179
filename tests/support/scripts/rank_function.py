"""Runs one rank of a function that a test would otherwise start with ``torch.multiprocessing``'s
``spawn`` (tests/support/distributed.py ``start_processes_forked``): argv[1] is the hex of a pickled
``(sys_path, module, qualname, args)``; this process calls ``module.qualname(rank, *args)`` with its rank
from ``RANK`` (set by the rank launcher; 0 for a single process), after putting the test process's
``sys.path`` in front (so that a test module's own function imports, as under ``spawn``)."""

import importlib
import os
import pickle
import sys

if __name__ == "__main__":
    path, module, qualname, args = pickle.loads(bytes.fromhex(sys.argv[1]))
    sys.path[:0] = [p for p in path if p not in sys.path]
    fn = importlib.import_module(module)
    for name in qualname.split("."):
        fn = getattr(fn, name)
    fn(int(os.environ.get("RANK", "0")), *args)
