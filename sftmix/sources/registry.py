"""The formats the plan reads, one reader each, asked in turn to open a dataset: a large JSON Lines file read
as its slices begin, Parquet by row group, else read whole (by batch, or through ``datasets``). A new format
is a package beside ``jsonl/`` and ``parquet/`` and a line here, before the readers it should win over."""

from __future__ import annotations

from sftmix.sources.jsonl.reader import STREAMED
from sftmix.sources.parquet.reader import BY_ROW_GROUP
from sftmix.sources.reading import Reader
from sftmix.sources.whole.reader import WHOLE

#: The readers in the order they are asked; the last (:data:`WHOLE`) reads any dataset.
READERS: tuple[Reader, ...] = (STREAMED, BY_ROW_GROUP, WHOLE)

__all__ = ["READERS", "WHOLE"]
