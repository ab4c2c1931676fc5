"""A large Parquet row group decoded once for all its slices. pyarrow decodes a row group from its start,
so each slice of one decoded it up to its own rows: P slices cost ~(P+1)/2 decodes, and the plan cut a
row group into at most 4, which left a file of one huge row group (pandas and pyarrow write up to 1Mi
rows a group: gigabytes of chats) on 4 cores of 64. The plan now decodes such a group once into a spill
(Arrow IPC batches, LZ4-compressed, in the datasets cache: about the Parquet file's size), each batch
hashed as it is written, and cuts the group into as many slices as its size makes; each slice is handed
on as soon as the batches that hold its rows are written, and reads just those, checking their hashes.

A batch is written only once every byte pyarrow read to decode it is known to be the version the plan
hashed (the plan hashes each column chunk in blocks; :meth:`sftmix.sources.parquet.decoding._StreamedGroup.tables`), so
no slice holds rows of another version, and none waits for the rest. The spill is renamed into place once
all of it is written; a later plan reuses it with its index (no decode). A slice that finds no spill
(removed, or on another machine), or a batch of it damaged, reads the row group from the Parquet file
itself.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from sftmix.errors import DatasetError
from sftmix.runtime.ahead import ahead
from sftmix.runtime.ownership import remove_abandoned_temps
from sftmix.runtime.parallel import available_cpus
from sftmix.runtime.storage import atomic_open, write_cache_file
from sftmix.sources.growing import open_landing
from sftmix.sources.tables import runs_in_parts, table_rows

logger = logging.getLogger(__name__)

#: Changes when the spill's layout does, so an older spill is not read as this one.
SPILL_FORMAT = 1
_COMPRESSION = "lz4"  # ~2x smaller than the decoded data, and faster to write and read than none here


class SpillBatch(BaseModel):
    """One batch of a spill: the row group's rows ``[first_row, first_row + rows)``, bytes ``[offset, end)``
    of the spill (the first batch's with the stream's schema before it)."""

    model_config = ConfigDict(frozen=True)

    first_row: int
    rows: int
    offset: int
    end: int
    sha256: str


class SpilledRows(BaseModel):
    """What a slice reads of a spill: its file (``temp`` while it is written), and the batches that hold
    the slice's rows of row group ``index`` of Parquet file ``group_path``."""

    model_config = ConfigDict(frozen=True)

    group_path: str
    index: int
    path: str
    temp: str = ""
    batches: tuple[SpillBatch, ...]


def spill_path(cache_dir: str, key: str) -> Path:
    """Where the spill of the row group whose content key is ``key`` lies (its index beside it)."""
    tag = hashlib.sha256(f"{SPILL_FORMAT}|{key}".encode()).hexdigest()[:32]
    return Path(cache_dir, "spilled", tag[:2], f"{tag}.arrows")


def _index_path(path: Path) -> Path:
    return path.with_suffix(".json")


class Spill:
    """A row group being spilled (or spilled before): its batches as they are written, and how its writing
    ended. Made by :func:`spill_group`; the plan asks :meth:`rows` for each slice, in order."""

    def __init__(self, group_path: str, index: int, path: Path, rows: int) -> None:
        self.group_path, self.index, self.path, self.total_rows = group_path, index, path, rows
        self._changed = threading.Condition()
        self._batches: list[SpillBatch] = []
        self._temp = ""
        self._ended = False
        self._error: BaseException | None = None

    def _landed(self) -> bool:
        """Whether it lies here whole from an earlier plan (its index read)."""
        try:
            index = json.loads(_index_path(self.path).read_text())
            batches = [SpillBatch.model_validate(b) for b in index["batches"]]
            landed = (
                self.path.stat().st_size == index["size"] and sum(b.rows for b in batches) == self.total_rows
            )
        except (OSError, ValueError, KeyError, TypeError):
            landed = False
        if not landed:
            return False
        with self._changed:  # (another thread may be waiting for it already)
            self._batches, self._ended = batches, True
            self._changed.notify_all()
        return True

    def _write(self, tables: Callable[[], Iterator[Any]]) -> None:
        try:
            self.path.unlink(missing_ok=True)  # (ours, without its index: a reader must not open it)
            remove_abandoned_temps(self.path.parent)  # a plan killed while it spilled this group
            with atomic_open(self.path) as fh:
                with self._changed:
                    self._temp = fh.name
                # each batch decoded on a thread of its own while the one before is compressed and
                # written (pyarrow lets go of the GIL for both): about the longer of the two, not their sum
                self._write_batches(fh, ahead(tables(), 2, "parquet-spill-decode"))
                size = fh.tell()
        except BaseException as exc:
            self._end(exc)
            if not isinstance(exc, Exception):
                raise
            return
        index = {"format": SPILL_FORMAT, "size": size, "batches": [b.model_dump() for b in self._batches]}
        write_cache_file(_index_path(self.path), json.dumps(index).encode())
        self._end(None)

    def _end(self, error: BaseException | None) -> None:
        with self._changed:
            self._ended, self._error = True, error
            self._changed.notify_all()

    def _write_batches(self, fh: Any, tables: Iterator[Any]) -> None:
        """Each batch written, and hashed as written (the stream's schema with the first)."""
        import pyarrow.ipc as ipc

        sink = _Hashed(fh)
        writer, first_row = None, 0
        for table in tables:
            if writer is None:
                options = ipc.IpcWriteOptions(compression=_COMPRESSION)
                writer = ipc.new_stream(sink, table.schema, options=options)
            for batch in table.to_batches():
                offset = sink.at
                writer.write_batch(batch)
                sink.flush()  # (its slices read it as it is written)
                done = SpillBatch(
                    first_row=first_row, rows=batch.num_rows, offset=offset, end=sink.at, sha256=sink.take()
                )
                first_row += batch.num_rows
                with self._changed:
                    self._batches.append(done)
                    self._changed.notify_all()
        if writer is not None:
            writer.close()

    def rows(self, start: int, end: int, wait: bool = True) -> SpilledRows | None:
        """The spill's batches that hold the row group's rows ``[start, end)``, once written (``wait``:
        until then; else ``None`` until then); its writer's error, raised."""
        with self._changed:
            while not self._ended and self._written() < end:
                if not wait:
                    return None
                self._changed.wait()
            error, batches = self._error, list(self._batches)
            temp = "" if self._ended else self._temp
        if error is not None:
            if isinstance(error, DatasetError):
                raise DatasetError(error.dataset, error.reason) from None
            raise DatasetError(  # (the decode's errors are the dataset's: this is the spill's own)
                self.group_path,
                f"row group {self.index} cannot be spilled to {self.path.parent}: {type(error).__name__}: {error}",
            )
        return SpilledRows(
            group_path=self.group_path,
            index=self.index,
            path=str(self.path),
            temp=temp,
            batches=tuple(b for b in batches if b.first_row < end and b.first_row + b.rows > start),
        )

    def _written(self) -> int:
        last = self._batches[-1] if self._batches else None
        return 0 if last is None else last.first_row + last.rows

    def wait(self) -> None:
        """Until it has landed; its writer's error, raised."""
        with self._changed:
            while not self._ended:
                self._changed.wait()
        self.rows(0, 0)


class _Hashed:
    """A file written through, the bytes since the last :meth:`take` hashed as they go."""

    def __init__(self, fh: Any) -> None:
        self._fh, self.at, self._hash = fh, fh.tell(), hashlib.sha256()

    def write(self, data: Any) -> int:
        self._hash.update(data)
        self.at += len(memoryview(data))
        return self._fh.write(data)

    def flush(self) -> None:
        self._fh.flush()

    @property
    def closed(self) -> bool:
        return self._fh.closed

    def close(self) -> None:
        """(The file is its opener's to close: it is fsynced and renamed after.)"""

    def take(self) -> str:
        found, self._hash = self._hash.hexdigest(), hashlib.sha256()
        return found


_SPILLS: dict[Path, Spill] = {}
_SPILLS_LOCK = threading.Lock()


def spill_group(
    group_path: str, index: int, rows: int, cache_dir: str, key: str, tables: Callable[[], Iterator[Any]]
) -> Spill:
    """The spill of row group ``index`` of ``group_path`` (``rows`` rows, content key ``key``): landed
    before, being written in this process, or begun now on a thread of its own (``tables``: the row
    group's batches, decoded and checked)."""
    path = spill_path(cache_dir, key)
    with _SPILLS_LOCK:
        found = _SPILLS.get(path)
        if found is not None and found._error is None:
            return found
        spill = _SPILLS[path] = Spill(group_path, index, path, rows)
    if not spill._landed():
        logger.info("decoding row group %d of %s once for its slices", index, group_path)
        threading.Thread(
            target=_write_in_turn, args=(spill, tables), name="parquet-spill", daemon=True
        ).start()
    return spill


#: Spills written at once: each on two threads (decoding, writing), holding a few batches, beside the
#: slices that read them.
_WRITING = threading.BoundedSemaphore(max(1, available_cpus() // 4))


def _write_in_turn(spill: Spill, tables: Callable[[], Iterator[Any]]) -> None:
    with _WRITING:  # (waiters are let in in the order they came: the row groups' order)
        spill._write(tables)


def forget_spills() -> None:
    """Spills landed or failed are not handed to a later plan from memory (it reads their index)."""
    with _SPILLS_LOCK:
        for path, spill in list(_SPILLS.items()):
            if spill._ended:
                del _SPILLS[path]


class SpilledGroup:
    """A slice's reader of a spill: its batches read by offset, each checked against the hash the plan
    recorded as it wrote it (the same interface as :mod:`sftmix.sources.parquet`'s row group readers). A batch
    that is not what the plan wrote (a damaged disk) is our cache gone bad, not the user's input: the
    slice reads the row group from the Parquet file instead (``decoded``, its reader there), and the
    spill's index is removed, so the next plan makes the spill again."""

    def __init__(self, spilled: SpilledRows, schema: Any, decoded: Callable[[], Any]) -> None:
        self.spilled, self._schema, self._decoded = spilled, schema, decoded
        self._fd: int | None = open_landing(spilled.path, spilled.temp)  # FileNotFoundError: not here
        self._table: Any = None
        self._at: SpillBatch | None = None
        self._instead: Any = None  # the Parquet file's reader, once a batch was found damaged

    def _batch(self, batch: SpillBatch) -> Any:
        """The batch's rows, or ``None`` where its bytes are not what the plan wrote."""
        import pyarrow as pa
        import pyarrow.ipc as ipc

        assert self._fd is not None
        data = os.pread(self._fd, batch.end - batch.offset, batch.offset)
        if len(data) != batch.end - batch.offset or hashlib.sha256(data).hexdigest() != batch.sha256:
            logger.warning(
                "%s: the decoded copy of row group %d (%s) is not what the plan wrote (a damaged disk?): "
                "this slice decodes the row group from the file instead, and the next run makes the copy again",
                self.spilled.group_path,
                self.spilled.index,
                self.spilled.path,
            )
            _index_path(Path(self.spilled.path)).unlink(missing_ok=True)  # (ours: the next plan rewrites it)
            return None
        for message in ipc.MessageReader.open_stream(pa.py_buffer(data)):
            if message.type == "record batch":
                table = pa.Table.from_batches([ipc.read_record_batch(message, self._schema)])
                return table.replace_schema_metadata(self._schema.metadata)
        raise DatasetError(self.spilled.group_path, f"{self.spilled.path}: a batch holds no rows")

    def rows(self, local: list[int]) -> list[dict[str, Any]]:
        if self._instead is not None:
            return self._instead.rows(local)
        out: list[dict[str, Any]] = []
        for batch, within in runs_in_parts(local, self.spilled.batches):
            if batch is None:
                raise DatasetError(
                    self.spilled.group_path,
                    f"row {within[0]} of row group {self.spilled.index} is in none of the slice's spilled batches",
                )
            if batch != self._at:
                table = self._batch(batch)
                if table is None:
                    self._instead = self._decoded()
                    return self._instead.rows(local)
                self._table, self._at = table, batch
            out += table_rows(self._table, within)
        return out

    def confirm(self) -> None:
        """Every row from the spill came from a batch whose hash is the plan's, written only once all
        decoded for it was known to be the version the plan hashed; the file's reader, where it read
        instead, confirms its own."""
        if self._instead is not None:
            self._instead.confirm()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._instead is not None:
            self._instead.close()
