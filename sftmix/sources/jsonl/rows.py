"""A slice's rows read from its batches: each batch parsed exactly as the builder parses it and cast to the
features, and a line that is not a row said by its place and reason (or counted, ``on_bad_row: skip``)."""

from __future__ import annotations

import codecs
import hashlib
import json
import re
from dataclasses import replace
from functools import lru_cache
from typing import Any

from sftmix.errors import DatasetError
from sftmix.sources.data_files import MIXED_TYPES
from sftmix.sources.features import schema_of
from sftmix.sources.hashing import valid_utf8
from sftmix.sources.jsonl import batches
from sftmix.sources.jsonl.batches import (
    BadLine,
    JsonlBatch,
    JsonlSource,
    changed_reason,
    parse_batch,
    read_range,
)
from sftmix.sources.tables import runs_in_parts, table_rows


def read_batch(
    data: bytes,
    lines_before: int,
    target: Any = None,
    offset: int = 0,
    utf8: bool | None = None,
    declared: bool = False,
) -> tuple[Any, dict[int, BadLine]]:
    """A batch as the builder reads it (cast to ``target``, the file's features, when given), and its
    bad lines by their row in the batch, each read as ``{}``. Only a batch the reader refuses, or whose
    bytes are not UTF-8, is looked at line by line (Python's JSON reader first, then pyarrow's on ever
    longer heads of the batch for what only it refuses: a field whose type differs). ``utf8``: whether
    the bytes are valid UTF-8, when known (the reader does not check it). ``declared``: ``target`` is
    the features a dataset's card declares (for the reason a row is refused)."""
    if utf8 if utf8 is not None else valid_utf8(data):
        try:
            return _table(data, target), {}
        except Exception as exc:
            refused: Exception = exc
    else:
        refused = DatasetError("", "not valid UTF-8")
    lines = data.split(b"\n")
    rows = _row_lines(lines)
    starts = [0]
    for line in lines[:-1]:
        starts.append(starts[-1] + len(line) + 1)
    bad: dict[int, tuple[str, str]] = {}
    for row, k in enumerate(rows):
        if (found := _line_problem(lines[k], offset + starts[k])) is not None:
            bad[row] = found
        elif target is not None and (key := _first_unknown_key(lines[k], target)) is not None:
            bad[row] = (_unknown_key_reason(key, declared), _excerpt(lines[k], 0))  # (the cast refuses it)
    while True:
        patched = [b"{}" if row in bad else lines[k] for row, k in enumerate(rows)]
        try:
            table = _table(b"\n".join(patched), target)
            break
        except Exception as exc:
            first = _first_refused_row(patched, target, exc)
            if first is None or first[0] in bad:
                raise refused from None  # no one line is at fault: the caller says so for the batch
            row, why = first
            line = lines[rows[row]]
            bad[row] = (_refusal_reason(why, line, target, declared), _excerpt(line, 0))
    return table, {
        row: BadLine(lines_before + rows[row] + 1, reason, excerpt)
        for row, (reason, excerpt) in sorted(bad.items())
    }


def _row_lines(lines: list[bytes]) -> list[int]:
    """The lines (0-based) that hold rows: every line but a blank one, as the reader skips it."""
    return [k for k, line in enumerate(lines) if line.strip(b" \t\r")]


def _table(data: bytes, target: Any) -> Any:
    table = parse_batch(data)
    return table if target is None else _cast(table, target)


def _first_refused_row(lines: list[bytes], target: Any, refused: Exception) -> tuple[int, Exception] | None:
    """The first row whose line, with the lines before it, the reader refuses, and the reader's error
    for that head (a binary search on heads of the batch, which the reader refuses as a whole with
    ``refused``); ``None`` for no lines."""
    lo, hi, why = 0, len(lines), refused  # heads of lo rows are read; of hi rows, refused (with why)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if (error := _refusal(lines, mid, target)) is None:
            lo = mid
        else:
            hi, why = mid, error
    return None if hi == 0 else (hi - 1, why)


def _refusal(lines: list[bytes], n: int, target: Any) -> Exception | None:
    """The reader's error for the first ``n`` rows' lines, ``None`` when it reads them."""
    try:
        _table(b"\n".join(lines[:n]), target)
    except Exception as exc:
        return exc
    return None


_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "true or false"}


def _line_problem(line: bytes, at: int) -> tuple[str, str] | None:
    """(what is wrong, the text near it) for a line (starting at byte ``at`` of the file) Python's JSON
    reader refuses or that is not one object; ``None`` for a JSON object."""
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"not valid UTF-8 (byte {at + exc.start} of the file)", _excerpt(line, exc.start)
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        return f"not valid JSON ({exc.msg}, column {exc.colno})", _excerpt(line, exc.pos, chars=True)
    if not isinstance(value, dict):
        return f"not a JSON object but {_KINDS.get(type(value), 'null')}", _excerpt(line, 0)
    if (found := _SURROGATE.search(line)) is not None:
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return "a string holds a lone surrogate (\\ud800-\\udfff without its pair)", _excerpt(
                line, found.start()
            )
    return None


def _refusal_reason(exc: Exception, line: bytes, target: Any, declared: bool = False) -> str:
    """Why the reader refuses a row that Python's JSON reader reads: a field's type (the message names
    the field), or a key the features (the first batch's, or those ``declared``) do not have."""
    if (changed := MIXED_TYPES.search(str(exc))) is not None:
        return (
            f"field '{changed['field']}' holds {_article(changed['b'])} here and {changed['a']}s in the rows "
            "before it (a field must have one type in every row)"
        )
    if target is not None and (found := _first_unknown_key(line, target)) is not None:
        return _unknown_key_reason(found, declared)
    return f"the reader refuses it ({type(exc).__name__}: {exc})"


def _unknown_key_reason(key: str, declared: bool) -> str:
    """Why a row with ``key``, which the features lack (those ``declared``, or the first batch's), is refused."""
    if declared:
        return (
            f"key {key!r} is not among the features the dataset's card declares (dataset_info in its "
            "README.md), which fix the columns; the reference's loader (datasets) refuses it too: declare "
            "it in the card, or remove it from the rows"
        )
    return (
        f"key {key!r} is in none of the rows of the first {batches.BATCH_BYTES >> 20} MiB the loader reads (of the "
        "first file, where a dataset has several), which fix the columns; the reference's loader (datasets) "
        "refuses it too: give every row the same keys (null where a value is unknown), or put a row with "
        "every key first"
    )


def _article(kind: str) -> str:
    return f"an {kind}" if kind[:1] in "aeiou" else f"a {kind}"


def _excerpt(line: bytes, at: int, chars: bool = False, width: int = 48) -> str:
    """The line's text around position ``at`` (a byte, or with ``chars`` a character), at most ``width``
    characters, cut ends marked."""
    text = line.decode("utf-8", errors="replace").rstrip("\r")
    if not chars:
        at = len(line[:at].decode("utf-8", errors="replace"))
    lo = max(0, min(at - width // 3, len(text) - width))
    hi = min(len(text), lo + width)
    return f"{'...' if lo else ''}{text[lo:hi]}{'...' if hi < len(text) else ''}"


class _Builder:
    """What ``datasets``' JSON builder's cast reads of itself: its features."""

    def __init__(self, features: Any) -> None:
        self.info = type("Info", (), {"features": features})()


@lru_cache(maxsize=2)
def _batch_table(
    path: str, batch: JsonlBatch, schema_b64: str, declared: bool = False
) -> tuple[Any, dict[int, BadLine]]:
    data = read_range(path, batch.offset, batch.end, batch.growing)
    if hashlib.sha256(data).hexdigest() != batch.sha256:
        raise DatasetError(path, changed_reason(batch.offset, batch.end))
    text = data.removeprefix(codecs.BOM_UTF8) if batch.offset == 0 else data
    rows = f"rows {batch.first_row}-{batch.first_row + batch.rows - 1} (from line {batch.lines_before + 1})"
    try:
        start = batch.offset + len(data) - len(text)
        table, bad = read_batch(text, batch.lines_before, schema_of(schema_b64), start, batch.utf8, declared)
    except Exception as exc:
        raise DatasetError(path, f"{rows} cannot be read as JSON Lines: {exc}") from None
    if table.num_rows != batch.rows:
        raise DatasetError(
            path, f"{rows}: the reader found {table.num_rows} rows where the plan counted {batch.rows}"
        )
    if batch.path:  # one of a dataset's several files: its lines are named by it
        bad = {row: replace(line, file=batch.path) for row, line in bad.items()}
    return table, bad


def _cast(table: Any, target: Any) -> Any:
    """``table`` cast to the file's features, as ``datasets``' builder casts every batch."""
    if table.schema.equals(target, check_metadata=False):
        return table.replace_schema_metadata(target.metadata)
    import datasets
    from datasets.packaged_modules.json.json import Json

    return Json._cast_table(_Builder(datasets.Features.from_arrow_schema(target)), table)


def _first_unknown_key(line: bytes, schema: Any) -> str | None:
    """The path (``messages[].function_calls``) of the first object key in ``line`` that the schema does
    not have: the cast refuses such a row (a struct, or the table, with a field the features lack)."""
    import pyarrow as pa

    def unknown(value: Any, typ: Any, where: str) -> str | None:
        if isinstance(value, dict) and pa.types.is_struct(typ):
            names = {typ.field(i).name: typ.field(i).type for i in range(typ.num_fields)}
            for key, item in value.items():
                path = f"{where}.{key}" if where else key
                if key not in names:
                    return path
                if (found := unknown(item, names[key], path)) is not None:
                    return found
        elif isinstance(value, list) and (pa.types.is_list(typ) or pa.types.is_large_list(typ)):
            for item in value:
                if (found := unknown(item, typ.value_type, f"{where}[]")) is not None:
                    return found
        return None

    try:
        return unknown(json.loads(line), pa.struct(list(schema)), "")
    except ValueError:
        return None


def read_rows(source: JsonlSource, rows: list[int]) -> list[dict[str, Any] | BadLine]:
    """Rows by index (in the order given) from the batches of ``source``; a bad line's row is its
    :class:`BadLine`."""
    out: list[dict[str, Any] | BadLine] = []
    for batch, local in runs_in_parts(rows, source.batches):
        if batch is None:
            raise DatasetError(source.path, f"row {local[0]} is in none of the slice's batches")
        table, bad = _batch_table(batch.path or source.path, batch, source.schema_b64, source.declared)
        got = table_rows(table, local)
        out += [bad.get(r, record) for r, record in zip(local, got, strict=True)] if bad else got
    return out


def row_place(source: JsonlSource, row: int) -> tuple[str, int] | None:
    """The file and 1-based line of ``row`` where its batch names its file (a dataset of several), blank
    lines skipped as the reader skips them; ``None`` otherwise. Reads the batch: for an error only."""
    for batch in source.batches:
        if batch.path and batch.first_row <= row < batch.first_row + batch.rows:
            lines = read_range(batch.path, batch.offset, batch.end, batch.growing).split(b"\n")
            return batch.path, batch.lines_before + _row_lines(lines)[row - batch.first_row] + 1
    return None


def release() -> None:
    """Forget the parsed batches (a worker between slices)."""
    _batch_table.cache_clear()
