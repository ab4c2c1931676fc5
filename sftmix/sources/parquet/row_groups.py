"""Parquet read by row group, as ``datasets``' Parquet builder reads it, without converting the whole
dataset to Arrow on one core before the first slice can start: a local ``.parquet`` file, a ``gs://``
one read in place by range (pinned to its generation: :mod:`sftmix.sources.pinned`), or the files of a hub
dataset's split (most hub datasets are Parquet; :func:`sftmix.sources.data_files.parquet_data_files` fetches them
into the cache ``datasets`` downloads to), or of a local directory laid out like one.

The reference loads these with ``datasets.load_dataset``: the features are the ones the dataset card
declares, else the first file's Arrow schema (``Features.from_arrow_schema``), and every row group of
every file, in order, is read and cast to them (``table_cast``). Row groups are independent of each
other, so here:

- the plan reads each file's footer (every row count, so any amount is selected at once), then hashes
  each row group's bytes and cuts each slice as soon as its row groups are hashed, so the first slice
  starts while the rest is read; nothing is decoded but the first row group (the plan's sample);
- a slice reads the footer and its row groups' bytes once, checks their sha256 against the plan's (a
  file that changed since the plan is one clear error, never rows of two versions), decodes its rows
  from those checked bytes alone (pyarrow reads through a file object that serves nothing else) and
  casts them as the builder does;
- a row group larger than :data:`STREAMED_BYTES` (pyarrow's writer puts up to 1Mi rows, gigabytes of
  chats, in one) is decoded batch by batch as it is read from the file, each column chunk hashed as
  pyarrow reads it; the slice checks those hashes against the plan's version before its checkpoint is
  written (:func:`confirm`). A worker holds a batch, not the row group.

So rows are the Python objects ``datasets`` gives (``tests/test_parquet.py`` compares them for several
writers, a hub layout of several files and features a card declares), and a slice's key follows from
the bytes of the row groups it reads. Anything else (a sliced split, features that decode such as an
Image, files of different schemas, row groups pyarrow reads outside their recorded bytes) goes through
``datasets`` as before (:mod:`sftmix.sources.whole.arrow`).
"""

from __future__ import annotations

import bisect
import hashlib
import io
import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict

from sftmix.errors import ConfigError, DatasetError
from sftmix.runtime import settings
from sftmix.runtime.parallel import available_cpus
from sftmix.runtime.storage import is_remote
from sftmix.sources import pinned
from sftmix.sources.downloads import Downloads, closed_on_error
from sftmix.sources.features import decodes, features_schema, schema_of, schema_text
from sftmix.sources.parquet.spill import SpilledGroup, SpilledRows
from sftmix.sources.paths import local_builder
from sftmix.sources.tables import runs_in_parts, table_rows

logger = logging.getLogger(__name__)

FINGERPRINT_PREFIX = "parquet-row-groups:"
MAGIC = b"PAR1"
#: A row group is cut into at most this many slices, and only when each piece still holds this many
#: slices' worth of rows. Each slice hashes the whole row group and decodes it up to its own last row:
#: ~1 s per 440 MiB of chats, against ~55 core-s to tokenize them, so four pieces cost ~5% more work.
MAX_PIECES_PER_ROW_GROUP = 4
_READ_BLOCK = 4 << 20
#: A row group whose data (uncompressed) is larger than this is decoded batch by batch, never whole:
#: pyarrow writes up to 1Mi rows a row group by default (gigabytes of chats), and a worker holds one
#: batch of about :data:`_STREAM_BATCH_BYTES`, whatever the writer chose. The environment's
#: ``TOKENIZE_MIXER_PARQUET_STREAMED_BYTES`` sets it.
STREAMED_BYTES = 64 << 20
_STREAM_BATCH_BYTES = 8 << 20
_STREAM_BUFFER = 1 << 20  # what pyarrow reads of a column chunk at a time


class ParquetFooter(BaseModel):
    """One file of the dataset: where its footer begins, and the footer's sha256."""

    model_config = ConfigDict(frozen=True)

    path: str
    size: int
    offset: int
    sha256: str


class RowGroup(BaseModel):
    """Row group ``index`` of file ``path``: bytes ``[offset, end)``, the dataset's rows
    ``[first_row, first_row + rows)``."""

    model_config = ConfigDict(frozen=True)

    path: str
    index: int
    offset: int
    end: int
    first_row: int
    rows: int
    nbytes: int  # its data uncompressed, as the writer recorded it: a slice's size
    sha256: str  # of its bytes
    meta_sha256: str  # of its footer record (column chunks: codecs, encodings, offsets)
    chunks: tuple[tuple[int, int], ...] = ()  # [offset, end) of each column chunk, in order
    #: sha256 of each column chunk, hashed with the row group where it is read batch by batch (then
    #: checked as it is decoded: :class:`_StreamedGroup`, without a pass of its own first)
    chunk_sha256: tuple[str, ...] = ()


class ParquetSource(BaseModel):
    """What a slice needs to read its rows: the footers of its files, the features as an Arrow schema,
    the row groups that hold its rows, and where the plan decoded one for all its slices, the batches of
    that spill which hold them (:mod:`sftmix.sources.parquet.spill`; what the rows are follows from the row groups)."""

    footers: list[ParquetFooter]
    schema_b64: str
    row_groups: list[RowGroup]
    spilled: list[SpilledRows] = []


@dataclass(frozen=True)
class ParquetLayout:
    """A dataset's files, row groups (in the order the builder reads them) and features, as the plan
    finds them."""

    footers: tuple[ParquetFooter, ...]
    file_schema_sha256: str  # the files' own Arrow schema: with a row group's bytes, what decodes them
    schema_b64: str  # the features' Arrow schema (with datasets' metadata), serialized
    row_groups: tuple[RowGroup, ...]
    stamps: tuple[
        tuple[Any, ...], ...
    ] = ()  # each file's path and version (:func:`sftmix.sources.pinned.version`)
    #: A hub dataset's files downloading while the plan reads them; ``None``: every file is where it is read.
    downloads: Downloads | None = field(default=None, compare=False, repr=False)

    @cached_property
    def first_rows(self) -> list[int]:
        return [g.first_row for g in self.row_groups]

    @property
    def n_rows(self) -> int:
        return sum(g.rows for g in self.row_groups)

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.row_groups)

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(schema_of(self.schema_b64).names)

    @property
    def fingerprint(self) -> str:
        h = hashlib.sha256(f"{self.schema_b64}|{self.file_schema_sha256}".encode("ascii"))
        for g in self.row_groups:
            h.update(f"{g.offset}:{g.end}:{g.rows}:{g.sha256}:{g.meta_sha256};".encode("ascii"))
        return FINGERPRINT_PREFIX + h.hexdigest()

    def data_key(self, groups: list[RowGroup]) -> list:
        """What a slice's rows follow from: the features, the files' schema, its row groups' bytes and
        records (not the whole footer: an edit elsewhere in the file leaves its checkpoint valid; not
        the files' names: a hub dataset's copies lie where each machine's cache puts them)."""
        return [self.schema_b64, self.file_schema_sha256, [[g.sha256, g.meta_sha256] for g in groups]]

    def source(self, groups: list[RowGroup], spilled: list[SpilledRows] | None = None) -> ParquetSource:
        paths = {g.path for g in groups}
        return ParquetSource(
            footers=[f for f in self.footers if f.path in paths],
            schema_b64=self.schema_b64,
            row_groups=groups,
            spilled=spilled or [],
        )


def disabled() -> bool:
    """``TOKENIZE_MIXER_PARQUET_READER=datasets``: every Parquet file goes through ``datasets``."""
    return settings.PARQUET_READER.get() == "datasets"


def applies(path: str, split: str) -> bool:
    """Whether ``path`` is a file this module reads: a Parquet file of the whole 'train' split, local or
    a pinned ``gs://`` object (:mod:`sftmix.sources.pinned`)."""
    if disabled() or local_builder(pinned.unpinned(path)[0]) != "parquet" or split.strip() != "train":
        return False
    if not is_remote(path) and not os.path.isfile(path):
        return False
    return pinned.size_of(path) > 2 * len(MAGIC)


def reads_remote(path: str, split: str) -> bool:
    """Whether ``path`` is a ``gs://`` Parquet object this module may read in place, by range
    (:func:`applies` tells, once it is pinned)."""
    return (
        not disabled() and is_remote(path) and local_builder(path) == "parquet" and split.strip() == "train"
    )


def _changed(what: str) -> str:
    return (
        f"the file changed since the run was planned ({what} is not what the plan read): "
        "rerun when it no longer changes; finished slices are kept"
    )


class _Served(io.RawIOBase):
    """A read-only file of ``size`` bytes for pyarrow, each read served by :meth:`_serve` (which fails
    for what it does not hold, instead of reaching the disk)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self._size, self._pos = size, 0

    def _serve(self, pos: int, n: int) -> bytes:
        raise NotImplementedError

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = base + pos
        return self._pos

    def read(self, n: int = -1) -> bytes:
        n = self._size - self._pos if n is None or n < 0 else min(n, self._size - self._pos)
        if n <= 0:
            return b""
        out = self._serve(self._pos, n)
        self._pos += n
        return out

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


class _Checked(_Served):
    """The file as the given pieces (offset, bytes) of it: pyarrow decodes from what was checked."""

    def __init__(self, size: int, pieces: list[tuple[int, bytes]]) -> None:
        super().__init__(size)
        self._pieces = sorted(pieces, key=lambda p: p[0])

    def _serve(self, pos: int, n: int) -> bytes:
        for offset, data in self._pieces:
            if offset <= pos and pos + n <= offset + len(data):
                return data[pos - offset : pos - offset + n]
        raise OSError(f"bytes {pos}-{pos + n} are outside the row groups the plan checked")


class _Ranges:
    """A file's bytes by range: a local file (or this machine's copy of a hub file, :func:`pinned.local_copy`)
    through one descriptor; a pinned ``gs://`` object or a hub file from its store, that version only,
    each range one request (the object is never fetched whole)."""

    def __init__(self, path: str) -> None:
        self.path, self._fd = path, None
        local = path if not is_remote(path) else pinned.local_copy(path)
        if local is not None:
            try:
                self._fd = os.open(local, os.O_RDONLY)
            except FileNotFoundError:
                raise DatasetError(path, _changed("the file, now missing,")) from None
        self.local = self._fd is not None
        # a request to a store costs tens of ms: fewer, larger ones, and a column chunk read ahead
        self.block = _READ_BLOCK if self._fd is not None else pinned.RANGE_BYTES
        self.ahead = 0 if self._fd is not None else pinned.RANGE_BYTES

    def read(self, offset: int, n: int) -> bytes:
        """Bytes ``[offset, offset + n)``; fewer where the file ends first (the caller counts them)."""
        if self._fd is not None:
            return os.pread(self._fd, n, offset)
        return pinned.read_remote(self.path, offset, offset + n, _changed(f"bytes {offset}-{offset + n}"))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> _Ranges:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _footer_bounds(ranges: _Ranges, size: int, tail: bytes) -> int:
    """Where the footer (its metadata, length and marker) begins, from the file's last 8 bytes ``tail``; a
    file without the markers is refused."""
    head = ranges.read(0, len(MAGIC))
    if head != MAGIC or tail[4:] != MAGIC:
        raise DatasetError(
            ranges.path,
            "not a whole Parquet file (it does not begin and end with the marker PAR1): "
            "a file still being written, cut short, or not Parquet",
        )
    length = int.from_bytes(tail[:4], "little")
    if length <= 0 or length > size - 12:
        raise DatasetError(ranges.path, f"not a whole Parquet file (its footer claims {length} bytes)")
    return size - 8 - length


def _metadata(footer: bytes) -> Any:
    """The file's metadata from its footer's bytes alone."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pq.read_metadata(pa.BufferReader(MAGIC + footer))


def _column_bounds(group: Any) -> list[tuple[int, int]]:
    """``[offset, end)`` of each of a row group's column chunks, from its footer record."""
    bounds = []
    for j in range(group.num_columns):
        col = group.column(j)
        start = col.data_page_offset
        if col.has_dictionary_page and col.dictionary_page_offset:
            start = min(start, col.dictionary_page_offset)
        bounds.append((start, start + col.total_compressed_size))
    return bounds


def _chunk_bounds(group: Any) -> tuple[int, int]:
    """``[offset, end)`` of a row group's column chunks, from its footer record."""
    bounds = _column_bounds(group)
    return min(s for s, _ in bounds), max(e for _, e in bounds)


def _record_sha256(record: Any, offset: int) -> str:
    """sha256 of a row group's footer record with its positions taken from its own start: what decodes
    its bytes, the same wherever in the file it lies (an edit before it moves it, not its rows)."""
    found = record.to_dict()
    for col in found["columns"]:
        for key in [k for k in col if k.endswith("_offset")]:
            col[key] = None if col[key] is None else col[key] - offset
    return hashlib.sha256(json.dumps(found, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def _blocks(ranges: _Ranges, start: int, end: int) -> Iterator[bytes]:
    """Bytes ``[start, end)`` of the file in blocks; fewer where the file ends first (the caller counts
    them)."""
    while start < end:
        block = ranges.read(start, min(ranges.block, end - start))
        if not block:
            return
        yield block
        start += len(block)


#: A column chunk is hashed in about this many blocks (each at least :data:`_MIN_CHECKED_BLOCK`), so one
#: decoded as it is read is known to be the plan's version a block at a time (:mod:`sftmix.sources.parquet.spill`).
_CHECKED_BLOCKS = 256
_MIN_CHECKED_BLOCK = 64 << 10


class _ChunkHash:
    """A column chunk's hash as its bytes come in, in order: sha256 of each block, and the chunk's, sha256
    of its blocks' hashes. With ``expected`` (the plan's blocks), each block is checked as it completes:
    :attr:`verified` is how far the bytes are known to be the plan's version."""

    def __init__(self, start: int, end: int, expected: Sequence[str] = ()) -> None:
        self.start, self.end, self.at = start, end, start
        self.block = max(_MIN_CHECKED_BLOCK, -(-(end - start) // _CHECKED_BLOCKS))
        self.blocks: list[str] = []
        self.bad = False
        self._hash, self._expected = hashlib.sha256(), expected

    def feed(self, data: bytes) -> None:
        view, i = memoryview(data), 0
        while i < len(view):
            boundary = self.next_boundary
            take = min(len(view) - i, boundary - self.at)
            if take <= 0:
                raise OSError(f"bytes past the column chunk's end {self.end}")
            self._hash.update(view[i : i + take])
            i, self.at = i + take, self.at + take
            if self.at == boundary:
                found, self._hash = self._hash.hexdigest(), hashlib.sha256()
                if self._expected and (
                    len(self.blocks) >= len(self._expected) or self._expected[len(self.blocks)] != found
                ):
                    self.bad = True
                self.blocks.append(found)

    @property
    def verified(self) -> int:
        """The end of the bytes checked against the plan's blocks (none after a mismatch)."""
        if self.bad or not self._expected:
            return self.start
        return min(self.end, self.start + len(self.blocks) * self.block)

    @property
    def next_boundary(self) -> int:
        """Where the block being hashed ends."""
        return min(self.end, self.start + (len(self.blocks) + 1) * self.block)

    def hexdigest(self) -> str:
        """The chunk's hash, once it is fed whole."""
        return hashlib.sha256("".join(self.blocks).encode("ascii")).hexdigest()


def _hash_group(
    ranges: _Ranges, group: RowGroup, chunks: Sequence[tuple[int, int]]
) -> tuple[str, tuple[str, ...], tuple[tuple[str, ...], ...]]:
    """sha256 of the row group's bytes, and the hash of each of its column chunks ``chunks`` with their
    blocks' (:class:`_ChunkHash`), in one pass."""
    whole, parts = hashlib.sha256(), [_ChunkHash(start, end) for start, end in chunks]
    at = group.offset
    for block in _blocks(ranges, group.offset, group.end):
        whole.update(block)
        for h in parts:
            lo, hi = max(h.start, at), min(h.end, at + len(block))
            if lo < hi:
                h.feed(block[lo - at : hi - at])
        at += len(block)
    if at != group.end:
        raise DatasetError(ranges.path, _changed(f"bytes {group.offset}-{group.end}"))
    return whole.hexdigest(), tuple(h.hexdigest() for h in parts), tuple(tuple(h.blocks) for h in parts)


#: Each large row group's column chunks' block hashes, as the plan hashed them (what a spill checks its
#: decode against as it goes; kept out of the row group, which every slice carries).
_BLOCKS: OrderedDict[tuple[str, int, str], tuple[tuple[str, ...], ...]] = OrderedDict()
_BLOCKS_LOCK = threading.Lock()
_KEPT_BLOCKS = 256


def _known_blocks(group: RowGroup) -> tuple[tuple[str, ...], ...] | None:
    with _BLOCKS_LOCK:
        return _BLOCKS.get((group.path, group.offset, group.sha256))


def _remember_blocks(group: RowGroup, blocks: tuple[tuple[str, ...], ...]) -> None:
    with _BLOCKS_LOCK:
        _BLOCKS[(group.path, group.offset, group.sha256)] = blocks
        while len(_BLOCKS) > _KEPT_BLOCKS:
            _BLOCKS.popitem(last=False)


T = TypeVar("T")

#: What :func:`hashed` hands on as each row group is hashed, in order.
GroupListener = Callable[[RowGroup], None]

_SCANS: OrderedDict[tuple, ParquetLayout | None] = OrderedDict()
_SCANS_LOCK = threading.Lock()
_KEPT_SCANS = 16


def scan(path: str, threads: int | None = None) -> ParquetLayout | None:
    """One file's row groups and features: :func:`scan_files` of ``[path]``."""
    return scan_files([path], None, threads)


def scan_files(paths: list[str], declared: Any = None, threads: int | None = None) -> ParquetLayout | None:
    """The row groups of a dataset's files, in order, hashed, and its features: :func:`counted`, then
    :func:`hashed`. ``None`` when ``datasets`` is to read it."""
    layout = counted(paths, declared)
    return None if layout is None else hashed(layout, None, threads)


def counted(paths: list[str], declared: Any = None) -> ParquetLayout | None:
    """A dataset's row groups from its files' footers alone (every count, no row group read: their
    ``sha256`` is empty until :func:`hashed`), and its features: ``declared`` (an Arrow schema: the
    features a hub dataset's card declares) or the first file's. ``None`` when ``datasets`` is to read
    it: no rows, features that decode, files of different schemas, row groups recorded out of place."""
    stamps, footers, bounds, schemas, first_row = [], [], [], [], 0
    for path, (version, (offset, footer, meta)) in zip(paths, _footers(paths), strict=True):
        stamps.append((path, *version))
        footers.append(
            ParquetFooter(
                path=path, size=version[0], offset=offset, sha256=hashlib.sha256(footer).hexdigest()
            )
        )
        schemas.append(meta.schema.to_arrow_schema())
        for i in range(meta.num_row_groups):
            record = meta.row_group(i)
            start, end = _chunk_bounds(record)
            if not len(MAGIC) <= start < end <= offset:
                return None  # recorded out of place: datasets reads (or refuses) it
            bounds.append((path, i, start, end, first_row, record.num_rows, record.total_byte_size, record))
            first_row += record.num_rows
    file_schema = schemas[0]
    if not first_row or any(not s.equals(file_schema, check_metadata=False) for s in schemas[1:]):
        return None  # no rows (datasets says so), or files datasets casts one to the other's features
    if declared is None and decodes(file_schema):
        return None  # features that decode: datasets' own to read
    schema = features_schema(file_schema) if declared is None else declared
    return ParquetLayout(
        footers=tuple(footers),
        file_schema_sha256=hashlib.sha256(file_schema.serialize().to_pybytes()).hexdigest(),
        schema_b64=schema_text(schema),
        row_groups=tuple(
            RowGroup(
                path=p,
                index=i,
                offset=o,
                end=e,
                first_row=r,
                rows=n,
                nbytes=max(0, b),
                sha256="",
                meta_sha256=_record_sha256(record, o),
                chunks=tuple(sorted(_column_bounds(record))),
            )
            for p, i, o, e, r, n, b, record in bounds
        ),
        stamps=tuple(stamps),
    )


def _footers(paths: list[str]) -> Iterator[tuple[tuple[Any, ...], tuple[int, bytes, Any]]]:
    """Each file's version and footer (:func:`_read_footer`), in order."""

    def read(path: str) -> tuple[tuple[Any, ...], tuple[int, bytes, Any]]:
        try:
            version = pinned.version(path)
            return version, _read_footer(path, version[0])
        except OSError as exc:
            raise DatasetError(path, f"cannot be read: {type(exc).__name__}: {exc}") from None

    return _each(read, paths)


def _each(fn: Callable[[str], T], paths: list[str]) -> Iterator[T]:
    """``fn`` of each path, in order; where some are remote, on as many threads as a network carries
    (each asks the store, tens of ms a request: a hub dataset has hundreds of files)."""
    if not any(is_remote(p) for p in paths):
        yield from map(fn, paths)
        return
    with ThreadPoolExecutor(max_workers=min(len(paths), pinned.READERS)) as pool:
        try:
            yield from pool.map(fn, paths)
        finally:
            pool.shutdown(cancel_futures=True)


def hashed(
    layout: ParquetLayout,
    on_group: GroupListener | None = None,
    threads: int | None = None,
    known: Sequence[RowGroup] = (),
) -> ParquetLayout | None:
    """``layout`` (from :func:`counted`) with every row group hashed on ``threads`` threads (default one
    per CPU). ``on_group`` is told each row group, in order, as soon as it and those before it are
    hashed: the plan cuts and starts slices while the rest is read. The first row group is decoded from
    its bytes before it is told (``None``: pyarrow reads it outside its recorded bytes; ``datasets`` is
    to read the dataset). Files hashed before (the same size, mtime and inode) are not read again, nor
    row groups ``known`` (hashed ahead: a sample's)."""
    key = (layout.stamps, layout.schema_b64)
    with _SCANS_LOCK:
        found = key in _SCANS
        done = _SCANS.get(key)
    if found:
        if done is not None and on_group is not None:
            for group in done.row_groups:
                on_group(group)
        return done
    done = _hashed(layout, on_group, threads or available_cpus(), {(g.path, g.index): g for g in known})
    with _SCANS_LOCK:
        _SCANS[key] = done
        while len(_SCANS) > _KEPT_SCANS:
            _SCANS.popitem(last=False)
    return done


def _hashed(
    layout: ParquetLayout,
    on_group: GroupListener | None,
    threads: int,
    known: dict[tuple[str, int], RowGroup],
) -> ParquetLayout | None:
    """``layout.stamps``: each file's path and version before the read; a file with another version after
    it (rewritten, grown, truncated, replaced by a rename) was read as no one version of it. A remote
    object's row groups are read on as many threads as a network carries, whatever the cores."""
    groups: list[RowGroup] = []
    todo = layout.row_groups
    if any(is_remote(f.path) for f in layout.footers):
        threads = max(threads, pinned.READERS)
    with ThreadPoolExecutor(max_workers=max(1, min(len(todo), threads))) as pool:
        try:
            with closed_on_error(layout.downloads):  # (and threads waiting for a file stop waiting)
                for group in pool.map(
                    lambda g: known.get((g.path, g.index)) or with_sha256(g, layout.downloads), todo
                ):
                    groups.append(group)
                    if len(groups) == 1 and not _decodes_alone(layout, groups[0]):
                        if layout.downloads is not None:
                            layout.downloads.close()  # datasets reads it, and downloads it itself
                        return None
                    if on_group is not None:
                        on_group(groups[-1])
        finally:
            pool.shutdown(cancel_futures=True)  # (a read that ends early reads no further)
    paths = [path for path, *_ in layout.stamps]
    for (path, *stamp), now in zip(layout.stamps, _each(pinned.version, paths), strict=True):
        if now != tuple(stamp):
            raise DatasetError(
                path, "the file changed while it was planned: plan it when it no longer changes"
            )
    return replace(layout, row_groups=tuple(groups))


def with_sha256(group: RowGroup, downloads: Downloads | None = None) -> RowGroup:
    """The row group with the sha256 of its bytes (one hashed ahead of the rest: a sample's), once its
    file has landed (:attr:`ParquetLayout.downloads`)."""
    if downloads is not None:
        downloads.wait(group.path)
    chunks = group.chunks if group.nbytes > streamed_bytes() else ()
    with _Ranges(group.path) as ranges:
        whole, parts, blocks = _hash_group(ranges, group, chunks)
    hashed = group.model_copy(update={"sha256": whole, "chunk_sha256": parts})
    if chunks:
        _remember_blocks(hashed, blocks)
    return hashed


def _decodes_alone(layout: ParquetLayout, first: RowGroup) -> bool:
    """Whether the row group decodes from its recorded bytes alone (it stays open: the plan's sample)."""
    try:
        _opened(layout.source([first]), first).rows([0])
    except DatasetError:
        raise
    except Exception as exc:
        logger.debug("%s: read through datasets (%s: %s)", first.path, type(exc).__name__, exc)
        return False
    return True


#: Bytes read at once from a remote file's end: its footer, length and marker in one request for most
#: files (a request costs tens of ms; a hub dataset has hundreds of files).
_FOOTER_GUESS = 64 << 10


def _read_footer(path: str, size: int) -> tuple[int, bytes, Any]:
    """Where the file's footer begins, its bytes and the metadata they hold."""
    with _Ranges(path) as ranges:
        guess = min(max(size, 0), 8 if ranges.local else _FOOTER_GUESS)
        end = ranges.read(size - guess, guess) if guess else b""
        offset = _footer_bounds(ranges, size, end[-8:] if len(end) == guess >= 8 else b"")
        if offset >= size - guess:
            footer = end[offset - (size - guess) :]
        else:
            footer = _read_at(ranges, offset, size, "its footer")
    try:
        return offset, footer, _metadata(footer)
    except Exception as exc:
        raise DatasetError(path, f"its Parquet footer cannot be read ({type(exc).__name__}: {exc})") from None


def groups_for(layout: ParquetLayout, start: int, end: int) -> list[RowGroup]:
    """The row groups that hold rows ``[start, end)``."""
    lo = max(bisect.bisect_right(layout.first_rows, start) - 1, 0)
    hi = bisect.bisect_left(layout.first_rows, end)
    return [g for g in layout.row_groups[lo:hi] if g.first_row < end and g.first_row + g.rows > start]


def slice_cuts(
    layout: ParquetLayout, selected: Any, slice_bytes: int, spill: bool = True
) -> list[tuple[int, int, list[int] | None]]:
    """(start, end, subset) per slice: whole row groups of about ``slice_bytes`` together, so each is
    decoded by one slice (one per task run: fewer, larger slices cost the orchestrator less). With
    ``spill``, a row group read batch by batch (:func:`spilled`) is cut into slices of about
    ``slice_bytes`` each (a batch's at least): the plan decodes it once for all of them
    (:mod:`sftmix.sources.parquet.spill`), so a file of a few huge row groups keeps every core busy. Any other of several
    times ``slice_bytes`` is cut into at most :data:`MAX_PIECES_PER_ROW_GROUP` slices, each decoding it
    up to its own rows."""
    import numpy as np

    cuts: list[tuple[int, int, list[int] | None]] = []

    def cut(lo: int, hi: int, pieces: int) -> None:
        if selected is None:
            rows = np.arange(lo, hi)
        else:
            rows = selected[np.searchsorted(selected, lo) : np.searchsorted(selected, hi)]
        for part in np.array_split(rows, min(pieces, len(rows))) if len(rows) else []:
            cuts.append((int(part[0]), int(part[-1]) + 1, None if selected is None else part.tolist()))

    waiting: list[RowGroup] = []
    for g in (g for g in layout.row_groups if g.rows):
        if g.nbytes > slice_bytes:
            if waiting:
                cut(waiting[0].first_row, waiting[-1].first_row + waiting[-1].rows, 1)
                waiting = []
            if spill and spilled(g):  # (a slice reads at least a batch of the spill)
                pieces = -(-g.nbytes // max(slice_bytes, stream_batch_bytes()))
            else:
                pieces = min(MAX_PIECES_PER_ROW_GROUP, g.nbytes // (MAX_PIECES_PER_ROW_GROUP * slice_bytes))
            cut(g.first_row, g.first_row + g.rows, max(1, pieces))
            continue
        if waiting and sum(w.nbytes for w in waiting) + g.nbytes > slice_bytes:
            cut(waiting[0].first_row, waiting[-1].first_row + waiting[-1].rows, 1)
            waiting = []
        waiting.append(g)
    if waiting:
        cut(waiting[0].first_row, waiting[-1].first_row + waiting[-1].rows, 1)
    return cuts


def stream_batch_bytes() -> int:
    """The data a batch of a row group read batch by batch holds (a few batches a row group at least)."""
    return max(1, min(_STREAM_BATCH_BYTES, streamed_bytes() // 4))


def spilled(group: RowGroup) -> bool:
    """Whether a row group is large enough to be read batch by batch (:data:`STREAMED_BYTES`): cut into
    several slices, the plan decodes it once for all of them."""
    return group.nbytes > streamed_bytes()


def decoded_tables(layout: ParquetLayout, group: RowGroup) -> Iterator[Any]:
    """The row group's rows, batch by batch, cast to the features, each given once every byte read to
    decode it is known to be the plan's version: a spill's."""
    footer = next(f for f in layout.footers if f.path == group.path)
    reader = _StreamedGroup(footer, layout.schema_b64, group, checked=True)
    try:
        yield from reader.tables()
    except Exception as exc:
        raise _unreadable(group, exc) from None
    finally:
        reader.close()


def _unreadable(group: RowGroup, exc: Exception) -> DatasetError:
    """A row group's read that failed, in words (our own errors as they are)."""
    if isinstance(exc, DatasetError):
        return exc
    return DatasetError(group.path, f"row group {group.index} cannot be read: {type(exc).__name__}: {exc}")


def _read_at(ranges: _Ranges, offset: int, end: int, what: str) -> bytes:
    data = ranges.read(offset, end - offset)
    if len(data) != end - offset:
        raise DatasetError(ranges.path, _changed(what))
    return data


def _opened(source: ParquetSource, group: RowGroup) -> _WholeGroup | _StreamedGroup | SpilledGroup:
    """The reader of a row group of ``source``: kept open between batches of a slice (the two last this
    thread read: a slice runs in one thread, and threads of a thread runner run their own)."""
    footer = next((f for f in source.footers if f.path == group.path), None)
    if footer is None:
        raise DatasetError(group.path, "the slice holds no footer for this file")
    spill = next((s for s in source.spilled if (s.group_path, s.index) == (group.path, group.index)), None)
    key, readers = (footer, source.schema_b64, group, spill), _open_readers()
    reader = readers.get(key)
    if reader is not None:
        readers.move_to_end(key)
        return reader

    def decoded() -> _WholeGroup | _StreamedGroup:
        return (_StreamedGroup if group.nbytes > streamed_bytes() else _WholeGroup)(
            footer, source.schema_b64, group
        )

    reader = None
    if spill is not None:
        try:
            reader = SpilledGroup(spill, schema_of(source.schema_b64), decoded)
        except FileNotFoundError:  # (removed since, or not on this machine: the file itself is read)
            logger.debug("%s: no spill of row group %d here; decoding it", group.path, group.index)
    if reader is None:
        reader = decoded()
    readers[key] = reader
    while len(readers) > _KEPT_OPEN:
        oldest = readers.popitem(last=False)[1]
        try:
            oldest.confirm()
        finally:
            oldest.close()
    return reader


def _open_readers() -> OrderedDict[tuple, _WholeGroup | _StreamedGroup | SpilledGroup]:
    readers = getattr(_OPEN, "readers", None)
    if readers is None:
        readers = _OPEN.readers = OrderedDict()
    return readers


def streamed_bytes() -> int:
    """:data:`STREAMED_BYTES`, or the environment's setting of it (a whole number of bytes)."""
    raw = settings.PARQUET_STREAMED_BYTES.get()
    if not raw:
        return STREAMED_BYTES
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(
            f"{settings.PARQUET_STREAMED_BYTES.name}={raw!r} is not a whole number of bytes"
        ) from None


def _where(group: RowGroup) -> str:
    return f"row group {group.index} (rows {group.first_row}-{group.first_row + group.rows - 1})"


def _checked_footer(ranges: _Ranges, footer: ParquetFooter) -> bytes:
    tail = _read_at(ranges, footer.offset, footer.size, "its footer")
    if hashlib.sha256(tail).hexdigest() != footer.sha256:
        raise DatasetError(footer.path, _changed("its footer"))
    return tail


class _WholeGroup:
    """A row group of ordinary size, decoded at once from bytes whose sha256 is the plan's."""

    def __init__(self, footer: ParquetFooter, schema_b64: str, group: RowGroup) -> None:
        import pyarrow.parquet as pq

        path, where = footer.path, _where(group)
        with _Ranges(path) as ranges:
            tail = _checked_footer(ranges, footer)
            data = _read_at(ranges, group.offset, group.end, where)
        if hashlib.sha256(data).hexdigest() != group.sha256:
            raise DatasetError(path, _changed(where))
        checked = _Checked(footer.size, [(footer.offset, tail), (group.offset, data)])
        table = pq.ParquetFile(checked, metadata=_metadata(tail), pre_buffer=False).read_row_group(
            group.index, use_threads=False
        )
        if table.num_rows != group.rows:
            raise DatasetError(
                path, f"{where}: the reader found {table.num_rows} rows where the plan counted {group.rows}"
            )
        self.table = _cast(table, schema_of(schema_b64))

    def rows(self, local: list[int]) -> list[dict[str, Any]]:
        return table_rows(self.table, local)

    def confirm(self) -> None:
        """Nothing to confirm: every byte was checked before it was decoded."""

    def close(self) -> None:
        """Nothing is open."""


class _ChunkCursor:
    """One column chunk ``[start, end)`` as pyarrow reads it: in order, each byte read from the file
    once and hashed as it is read, served only from what was hashed. :meth:`finish` hashes the rest and
    compares with ``sha256``, the chunk's hash in the version of the file the plan read; with the plan's
    ``blocks``, :meth:`check_read` says whether all read so far is that version."""

    def __init__(self, start: int, end: int, sha256: str, blocks: Sequence[str] = ()) -> None:
        self.start, self.end, self.sha256 = start, end, sha256
        self._hash = _ChunkHash(start, end, blocks)
        self._held_from, self._held = start, b""  # bytes from the last read's start: [held_from, frontier)

    @property
    def frontier(self) -> int:
        return self._held_from + len(self._held)

    def _extend(self, ranges: _Ranges, to: int) -> None:
        want = to - self.frontier
        new = ranges.read(self.frontier, want)
        if len(new) != want:
            raise OSError(f"the file ends before byte {self.frontier + want}")
        self._hash.feed(new)
        self._held += new

    def read(self, ranges: _Ranges, pos: int, n: int) -> bytes:
        end = pos + n
        if pos < self._held_from or end > self.end:
            raise OSError(f"bytes {pos}-{end} are read out of order in the column chunk at {self.start}")
        if end > self.frontier:
            self._extend(ranges, max(end, min(self.end, self.frontier + ranges.ahead)))
            self._held, self._held_from = self._held[pos - self._held_from :], pos  # (what lies behind goes)
        return self._held[pos - self._held_from : end - self._held_from]

    def check_read(self, ranges: _Ranges) -> bool:
        """Whether every byte read so far is the plan's version: the block being read is read to its end
        first (and served from memory after)."""
        if self.frontier > self._hash.verified and not self._hash.bad:
            self._extend(ranges, self._hash.next_boundary)
        return self._hash.verified >= self.frontier

    def finish(self, ranges: _Ranges) -> bool:
        """Whether the chunk, read to its end, is the plan's version."""
        at = self.frontier
        for block in _blocks(ranges, at, self.end):
            self._hash.feed(block)
            at += len(block)
        self._held = b""
        return at == self.end and not self._hash.bad and self._hash.hexdigest() == self.sha256


class _Streamed(_Served):
    """The file as pyarrow reads one large row group from it: the footer from checked bytes, each column
    chunk through its :class:`_ChunkCursor` (what is decoded is what is hashed)."""

    def __init__(
        self, ranges: _Ranges, size: int, footer: tuple[int, bytes], cursors: list[_ChunkCursor]
    ) -> None:
        super().__init__(size)
        self._ranges, self._footer = ranges, footer
        self.cursors = sorted(cursors, key=lambda c: c.start)
        self._starts = [c.start for c in self.cursors]

    def _serve(self, pos: int, n: int) -> bytes:
        offset, tail = self._footer
        if offset <= pos and pos + n <= offset + len(tail):
            return tail[pos - offset : pos - offset + n]
        i = bisect.bisect_right(self._starts, pos) - 1
        if i < 0 or pos >= self.cursors[i].end:
            raise OSError(f"bytes {pos}-{pos + n} are outside the row group the plan checked")
        return self.cursors[i].read(self._ranges, pos, n)


class _StreamedGroup:
    """A large row group read batch by batch (:data:`STREAMED_BYTES`), decoded as pyarrow reads its
    bytes, each column chunk hashed as it is read: :meth:`confirm` (before the slice's checkpoint is
    written) says whether what was decoded is the version the plan read (the chunks' hashes come with the
    plan's row group; without them, a first pass hashes it). ``checked``: :meth:`tables` gives each batch
    once all read for it is known to be that version (the plan's blocks of each chunk, :class:`_ChunkHash`).
    A request for rows behind the current batch starts a new pass (rows come in order within a slice)."""

    def __init__(
        self, footer: ParquetFooter, schema_b64: str, group: RowGroup, checked: bool = False
    ) -> None:
        self.footer, self.group, self._target = footer, group, schema_of(schema_b64)
        self._checked = checked
        self._ranges: _Ranges | None = None
        self._begin()

    def _begin(self) -> None:
        self._ranges = _Ranges(self.footer.path)
        try:
            self._hash_and_open()
        except BaseException:
            self.close()
            raise

    def _hash_and_open(self) -> None:
        import pyarrow.parquet as pq

        path, group = self.footer.path, self.group
        assert self._ranges is not None
        tail = _checked_footer(self._ranges, self.footer)
        meta = _metadata(tail)
        bounds = sorted(_column_bounds(meta.row_group(group.index)))
        hashes, blocks = group.chunk_sha256, _known_blocks(group) if self._checked else None
        hashed = len(hashes) == len(bounds) and list(group.chunks) == bounds
        if not hashed or (self._checked and (blocks is None or len(blocks) != len(bounds))):
            try:
                whole, hashes, blocks = _hash_group(self._ranges, group, bounds)
            except DatasetError:
                raise DatasetError(path, _changed(_where(group))) from None
            if whole != group.sha256:
                raise DatasetError(path, _changed(_where(group)))
        expected = blocks if self._checked and blocks is not None else [()] * len(bounds)
        cursors = [_ChunkCursor(s, e, h, b) for (s, e), h, b in zip(bounds, hashes, expected, strict=True)]
        self._file = _Streamed(self._ranges, self.footer.size, (self.footer.offset, tail), cursors)
        batch_rows = max(1, group.rows * stream_batch_bytes() // max(group.nbytes, 1))
        self._batches = pq.ParquetFile(
            self._file, metadata=meta, pre_buffer=False, buffer_size=_STREAM_BUFFER
        ).iter_batches(batch_size=batch_rows, row_groups=[group.index], use_threads=False)
        self._table: Any = None
        self._start = 0  # the group's row at the current batch's start

    def _next_batch(self) -> None:
        import pyarrow as pa

        start = self._start + (0 if self._table is None else self._table.num_rows)
        try:
            batch = next(self._batches)
        except StopIteration:
            raise DatasetError(
                self.footer.path,
                f"{_where(self.group)}: the reader found {start} rows where the plan counted {self.group.rows}",
            ) from None
        except Exception:
            self.confirm()  # a file that changed under the reader is said so, not as what pyarrow met
            raise
        self._table, self._start = _cast(pa.Table.from_batches([batch]), self._target), start

    def rows(self, local: list[int]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        i = 0
        while i < len(local):
            if self._ranges is None or (self._table is not None and local[i] < self._start):
                self.confirm()  # (rows behind the current batch, or after a confirm: a new pass)
                self._begin()
            while self._table is None or local[i] >= self._start + self._table.num_rows:
                self._next_batch()
            end, j = self._start + self._table.num_rows, i
            while j < len(local) and self._start <= local[j] < end:
                j += 1
            out += table_rows(self._table, [r - self._start for r in local[i:j]])
            i = j
        return out

    def tables(self) -> Iterator[Any]:
        """Every batch of the row group, in order, each given once all read to decode it is known to be
        the plan's version (``checked``), the last once all the row group is."""
        while self._start + (0 if self._table is None else self._table.num_rows) < self.group.rows:
            self._next_batch()
            if self._start + self._table.num_rows >= self.group.rows:
                self.confirm()
            elif self._checked and not all(c.check_read(self._ranges) for c in self._file.cursors):  # type: ignore[arg-type]  # open: only the last batch's confirm() unsets it
                self.close()
                raise DatasetError(self.footer.path, _changed(_where(self.group)))
            yield self._table
        self.confirm()

    def confirm(self) -> None:
        """Raise if what was decoded is not the version the plan read; the file is closed after."""
        ranges, self._ranges = self._ranges, None
        if ranges is None:
            return
        with ranges:
            same = all(c.finish(ranges) for c in self._file.cursors)
        if not same:
            raise DatasetError(self.footer.path, _changed(_where(self.group)))

    def close(self) -> None:
        if self._ranges is not None:
            self._ranges.close()
            self._ranges = None


_OPEN = threading.local()  # .readers: this thread's open row groups, the last read last
_KEPT_OPEN = 2


def _cast(table: Any, target: Any) -> Any:
    """``table`` cast to the features, as the builder casts every row group (``datasets.table.table_cast``)."""
    if table.schema.equals(target, check_metadata=False):
        return table.replace_schema_metadata(target.metadata)
    from datasets.table import table_cast

    return table_cast(table, target)


def read_rows(source: ParquetSource, rows: list[int]) -> list[dict[str, Any]]:
    """Rows by index (in the order given) from the row groups of ``source``."""
    out: list[dict[str, Any]] = []
    for group, local in runs_in_parts(rows, source.row_groups):
        if group is None:
            raise DatasetError(
                source.row_groups[0].path, f"row {local[0]} is in none of the slice's row groups"
            )
        try:
            out += _opened(source, group).rows(local)
        except Exception as exc:
            raise _unreadable(group, exc) from None
    return out


def confirm() -> None:
    """Raise if any row group read batch by batch since the last :func:`release` was decoded from bytes
    other than the plan's (the file changed while the slice read it): a slice calls it before its
    checkpoint is written."""
    for reader in list(_open_readers().values()):
        reader.confirm()


def release() -> None:
    """Forget this thread's open row groups (a worker between slices)."""
    readers = _open_readers()
    for reader in readers.values():
        reader.close()
    readers.clear()
