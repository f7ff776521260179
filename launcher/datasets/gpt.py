"""megatron-core's GPT datasets over the resolved data: ``BlendedMegatronDatasetBuilder`` + ``GPTDataset``,
fixed-length samples of ``seq_length`` tokens (+1 for the shifted labels). Units: a sample is one sequence.
"""

from __future__ import annotations

import contextlib
import os

from k2.config.errors import ConfigError
from k2.launcher.datasets.locks import file_lock
from k2.launcher.datasets.resolve import ResolvedData
from k2.launcher.datasets.tokenizer import HFTokenizer


def build_datasets(
    resolved: ResolvedData,
    seq_length: int,
    seed: int,
    train_samples: int,
    valid_samples: int | None,
    *,
    create_attention_mask: bool = False,
):
    """Build the train and validation ``GPTDataset``\\ s (or ``BlendedDataset``\\ s of them).

    Uses megatron-core's ``BlendedMegatronDatasetBuilder(GPTDataset, ...)`` with ``GPTDatasetConfig``:
    ``blend``+``split`` when the validation data is carved from the train blend, else
    ``blend_per_split``; ``reset_position_ids`` / ``reset_attention_mask`` / ``eod_mask_loss`` False;
    ``mmap_bin_files`` True; sample/shuffle indices cached in ``resolved.index_cache_dir`` (keyed by
    an MD5 of prefixes, sizes, seed, seq_length, split and tokenizer, so runs share them safely).

    Each sample is a dict of ``tokens`` / ``labels`` (int64 ``[seq_length]``; labels = tokens shifted
    left by one), ``loss_mask`` (float32 ``[seq_length]``), ``position_ids`` (int64 ``[seq_length]``),
    ``attention_mask`` (bool ``[1, seq_length, seq_length]``, True = masked) only if
    ``create_attention_mask``, and ``dataset_id`` when the split is a blend of several prefixes.

    Distributed: works without ``torch.distributed``. When it IS initialised, megatron builds on global
    rank 0 first and the other ranks load its cached indices after a ``barrier()`` on the default
    group, so this function is then a collective: every rank of the world must call it, with the same
    arguments, and ``index_cache_dir`` must be on a filesystem all ranks see. The writer (the process, or
    global rank 0) holds ``<index_cache_dir>/.build.lock`` while it builds, so runs that share the cache
    never read each other's half-written index files.

    Args:
        resolved: from :func:`resolve_data`.
        seq_length: tokens per sample.
        seed: megatron's ``random_seed`` for the document / sample shuffles.
        train_samples: at least this many training samples are indexed (repeating epochs as needed).
        valid_samples: the same for validation; None = one pass (unweighted validation blends only).
        create_attention_mask: also return megatron's dense causal mask per sample (memory: S^2).

    Returns:
        ``(train_ds, valid_ds)``; ``valid_ds`` is None when ``data.split`` gives validation no share.

    Raises:
        FileNotFoundError: the embedded corpus has not been prepared (run ``k2-data``).
        ConfigError: a split holds fewer than ``seq_length + 1`` tokens, so it yields no sample.
        ValueError: non-positive ``seq_length`` / ``train_samples``, or ``valid_samples`` None with a
            weighted validation blend (megatron needs a size to honour weights).
    """
    import torch
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    _check_inputs(resolved, seq_length, train_samples, valid_samples)
    config = _dataset_config(resolved, seq_length, seed, create_attention_mask)
    sizes = [int(train_samples), None if valid_samples is None else int(valid_samples), 0]

    os.makedirs(resolved.index_cache_dir, exist_ok=True)
    builder = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config)
    # Independent runs that share index_cache_dir (two runs, the points of a sweep as concurrent jobs)
    # must not write the same index files at once: megatron writes them with numpy.save (not atomic) and
    # another run would read a half-written file. The writer holds a file lock: without torch.distributed
    # the process; with it, global rank 0, which writes while the other ranks wait at megatron's barrier
    # and then only read what it wrote.
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    lock = (
        file_lock(os.path.join(resolved.index_cache_dir, ".build.lock"))
        if not distributed or torch.distributed.get_rank() == 0
        else contextlib.nullcontext()
    )
    with lock:
        train_ds, valid_ds, _ = builder.build()  # with torch.distributed: rank 0 first, barrier, the rest
    _check_built(resolved, seq_length, train_ds, valid_ds)
    return train_ds, valid_ds


def _check_inputs(resolved: ResolvedData, seq_length: int, train_samples: int, valid_samples) -> None:
    """The errors :func:`build_datasets` raises before megatron builds anything."""
    if int(seq_length) <= 0 or int(train_samples) <= 0:
        raise ValueError(f"seq_length ({seq_length}) and train_samples ({train_samples}) must be > 0")
    if resolved.embedded:
        for f in [resolved.tokenizer_path] + [
            p + ext for p in resolved.train_blend[0] + resolved.valid_blend[0] for ext in (".bin", ".idx")
        ]:
            if not os.path.isfile(f):
                raise FileNotFoundError(
                    f"the embedded stdlib corpus is not prepared ({f} is missing): run k2-data with the "
                    f"same data.* settings, or call k2.launcher.datasets.corpus.prepare_stdlib_corpus first"
                )
    valid_weighted = (resolved.valid_blend or resolved.train_blend)[1] is not None
    if valid_samples is None and valid_weighted:
        raise ValueError("valid_samples=None (one pass) needs an unweighted validation blend")


def _dataset_config(resolved: ResolvedData, seq_length: int, seed: int, create_attention_mask: bool):
    """megatron's ``GPTDatasetConfig``: ``blend_per_split`` with separate validation data, else
    ``blend`` + ``split`` without a test split."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    common = dict(
        random_seed=int(seed),
        sequence_length=int(seq_length),
        path_to_cache=resolved.index_cache_dir,
        mmap_bin_files=True,
        tokenizer=HFTokenizer(resolved.tokenizer_path),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=create_attention_mask,
    )
    if resolved.valid_blend is not None:
        return GPTDatasetConfig(blend_per_split=[resolved.train_blend, resolved.valid_blend, None], **common)
    config = GPTDatasetConfig(blend=resolved.train_blend, split=resolved.split, **common)
    # never build the test split (the builder would otherwise index it with size 0)
    config.split_matrix = [config.split_matrix[0], config.split_matrix[1], None]
    return config


def _check_built(resolved: ResolvedData, seq_length: int, train_ds, valid_ds) -> None:
    """Refuse splits that yield no sample, naming the setting that holds their data."""
    where = "data.path" if not resolved.embedded else "the embedded corpus"
    if train_ds is None or len(train_ds) == 0:
        raise ConfigError(
            f"{where} yields no training sample of seq_length={seq_length} tokens (the schedule phase's context length)"
        )
    if valid_ds is not None and len(valid_ds) == 0:
        setting = (
            "data.valid_path"
            if resolved.valid_blend is not None and not resolved.embedded
            else "data.valid_fraction"
            if resolved.embedded
            else "data.split"
        )
        raise ConfigError(
            f"the validation data ({setting}) holds fewer than seq_length+1={seq_length + 1} "
            f"tokens, so it yields no validation sample; lower the schedule phase's seq_length or "
            f"enlarge {setting}"
        )
