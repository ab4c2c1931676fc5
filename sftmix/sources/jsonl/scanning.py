"""The plan's scan of JSON Lines files: each batch's bounds found, hashed, counted and checked on many threads
(a ``gs://`` object read by range as it arrives, a copy read as it is written), told in order to a listener so a
large file's slices begin while it is read, and the first batch's features fixing those of all."""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, NamedTuple, TypeVar, cast

from sftmix.errors import DatasetError
from sftmix.runtime.ahead import ahead
from sftmix.runtime.parallel import available_cpus
from sftmix.runtime.storage import is_remote
from sftmix.sources import pinned
from sftmix.sources.features import features_schema, schema_text
from sftmix.sources.growing import GrowingFile, final_name
from sftmix.sources.hashing import valid_utf8
from sftmix.sources.jsonl import batches
from sftmix.sources.jsonl.batches import (
    CHANGED_WHILE_PLANNED,
    BadLine,
    BatchListener,
    JsonlBatch,
    JsonlLayout,
    applies,
    batch_bounds,
    lines_first,
    read_range,
    rows_in,
)
from sftmix.sources.jsonl.rows import read_batch

#: A ``gs://`` object is read in ranges of this many bytes, by this many threads ahead of the plan's scan.
REMOTE_CHUNK = pinned.RANGE_BYTES


REMOTE_READERS = pinned.READERS


def _scan_batch(path: str, offset: int, end: int, growing: str = "") -> tuple[str, int, int, bool, bool]:
    """sha256, rows (lines that are not blank) and newlines of one batch, whether some line does not
    look like one object, and whether its bytes are valid UTF-8."""
    return _scanned(read_range(path, offset, end, growing), offset)


def _scanned(data: bytes, offset: int) -> tuple[str, int, int, bool, bool]:
    rows, newlines, odd = rows_in(data.removeprefix(codecs.BOM_UTF8) if offset == 0 else data)
    return hashlib.sha256(data).hexdigest(), rows, newlines, odd, valid_utf8(data)


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
    data = read_range(path, 0, end)
    found = _counted(path, _Place(0, 0, end), _scanned(data, 0), data)
    if found is None or found[2] is None:
        return None
    return found[0], found[2]


def _first_batch_end(path: str, size: int) -> int:
    if size <= batches.BATCH_BYTES:
        return size
    at, window = batches.BATCH_BYTES, min(1 << 16, REMOTE_CHUNK)  # the rest of the line, as readline reads it
    while at < size:
        data = read_range(path, at, min(size, at + window))
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
        data = read_range(path, offset, end, growing) if data is None else data
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
        raise DatasetError(path, CHANGED_WHILE_PLANNED)
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
        lines = first is not None and lines_first(read_range(file.final, 0, min(first[1], 4), file.temp))
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
        raise DatasetError(file.final, CHANGED_WHILE_PLANNED)
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
    data = read_range(file.final, offset, end, file.temp)
    if not lines_first(data):
        return None
    found = _counted(file.final, _Place(0, offset, end), _scanned(data, offset), data)
    if found is None or found[2] is None:
        return None
    return found[0].model_copy(update={"growing": file.temp}), found[2]


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
            look = start + batches.BATCH_BYTES  # then the rest of the line, as readline reads it
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
    chunks = pinned.fetched(
        lambda offset, end: read_range(path, offset, end), size, REMOTE_CHUNK, REMOTE_READERS
    )
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
        look = batches.BATCH_BYTES  # then the rest of the line, as readline reads it
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
