"""Shared by the k2-data tests of this folder: a byte-level BPE trained on the test module's own ``docs``
fixture, of the module's ``VOCAB`` ids (each module says how many standard-library docstrings it tokenizes
and sets ``model/data.vocab_size`` to its ``VOCAB``)."""

from __future__ import annotations

import pytest

from k2.launcher.datasets.tokenizer import train_byte_level_bpe


@pytest.fixture(scope="module")
def tokenizer_json(request, tmp_path_factory, docs) -> str:
    """``tokenizer.json`` of a byte-level BPE of ``request.module.VOCAB`` ids trained on ``docs``."""
    path = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    train_byte_level_bpe(docs, request.module.VOCAB).save(path)
    return path
