"""A Parquet file's bytes served by range to pyarrow: a footer found and parsed, a row group's column chunks read
and hashed in blocks, so that what pyarrow decodes is only bytes checked against the plan's."""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

from sftmix.errors import DatasetError
from sftmix.runtime.storage import is_remote
from sftmix.sources import pinned
from sftmix.sources.parquet.row_groups import MAGIC, ParquetFooter, RowGroup, changed_reason

_READ_BLOCK = 4 << 20


class Served(io.RawIOBase):
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


class Checked(Served):
    """The file as the given pieces (offset, bytes) of it: pyarrow decodes from what was checked."""

    def __init__(self, size: int, pieces: list[tuple[int, bytes]]) -> None:
        super().__init__(size)
        self._pieces = sorted(pieces, key=lambda p: p[0])

    def _serve(self, pos: int, n: int) -> bytes:
        for offset, data in self._pieces:
            if offset <= pos and pos + n <= offset + len(data):
                return data[pos - offset : pos - offset + n]
        raise OSError(f"bytes {pos}-{pos + n} are outside the row groups the plan checked")


class Ranges:
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
                raise DatasetError(path, changed_reason("the file, now missing,")) from None
        self.local = self._fd is not None
        # a request to a store costs tens of ms: fewer, larger ones, and a column chunk read ahead
        self.block = _READ_BLOCK if self._fd is not None else pinned.RANGE_BYTES
        self.ahead = 0 if self._fd is not None else pinned.RANGE_BYTES

    def read(self, offset: int, n: int) -> bytes:
        """Bytes ``[offset, offset + n)``; fewer where the file ends first (the caller counts them)."""
        if self._fd is not None:
            return os.pread(self._fd, n, offset)
        return pinned.read_remote(
            self.path, offset, offset + n, changed_reason(f"bytes {offset}-{offset + n}")
        )

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> Ranges:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _footer_bounds(ranges: Ranges, size: int, tail: bytes) -> int:
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


def footer_metadata(footer: bytes) -> Any:
    """The file's metadata from its footer's bytes alone."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pq.read_metadata(pa.BufferReader(MAGIC + footer))


def column_bounds(group: Any) -> list[tuple[int, int]]:
    """``[offset, end)`` of each of a row group's column chunks, from its footer record."""
    bounds = []
    for j in range(group.num_columns):
        col = group.column(j)
        start = col.data_page_offset
        if col.has_dictionary_page and col.dictionary_page_offset:
            start = min(start, col.dictionary_page_offset)
        bounds.append((start, start + col.total_compressed_size))
    return bounds


def chunk_bounds(group: Any) -> tuple[int, int]:
    """``[offset, end)`` of a row group's column chunks, from its footer record."""
    bounds = column_bounds(group)
    return min(s for s, _ in bounds), max(e for _, e in bounds)


def record_sha256(record: Any, offset: int) -> str:
    """sha256 of a row group's footer record with its positions taken from its own start: what decodes
    its bytes, the same wherever in the file it lies (an edit before it moves it, not its rows)."""
    found = record.to_dict()
    for col in found["columns"]:
        for key in [k for k in col if k.endswith("_offset")]:
            col[key] = None if col[key] is None else col[key] - offset
    return hashlib.sha256(json.dumps(found, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def blocks_of(ranges: Ranges, start: int, end: int) -> Iterator[bytes]:
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


class ChunkHash:
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


def hash_group(
    ranges: Ranges, group: RowGroup, chunks: Sequence[tuple[int, int]]
) -> tuple[str, tuple[str, ...], tuple[tuple[str, ...], ...]]:
    """sha256 of the row group's bytes, and the hash of each of its column chunks ``chunks`` with their
    blocks' (:class:`ChunkHash`), in one pass."""
    whole, parts = hashlib.sha256(), [ChunkHash(start, end) for start, end in chunks]
    at = group.offset
    for block in blocks_of(ranges, group.offset, group.end):
        whole.update(block)
        for h in parts:
            lo, hi = max(h.start, at), min(h.end, at + len(block))
            if lo < hi:
                h.feed(block[lo - at : hi - at])
        at += len(block)
    if at != group.end:
        raise DatasetError(ranges.path, changed_reason(f"bytes {group.offset}-{group.end}"))
    return whole.hexdigest(), tuple(h.hexdigest() for h in parts), tuple(tuple(h.blocks) for h in parts)


#: Each large row group's column chunks' block hashes, as the plan hashed them (what a spill checks its
#: decode against as it goes; kept out of the row group, which every slice carries).
_BLOCKS: OrderedDict[tuple[str, int, str], tuple[tuple[str, ...], ...]] = OrderedDict()


_BLOCKS_LOCK = threading.Lock()


_KEPT_BLOCKS = 256


def known_blocks(group: RowGroup) -> tuple[tuple[str, ...], ...] | None:
    with _BLOCKS_LOCK:
        return _BLOCKS.get((group.path, group.offset, group.sha256))


def remember_blocks(group: RowGroup, blocks: tuple[tuple[str, ...], ...]) -> None:
    with _BLOCKS_LOCK:
        _BLOCKS[(group.path, group.offset, group.sha256)] = blocks
        while len(_BLOCKS) > _KEPT_BLOCKS:
            _BLOCKS.popitem(last=False)


#: Bytes read at once from a remote file's end: its footer, length and marker in one request for most
#: files (a request costs tens of ms; a hub dataset has hundreds of files).
_FOOTER_GUESS = 64 << 10


def read_footer(path: str, size: int) -> tuple[int, bytes, Any]:
    """Where the file's footer begins, its bytes and the metadata they hold."""
    with Ranges(path) as ranges:
        guess = min(max(size, 0), 8 if ranges.local else _FOOTER_GUESS)
        end = ranges.read(size - guess, guess) if guess else b""
        offset = _footer_bounds(ranges, size, end[-8:] if len(end) == guess >= 8 else b"")
        if offset >= size - guess:
            footer = end[offset - (size - guess) :]
        else:
            footer = read_at(ranges, offset, size, "its footer")
    try:
        return offset, footer, footer_metadata(footer)
    except Exception as exc:
        raise DatasetError(path, f"its Parquet footer cannot be read ({type(exc).__name__}: {exc})") from None


def read_at(ranges: Ranges, offset: int, end: int, what: str) -> bytes:
    data = ranges.read(offset, end - offset)
    if len(data) != end - offset:
        raise DatasetError(ranges.path, changed_reason(what))
    return data


def group_place(group: RowGroup) -> str:
    return f"row group {group.index} (rows {group.first_row}-{group.first_row + group.rows - 1})"


def checked_footer(ranges: Ranges, footer: ParquetFooter) -> bytes:
    tail = read_at(ranges, footer.offset, footer.size, "its footer")
    if hashlib.sha256(tail).hexdigest() != footer.sha256:
        raise DatasetError(footer.path, changed_reason("its footer"))
    return tail
