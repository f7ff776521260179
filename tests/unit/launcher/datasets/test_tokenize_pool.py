"""The tokenizing step of ``k2-data prepare`` (k2.launcher.datasets.tokenize_pool): one chunk of JSONL
records gives, for each token dtype of the ``.bin`` (uint16, int32), every document's ids followed by the
EOD id, as ``tokenizers``' own single-document ``encode`` gives them (with character offsets: another
path than the batched, offset-free one under test); bad and empty records are counted, not encoded."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from k2.launcher.benchmarks.data_prepare import stdlib_docstrings
from k2.launcher.datasets import tokenize_pool as TP
from k2.launcher.datasets.tokenizer import EOD_TOKEN, train_byte_level_bpe


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    train_byte_level_bpe(stdlib_docstrings(300), 600).save(path)
    return path


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_a_chunk_equals_encoding_each_document(tokenizer_json, dtype, monkeypatch):
    monkeypatch.setattr(TP, "WORKER_STATE", {})
    texts = stdlib_docstrings(120)[20:120] + ["x", "é\u4e2d\U0001f600 tabs\tand\nnewlines"]
    lines = [json.dumps({"text": t}).encode() + b"\n" for t in texts]
    lines[3:3] = [b'{"text": ""}\n', b'{"body": "no text field"}\n', b"not json\n"]
    TP.init_worker(tokenizer_json, ["corpus.jsonl"], ["jsonl"], "text", dtype)

    tokens, lengths, bad, empty = TP.tokenize_chunk([(0, i + 1, raw) for i, raw in enumerate(lines)])

    ref_tok = Tokenizer.from_file(tokenizer_json)
    eod = ref_tok.token_to_id(EOD_TOKEN)
    reference = [ref_tok.encode(t, add_special_tokens=False).ids + [eod] for t in texts]
    assert tokens.dtype == np.dtype(dtype) and lengths.dtype == np.int64
    assert lengths.tolist() == [len(r) for r in reference]
    assert tokens.tolist() == [i for r in reference for i in r]
    assert empty == 1
    assert [where for where, _ in bad] == ["corpus.jsonl:5", "corpus.jsonl:6"]
    assert "no field 'text'" in bad[0][1] and "not a JSON object" in bad[1][1]
