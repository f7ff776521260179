"""Raw-text inputs of ``k2-data prepare``: which files ``prepare.input`` names, and their records.

``prepare.input`` is a file, a directory (searched recursively for the formats below) or a glob, or a
list of them. Formats, by file name:

* JSON Lines (``.jsonl``, ``.json``, ``.ndjson``), optionally compressed (``.gz`` with the standard
  library's gzip, ``.zst`` with the ``zstandard`` package): one JSON object per line, the document in
  the field ``prepare.text_key``;
* Parquet (``.parquet``, read with ``pyarrow``): one document per row, the column ``prepare.text_key``;
* plain text (``.txt``, also ``.gz`` / ``.zst``): the whole file is one document
  (``prepare.text_document=file``), or each blank-line separated paragraph is (``paragraph``).

A record is ``(file_index, line, raw)``: the 1-based line (JSONL, text) or row (Parquet) where it
starts, and the raw value (a JSONL line or a text document as bytes, a Parquet cell) that
:func:`record_text` turns into the document text. Parsing is split from reading so that the parsing of
JSONL can run in the tokenizing worker processes while one process reads the files in order.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from k2.config.errors import ConfigError

JSONL_EXTS = (".jsonl", ".json", ".ndjson")
TEXT_EXTS = (".txt",)
PARQUET_EXTS = (".parquet",)
COMPRESSIONS = (".gz", ".zst")
_PARQUET_BATCH_ROWS = 1024


@dataclass(frozen=True)
class InputFile:
    """One input file, or a byte range of one. ``kind``: ``jsonl`` | ``parquet`` | ``text``;
    ``compression``: ``""`` | ``.gz`` | ``.zst``; ``bytes``: its size on disk (of the range: ``end -
    start``). ``start`` / ``end``: the range read, in bytes (``end`` None: to the end of the file); only an
    uncompressed JSONL file is read by range, cut at line starts (:mod:`k2.launcher.datasets.pieces`)."""

    path: str
    kind: str
    compression: str
    bytes: int
    start: int = 0
    end: int | None = None

    @property
    def cuttable(self) -> bool:
        """Whether the file may be read by byte range (records are lines of raw bytes)."""
        return self.kind == "jsonl" and not self.compression

    @property
    def where(self) -> str:
        """The file as a bad record's message names it: its path, and the range's first byte when the
        range starts inside the file (line numbers then count from there)."""
        return self.path if self.start == 0 else f"{self.path} (from byte {self.start})"


class BadRecord(ValueError):
    """A record that is not a document: ``where`` is ``FILE:LINE`` (or ``FILE row N``), ``why`` the reason."""

    def __init__(self, where: str, why: str):
        super().__init__(f"{where}: {why}")
        self.where, self.why = where, why


def _classify(path: str) -> tuple[str, str] | None:
    name = path.lower()
    comp = next((c for c in COMPRESSIONS if name.endswith(c)), "")
    base = name[: len(name) - len(comp)]
    if base.endswith(JSONL_EXTS):
        return "jsonl", comp
    if base.endswith(TEXT_EXTS):
        return "text", comp
    if base.endswith(PARQUET_EXTS) and not comp:
        return "parquet", comp
    return None


_ALLOWED = "JSON Lines (.jsonl/.json/.ndjson, also .gz/.zst), Parquet (.parquet), plain text (.txt, also .gz/.zst)"


def expand_inputs(value: Any) -> list[InputFile]:
    """The input files named by ``prepare.input``: each entry a file, a directory (recursive, only
    files of a known format) or a glob (``**`` recursive); files sorted within each entry, entries in
    the order given, a file named twice kept once.

    Raises:
        ConfigError: ``prepare.input`` empty; an entry that matches nothing; a named file of an unknown
            format; an unreadable file; a ``.zst`` file without the ``zstandard`` package, or a Parquet
            file without ``pyarrow``.
    """
    from omegaconf import OmegaConf

    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    entries = [value] if isinstance(value, str) else list(value or [])
    if not entries or any(not isinstance(e, str) or not e.strip() for e in entries):
        raise ConfigError(f"prepare.input={value!r}: give one or more files, directories or globs of {_ALLOWED}")
    out, seen = [], set()
    for entry in entries:
        pattern = os.path.expanduser(entry)
        if os.path.isdir(pattern):
            found = [os.path.join(d, f) for d, _, fs in os.walk(pattern) for f in fs if _classify(f) is not None]
        elif os.path.isfile(pattern):
            found = [pattern]
            if _classify(pattern) is None:
                raise ConfigError(f"prepare.input: {pattern} is not of a known format; allowed: {_ALLOWED}")
        elif os.path.exists(pattern):
            raise _not_a_file_error(pattern)
        else:
            matched = glob.glob(pattern, recursive=True)
            found = [p for p in matched if os.path.isfile(p) and _classify(p) is not None]
            others = [p for p in matched if os.path.exists(p) and not os.path.isfile(p) and not os.path.isdir(p)]
            if not found and others:
                raise _not_a_file_error(others[0])
        if not found:
            raise ConfigError(f"prepare.input: '{entry}' matches no file of {_ALLOWED}")
        for p in sorted(os.path.abspath(f) for f in found):
            if p in seen:
                continue
            seen.add(p)
            kind, comp = _classify(p)
            if not os.access(p, os.R_OK):
                raise ConfigError(f"prepare.input: cannot read {p} (permission denied)")
            _require_library(p, kind, comp)
            out.append(InputFile(p, kind, comp, os.path.getsize(p)))
    return out


def _not_a_file_error(path: str) -> ConfigError:
    """The error for an input that exists but is not a regular file (a FIFO, a socket, a device)."""
    import stat

    mode = os.stat(path).st_mode
    what = (
        "a FIFO (named pipe)"
        if stat.S_ISFIFO(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "a device"
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "not a regular file"
    )
    return ConfigError(
        f"prepare.input: {path} is {what}, not a regular file: k2-data reads every input more than "
        "once (its checksum for the manifest, then its records in chunks by byte offset, resumable) "
        "and needs its size; write the stream into a file first (e.g. cat the pipe > corpus.jsonl)"
    )


def _require_library(path: str, kind: str, comp: str) -> None:
    import importlib.util

    for needed, module, package in (
        (comp == ".zst", "zstandard", "zstandard"),
        (kind == "parquet", "pyarrow", "pyarrow"),
    ):
        if needed and importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"prepare.input: {path} needs the '{package}' package, which is not installed "
                f"(pip install '{package}', or pip install 'k2-launcher[data]')"
            )


def file_sha256(path: str) -> str:
    """sha256 of a file's bytes (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class _Counted(io.RawIOBase):
    """A binary file that counts the bytes read from disk (the progress bar's position), read from byte
    ``start`` and, with ``limit``, at most ``limit`` bytes (a range of the file)."""

    def __init__(self, f, start: int = 0, limit: int | None = None):
        self.f, self.pos, self.left = f, 0, limit
        if start:
            f.seek(start)

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if self.left is not None:
            b = memoryview(b)[: self.left]
        n = self.f.readinto(b)
        self.pos += n or 0
        if self.left is not None:
            self.left -= n or 0
        return n

    def close(self) -> None:
        self.f.close()
        super().close()


def _open_binary(inp: InputFile, counter: _Counted):
    if inp.compression == ".gz":
        return gzip.GzipFile(fileobj=io.BufferedReader(counter))
    if inp.compression == ".zst":
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(counter))
    return io.BufferedReader(counter, buffer_size=1 << 20)


def read_records(
    files: Sequence[InputFile], text_key: str, text_document: str = "file", skip: int = 0
) -> Iterator[tuple[int, int, Any, int]]:
    """Every record of ``files`` in order, as ``(file_index, line, raw, bytes_read)``; ``bytes_read``
    counts the input bytes read from disk so far (all files). The first ``skip`` records are read but
    not returned (a resumed build).

    Raises:
        ConfigError: a file that cannot be read or decompressed, a Parquet file without the column
            ``prepare.text_key`` (naming its columns).
    """
    done_bytes = 0
    index = 0
    for fi, inp in enumerate(files):
        if (inp.start or inp.end is not None) and not inp.cuttable:
            raise ValueError(f"{inp.path}: only an uncompressed JSONL file is read by byte range")
        counter = _Counted(
            open(inp.path, "rb", buffering=0), inp.start, None if inp.end is None else inp.end - inp.start
        )
        try:
            if inp.kind == "parquet":
                gen = _parquet_rows(inp, text_key, skip - index)
            elif inp.kind == "jsonl":
                gen = _lines(_open_binary(inp, counter))
            else:
                gen = _text_documents(_open_binary(inp, counter), text_document)
            for line, raw in gen:
                if index >= skip:
                    pos = counter.pos if inp.kind != "parquet" else 0
                    yield fi, line, raw, done_bytes + pos
                index += 1
        except (OSError, EOFError, ValueError) as e:
            if isinstance(e, (BadRecord, ConfigError)):
                raise
            raise ConfigError(f"prepare.input: cannot read {inp.path}: {e}") from None
        finally:
            counter.close()
        done_bytes += inp.bytes


def _lines(f) -> Iterator[tuple[int, bytes]]:
    with f:
        for n, line in enumerate(f, 1):
            if line.strip():
                yield n, line


def _text_documents(f, mode: str) -> Iterator[tuple[int, bytes]]:
    with f:
        if mode == "file":
            yield 1, f.read()
            return
        para, start = [], 0
        for n, line in enumerate(f, 1):
            if line.strip():
                if not para:
                    start = n
                para.append(line)
            elif para:
                yield start, b"".join(para)
                para = []
        if para:
            yield start, b"".join(para)


def _parquet_rows(inp: InputFile, text_key: str, skip: int) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(inp.path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a damaged file
        raise ConfigError(f"prepare.input: cannot read {inp.path} as Parquet: {e}") from None
    names = pf.schema_arrow.names
    if text_key not in names:
        raise ConfigError(f"prepare.text_key={text_key!r}: {inp.path} has no such column (columns: {', '.join(names)})")
    row = 0
    for g in range(pf.num_row_groups):  # whole row groups before the resume point are not read
        n = pf.metadata.row_group(g).num_rows
        if row + n <= skip:
            for _ in range(n):
                row += 1
                yield row, None
            continue
        for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS, row_groups=[g], columns=[text_key]):
            for value in batch.column(0).to_pylist():
                row += 1
                yield row, value


def record_text(path: str, kind: str, line: int, raw: Any, text_key: str) -> str:
    """The document text of one record (runs in the worker processes).

    Raises:
        BadRecord: a text document that is not UTF-8; a JSONL line that is not a JSON object, lacks ``text_key``
        or whose value is not a
            string; a Parquet cell that is null or not a string.
    """
    if kind == "text":
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            at = line + raw.count(b"\n", 0, e.start)
            raise BadRecord(f"{path}:{at}", f"not UTF-8 (byte {e.start} of the document)") from None
    if kind == "parquet":
        if not isinstance(raw, str):
            raise BadRecord(f"{path} row {line}", f"column {text_key!r} is {type(raw).__name__}, not a string")
        return raw
    try:
        obj = json.loads(raw)
    except ValueError as e:
        raise BadRecord(f"{path}:{line}", f"not a JSON object ({e})") from None
    if not isinstance(obj, dict):
        raise BadRecord(f"{path}:{line}", f"a JSON {type(obj).__name__}, not an object")
    if text_key not in obj:
        raise BadRecord(
            f"{path}:{line}", f"no field {text_key!r} (prepare.text_key; fields: {', '.join(sorted(obj)[:10])})"
        )
    text = obj[text_key]
    if not isinstance(text, str):
        raise BadRecord(f"{path}:{line}", f"field {text_key!r} is {type(text).__name__}, not a string")
    return text
