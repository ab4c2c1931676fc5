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

from sftmix.sources.jsonl.batches import (
    FINGERPRINT_PREFIX,
    BadLine,
    BatchListener,
    JsonlBatch,
    JsonlLayout,
    JsonlSource,
    applies,
    batch_bounds,
    batches_for,
    files_of,
    lines_of,
    parse_batch,
    reads_decompressed,
    reads_remote,
    schema_names,
)
from sftmix.sources.jsonl.rows import read_batch, read_rows, release, row_place
from sftmix.sources.jsonl.scanning import first_batch, scan, scan_file, scan_files, scan_growing

__all__ = [
    "BadLine",
    "BatchListener",
    "FINGERPRINT_PREFIX",
    "JsonlBatch",
    "JsonlLayout",
    "JsonlSource",
    "applies",
    "batch_bounds",
    "batches_for",
    "files_of",
    "first_batch",
    "lines_of",
    "parse_batch",
    "read_batch",
    "read_rows",
    "reads_decompressed",
    "reads_remote",
    "release",
    "row_place",
    "scan",
    "scan_file",
    "scan_files",
    "scan_growing",
    "schema_names",
]
