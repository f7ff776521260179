"""Files a test writes instead of running a trainer: a checkpoint directory with the non-tensor files a
resume plan reads, and a small megatron indexed dataset. Shared by the tests of checkpointing, datasets
and Slurm submission (tests/unit/launcher/*/)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

#: the parallel layout of a one-rank run, as ``k2_state.json`` records it
SINGLE = {"pp": 1, "vpp": 1, "ep": 1, "dp": 1, "world_size": 1}


def fake_checkpoint(run_dir: Path, step: int, overrides: list[str], layout: dict) -> Path:
    """A directory with what a complete checkpoint's non-tensor files hold (enough for the plan), without
    a manifest (as a checkpoint of an older k2-launcher: accepted unverified)."""
    from k2.config.load import load_config, to_yaml

    path = run_dir / "checkpoints" / f"iter_{step:07d}"
    path.mkdir(parents=True)
    (path / "metadata.json").write_text("{}")
    (path / ".metadata").write_bytes(b"")
    (path / "config.yaml").write_text(to_yaml(load_config(overrides)))
    (path / "k2_state.json").write_text(json.dumps({"step": step, "layout": layout, "optimizer_dp_fixed": False}))
    (run_dir / "checkpoints" / "latest").write_text(path.name + "\n")
    return path


def write_dataset(prefix: str, docs: list[list[int]], vocab: int = 16) -> None:
    """``prefix.bin`` / ``prefix.idx``: one uint16 megatron document per list of token ids in ``docs``
    (megatron-core's own ``IndexedDatasetBuilder``); ``vocab`` is not used (the ids are written as given)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for d in docs:
        b.add_document(np.asarray(d, dtype=np.uint16), [len(d)])
    b.finalize(prefix + ".idx")
