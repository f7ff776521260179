"""HF ``tokenizers`` wrapper with the interface megatron-core's GPT datasets use.

megatron-core 0.19.2 touches these tokenizer attributes (``megatron/core/datasets``):

* ``GPTDatasetConfig.__post_init__``: ``vocab_size`` (picks the token dtype code);
* ``GPTDataset.__getitem__``: ``eod`` (passed to the mask / position-id builder);
* ``MegatronDataset.__init__``: ``pad`` (padding id masked out of the loss; any exception -> -1) and,
  for the pad-collision check, ``special_tokens_dict`` or else ``eos`` / ``eod``;
* ``MegatronDataset.unique_description``: ``json.dumps(..., default=lambda o: o.unique_identifiers)``
  -- the config (tokenizer included) is hashed into the name of the cached sample indices, so the
  tokenizer object must expose ``unique_identifiers`` or building any dataset raises AttributeError.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from k2.launcher.datasets.sources import file_sha256

EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"

# Tried in order when a user tokenizer does not contain EOD_TOKEN.
_EOD_CANDIDATES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]", "<|im_end|>")
_PAD_CANDIDATES = (PAD_TOKEN, "<pad>", "[PAD]", "<|padding|>")

# megatron's sentinel for "no pad token" (megatron/core/datasets/megatron_dataset.py::_PAD_TOKEN_ID)
NO_PAD_ID = -1


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int, length: int | None = None):
    """Train a byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` ids (GPT-2's byte-level
    pre-tokenizer, no prefix space; special tokens ``<|endoftext|>`` = EOD and ``<|pad|>`` first, ids 0
    and 1) on ``texts``, streamed once (``tokenizers``' ``BpeTrainer.train_from_iterator``; it keeps word
    counts, not the texts). A literal ``<|endoftext|>`` in a later input is encoded as text
    (``encode_special_tokens``), not as a document boundary. ``length``: the number of texts, if known.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    tok.encode_special_tokens = True
    return tok


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (``tokenizer.json``) with megatron's tokenizer attributes.

    Args:
        path: a HF ``tokenizer.json``.
        eod_token: the end-of-document token. ``None`` = ``<|endoftext|>`` or, failing that, the first
            of ``<|end_of_text|>``, ``</s>``, ``<eos>``, ... that the vocabulary holds.
        pad_token: the padding token. ``None`` = ``<|pad|>``, ``<pad>``, ``[PAD]``, ...; when none
            exists ``pad`` is megatron's sentinel ``-1`` (never a real id).

    Attributes:
        vocab_size: number of ids, added/special tokens included (the embedding table needs at
            least this many rows).
        eod: id of the end-of-document token (appended after every document by ``k2-data``).
        pad: id of the padding token, or ``-1``.
        unique_identifiers: what megatron hashes into its dataset-index cache names (path and a
            content hash of the tokenizer file).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a tokenizer, or it has no end-of-document token.
    """

    def __init__(self, path: str, eod_token: str | None = None, pad_token: str | None = None) -> None:
        from tokenizers import Tokenizer

        path = os.path.abspath(os.path.expanduser(str(path)))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise ValueError(f"cannot load tokenizer {path}: {e}") from None
        self.path = path
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)

        eod_id = self._lookup(eod_token, _EOD_CANDIDATES)
        if eod_id is None:
            wanted = eod_token or " / ".join(_EOD_CANDIDATES)
            raise ValueError(f"tokenizer {path} has no end-of-document token ({wanted})")
        self.eod: int = eod_id
        pad_id = self._lookup(pad_token, _PAD_CANDIDATES)
        self.pad: int = NO_PAD_ID if pad_id is None or pad_id == eod_id else pad_id
        self.eod_token: str = self._tok.id_to_token(self.eod)

        self.unique_identifiers: OrderedDict[str, str] = OrderedDict()
        self.unique_identifiers["class"] = f"{type(self).__module__}.{type(self).__qualname__}"
        self.unique_identifiers["tokenizer_path"] = path
        self.unique_identifiers["sha256"] = file_sha256(path)

    def _lookup(self, explicit: str | None, candidates: Sequence[str]) -> int | None:
        for tok in (explicit,) if explicit is not None else candidates:
            i = self._tok.token_to_id(tok)
            if i is not None:
                return int(i)
        return None

    # megatron calls eos when there is no special_tokens_dict (pad-collision check)
    @property
    def eos(self) -> int:
        """Same as ``eod``."""
        return self.eod

    @property
    def vocab(self) -> dict:
        """Token string -> id, added tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)

    @property
    def inv_vocab(self) -> dict:
        """Id -> token string."""
        return {i: t for t, i in self.vocab.items()}

    @property
    def backend(self):
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._tok

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no EOD appended; special-token strings in ``text`` map to their id)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``tokenize`` over many texts, in parallel inside ``tokenizers`` (``encode_batch_fast``: the ids
        of ``encode_batch`` without the character offsets, which cost CPU and are not needed here)."""
        return [e.ids for e in self._tok.encode_batch_fast(list(texts), add_special_tokens=False)]

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of token ids; special tokens (EOD, pad) are kept as their strings."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size}, eod={self.eod}, pad={self.pad})"


def load_user_tokenizer(path, model_vocab: int) -> HFTokenizer:
    """``data.tokenizer``: the ``tokenizer.json`` at ``path`` (``~`` expanded), checked against the model.

    Args:
        path: the setting's value.
        model_vocab: ``model.vocab_size`` (ids of the embedding table).

    Raises:
        ConfigError: the file is missing or not a usable tokenizer (no end-of-document token), or it has
            more ids than ``model.vocab_size`` (token ids would overflow the embedding table).
    """
    from k2.config.errors import ConfigError

    full = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.isfile(full):
        raise ConfigError(f"data.tokenizer: file not found: {full}")
    try:
        tok = HFTokenizer(full)
    except ValueError as e:
        raise ConfigError(f"data.tokenizer: {e}") from None
    if tok.vocab_size > int(model_vocab):
        raise ConfigError(
            f"data.tokenizer {full} has {tok.vocab_size} ids but model.vocab_size={model_vocab}: token ids "
            f"would overflow the embedding table; set model.vocab_size={tok.vocab_size} (or larger) or use "
            f"a smaller tokenizer"
        )
    return tok
