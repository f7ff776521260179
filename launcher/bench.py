"""``k2-bench``: micro-benchmarks of the launcher's own components, on CPU and (when present) CUDA.

Usage::

    k2-bench                                   # bench=none: list the benchmarks
    k2-bench bench=attention                   # figures as a table
    k2-bench bench=attention output=json       # one JSON object on stdout
    k2-bench bench=optimizer                   # MuonClip vs AdamW optimizer step, CPU proxy
    k2-bench bench=pipeline                    # decoupled wgrad on vs off: step time, cpu4
    k2-bench bench=memory                      # saved bytes / step time: memory none|fp8|recompute|offload|all
    k2-bench bench=step                        # full K2 step vs plain megatron-core, each feature toggled

The benchmarks and the JSON record are described in :mod:`k2.launcher.benchmarks.registry`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from k2.config import ConfigError, load_config
from k2.launcher.cli import run_main

PROG = "k2-bench"
OUTPUTS = ("text", "json")

USAGE = """usage: k2-bench [HYDRA_OVERRIDE ...]

Micro-benchmarks of the launcher's components on CPU and (when present) CUDA. Without bench=NAME it
lists the benchmarks. output=json prints one JSON record; bench.options.* set a benchmark's options.

examples:
  k2-bench                                   # list the benchmarks
  k2-bench bench=attention output=json       # core attention, one JSON object
  k2-bench bench=optimizer                   # MuonClip vs AdamW optimizer step, CPU proxy
  k2-bench bench=memory                      # saved bytes / step time per memory setting
  k2-bench bench=step bench.options.json_out=step.json
"""


def _bench(args: list[str]) -> int:
    # imported here: --help does not wait for the benchmarks' imports (megatron-core, torch)
    from k2.launcher.benchmarks.common import format_table
    from k2.launcher.benchmarks.registry import run_bench

    cfg = load_config(args)
    if cfg.output not in OUTPUTS:
        raise ConfigError(f"output={cfg.output!r}; allowed for k2-bench: {', '.join(OUTPUTS)}")
    record = run_bench(cfg)
    if cfg.output == "json":
        print(json.dumps(record))
    elif record["bench"] == "none":
        print("k2-bench: available benchmarks (run with bench=<name>):")
        for name, text in record["available"].items():
            print(f"  {name:<12} {text}")
    else:
        print(format_table(record))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``k2-bench [HYDRA_OVERRIDE ...]``; 0, or 2 for a bad setting."""
    return run_main(PROG, _bench, argv, usage=USAGE)


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
