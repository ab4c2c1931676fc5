"""JSON Lines files (local, ``gs://``, a hub dataset's) read as ``datasets``' JSON builder reads them,
without converting them whole on one core before the first slice can start.

The reference loads a local ``.jsonl`` with ``datasets.load_dataset("json")``. Its builder reads the file
in batches (10 MiB, then the rest of the line: :data:`BATCH_BYTES`), parses each batch with pyarrow's JSON
reader (in blocks of 1/32 of the batch, doubled when an object straddles them), takes the *first*
batch's Arrow schema as the dataset's features and casts every batch to them (a key a row lacks is
null; a struct key the first batch never saw fails the load). Once the first batch is known, the
batches are independent of each other, so here:

- the plan finds the batch boundaries (a seek and a short read each, where the builder's read and
  readline end) and hashes, counts and checks (UTF-8) the batches on all cores; it parses only the first;
- a slice reads the batches that hold its rows, checks each one's sha256 against the plan's (a file
  that changed since the plan is one clear error, never rows of two versions), parses it exactly as the
  builder does, casts it to the features (pyarrow alone when the schemas already agree, else
  ``datasets``' own cast) and takes its rows.

So rows are the same Python objects ``datasets`` gives (``tests/test_jsonl.py`` compares them on files of
several batches), and a slice's key follows from the bytes of the batches it reads.

A ``gs://`` object is read the same way, in byte ranges, without a copy first: the plan pins the
generation the object has when it is planned (:mod:`sftmix.sources.pinned`), reads its ranges on many threads and counts the batches in order as they arrive; each slice reads its own
batches' ranges of that generation. A hub dataset's (or a local directory's) JSON Lines files are read
the same way (:func:`scan_files`): the builder reads them one after another, the first file's first batch
fixing the features of all. Anything else (a JSON array, a compressed file, a sliced split, a first batch
pyarrow cannot parse) goes through ``datasets`` as before (:mod:`sftmix.sources.whole.arrow`).
"""

from __future__ import annotations

import bisect
import codecs
import contextlib
import hashlib
import io
import json
import os
import queue
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from typing import Any, NamedTuple, TypeVar, cast

from pydantic import BaseModel, ConfigDict

from sftmix.errors import BadLineError, DatasetError
from sftmix.runtime import settings
from sftmix.runtime.ahead import ahead
from sftmix.runtime.parallel import available_cpus
from sftmix.runtime.storage import is_remote
from sftmix.sources import pinned
from sftmix.sources.data_files import BATCH_BYTES, MIXED_TYPES
from sftmix.sources.features import features_schema, schema_of, schema_text
from sftmix.sources.growing import GrowingFile, final_name, open_landing
from sftmix.sources.hashing import valid_utf8
from sftmix.sources.paths import compression_of, local_builder
from sftmix.sources.tables import runs_in_parts, table_rows

FINGERPRINT_PREFIX = "jsonl-batches:"
#: A ``gs://`` object is read in ranges of this many bytes, by this many threads ahead of the plan's scan.
REMOTE_CHUNK = pinned.RANGE_BYTES
REMOTE_READERS = pinned.READERS
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


class JsonlSource(BaseModel):
    """What a slice needs to read its rows: the file (or, for a dataset of several files, the dataset:
    each batch names its file), the features as an Arrow schema, its batches."""

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
    return _lines_first(_read(path, 0, min(size, len(codecs.BOM_UTF8) + 1)))


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


def _read(path: str, offset: int, end: int, growing: str = "") -> bytes:
    """Bytes ``[offset, end)`` of the file (``growing``: its name while it is still being written)."""
    if is_remote(path):
        data = pinned.read_remote(path, offset, end, _changed(offset, end))
    else:
        try:
            fd = open_landing(path, growing)
        except FileNotFoundError:
            raise DatasetError(path, _GONE) from None
        with open(fd, "rb") as fh:
            fh.seek(offset)
            data = fh.read(end - offset)
    if len(data) != end - offset:
        raise DatasetError(path, _changed(offset, end))
    return data


_CHANGED_WHILE_PLANNED = "the file changed while it was planned: plan it when it no longer changes"
_GONE = "the file is gone since the run was planned (moved, deleted, or its copy not made): rerun it"


def _changed(offset: int, end: int) -> str:
    return (
        f"the file changed since the run was planned (bytes {offset}-{end} are not what the plan read): "
        "rerun when it no longer changes; finished slices are kept"
    )


def _rows_in(data: bytes) -> tuple[int, int, bool]:
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


def _scan_batch(path: str, offset: int, end: int, growing: str = "") -> tuple[str, int, int, bool, bool]:
    """sha256, rows (lines that are not blank) and newlines of one batch, whether some line does not
    look like one object, and whether its bytes are valid UTF-8."""
    return _scanned(_read(path, offset, end, growing), offset)


def _scanned(data: bytes, offset: int) -> tuple[str, int, int, bool, bool]:
    rows, newlines, odd = _rows_in(data.removeprefix(codecs.BOM_UTF8) if offset == 0 else data)
    return hashlib.sha256(data).hexdigest(), rows, newlines, odd, valid_utf8(data)


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

_SCANS: OrderedDict[tuple[str, int, int, int], JsonlLayout | None] = OrderedDict()
_SCANS_LOCK = threading.Lock()
_KEPT_SCANS = 16
#: Beyond the last ``_KEPT_SCANS`` files, scans are kept while they hold this many batches (~1.3 TB of
#: files, some 100 bytes each): a hub dataset's hundreds of files are not read again by the plan that
#: follows the one made ahead of it (:func:`sftmix.planning.plan.prepare_plan`).
_KEPT_BATCHES = 1 << 17


def scan(path: str, on_batch: BatchListener | None = None, threads: int | None = None) -> JsonlLayout | None:
    """The file's batches (hashed, counted and checked on all cores) and features; ``None`` when the
    first batch is not JSON Lines pyarrow reads (``datasets`` then loads the file as before).

    ``on_batch`` is told each batch, in order, as soon as it and every batch before it are counted:
    the plan cuts and starts slices while the rest of a large file is still being read. ``threads``:
    how many read it (default: one per CPU), fewer where slices already use the cores. A file scanned
    before (the same size, mtime and inode) is not read again: its batches are told at once."""
    version = pinned.version(path)
    stamp = (path, *version)
    with _SCANS_LOCK:
        found = stamp in _SCANS
        layout = _SCANS.get(stamp)
    if found:
        _tell(layout, on_batch)
        return layout
    layout = _scan(path, version, on_batch, threads or available_cpus())
    _keep(stamp, layout)
    return layout


def _tell(layout: JsonlLayout | None, on_batch: BatchListener | None) -> None:
    """``on_batch`` told each batch of a layout scanned before, at once."""
    if layout is not None and on_batch is not None:
        for batch in layout.batches:
            on_batch(batch, layout.schema_b64)


def _keep(stamp: tuple[str, int, int, int], layout: JsonlLayout | None) -> None:
    """A file's layout kept for the next scan of the same version (the oldest forgotten past a bound)."""
    with _SCANS_LOCK:
        _SCANS[stamp] = layout
        while (
            len(_SCANS) > _KEPT_SCANS
            and sum(len(kept.batches) for kept in _SCANS.values() if kept) > _KEPT_BATCHES
        ):
            _SCANS.popitem(last=False)


def scan_file(
    file: str | GrowingFile,
    on_batch: BatchListener | None = None,
    threads: int | None = None,
    declared: Any = None,
) -> JsonlLayout | None:
    """:func:`scan` of a file this module reads (:func:`applies`), or :func:`scan_growing` of a copy still
    being written; else ``None``. ``declared``: the features a hub dataset's card declares (see
    :func:`scan_files`)."""

    def scanned(told: BatchListener | None) -> JsonlLayout | None:
        if isinstance(file, GrowingFile):
            return scan_growing(file, told, threads)
        return scan(file, told, threads) if applies(file, "train") else None

    return _cast_as_declared(declared, on_batch, scanned)


def _cast_as_declared(
    declared: Any,
    on_batch: BatchListener | None,
    scanned: Callable[[BatchListener | None], JsonlLayout | None],
) -> JsonlLayout | None:
    """What ``scanned`` finds (told to ``on_batch``), its features, where a dataset's card declares them
    (``declared``, an Arrow schema), those: ``datasets``' builder then casts every batch to them, the
    first file's first batch included, and infers none."""
    if declared is None:
        return scanned(on_batch)
    fixed = schema_text(declared)
    layout = scanned(None if on_batch is None else lambda batch, _: on_batch(batch, fixed))
    return None if layout is None else replace(layout, schema_b64=fixed, declared=True)


def scan_files(
    paths: list[str],
    name: str,
    on_batch: BatchListener | None = None,
    threads: int | None = None,
    local: Callable[[int], str | GrowingFile] | None = None,
    declared: Any = None,
) -> JsonlLayout | None:
    """The batches of a dataset of several JSON Lines files (a hub dataset's, a directory's), as
    ``datasets``' JSON builder reads them one after another: rows numbered across the files in order,
    every batch cast to the features its card declares (``declared``, an Arrow schema), or else to those
    of the *first* file's first batch (a key a row lacks is null). ``None`` where a file is not one
    :func:`applies` to, or is not JSON Lines pyarrow reads (``datasets`` then loads the dataset).

    The files are scanned side by side, each on a share of the ``threads``, each once ``local(k)`` gives
    its copy here (a hub file as it lands, a decompressed copy as it is written; default: the path as it
    is); ``on_batch`` is told each batch in the dataset's order (on this thread) as soon as it and every
    batch before it are counted, as :func:`scan` tells a file's. The batches name the files' copies."""
    if not paths:
        return None
    return _cast_as_declared(declared, on_batch, lambda told: _scan_files(paths, name, told, threads, local))


def _scan_files(
    paths: list[str],
    name: str,
    on_batch: BatchListener | None,
    threads: int | None,
    local: Callable[[int], str | GrowingFile] | None,
) -> JsonlLayout | None:
    cpus = threads or available_cpus()
    share = max(1, cpus // len(paths))
    events: queue.SimpleQueue[tuple[int, Any, str | None]] = queue.SimpleQueue()
    files = _FilesInOrder(list(paths), on_batch)

    def scan_one(k: int) -> None:
        try:
            here = paths[k] if local is None else local(k)
            files.copies[k] = final_name(here)
            found = scan_file(here, lambda batch, schema: events.put((k, batch, schema)), share)
        except BaseException as exc:
            events.put((k, exc, None))
            raise
        events.put((k, found, None))

    pool = ThreadPoolExecutor(max_workers=max(1, min(len(paths), cpus)))
    try:
        for k in range(len(paths)):
            pool.submit(scan_one, k)
        while len(files.layouts) < len(paths):
            k, item, file_schema = events.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, JsonlBatch):
                files.counted[k].append(item)
                # (a batch's event carries its schema text)
                files.schema = files.schema or (cast(str, file_schema) if k == 0 else "")
            elif item is None or (k == 0 and not item.schema_b64):
                return None  # (the other files' scans are left to end)
            else:
                files.done[k] = item
            files.hand_on()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return files.layout(name)


class _FilesInOrder:
    """The files of a dataset scanned at once, their batches handed on in the files' order, numbered
    across them, each as soon as every file before its own is whole."""

    def __init__(self, copies: list[str], on_batch: BatchListener | None) -> None:
        self.copies = copies  # each file's copy here, once its scan has it
        self.on_batch = on_batch
        self.counted: list[list[JsonlBatch]] = [[] for _ in copies]  # told by a file's scan, not handed on
        self.batches: list[JsonlBatch] = []  # handed on, numbered across the files
        self.layouts: list[JsonlLayout] = []  # of the files before ``len(layouts)``, scanned and handed on
        self.done: dict[int, JsonlLayout] = {}
        self.schema, self.first_row = "", 0

    def hand_on(self) -> None:
        """What is due, in order: the batches of the first file not yet whole, and every whole file's."""
        while len(self.layouts) < len(self.copies):
            now = len(self.layouts)
            for batch in self.counted[now]:
                update = {"first_row": self.first_row + batch.first_row, "path": self.copies[now]}
                self.batches.append(batch.model_copy(update=update))
                if self.on_batch is not None:
                    self.on_batch(self.batches[-1], self.schema)
            self.counted[now].clear()
            if now not in self.done:
                break
            self.layouts.append(self.done.pop(now))
            self.first_row += self.layouts[-1].n_rows

    def layout(self, name: str) -> JsonlLayout:
        return JsonlLayout(
            path=name,
            size=sum(layout.size for layout in self.layouts),
            batches=tuple(self.batches),
            schema_b64=self.layouts[0].schema_b64,
            bad_lines=tuple(
                replace(bad, file=path)
                for path, layout in zip(self.copies, self.layouts, strict=True)
                for bad in layout.bad_lines
            ),
        )


def first_batch(path: str | GrowingFile, declared: Any = None) -> tuple[JsonlBatch, str] | None:
    """The file's first batch and the features' schema (serialized), from that batch alone (or those
    ``declared``: see :func:`scan_files`): what the plan needs of a file before its slices can be cut
    (its columns, the rows it samples). ``None`` as for :func:`scan`. (A copy still being written: once
    its first batch is.)"""
    found = _first_batch(path)
    return found if found is None or declared is None else (found[0], schema_text(declared))


def _first_batch(path: str | GrowingFile) -> tuple[JsonlBatch, str] | None:
    if isinstance(path, GrowingFile):
        return _copy_read(path, lambda: _first_batch_growing(path))
    end = _first_batch_end(path, pinned.size_of(path))
    data = _read(path, 0, end)
    found = _counted(path, _Place(0, 0, end), _scanned(data, 0), data)
    if found is None or found[2] is None:
        return None
    return found[0], found[2]


def _first_batch_end(path: str, size: int) -> int:
    if size <= BATCH_BYTES:
        return size
    at, window = BATCH_BYTES, min(1 << 16, REMOTE_CHUNK)  # the rest of the line, as readline reads it
    while at < size:
        data = _read(path, at, min(size, at + window))
        if (newline := data.find(b"\n")) >= 0:
            return at + newline + 1
        at, window = at + len(data), 2 * window
    return size


class _Place(NamedTuple):
    """Batch ``k`` of a file: its bytes ``[offset, end)``, its first row and the newlines before it."""

    k: int
    offset: int
    end: int
    first_row: int = 0
    lines: int = 0


def _counted(
    path: str,
    place: _Place,
    scanned: tuple[str, int, int, bool, bool],
    data: bytes | None = None,
    growing: str = "",
) -> tuple[JsonlBatch, list[BadLine], str | None] | None:
    """Batch ``k`` of the file from its scan (and its bytes, where they are at hand), with the bad lines
    found in it and (for the first batch) the features' schema: a batch that may hold a bad line (or is
    the first) is parsed. ``None``: the file is not JSON Lines pyarrow reads (the caller lets
    ``datasets`` read it)."""
    sha, rows, newlines, odd, utf8 = scanned
    k, offset, end, first_row, lines = place
    bad: list[BadLine] = []
    schema = None
    if k == 0 or odd or not utf8:  # the first gives the features; an odd one may be JSON over many lines
        data = _read(path, offset, end, growing) if data is None else data
        text = data.removeprefix(codecs.BOM_UTF8) if k == 0 else data
        try:
            table, found = read_batch(text, lines, None, offset + len(data) - len(text), utf8)
        except Exception:
            return None  # not JSON Lines pyarrow reads: datasets reads it (its fallbacks included)
        if table.num_rows != rows:
            return None  # objects over several lines: datasets reads them
        bad += found.values()
        if k == 0:
            schema = schema_text(features_schema(table.schema))
    batch = JsonlBatch(
        offset=offset, end=end, first_row=first_row, rows=rows, sha256=sha, lines_before=lines, utf8=utf8
    )
    return batch, bad, schema


def _scan(
    path: str, stamp: tuple[Any, ...], on_batch: BatchListener | None, threads: int
) -> JsonlLayout | None:
    """``stamp``: the file's :func:`sftmix.sources.pinned.version` before the read; a file with another version
    after it (rewritten, grown, truncated, replaced by a rename) was read as no one version of it."""
    layout = _layout(path, _scanned_batches(path, stamp[0], threads), on_batch)
    if pinned.version(path) != stamp:
        raise DatasetError(path, _CHANGED_WHILE_PLANNED)
    return layout


def _layout(
    path: str, scanned_batches: Generator[Scanned], on_batch: BatchListener | None, growing: str = ""
) -> JsonlLayout | None:
    """The layout of file ``path`` from its batches' scans, in order (``on_batch`` told each, naming
    ``growing``, where the file is still being written)."""
    batches: list[JsonlBatch] = []
    bad_lines: list[BadLine] = []
    first_row = lines = size = 0
    schema = ""
    with contextlib.closing(scanned_batches):
        for k, (offset, end, scanned, data) in enumerate(scanned_batches):
            found = _counted(path, _Place(k, offset, end, first_row, lines), scanned, data, growing)
            if found is None:
                return None  # (closing the batches reads no further)
            batch, bad, first_schema = found
            schema = first_schema or schema
            batches.append(batch)
            bad_lines += bad
            first_row += batch.rows
            lines += scanned[2]
            size = end
            if on_batch is not None:
                on_batch(batch.model_copy(update={"growing": growing}) if growing else batch, schema)
    return JsonlLayout(
        path=path, size=size, batches=tuple(batches), schema_b64=schema, bad_lines=tuple(bad_lines)
    )


def scan_growing(
    file: GrowingFile, on_batch: BatchListener | None = None, threads: int | None = None
) -> JsonlLayout | None:
    """:func:`scan` of a file still being written (a decompressed copy: :mod:`sftmix.sources.growing`), each batch
    told as soon as its bytes are written and counted (each read where it lies, on ``threads`` threads,
    as a file's); its layout names the file it becomes. ``None`` as :func:`scan`, and for a file that is
    empty or opens a JSON array. Scanned once in this process: another caller meanwhile (the plan made
    ahead of the plan, and the plan) waits for it, and is told its batches at once."""
    with _SCANS_LOCK:
        running = _GROWING_SCANS.get(file.temp)
        if running is None:
            mine = _GROWING_SCANS[file.temp] = Future()
    if running is not None:
        layout = running.result()
        _tell(layout, on_batch)
        return layout
    try:
        layout = _copy_read(file, lambda: _scan_growing(file, on_batch, threads))
    except BaseException as exc:
        mine.set_exception(exc)
        raise
    else:
        mine.set_result(layout)
    finally:
        with _SCANS_LOCK:
            del _GROWING_SCANS[file.temp]
    return layout


#: Scans of copies being written, by the temp file each is written to (see :func:`scan_growing`).
_GROWING_SCANS: dict[str, Future[JsonlLayout | None]] = {}


T = TypeVar("T")


def _copy_read(file: GrowingFile, read: Callable[[], T]) -> T:
    """``read()`` of a copy being written; where it finds the copy gone or cut short because its writer
    failed (and removed it), the writer's error, which says why."""
    try:
        return read()
    except DatasetError:
        file.failed()
        raise


def _scan_growing(
    file: GrowingFile, on_batch: BatchListener | None, threads: int | None
) -> JsonlLayout | None:
    bounds = _growing_bounds(file)
    try:
        first = next(bounds, None)
        lines = first is not None and _lines_first(_read(file.final, 0, min(first[1], 4), file.temp))
    except BaseException:
        bounds.close()
        raise
    if first is None or not lines:
        bounds.close()
        return None

    def every() -> Generator[tuple[int, int, bytes | None]]:
        yield first[0], first[1], None
        yield from ((offset, end, None) for offset, end in bounds)

    def scan_one(offset: int, end: int, data: bytes | None) -> tuple[str, int, int, bool, bool]:
        return _scan_batch(file.final, offset, end, file.temp)

    # (the scan's own thread reads the bounds, and closes them)
    scanned = _scanned_stream(every(), scan_one, threads or available_cpus())
    layout = _layout(file.final, scanned, on_batch, file.temp)
    if layout is None:
        return None
    stamp = pinned.version(file.final)
    if stamp[0] != layout.size:
        raise DatasetError(file.final, _CHANGED_WHILE_PLANNED)
    _keep((file.final, *stamp), layout)  # (a later plan of the copy made reads it no more)
    return layout


def _first_batch_growing(file: GrowingFile) -> tuple[JsonlBatch, str] | None:
    bounds = _growing_bounds(file)
    try:
        first = next(bounds, None)
    finally:
        bounds.close()
    if first is None:
        return None
    offset, end = first
    data = _read(file.final, offset, end, file.temp)
    if not _lines_first(data):
        return None
    found = _counted(file.final, _Place(0, offset, end), _scanned(data, offset), data)
    if found is None or found[2] is None:
        return None
    return found[0].model_copy(update={"growing": file.temp}), found[2]


def _lines_first(head: bytes) -> bool:
    """Whether a file that begins with ``head`` may be JSON Lines: not empty, not a JSON array (as
    :func:`applies` asks)."""
    return bool(head) and not head.removeprefix(codecs.BOM_UTF8).startswith(b"[")


def _growing_bounds(file: GrowingFile) -> Generator[tuple[int, int]]:
    """The bounds of a file's batches, as :func:`batch_bounds` finds them, each as soon as the file being
    written holds it whole."""
    fd = file.opened()
    try:
        start = 0
        while True:
            written = file.wait(start)
            if written <= start:  # (ended there)
                return
            look = start + BATCH_BYTES  # then the rest of the line, as readline reads it
            while True:
                written = file.wait(look)
                if written <= look:  # ended before: the rest, or a last line with no newline
                    end = written
                    break
                window = os.pread(fd, min(written - look, 1 << 16), look)
                if not window:
                    raise DatasetError(file.final, "its copy ended before the bytes written to it")
                if (newline := window.find(b"\n")) >= 0:
                    end = look + newline + 1
                    break
                look += len(window)
            yield start, end
            start = end
    finally:
        os.close(fd)


Scanned = tuple[int, int, tuple[str, int, int, bool, bool], bytes | None]
#: A batch's bytes as fetched for its scan: ``None`` where the scan reads them itself.
_Data = TypeVar("_Data", bound=bytes | None)


def _scanned_batches(path: str, size: int, threads: int) -> Generator[Scanned]:
    """Each batch's bounds and scan (and a remote batch's bytes), in order, each as soon as it and the
    ones before it are scanned: a local file's batches on ``threads`` threads; a remote object's ranges
    fetched ahead (:func:`_fetched_batches`), then scanned on ``threads`` threads."""
    if not is_remote(path):
        bounds = batch_bounds(path)
        pool = ThreadPoolExecutor(max_workers=max(1, min(len(bounds), threads)))
        try:
            scans = pool.map(lambda b: _scan_batch(path, *b), bounds)
            for (offset, end), scanned in zip(bounds, scans, strict=True):
                yield offset, end, scanned, None
        finally:
            pool.shutdown(cancel_futures=True)
        return
    yield from _scanned_stream(
        _fetched_batches(path, size), lambda offset, end, data: _scanned(data, offset), threads
    )


def _scanned_stream(
    fetched: Generator[tuple[int, int, _Data]],
    scan: Callable[[int, int, _Data], tuple[str, int, int, bool, bool]],
    threads: int,
) -> Generator[Scanned]:
    """Each of ``fetched`` batches (bounds, and bytes where fetched; in order) and its ``scan``, on
    ``threads`` threads. ``fetched`` is read on a thread of its own, so each batch is told once it and
    those before it are scanned, whether or not the next one has come (a copy still being written, a
    slow object)."""
    pool = ThreadPoolExecutor(max_workers=max(1, threads))

    def submitted() -> Iterator[tuple[int, int, Future[tuple[str, int, int, bool, bool]], _Data]]:
        try:
            for offset, end, data in fetched:
                yield offset, end, pool.submit(scan, offset, end, data), data
        finally:
            fetched.close()

    try:  # (at most ``threads`` batches held ahead)
        with contextlib.closing(ahead(submitted(), threads, "batch-scan")) as scans:
            for offset, end, scanning, data in scans:
                yield offset, end, scanning.result(), data
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _fetched_batches(path: str, size: int) -> Generator[tuple[int, int, bytes]]:
    """A remote object's batches, in order: bounds as :func:`batch_bounds` finds them, and bytes."""
    chunks = pinned.fetched(lambda offset, end: _read(path, offset, end), size, REMOTE_CHUNK, REMOTE_READERS)
    try:
        yield from _batched(chunks)
    finally:
        chunks.close()


def _batched(chunks: Iterator[bytes]) -> Iterator[tuple[int, int, bytes]]:
    """The batches of a file given as its bytes in order (``chunks``, to its end): bounds as
    :func:`batch_bounds` finds them, and bytes; each as soon as the bytes that end it are given."""
    start, buffer, ended = 0, bytearray(), False  # the bytes given from ``start`` on

    def more() -> bool:
        nonlocal ended
        if not ended:
            chunk = next(chunks, None)
            ended = chunk is None
            if chunk is not None:
                buffer.extend(chunk)
        return not ended

    while True:
        look = BATCH_BYTES  # then the rest of the line, as readline reads it
        while True:
            if len(buffer) > look:
                if (newline := buffer.find(b"\n", look)) >= 0:
                    cut = newline + 1
                    break
                look = len(buffer)
            if not more():
                cut = len(buffer)  # the file ends within the batch, or its last line has no newline
                break
        if not cut:
            return
        with memoryview(buffer) as view:
            data = bytes(view[:cut])  # (one copy, not two)
        del buffer[:cut]
        yield start, start + cut, data
        start += cut


def read_batch(
    data: bytes,
    lines_before: int,
    target: Any = None,
    offset: int = 0,
    utf8: bool | None = None,
    declared: bool = False,
) -> tuple[Any, dict[int, BadLine]]:
    """A batch as the builder reads it (cast to ``target``, the file's features, when given), and its
    bad lines by their row in the batch, each read as ``{}``. Only a batch the reader refuses, or whose
    bytes are not UTF-8, is looked at line by line (Python's JSON reader first, then pyarrow's on ever
    longer heads of the batch for what only it refuses: a field whose type differs). ``utf8``: whether
    the bytes are valid UTF-8, when known (the reader does not check it). ``declared``: ``target`` is
    the features a dataset's card declares (for the reason a row is refused)."""
    if utf8 if utf8 is not None else valid_utf8(data):
        try:
            return _table(data, target), {}
        except Exception as exc:
            refused: Exception = exc
    else:
        refused = DatasetError("", "not valid UTF-8")
    lines = data.split(b"\n")
    rows = _row_lines(lines)
    starts = [0]
    for line in lines[:-1]:
        starts.append(starts[-1] + len(line) + 1)
    bad: dict[int, tuple[str, str]] = {}
    for row, k in enumerate(rows):
        if (found := _line_problem(lines[k], offset + starts[k])) is not None:
            bad[row] = found
        elif target is not None and (key := _first_unknown_key(lines[k], target)) is not None:
            bad[row] = (_unknown_key_reason(key, declared), _excerpt(lines[k], 0))  # (the cast refuses it)
    while True:
        patched = [b"{}" if row in bad else lines[k] for row, k in enumerate(rows)]
        try:
            table = _table(b"\n".join(patched), target)
            break
        except Exception as exc:
            first = _first_refused_row(patched, target, exc)
            if first is None or first[0] in bad:
                raise refused from None  # no one line is at fault: the caller says so for the batch
            row, why = first
            line = lines[rows[row]]
            bad[row] = (_refusal_reason(why, line, target, declared), _excerpt(line, 0))
    return table, {
        row: BadLine(lines_before + rows[row] + 1, reason, excerpt)
        for row, (reason, excerpt) in sorted(bad.items())
    }


def _row_lines(lines: list[bytes]) -> list[int]:
    """The lines (0-based) that hold rows: every line but a blank one, as the reader skips it."""
    return [k for k, line in enumerate(lines) if line.strip(b" \t\r")]


def _table(data: bytes, target: Any) -> Any:
    table = parse_batch(data)
    return table if target is None else _cast(table, target)


def _first_refused_row(lines: list[bytes], target: Any, refused: Exception) -> tuple[int, Exception] | None:
    """The first row whose line, with the lines before it, the reader refuses, and the reader's error
    for that head (a binary search on heads of the batch, which the reader refuses as a whole with
    ``refused``); ``None`` for no lines."""
    lo, hi, why = 0, len(lines), refused  # heads of lo rows are read; of hi rows, refused (with why)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if (error := _refusal(lines, mid, target)) is None:
            lo = mid
        else:
            hi, why = mid, error
    return None if hi == 0 else (hi - 1, why)


def _refusal(lines: list[bytes], n: int, target: Any) -> Exception | None:
    """The reader's error for the first ``n`` rows' lines, ``None`` when it reads them."""
    try:
        _table(b"\n".join(lines[:n]), target)
    except Exception as exc:
        return exc
    return None


_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "true or false"}


def _line_problem(line: bytes, at: int) -> tuple[str, str] | None:
    """(what is wrong, the text near it) for a line (starting at byte ``at`` of the file) Python's JSON
    reader refuses or that is not one object; ``None`` for a JSON object."""
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"not valid UTF-8 (byte {at + exc.start} of the file)", _excerpt(line, exc.start)
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        return f"not valid JSON ({exc.msg}, column {exc.colno})", _excerpt(line, exc.pos, chars=True)
    if not isinstance(value, dict):
        return f"not a JSON object but {_KINDS.get(type(value), 'null')}", _excerpt(line, 0)
    if (found := _SURROGATE.search(line)) is not None:
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return "a string holds a lone surrogate (\\ud800-\\udfff without its pair)", _excerpt(
                line, found.start()
            )
    return None


def _refusal_reason(exc: Exception, line: bytes, target: Any, declared: bool = False) -> str:
    """Why the reader refuses a row that Python's JSON reader reads: a field's type (the message names
    the field), or a key the features (the first batch's, or those ``declared``) do not have."""
    if (changed := MIXED_TYPES.search(str(exc))) is not None:
        return (
            f"field '{changed['field']}' holds {_article(changed['b'])} here and {changed['a']}s in the rows "
            "before it (a field must have one type in every row)"
        )
    if target is not None and (found := _first_unknown_key(line, target)) is not None:
        return _unknown_key_reason(found, declared)
    return f"the reader refuses it ({type(exc).__name__}: {exc})"


def _unknown_key_reason(key: str, declared: bool) -> str:
    """Why a row with ``key``, which the features lack (those ``declared``, or the first batch's), is refused."""
    if declared:
        return (
            f"key {key!r} is not among the features the dataset's card declares (dataset_info in its "
            "README.md), which fix the columns; the reference's loader (datasets) refuses it too: declare "
            "it in the card, or remove it from the rows"
        )
    return (
        f"key {key!r} is in none of the rows of the first {BATCH_BYTES >> 20} MiB the loader reads (of the "
        "first file, where a dataset has several), which fix the columns; the reference's loader (datasets) "
        "refuses it too: give every row the same keys (null where a value is unknown), or put a row with "
        "every key first"
    )


def _article(kind: str) -> str:
    return f"an {kind}" if kind[:1] in "aeiou" else f"a {kind}"


def _excerpt(line: bytes, at: int, chars: bool = False, width: int = 48) -> str:
    """The line's text around position ``at`` (a byte, or with ``chars`` a character), at most ``width``
    characters, cut ends marked."""
    text = line.decode("utf-8", errors="replace").rstrip("\r")
    if not chars:
        at = len(line[:at].decode("utf-8", errors="replace"))
    lo = max(0, min(at - width // 3, len(text) - width))
    hi = min(len(text), lo + width)
    return f"{'...' if lo else ''}{text[lo:hi]}{'...' if hi < len(text) else ''}"


def batches_for(layout: JsonlLayout, start: int, end: int) -> list[JsonlBatch]:
    """The batches that hold rows ``[start, end)`` (a binary search: the plan asks once per slice, and a
    100 GB file has some 10,000 batches)."""
    lo = max(bisect.bisect_left(layout.first_rows, start) - 1, 0)  # batches are contiguous: none before
    hi = bisect.bisect_left(layout.first_rows, end)  # this one can reach past ``start``
    return [b for b in layout.batches[lo:hi] if b.first_row < end and b.first_row + b.rows > start]


class _Builder:
    """What ``datasets``' JSON builder's cast reads of itself: its features."""

    def __init__(self, features: Any) -> None:
        self.info = type("Info", (), {"features": features})()


@lru_cache(maxsize=2)
def _batch_table(
    path: str, batch: JsonlBatch, schema_b64: str, declared: bool = False
) -> tuple[Any, dict[int, BadLine]]:
    data = _read(path, batch.offset, batch.end, batch.growing)
    if hashlib.sha256(data).hexdigest() != batch.sha256:
        raise DatasetError(path, _changed(batch.offset, batch.end))
    text = data.removeprefix(codecs.BOM_UTF8) if batch.offset == 0 else data
    rows = f"rows {batch.first_row}-{batch.first_row + batch.rows - 1} (from line {batch.lines_before + 1})"
    try:
        start = batch.offset + len(data) - len(text)
        table, bad = read_batch(text, batch.lines_before, schema_of(schema_b64), start, batch.utf8, declared)
    except Exception as exc:
        raise DatasetError(path, f"{rows} cannot be read as JSON Lines: {exc}") from None
    if table.num_rows != batch.rows:
        raise DatasetError(
            path, f"{rows}: the reader found {table.num_rows} rows where the plan counted {batch.rows}"
        )
    if batch.path:  # one of a dataset's several files: its lines are named by it
        bad = {row: replace(line, file=batch.path) for row, line in bad.items()}
    return table, bad


def _cast(table: Any, target: Any) -> Any:
    """``table`` cast to the file's features, as ``datasets``' builder casts every batch."""
    if table.schema.equals(target, check_metadata=False):
        return table.replace_schema_metadata(target.metadata)
    import datasets
    from datasets.packaged_modules.json.json import Json

    return Json._cast_table(_Builder(datasets.Features.from_arrow_schema(target)), table)


def _first_unknown_key(line: bytes, schema: Any) -> str | None:
    """The path (``messages[].function_calls``) of the first object key in ``line`` that the schema does
    not have: the cast refuses such a row (a struct, or the table, with a field the features lack)."""
    import pyarrow as pa

    def unknown(value: Any, typ: Any, where: str) -> str | None:
        if isinstance(value, dict) and pa.types.is_struct(typ):
            names = {typ.field(i).name: typ.field(i).type for i in range(typ.num_fields)}
            for key, item in value.items():
                path = f"{where}.{key}" if where else key
                if key not in names:
                    return path
                if (found := unknown(item, names[key], path)) is not None:
                    return found
        elif isinstance(value, list) and (pa.types.is_list(typ) or pa.types.is_large_list(typ)):
            for item in value:
                if (found := unknown(item, typ.value_type, f"{where}[]")) is not None:
                    return found
        return None

    try:
        return unknown(json.loads(line), pa.struct(list(schema)), "")
    except ValueError:
        return None


def read_rows(source: JsonlSource, rows: list[int]) -> list[dict[str, Any] | BadLine]:
    """Rows by index (in the order given) from the batches of ``source``; a bad line's row is its
    :class:`BadLine`."""
    out: list[dict[str, Any] | BadLine] = []
    for batch, local in runs_in_parts(rows, source.batches):
        if batch is None:
            raise DatasetError(source.path, f"row {local[0]} is in none of the slice's batches")
        table, bad = _batch_table(batch.path or source.path, batch, source.schema_b64, source.declared)
        got = table_rows(table, local)
        out += [bad.get(r, record) for r, record in zip(local, got, strict=True)] if bad else got
    return out


def lines_of(dataset: str, file: str) -> str:
    """What the lines of ``file`` (what mixer entry ``dataset``'s slices read, where their batches name no
    file) are numbered in: the file, where the dataset is a directory's or a hub dataset's one file (a line
    of a directory means nothing); else the dataset itself (a compressed file's lines are its own, not
    its copy's)."""
    if local_builder(dataset) is None and not is_remote(dataset):
        return file
    return dataset


def row_place(source: JsonlSource, row: int) -> tuple[str, int] | None:
    """The file and 1-based line of ``row`` where its batch names its file (a dataset of several), blank
    lines skipped as the reader skips them; ``None`` otherwise. Reads the batch: for an error only."""
    for batch in source.batches:
        if batch.path and batch.first_row <= row < batch.first_row + batch.rows:
            lines = _read(batch.path, batch.offset, batch.end, batch.growing).split(b"\n")
            return batch.path, batch.lines_before + _row_lines(lines)[row - batch.first_row] + 1
    return None


def release() -> None:
    """Forget the parsed batches (a worker between slices)."""
    _batch_table.cache_clear()
