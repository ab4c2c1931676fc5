"""Parquet read by row group, as ``datasets``' Parquet builder reads it, without converting the whole
dataset to Arrow on one core before the first slice can start: a local ``.parquet`` file, or the files
of a hub dataset's split (most hub datasets are Parquet; :func:`sftmix.sources.parquet_data_files`
fetches them into the cache ``datasets`` downloads to), or of a local directory laid out like one.

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
  casts them as the builder does.

So rows are the Python objects ``datasets`` gives (``tests/test_parquet.py`` compares them for several
writers, a hub layout of several files and features a card declares), and a slice's key follows from
the bytes of the row groups it reads. Anything else (a sliced split, features that decode such as an
Image, files of different schemas, row groups pyarrow reads outside their recorded bytes) goes through
``datasets`` as before (:mod:`sftmix.sources`).
"""

from __future__ import annotations

import base64
import bisect
import hashlib
import io
import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from typing import Any

from pydantic import BaseModel, ConfigDict

from . import settings
from .errors import DatasetError
from .features import decodes, features_schema
from .parallel import available_cpus
from .sources import local_builder, runs_in_parts, table_rows
from .storage import is_remote

logger = logging.getLogger(__name__)

FINGERPRINT_PREFIX = "parquet-row-groups:"
MAGIC = b"PAR1"
#: A row group is cut into at most this many slices (each decodes all of it), and only when each piece
#: still holds this many slices' worth of rows: decoding is a few percent of tokenizing the same rows.
MAX_PIECES_PER_ROW_GROUP = 4
_READ_BLOCK = 4 << 20


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


class ParquetSource(BaseModel):
    """What a slice needs to read its rows: the footers of its files, the features as an Arrow schema,
    and the row groups that hold its rows."""

    footers: list[ParquetFooter]
    schema_b64: str
    row_groups: list[RowGroup]


@dataclass(frozen=True)
class ParquetLayout:
    """A dataset's files, row groups (in the order the builder reads them) and features, as the plan
    finds them."""

    footers: tuple[ParquetFooter, ...]
    file_schema_sha256: str  # the files' own Arrow schema: with a row group's bytes, what decodes them
    schema_b64: str  # the features' Arrow schema (with datasets' metadata), serialized
    row_groups: tuple[RowGroup, ...]
    stamps: tuple[tuple[str, int, int, int], ...] = ()  # each file's path, size, mtime and inode, as counted

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
        return tuple(_schema(self.schema_b64).names)

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

    def source(self, groups: list[RowGroup]) -> ParquetSource:
        paths = {g.path for g in groups}
        return ParquetSource(
            footers=[f for f in self.footers if f.path in paths],
            schema_b64=self.schema_b64,
            row_groups=groups,
        )


def disabled() -> bool:
    """``TOKENIZE_MIXER_PARQUET_READER=datasets``: every Parquet file goes through ``datasets``."""
    return settings.PARQUET_READER.get() == "datasets"


def applies(path: str, split: str) -> bool:
    """Whether ``path`` is a file this module reads: a local Parquet file of the whole 'train' split."""
    if disabled():
        return False
    if is_remote(path) or local_builder(path) != "parquet" or split.strip() != "train":
        return False
    return os.path.isfile(path) and os.path.getsize(path) > 2 * len(MAGIC)


def _changed(what: str) -> str:
    return (
        f"the file changed since the run was planned ({what} is not what the plan read): "
        "rerun when it no longer changes; finished slices are kept"
    )


class _Checked(io.RawIOBase):
    """A read-only file of ``size`` bytes that holds only the given pieces (offset, bytes): pyarrow
    decodes from what was checked, and a read of anything else fails instead of reaching the disk."""

    def __init__(self, size: int, pieces: list[tuple[int, bytes]]) -> None:
        super().__init__()
        self._size, self._pieces, self._pos = size, sorted(pieces, key=lambda p: p[0]), 0

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
        for offset, data in self._pieces:
            if offset <= self._pos and self._pos + n <= offset + len(data):
                out = data[self._pos - offset : self._pos - offset + n]
                self._pos += n
                return out
        raise OSError(f"bytes {self._pos}-{self._pos + n} are outside the row groups the plan checked")

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


def _footer_bounds(fh: Any, size: int) -> int:
    """Where the footer (its metadata, length and marker) begins; a file without the markers is refused."""
    fh.seek(0)
    head = fh.read(len(MAGIC))
    fh.seek(size - 8)
    tail = fh.read(8)
    if head != MAGIC or tail[4:] != MAGIC:
        raise DatasetError(
            fh.name,
            "not a whole Parquet file (it does not begin and end with the marker PAR1): "
            "a file still being written, cut short, or not Parquet",
        )
    length = int.from_bytes(tail[:4], "little")
    if length <= 0 or length > size - 12:
        raise DatasetError(fh.name, f"not a whole Parquet file (its footer claims {length} bytes)")
    return size - 8 - length


def _metadata(footer: bytes) -> Any:
    """The file's metadata from its footer's bytes alone."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pq.read_metadata(pa.BufferReader(MAGIC + footer))


def _chunk_bounds(group: Any) -> tuple[int, int]:
    """``[offset, end)`` of a row group's column chunks, from its footer record."""
    starts, ends = [], []
    for j in range(group.num_columns):
        col = group.column(j)
        start = col.data_page_offset
        if col.has_dictionary_page and col.dictionary_page_offset:
            start = min(start, col.dictionary_page_offset)
        starts.append(start)
        ends.append(start + col.total_compressed_size)
    return min(starts), max(ends)


def _record_sha256(record: Any, offset: int) -> str:
    """sha256 of a row group's footer record with its positions taken from its own start: what decodes
    its bytes, the same wherever in the file it lies (an edit before it moves it, not its rows)."""
    found = record.to_dict()
    for col in found["columns"]:
        for key in [k for k in col if k.endswith("_offset")]:
            col[key] = None if col[key] is None else col[key] - offset
    return hashlib.sha256(json.dumps(found, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def _sha256_range(path: str, offset: int, end: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        fh.seek(offset)
        left = end - offset
        while left > 0:
            block = fh.read(min(_READ_BLOCK, left))
            if not block:
                raise DatasetError(path, _changed(f"bytes {offset}-{end}"))
            h.update(block)
            left -= len(block)
    return h.hexdigest()


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
    for path in paths:
        try:
            st = os.stat(path)
            offset, footer, meta = _read_footer(path, st.st_size)
        except OSError as exc:
            raise DatasetError(path, f"cannot be read: {type(exc).__name__}: {exc}") from None
        stamps.append((path, st.st_size, st.st_mtime_ns, st.st_ino))
        footers.append(
            ParquetFooter(
                path=path, size=st.st_size, offset=offset, sha256=hashlib.sha256(footer).hexdigest()
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
        schema_b64=base64.b64encode(schema.serialize().to_pybytes()).decode("ascii"),
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
            )
            for p, i, o, e, r, n, b, record in bounds
        ),
        stamps=tuple(stamps),
    )


def hashed(
    layout: ParquetLayout, on_group: GroupListener | None = None, threads: int | None = None
) -> ParquetLayout | None:
    """``layout`` (from :func:`counted`) with every row group hashed on ``threads`` threads (default one
    per CPU). ``on_group`` is told each row group, in order, as soon as it and those before it are
    hashed: the plan cuts and starts slices while the rest is read. The first row group is decoded from
    its bytes before it is told (``None``: pyarrow reads it outside its recorded bytes; ``datasets`` is
    to read the dataset). Files hashed before (the same size, mtime and inode) are not read again."""
    key = (layout.stamps, layout.schema_b64)
    with _SCANS_LOCK:
        found = key in _SCANS
        done = _SCANS.get(key)
    if found:
        if done is not None and on_group is not None:
            for group in done.row_groups:
                on_group(group)
        return done
    done = _hashed(layout, on_group, threads or available_cpus())
    with _SCANS_LOCK:
        _SCANS[key] = done
        while len(_SCANS) > _KEPT_SCANS:
            _SCANS.popitem(last=False)
    return done


def _hashed(layout: ParquetLayout, on_group: GroupListener | None, threads: int) -> ParquetLayout | None:
    """``layout.stamps``: each file's (path, size, mtime, inode) before the read; a file that has another
    after it (rewritten, grown, truncated, replaced by a rename) was read as no one version of it."""
    groups: list[RowGroup] = []
    todo = layout.row_groups
    with ThreadPoolExecutor(max_workers=max(1, min(len(todo), threads))) as pool:
        try:
            for group, sha in zip(
                todo, pool.map(lambda g: _sha256_range(g.path, g.offset, g.end), todo), strict=True
            ):
                groups.append(group.model_copy(update={"sha256": sha}))
                if len(groups) == 1 and not _decodes_alone(layout, groups[0]):
                    return None
                if on_group is not None:
                    on_group(groups[-1])
        finally:
            pool.shutdown(cancel_futures=True)  # (a read that ends early reads no further)
    for path, *stamp in layout.stamps:
        st = os.stat(path)
        if (st.st_size, st.st_mtime_ns, st.st_ino) != tuple(stamp):
            raise DatasetError(
                path, "the file changed while it was planned: plan it when it no longer changes"
            )
    return replace(layout, row_groups=tuple(groups))


def with_sha256(group: RowGroup) -> RowGroup:
    """The row group with the sha256 of its bytes (one hashed ahead of the rest: a sample's)."""
    return group.model_copy(update={"sha256": _sha256_range(group.path, group.offset, group.end)})


def _decodes_alone(layout: ParquetLayout, first: RowGroup) -> bool:
    """Whether the row group decodes from its recorded bytes alone (it stays cached: the plan's sample)."""
    try:
        _row_group_table(layout.source([first]), first)
    except DatasetError:
        raise
    except Exception as exc:
        logger.debug("%s: read through datasets (%s: %s)", first.path, type(exc).__name__, exc)
        return False
    return True


def _read_footer(path: str, size: int) -> tuple[int, bytes, Any]:
    """Where the file's footer begins, its bytes and the metadata they hold."""
    with open(path, "rb") as fh:
        offset = _footer_bounds(fh, size)
        fh.seek(offset)
        footer = fh.read(size - offset)
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
    layout: ParquetLayout, selected: Any, slice_bytes: int
) -> list[tuple[int, int, list[int] | None]]:
    """(start, end, subset) per slice: whole row groups of about ``slice_bytes`` together, so each is
    decoded by one slice (one per task run: fewer, larger slices cost the orchestrator less); a row
    group of several times ``slice_bytes`` is cut into at most :data:`MAX_PIECES_PER_ROW_GROUP` slices,
    each decoding it whole, so a file of a few large row groups still keeps several cores busy."""
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
            pieces = g.nbytes // (MAX_PIECES_PER_ROW_GROUP * slice_bytes)
            cut(g.first_row, g.first_row + g.rows, max(1, min(MAX_PIECES_PER_ROW_GROUP, pieces)))
            continue
        if waiting and sum(w.nbytes for w in waiting) + g.nbytes > slice_bytes:
            cut(waiting[0].first_row, waiting[-1].first_row + waiting[-1].rows, 1)
            waiting = []
        waiting.append(g)
    if waiting:
        cut(waiting[0].first_row, waiting[-1].first_row + waiting[-1].rows, 1)
    return cuts


@lru_cache(maxsize=8)
def _schema(schema_b64: str) -> Any:
    import pyarrow as pa

    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(schema_b64)))


def _read_at(fh: Any, offset: int, end: int, path: str, what: str) -> bytes:
    fh.seek(offset)
    data = fh.read(end - offset)
    if len(data) != end - offset:
        raise DatasetError(path, _changed(what))
    return data


def _row_group_table(source: ParquetSource, group: RowGroup) -> Any:
    """A row group's rows as the builder gives them, decoded from bytes whose sha256 is the plan's."""
    footer = next((f for f in source.footers if f.path == group.path), None)
    if footer is None:
        raise DatasetError(group.path, "the slice holds no footer for this file")
    return _decoded(footer, source.schema_b64, group)


@lru_cache(maxsize=2)
def _decoded(footer: ParquetFooter, schema_b64: str, group: RowGroup) -> Any:
    import pyarrow.parquet as pq

    path = footer.path
    where = f"row group {group.index} (rows {group.first_row}-{group.first_row + group.rows - 1})"
    try:
        with open(path, "rb") as fh:
            tail = _read_at(fh, footer.offset, footer.size, path, "its footer")
            data = _read_at(fh, group.offset, group.end, path, where)
    except FileNotFoundError:
        raise DatasetError(path, _changed("the file, now missing,")) from None
    if hashlib.sha256(tail).hexdigest() != footer.sha256:
        raise DatasetError(path, _changed("its footer"))
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
    return _cast(table, _schema(schema_b64))


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
            table = _row_group_table(source, group)
        except DatasetError:
            raise
        except Exception as exc:
            raise DatasetError(
                group.path, f"row group {group.index} cannot be read: {type(exc).__name__}: {exc}"
            ) from None
        out += table_rows(table, local)
    return out


def release() -> None:
    """Forget the decoded row groups (a worker between slices)."""
    _decoded.cache_clear()
