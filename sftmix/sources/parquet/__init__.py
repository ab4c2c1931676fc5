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

from sftmix.sources.parquet.counting import counted, hashed, scan, scan_files, with_sha256
from sftmix.sources.parquet.decoding import confirm, decoded_tables, read_rows, release
from sftmix.sources.parquet.row_groups import (
    FINGERPRINT_PREFIX,
    MAX_PIECES_PER_ROW_GROUP,
    STREAMED_BYTES,
    GroupListener,
    ParquetFooter,
    ParquetLayout,
    ParquetSource,
    RowGroup,
    applies,
    disabled,
    groups_for,
    reads_remote,
    slice_cuts,
    spilled,
    stream_batch_bytes,
    streamed_bytes,
)

__all__ = [
    "FINGERPRINT_PREFIX",
    "GroupListener",
    "MAX_PIECES_PER_ROW_GROUP",
    "ParquetFooter",
    "ParquetLayout",
    "ParquetSource",
    "RowGroup",
    "STREAMED_BYTES",
    "applies",
    "confirm",
    "counted",
    "decoded_tables",
    "disabled",
    "groups_for",
    "hashed",
    "read_rows",
    "reads_remote",
    "release",
    "scan",
    "scan_files",
    "slice_cuts",
    "spilled",
    "stream_batch_bytes",
    "streamed_bytes",
    "with_sha256",
]
