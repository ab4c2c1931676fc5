"""A slice's rows decoded from its row groups' checked bytes and cast as the builder casts them: a row group
read whole, or a large one batch by batch as it is read, each column chunk hashed as pyarrow reads it."""

from __future__ import annotations

import bisect
import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

from sftmix.errors import DatasetError
from sftmix.sources.features import schema_of
from sftmix.sources.parquet import ranges as byte_ranges
from sftmix.sources.parquet.ranges import (
    Checked,
    ChunkHash,
    Ranges,
    Served,
    blocks_of,
    checked_footer,
    column_bounds,
    footer_metadata,
    group_place,
    known_blocks,
    read_at,
)
from sftmix.sources.parquet.row_groups import (
    ParquetFooter,
    ParquetLayout,
    ParquetSource,
    RowGroup,
    changed_reason,
    stream_batch_bytes,
    streamed_bytes,
)
from sftmix.sources.parquet.spill import SpilledGroup
from sftmix.sources.tables import runs_in_parts, table_rows

logger = logging.getLogger(__name__)


_STREAM_BUFFER = 1 << 20  # what pyarrow reads of a column chunk at a time


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


def opened_group(source: ParquetSource, group: RowGroup) -> _WholeGroup | _StreamedGroup | SpilledGroup:
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


class _WholeGroup:
    """A row group of ordinary size, decoded at once from bytes whose sha256 is the plan's."""

    def __init__(self, footer: ParquetFooter, schema_b64: str, group: RowGroup) -> None:
        import pyarrow.parquet as pq

        path, where = footer.path, group_place(group)
        with Ranges(path) as ranges:
            tail = checked_footer(ranges, footer)
            data = read_at(ranges, group.offset, group.end, where)
        if hashlib.sha256(data).hexdigest() != group.sha256:
            raise DatasetError(path, changed_reason(where))
        checked = Checked(footer.size, [(footer.offset, tail), (group.offset, data)])
        table = pq.ParquetFile(checked, metadata=footer_metadata(tail), pre_buffer=False).read_row_group(
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
        self._hash = ChunkHash(start, end, blocks)
        self._held_from, self._held = start, b""  # bytes from the last read's start: [held_from, frontier)

    @property
    def frontier(self) -> int:
        return self._held_from + len(self._held)

    def _extend(self, ranges: Ranges, to: int) -> None:
        want = to - self.frontier
        new = ranges.read(self.frontier, want)
        if len(new) != want:
            raise OSError(f"the file ends before byte {self.frontier + want}")
        self._hash.feed(new)
        self._held += new

    def read(self, ranges: Ranges, pos: int, n: int) -> bytes:
        end = pos + n
        if pos < self._held_from or end > self.end:
            raise OSError(f"bytes {pos}-{end} are read out of order in the column chunk at {self.start}")
        if end > self.frontier:
            self._extend(ranges, max(end, min(self.end, self.frontier + ranges.ahead)))
            self._held, self._held_from = self._held[pos - self._held_from :], pos  # (what lies behind goes)
        return self._held[pos - self._held_from : end - self._held_from]

    def check_read(self, ranges: Ranges) -> bool:
        """Whether every byte read so far is the plan's version: the block being read is read to its end
        first (and served from memory after)."""
        if self.frontier > self._hash.verified and not self._hash.bad:
            self._extend(ranges, self._hash.next_boundary)
        return self._hash.verified >= self.frontier

    def finish(self, ranges: Ranges) -> bool:
        """Whether the chunk, read to its end, is the plan's version."""
        at = self.frontier
        for block in blocks_of(ranges, at, self.end):
            self._hash.feed(block)
            at += len(block)
        self._held = b""
        return at == self.end and not self._hash.bad and self._hash.hexdigest() == self.sha256


class _Streamed(Served):
    """The file as pyarrow reads one large row group from it: the footer from checked bytes, each column
    chunk through its :class:`_ChunkCursor` (what is decoded is what is hashed)."""

    def __init__(
        self, ranges: Ranges, size: int, footer: tuple[int, bytes], cursors: list[_ChunkCursor]
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
    once all read for it is known to be that version (the plan's blocks of each chunk, :class:`ChunkHash`).
    A request for rows behind the current batch starts a new pass (rows come in order within a slice)."""

    def __init__(
        self, footer: ParquetFooter, schema_b64: str, group: RowGroup, checked: bool = False
    ) -> None:
        self.footer, self.group, self._target = footer, group, schema_of(schema_b64)
        self._checked = checked
        self._ranges: Ranges | None = None
        self._begin()

    def _begin(self) -> None:
        self._ranges = Ranges(self.footer.path)
        try:
            self._hash_and_open()
        except BaseException:
            self.close()
            raise

    def _hash_and_open(self) -> None:
        import pyarrow.parquet as pq

        path, group = self.footer.path, self.group
        assert self._ranges is not None
        tail = checked_footer(self._ranges, self.footer)
        meta = footer_metadata(tail)
        bounds = sorted(column_bounds(meta.row_group(group.index)))
        hashes, blocks = group.chunk_sha256, known_blocks(group) if self._checked else None
        hashed = len(hashes) == len(bounds) and list(group.chunks) == bounds
        if not hashed or (self._checked and (blocks is None or len(blocks) != len(bounds))):
            try:
                # (by its module: a test counts the passes)
                whole, hashes, blocks = byte_ranges.hash_group(self._ranges, group, bounds)
            except DatasetError:
                raise DatasetError(path, changed_reason(group_place(group))) from None
            if whole != group.sha256:
                raise DatasetError(path, changed_reason(group_place(group)))
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
                f"{group_place(self.group)}: the reader found {start} rows where the plan counted {self.group.rows}",
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
                raise DatasetError(self.footer.path, changed_reason(group_place(self.group)))
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
            raise DatasetError(self.footer.path, changed_reason(group_place(self.group)))

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
            out += opened_group(source, group).rows(local)
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
