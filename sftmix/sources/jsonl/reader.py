"""The reader of a JSON Lines dataset whose slices are cut while it is read: a large file (or a pinned
``gs://`` object, a compressed file's copy as it is written, a directory's or hub dataset's files) whose
every row is selected whatever its count. Each slice is handed on as soon as its batches are counted, so
tokenizing begins while the plan still reads the rest."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from sftmix.config.config import DatasetEntry
from sftmix.config.selection import selection_problem, target_rows
from sftmix.errors import DatasetError
from sftmix.sources import jsonl
from sftmix.sources.data_files import JsonFiles
from sftmix.sources.downloads import closed_on_error
from sftmix.sources.growing import final_name
from sftmix.sources.jsonl.files import (
    bad_lines_warning,
    batch_data,
    batch_pieces,
    row_pieces,
    scanned_files,
    slice_is_full,
    streamed_files,
)
from sftmix.sources.paths import readable_here
from sftmix.sources.reading import (
    Cut,
    DataFormat,
    HandOn,
    Opened,
    Planning,
    Rows,
    RowsAt,
    dataset_error,
    format_of,
    read_whole_instead,
)


def _files(dataset: Opened) -> JsonFiles:
    assert isinstance(dataset.held, JsonFiles)
    return dataset.held


def _source_path(dataset: Opened) -> str:
    """What a streamed dataset's slices name as their file: the file, or the dataset of several files."""
    files = _files(dataset)
    return final_name(files.follow(0)) if len(files.paths) == 1 else dataset.entry.path


def _source(dataset: Opened, schema_b64: str, batches: list[jsonl.JsonlBatch]) -> jsonl.JsonlSource:
    """What a slice of a streamed dataset reads: ``batches``, cast to the features ``schema_b64``."""
    declared = _files(dataset).declared is not None
    return jsonl.JsonlSource(
        path=_source_path(dataset), schema_b64=schema_b64, batches=batches, declared=declared
    )


class StreamedReader:
    def ahead(self, entry: DatasetEntry, datasets_cache: str) -> bool:
        return streamed_files(entry, datasets_cache) is not None  # (read by the plan as it goes)

    def open(self, index: int, entry: DatasetEntry, at: Planning) -> Opened | None:
        """Opened from its first batch; ``None`` for any other dataset (or one whose selection, estimated
        from its first batch, might be refused: it is counted first)."""
        try:
            if (files := streamed_files(entry, at.datasets_cache)) is None:
                return None
            with closed_on_error(files):
                dataset = self._opened(index, entry, at, files)
        except DatasetError as exc:
            raise dataset_error(entry, exc) from None
        if dataset is None:
            files.close()  # (counted first: read again, as they land)
        return dataset

    def _opened(self, index: int, entry: DatasetEntry, at: Planning, files: JsonFiles) -> Opened | None:
        first = files.follow(0)
        head = jsonl.first_batch(first, files.declared)
        if head is None:
            return None
        batch, schema_b64 = head
        columns = jsonl.schema_names(schema_b64)
        if not batch.rows or not columns:
            return None
        nbytes = sum(files.sizes)
        estimate = round(nbytes * batch.rows / max(1, batch.end - batch.offset))
        target = target_rows(entry.amount, estimate)
        if selection_problem(entry.amount, estimate, target, 2 * target, at.memory) is not None:
            return None  # (near a limit: counted first, so that a refusal comes before any work)
        row_format, messages_key = format_of(entry, columns)
        dataset = Opened(
            index, entry, self, held=files, row_format=row_format, messages_key=messages_key, nbytes=nbytes
        )
        if len(files.paths) > 1:  # (each batch names its file)
            batch = batch.model_copy(update={"path": final_name(first)})
        source = _source(dataset, schema_b64, [batch])
        rows = (0, min(batch.rows, at.run.slice_rows or batch.rows), None)  # the first slice's rows
        dataset.sampled = Cut(rows, batch_data(schema_b64, [batch]), 0, source)
        return dataset

    def cut(self, dataset: Opened, at: Planning, hand_on: HandOn) -> int:
        """Its slices (whole batches, or ``slice_rows`` rows of one), each handed on as soon as its batches
        are counted; the file is then a dataset like any other (or, found not to be JSON Lines pyarrow
        reads after all, is read whole)."""
        entry, run = dataset.entry, at.run
        waiting: list[jsonl.JsonlBatch] = []  # counted batches of the next slice

        def cut(batches: list[jsonl.JsonlBatch], schema_b64: str) -> None:
            source = _source(dataset, schema_b64, batches)
            data = batch_data(schema_b64, batches)
            lo, hi = batches[0].first_row, batches[-1].first_row + batches[-1].rows
            nbytes = sum(b.end - b.offset for b in batches)
            pieces: list[Rows]
            if run.slice_rows:
                pieces = [(a, min(a + run.slice_rows, hi), None) for a in range(lo, hi, run.slice_rows)]
            else:  # (as a count first cuts a small mixture's: files.batch_groups)
                pieces = row_pieces(
                    lo, hi, None, batch_pieces(batches, at.slice_bytes) if at.cut_batches else 1
                )
            for start, end, _ in pieces:
                size = round(nbytes * (end - start) / (hi - lo))
                hand_on(Cut((start, end, None), data, size, source))

        def counted(batch: jsonl.JsonlBatch, schema_b64: str) -> None:
            if not batch.rows:
                return
            waiting.append(batch)
            if run.slice_rows or slice_is_full(waiting, at.slice_bytes):  # (slice_rows: one batch's rows)
                cut(waiting[:], schema_b64)
                waiting.clear()

        try:
            layout = self._scanned(dataset, counted, hand_on)
        except DatasetError as exc:
            raise dataset_error(entry, exc) from None
        if layout is not None and waiting:  # the file's last batches
            cut(waiting, layout.schema_b64)
        if layout is None or not layout.n_rows or not layout.columns:
            return read_whole_instead(dataset, at)
        if (w := bad_lines_warning(entry, at.on_bad_row, layout.bad_lines)) is not None:
            dataset.warnings.append(w)
        target = target_rows(entry.amount, layout.n_rows)
        at.check_selection(entry, layout.n_rows, target)
        dataset.cuts = hand_on.made
        dataset.counted(layout.n_rows, target, layout.fingerprint)
        return len(dataset.cuts)

    @staticmethod
    def _scanned(dataset: Opened, counted: jsonl.BatchListener, hand_on: HandOn) -> jsonl.JsonlLayout | None:
        """Its files read, ``counted`` called with each batch as it is counted."""
        entry, files = dataset.entry, _files(dataset)
        if len(files.paths) > 1:
            return scanned_files(files, entry.path, counted, hand_on.reading_threads())
        with closed_on_error(files):  # (its batches name no file)
            layout = jsonl.scan_file(files.follow(0), counted, hand_on.reading_threads(), files.declared)
        file = jsonl.lines_of(entry.path, _source_path(dataset))  # (as its slices name them)
        if layout is not None and layout.bad_lines and file != entry.path:  # (a directory's one file)
            layout = replace(layout, bad_lines=tuple(replace(b, file=file) for b in layout.bad_lines))
        return layout


STREAMED = StreamedReader()


def _rows(source: jsonl.JsonlSource, at: RowsAt, rows: list[int]) -> Sequence[dict[str, Any] | jsonl.BadLine]:
    return jsonl.read_rows(source, rows)


def _here(source: jsonl.JsonlSource) -> jsonl.JsonlSource | None:
    """Read as planned where its files are on this machine (or on ``gs://``); else ``datasets`` opens it."""
    return source if readable_here(jsonl.files_of(source)) else None


def _place(source: jsonl.JsonlSource, at: RowsAt, row: int) -> tuple[str | None, int] | None:
    return jsonl.row_place(source, row)


FORMAT = DataFormat(jsonl.JsonlSource, STREAMED, _rows, _here, _place, release=jsonl.release)
