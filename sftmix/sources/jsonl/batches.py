"""A JSON Lines file's batches as ``datasets``' JSON builder cuts them (10 MiB, then the rest of the line): what
the plan records of each (offset, end, rows, sha256) and of a file, where a slice's batches are, and the reading of one
batch's bytes, checked against the plan's."""

from __future__ import annotations

import bisect
import codecs
import hashlib
import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from sftmix.errors import BadLineError, DatasetError
from sftmix.runtime import settings
from sftmix.runtime.storage import is_remote
from sftmix.sources import pinned
from sftmix.sources.data_files import BATCH_BYTES  # (the package reads it here: batches.BATCH_BYTES)
from sftmix.sources.features import schema_of
from sftmix.sources.growing import open_landing
from sftmix.sources.paths import compression_of, local_builder
from sftmix.sources.reading import RowSource

FINGERPRINT_PREFIX = "jsonl-batches:"


#: Set to ``datasets`` to load every JSON file through ``datasets`` as before (to compare, or should
#: reading by batch ever misbehave).
READER_ENV = settings.JSON_READER.name


@dataclass(frozen=True)
class BadLine:
    """A line the reader cannot take as a row: not JSON, not an object, not UTF-8 (or a lone surrogate),
    or a field of another type than the file's other rows have. Its row is read as ``{}`` (so every
    later row keeps its number) and stands for this: skipped, or the run's error."""

    line: int  # 1-based, as editors count
    reason: str
    excerpt: str  # the text near the fault
    file: str = ""  # the file it is in, for a dataset of several files

    def error(self, path: str, more: int = 0) -> BadLineError:
        return BadLineError(self.file or path, self.line, self.reason, self.excerpt, more)

    @property
    def place(self) -> str:
        return f"{self.file}:{self.line}" if self.file else str(self.line)

    @property
    def detail(self) -> str:
        return f"line {self.place}: {self.reason} ({self.excerpt})"


class JsonlBatch(BaseModel):
    """Bytes ``[offset, end)`` of the file: rows ``[first_row, first_row + rows)``."""

    model_config = ConfigDict(frozen=True)

    offset: int
    end: int
    first_row: int
    rows: int
    sha256: str
    lines_before: int = 0  # newlines in the file before it, to name a line in errors
    utf8: bool = True  # the plan found its bytes valid UTF-8 (the slice checks its sha256 is the plan's)
    path: str = ""  # its file, in a dataset of several files ("": the source's)
    growing: str = (
        ""  # where its file is still being written, when the plan found it (sftmix.sources.growing)
    )


class JsonlSource(RowSource):
    """What a slice needs to read its rows: the file (or, for a dataset of several files, the dataset:
    each batch names its file), the features as an Arrow schema, its batches."""

    data_format: Literal["jsonl"] = "jsonl"
    path: str
    schema_b64: str
    batches: list[JsonlBatch]
    declared: bool = False  # the features are those the dataset's card declares, not its first rows'


@dataclass(frozen=True)
class JsonlLayout:
    """A file's batches and features, as the plan finds them."""

    path: str
    size: int
    batches: tuple[JsonlBatch, ...]
    schema_b64: str  # the features' Arrow schema (with datasets' metadata), serialized
    bad_lines: tuple[BadLine, ...] = ()  # found by the plan (in the batches it parses: see scan)
    declared: bool = False  # the features are those the dataset's card declares, not its first rows'

    @cached_property
    def first_rows(self) -> list[int]:
        return [b.first_row for b in self.batches]

    @property
    def n_rows(self) -> int:
        return sum(b.rows for b in self.batches)

    @property
    def columns(self) -> tuple[str, ...]:
        return schema_names(self.schema_b64)

    @property
    def fingerprint(self) -> str:
        h = hashlib.sha256(self.schema_b64.encode("ascii"))
        for b in self.batches:
            h.update(f"{b.offset}:{b.end}:{b.sha256};".encode("ascii"))
        return FINGERPRINT_PREFIX + h.hexdigest()

    def source(self, batches: list[JsonlBatch]) -> JsonlSource:
        return JsonlSource(
            path=self.path, schema_b64=self.schema_b64, batches=batches, declared=self.declared
        )


def files_of(source: JsonlSource) -> set[str]:
    """The files a slice's batches are in."""
    return {b.path or source.path for b in source.batches}


def applies(path: str, split: str) -> bool:
    """Whether ``path`` is a file this module reads: an uncompressed JSON file of the 'train' split (local,
    or a pinned ``gs://`` object: :mod:`sftmix.sources.pinned`), whose first byte (after a BOM) does not open a
    JSON array."""
    if settings.JSON_READER.get() == "datasets":
        return False
    url = pinned.unpinned(path)[0]
    if local_builder(url) != "json" or compression_of(url) is not None or split.strip() != "train":
        return False
    if not is_remote(path) and not os.path.isfile(path):
        return False
    size = pinned.size_of(path)
    if size == 0:
        return False
    return lines_first(read_range(path, 0, min(size, len(codecs.BOM_UTF8) + 1)))


def reads_remote(path: str, split: str) -> bool:
    """Whether ``path`` is a ``gs://`` JSON Lines object this module may read in place (:func:`applies`
    tells, once it is pinned)."""
    return (
        settings.JSON_READER.get() != "datasets"
        and is_remote(path)
        and local_builder(path) == "json"
        and compression_of(path) is None
        and split.strip() == "train"
    )


def reads_decompressed(path: str, split: str) -> bool:
    """Whether ``path`` is a compressed JSON file (local, or a ``gs://`` object) of the 'train' split that the
    plan decompresses to a copy (:func:`sftmix.sources.copies.decompressed_copy`) and reads by batch, if
    :func:`applies` to it."""
    url = pinned.unpinned(path)[0]
    if settings.JSON_READER.get() == "datasets" or split.strip() != "train":
        return False
    if local_builder(url) != "json" or compression_of(url) is None:
        return False
    return is_remote(path) or os.path.isfile(path)


def batch_bounds(path: str) -> list[tuple[int, int]]:
    """``[offset, end)`` of each batch the builder reads: ``BATCH_BYTES``, then up to and including the
    next newline (the line after, when the batch ends on one: that is what readline returns)."""
    size = os.path.getsize(path)
    bounds = []
    with open(path, "rb") as fh:
        start = 0
        while start < size:
            end = _batch_end(fh, start, size)
            bounds.append((start, end))
            start = end
    return bounds


def _batch_end(fh: Any, start: int, size: int) -> int:
    if start + BATCH_BYTES >= size:
        return size
    fh.seek(start + BATCH_BYTES)
    fh.readline()
    return min(size, fh.tell())


def read_range(path: str, offset: int, end: int, growing: str = "") -> bytes:
    """Bytes ``[offset, end)`` of the file (``growing``: its name while it is still being written)."""
    if is_remote(path):
        data = pinned.read_remote(path, offset, end, changed_reason(offset, end))
    else:
        try:
            fd = open_landing(path, growing)
        except FileNotFoundError:
            raise DatasetError(path, _GONE) from None
        with open(fd, "rb") as fh:
            fh.seek(offset)
            data = fh.read(end - offset)
    if len(data) != end - offset:
        raise DatasetError(path, changed_reason(offset, end))
    return data


CHANGED_WHILE_PLANNED = "the file changed while it was planned: plan it when it no longer changes"


_GONE = "the file is gone since the run was planned (moved, deleted, or its copy not made): rerun it"


def changed_reason(offset: int, end: int) -> str:
    return (
        f"the file changed since the run was planned (bytes {offset}-{end} are not what the plan read): "
        "rerun when it no longer changes; finished slices are kept"
    )


def rows_in(data: bytes) -> tuple[int, int, bool]:
    """Rows pyarrow's reader finds when every line that is not blank holds one object (lines that are
    not blank), the newlines, and whether some line does not look like one object (does not start with
    '{' and end with '}': a bad line, or objects over several lines, which only a parse tells apart).
    Lines are found with numpy (no Python loop per line, the GIL mostly released); only lines that do
    not start with '{' and end with '}' as they are (blank, padded, CRLF) are looked at one by one."""
    import numpy as np

    raw = np.frombuffer(data, dtype=np.uint8)
    newlines = np.flatnonzero(raw == 0x0A)
    starts = np.concatenate(([0], newlines + 1))
    ends = np.concatenate((newlines, [len(raw)]))  # exclusive
    filled = ends > starts
    plain = np.zeros(len(starts), dtype=bool)
    plain[filled] = (raw[starts[filled]] == 0x7B) & (raw[ends[filled] - 1] == 0x7D)
    rows, odd = int(plain.sum()), False
    for i in np.flatnonzero(~plain):
        line = data[starts[i] : ends[i]].strip(b" \t\r")
        if line:
            odd = odd or line[:1] != b"{" or line[-1:] != b"}"
            rows += 1
    return rows, len(newlines), odd


def parse_batch(data: bytes) -> Any:
    """One batch as the builder parses it: pyarrow's JSON reader in blocks of 1/32 of the batch (all of
    it for a batch much larger than that), the block doubled while an object straddles blocks."""
    import pyarrow as pa
    import pyarrow.json as paj

    block_size = max(BATCH_BYTES // 32, 16 << 10)
    block_size = len(data) if len(data) // 8 > block_size else block_size
    while True:
        try:
            table = paj.read_json(io.BytesIO(data), read_options=paj.ReadOptions(block_size=block_size))
            table.validate()
            return table
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            if ("straddling" in str(exc) or "JSON conversion to" in str(exc)) and block_size < len(data):
                block_size *= 2
                continue
            raise


def schema_names(schema_b64: str) -> tuple[str, ...]:
    """The columns of a serialized features schema."""
    return tuple(schema_of(schema_b64).names)


#: What :func:`scan` hands on as each batch is counted: the batch and the features' schema (serialized).
BatchListener = Callable[[JsonlBatch, str], None]


def lines_first(head: bytes) -> bool:
    """Whether a file that begins with ``head`` may be JSON Lines: not empty, not a JSON array (as
    :func:`applies` asks)."""
    return bool(head) and not head.removeprefix(codecs.BOM_UTF8).startswith(b"[")


def batches_for(layout: JsonlLayout, start: int, end: int) -> list[JsonlBatch]:
    """The batches that hold rows ``[start, end)`` (a binary search: the plan asks once per slice, and a
    100 GB file has some 10,000 batches)."""
    lo = max(bisect.bisect_left(layout.first_rows, start) - 1, 0)  # batches are contiguous: none before
    hi = bisect.bisect_left(layout.first_rows, end)  # this one can reach past ``start``
    return [b for b in layout.batches[lo:hi] if b.first_row < end and b.first_row + b.rows > start]


def lines_of(dataset: str, file: str) -> str:
    """What the lines of ``file`` (what mixer entry ``dataset``'s slices read, where their batches name no
    file) are numbered in: the file, where the dataset is a directory's or a hub dataset's one file (a line
    of a directory means nothing); else the dataset itself (a compressed file's lines are its own, not
    its copy's)."""
    if local_builder(dataset) is None and not is_remote(dataset):
        return file
    return dataset
