"""A Parquet dataset's row groups as the plan records them (each file's footer, each row group's rows and bytes
and sha256), which files this package reads, and where a slice's row groups and boundaries are."""

from __future__ import annotations

import bisect
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from sftmix.errors import ConfigError
from sftmix.runtime import settings
from sftmix.runtime.storage import is_remote
from sftmix.sources import pinned
from sftmix.sources.downloads import Downloads
from sftmix.sources.features import schema_of
from sftmix.sources.parquet.spill import SpilledRows
from sftmix.sources.paths import local_builder
from sftmix.sources.reading import RowSource

FINGERPRINT_PREFIX = "parquet-row-groups:"


MAGIC = b"PAR1"


#: A row group is cut into at most this many slices, and only when each piece still holds this many
#: slices' worth of rows. Each slice hashes the whole row group and decodes it up to its own last row:
#: ~1 s per 440 MiB of chats, against ~55 core-s to tokenize them, so four pieces cost ~5% more work.
MAX_PIECES_PER_ROW_GROUP = 4


#: A row group whose data (uncompressed) is larger than this is decoded batch by batch, never whole:
#: pyarrow writes up to 1Mi rows a row group by default (gigabytes of chats), and a worker holds one
#: batch of about :data:`_STREAM_BATCH_BYTES`, whatever the writer chose. The environment's
#: ``TOKENIZE_MIXER_PARQUET_STREAMED_BYTES`` sets it.
STREAMED_BYTES = 64 << 20


_STREAM_BATCH_BYTES = 8 << 20


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


class ParquetSource(RowSource):
    """What a slice needs to read its rows: the footers of its files, the features as an Arrow schema,
    the row groups that hold its rows, and where the plan decoded one for all its slices, the batches of
    that spill which hold them (:mod:`sftmix.sources.parquet.spill`; what the rows are follows from the row groups)."""

    data_format: Literal["parquet"] = "parquet"
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


def changed_reason(what: str) -> str:
    return (
        f"the file changed since the run was planned ({what} is not what the plan read): "
        "rerun when it no longer changes; finished slices are kept"
    )


#: What :func:`hashed` hands on as each row group is hashed, in order.
GroupListener = Callable[[RowGroup], None]


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
