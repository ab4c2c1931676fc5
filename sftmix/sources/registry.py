"""The data formats, each a package with its plan's reader and its slices' source: the readers are asked in
turn to open a dataset (a large JSON Lines file read as its slices begin, Parquet by row group, else read
whole: by batch, or through ``datasets``), and a worker reads a slice's rows by its source's format. A new
format is a package beside ``jsonl/`` and ``parquet/``, a line in :data:`FORMATS` before the formats it
should win over, and its source in :data:`SliceSource`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import Field

from sftmix.sources import jsonl, parquet
from sftmix.sources.jsonl import reader as jsonl_reader
from sftmix.sources.parquet import reader as parquet_reader
from sftmix.sources.reading import DataFormat, Reader, RowsAt
from sftmix.sources.whole import reader as whole_reader
from sftmix.sources.whole.arrow import ArrowSource

#: In the order their readers are asked; the last (``datasets``' Arrow files) reads any dataset.
FORMATS: tuple[DataFormat, ...] = (jsonl_reader.FORMAT, parquet_reader.FORMAT, whole_reader.FORMAT)

#: Where a slice's rows are: one of the formats' sources, told apart by its ``data_format``.
SliceSource = Annotated[
    jsonl.JsonlSource | parquet.ParquetSource | ArrowSource, Field(discriminator="data_format")
]

READERS: tuple[Reader, ...] = tuple(f.reader for f in FORMATS)
WHOLE = whole_reader.WHOLE  # (a reader that finds its dataset is not its own hands it on to this one)

_BY_NAME = {f.name: f for f in FORMATS}


def read_rows(source: SliceSource, at: RowsAt, rows: list[int]) -> Sequence[Any]:
    """A slice's rows by index, by its source's format (a line that is not a row: its format's record)."""
    return _BY_NAME[source.data_format].read_rows(source, at, rows)


def row_place(source: SliceSource, at: RowsAt, row: int) -> tuple[str | None, int] | None:
    """The file (``None``: the dataset's own) and 1-based line of a row, for an error; ``None``: not known."""
    found = _BY_NAME[source.data_format].row_place(source, at, row)
    return found if found is not None else whole_reader.FORMAT.row_place(ArrowSource(), at, row)


def here(source: SliceSource) -> SliceSource:
    """The source as this machine (not the planner's) reads it: as planned where its files are here, else
    through ``datasets``."""
    found = _BY_NAME[source.data_format].here(source)
    return (
        found if isinstance(found, jsonl.JsonlSource | parquet.ParquetSource | ArrowSource) else ArrowSource()
    )


def finish(source: SliceSource) -> None:
    """Once a slice's rows are read: its format's check (Parquet's rows decoded batch by batch came from
    the version the plan read)."""
    _BY_NAME[source.data_format].finish()


def release() -> None:
    """Every format's caches released between slices (resident memory stays per slice)."""
    for data_format in FORMATS:
        data_format.release()
