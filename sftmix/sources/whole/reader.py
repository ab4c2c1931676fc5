"""The reader of a dataset read whole before its slices are cut: a JSON Lines file counted (and hashed)
by batch, or any dataset ``datasets`` reads (a hub dataset, a CSV, a file of another layout), counted from
its Arrow files and hashed by row range. It opens any dataset: the last reader asked."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sftmix.config.config import DatasetEntry
from sftmix.config.selection import target_rows
from sftmix.errors import DatasetError
from sftmix.runtime.storage import atomic_write_bytes
from sftmix.sources import jsonl
from sftmix.sources.jsonl.files import bad_lines_warning, batch_data, batch_groups, counted_jsonl
from sftmix.sources.reading import (
    Cut,
    DataFormat,
    HandOn,
    Opened,
    Planning,
    Rows,
    RowsAt,
    digest,
    format_of,
    row_groups,
    rows_key,
    selected_rows,
)
from sftmix.sources.whole.arrow import (
    ArrowSource,
    RowsFingerprinter,
    SourceInfo,
    arrow_cache_files,
    describe,
    read_rows,
    release_mapped_data,
    row_line,
)

MAX_AUTO_SLICE_ROWS = 20_000


def rows_per_slice(nbytes: int, n_rows: int, slice_bytes: int) -> int:
    """Rows that make about ``slice_bytes`` of this dataset's data."""
    per_row = max(1.0, nbytes / max(n_rows, 1))
    return max(1, min(MAX_AUTO_SLICE_ROWS, int(slice_bytes // per_row)))


class FingerprintMemo:
    """Row-range fingerprints of one dataset version (keyed by its content fingerprint), kept in the
    work directory so a rerun does not hash the data again."""

    def __init__(self, work_dir: Path, source_fingerprint: str, split: str) -> None:
        name = hashlib.sha256(f"{source_fingerprint}|{split}".encode()).hexdigest()[:32]
        self.path = work_dir / "fingerprints" / f"{name}.json"
        try:
            self.known: dict[str, str] = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            self.known = {}
        self.dirty = False

    @staticmethod
    def key(rows: dict) -> str:
        return digest(rows)

    def remember(self, rows: dict, fingerprint: str) -> None:
        self.known[self.key(rows)] = fingerprint
        self.dirty = True

    def save(self) -> None:
        if self.dirty:
            atomic_write_bytes(self.path, json.dumps(self.known, sort_keys=True).encode("utf-8"))


@dataclass
class _Whole:
    """What cutting a dataset read whole into slices needs: its count, its batches or Arrow files."""

    info: SourceInfo
    batched: jsonl.JsonlLayout | None
    arrow_files: list[str] | None


class WholeReader:
    def ahead(self, entry: DatasetEntry, datasets_cache: str) -> bool:
        if counted_jsonl(entry, datasets_cache) is None:
            describe(entry.path, entry.split, entry.revision, datasets_cache)
            arrow_cache_files(entry.path, entry.split, entry.revision, datasets_cache)
        return True

    def open(self, index: int, entry: DatasetEntry, at: Planning) -> Opened:
        """Counted and sampled here; its slices cut by :meth:`cut` once the mixture's size is known."""
        warnings: list[str] = []
        batched = counted_jsonl(entry, at.datasets_cache)
        if batched is not None:
            if (w := bad_lines_warning(entry, at.on_bad_row, batched.bad_lines)) is not None:
                warnings.append(w)
            info = SourceInfo(batched.n_rows, batched.fingerprint, batched.columns, batched.size)
        else:
            info = describe(entry.path, entry.split, entry.revision, at.datasets_cache)
        if info.n_rows == 0:
            raise DatasetError(
                entry.path, f"split {entry.split!r} has no rows; remove it from the mixer or give it rows"
            )
        row_format, messages_key = format_of(entry, info.columns)
        arrow_files = (
            None
            if batched is not None
            else arrow_cache_files(entry.path, entry.split, entry.revision, at.datasets_cache)
        )
        target = target_rows(entry.amount, info.n_rows)
        at.check_selection(entry, info.n_rows, target)
        dataset = Opened(
            index,
            entry,
            self,
            held=_Whole(info, batched, arrow_files),
            warnings=warnings,
            row_format=row_format,
            messages_key=messages_key,
            selected=selected_rows(entry, info.n_rows, target, warnings),
            nbytes=info.nbytes,
        )
        rows = at.sampled_rows(info.n_rows, dataset.selected)
        source = None if batched is None else batched.source(jsonl.batches_for(batched, rows[0], rows[1]))
        dataset.sampled = Cut(rows, "sample", 0, source or ArrowSource(arrow_files=arrow_files))
        dataset.counted(info.n_rows, target, info.fingerprint)
        return dataset

    def cut(self, dataset: Opened, at: Planning, hand_on: HandOn | None = None) -> int:
        """Its slices, each with the fingerprint of the rows it reads (the selection checked again: it was
        opened before the counts of streamed files before it were known)."""
        whole, entry = dataset.held, dataset.entry
        assert isinstance(whole, _Whole) and dataset.plan is not None
        at.check_selection(entry, dataset.plan.n_rows, dataset.plan.target)
        info, batched, arrow_files = whole.info, whole.batched, whole.arrow_files
        memo = FingerprintMemo(at.work_dir, info.fingerprint, entry.split)
        fingerprint_rows = RowsFingerprinter(
            entry.path, entry.split, entry.revision, at.datasets_cache, arrow_files
        )
        data: str | None  # the rows' fingerprint (None: not remembered yet)
        for start, end, subset in self._groups(dataset, at):
            source = None
            if batched is not None:  # the bytes of the batches it reads, and the columns they are cast to
                source = batched.source(jsonl.batches_for(batched, start, end))
                data = batch_data(batched.schema_b64, source.batches)
            elif (data := memo.known.get(memo.key(rows_key(start, end, subset)))) is None:
                data = fingerprint_rows(start, end, subset)
                memo.remember(rows_key(start, end, subset), data)
            size = round((end - start if subset is None else len(subset)) * info.nbytes / info.n_rows)
            dataset.cuts.append(
                Cut((start, end, subset), data, size, source or ArrowSource(arrow_files=arrow_files))
            )
        memo.save()
        fingerprint_rows.close()
        return len(dataset.cuts)

    @staticmethod
    def _groups(dataset: Opened, at: Planning) -> list[Rows]:
        whole = dataset.held
        assert isinstance(whole, _Whole)
        if whole.batched is not None and not at.run.slice_rows:
            return batch_groups(whole.batched, dataset.selected, at.slice_bytes, at.cut_batches)
        info = whole.info
        per_slice = at.run.slice_rows or rows_per_slice(info.nbytes, info.n_rows, at.slice_bytes)
        return row_groups(info.n_rows, dataset.selected, per_slice)


WHOLE = WholeReader()


def _rows(source: ArrowSource, at: RowsAt, rows: list[int]) -> Sequence[dict[str, Any]]:
    return read_rows(at.path, at.split, at.revision, at.datasets_cache, rows, source.arrow_files)


def _place(source: ArrowSource, at: RowsAt, row: int) -> tuple[str | None, int] | None:
    line = row_line(at.path, at.split, row)
    return None if line is None else (None, line)


FORMAT = DataFormat(
    ArrowSource, WHOLE, _rows, lambda source: ArrowSource(), _place, release=release_mapped_data
)
