"""Rows of Arrow tables by index, across the parts (batches, row groups) that a slice's rows fall in."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol, TypeVar


class Part(Protocol):
    """A piece of a file that holds consecutive rows: a JSON Lines batch, a Parquet row group."""

    # (read only, as a frozen model's fields are)
    @property
    def first_row(self) -> int: ...

    @property
    def rows(self) -> int: ...


P = TypeVar("P", bound=Part)


def runs_in_parts(rows: list[int], parts: Sequence[P]) -> Iterator[tuple[P | None, list[int]]]:
    """``rows`` (in the order given) as runs that each lie in one part, with the run's rows counted from
    the part's start; a row in no part comes alone with ``None`` (the caller says so)."""
    i = 0
    while i < len(rows):
        part = next((p for p in parts if p.first_row <= rows[i] < p.first_row + p.rows), None)
        if part is None:
            yield None, [rows[i]]
            return
        j = i
        while j < len(rows) and part.first_row <= rows[j] < part.first_row + part.rows:
            j += 1
        yield part, [r - part.first_row for r in rows[i:j]]
        i = j


def table_rows(table: Any, rows: list[int]) -> list[dict[str, Any]]:
    """Rows of an Arrow table as Python objects, in the order given: consecutive rows as one slice, any
    other order by one take, its index built from a numpy buffer (from a list, pyarrow imports pandas
    to ask whether it is one of its objects: 0.2 s of a small run's planning)."""
    import numpy as np
    import pyarrow as pa

    if rows and rows[-1] - rows[0] + 1 == len(rows):
        return table.slice(rows[0], len(rows)).to_pylist()
    index = pa.Array.from_buffers(
        pa.int64(), len(rows), [None, pa.py_buffer(np.asarray(rows, dtype=np.int64))]
    )
    return table.take(index).to_pylist()
