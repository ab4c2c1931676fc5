"""A dataset's JSON Lines files as the plan finds them: where they are (a file, a directory's or hub
dataset's files, a pinned ``gs://`` object, a compressed file's copy), how they are counted, and how
their batches are cut into slices (whole batches, so each is parsed once)."""

from __future__ import annotations

import logging

import numpy as np

from sftmix.config.config import DatasetEntry
from sftmix.config.selection import every_row
from sftmix.errors import DatasetError
from sftmix.runtime.read_progress import ReadProgress
from sftmix.runtime.storage import is_remote
from sftmix.sources import jsonl, pinned
from sftmix.sources.copies import copies_of, readable_copy
from sftmix.sources.data_files import JsonFiles, json_data_files
from sftmix.sources.downloads import closed_on_error
from sftmix.sources.jsonl import batches as jsonl_batches
from sftmix.sources.paths import local_builder
from sftmix.sources.reading import Rows, dataset_error, digest

logger = logging.getLogger(__name__)


def counted_jsonl(entry: DatasetEntry, datasets_cache: str) -> jsonl.JsonlLayout | None:
    """The batches of a JSON Lines file, or of a hub dataset's (or a directory's) JSON Lines files, read
    by batch (:mod:`sftmix.sources.jsonl`); else ``None``."""
    path = entry.path
    try:
        if local_builder(entry.path) is None and not is_remote(entry.path):
            files = json_data_files(entry.path, entry.split, entry.revision, datasets_cache)
            if files is None:
                return None
            # (files still downloading, or decompressed as they are read: those lines say how far)
            total = 0 if files.downloads or files.copies else sum(files.sizes)
            with ReadProgress(entry.path, total) as progress:
                layout = scanned_files(files, entry.path, progress.batch_read)
        elif jsonl.reads_decompressed(entry.path, entry.split):  # counted as its copy is written
            files = compressed_file(entry, datasets_cache)
            with closed_on_error(files), ReadProgress(entry.path, files.sizes[0]) as progress:
                layout = jsonl.scan_file(files.follow(0), progress.batch_read)
        else:
            path = readable_copy(
                entry.path, entry.split, datasets_cache, jsonl.reads_remote(entry.path, entry.split)
            )
            if not jsonl.applies(path, entry.split):
                return None
            with ReadProgress(entry.path, pinned.size_of(path)) as progress:
                layout = jsonl.scan(path, progress.batch_read)
    except DatasetError as exc:
        raise dataset_error(entry, exc) from None
    if layout is None or not layout.n_rows or not layout.columns:
        return None  # no rows, or only empty objects: datasets' path says why
    return layout


def batches_per_slice(slice_bytes: int) -> int:
    """The whole batches a slice of a file of several batches holds: about ``slice_bytes`` of them, at
    least one (so each batch is parsed by one slice). Larger slices mean fewer task runs: Prefect's
    per-task-run cost caps how many a run can dispatch per second, whatever the cores."""
    return max(1, round(slice_bytes / jsonl_batches.BATCH_BYTES))


def slice_is_full(taken: list[jsonl.JsonlBatch], slice_bytes: int) -> bool:
    """Whether ``taken``, consecutive batches, make a slice: :func:`batches_per_slice` of one file's, or
    of several files' (their last batches short) ``slice_bytes`` or a little more. The rule both the plan
    that counts first and the one that cuts as it counts follow."""
    if any(b.path for b in taken):
        return sum(b.end - b.offset for b in taken) >= slice_bytes
    return len(taken) >= batches_per_slice(slice_bytes)


def batch_pieces(taken: list[jsonl.JsonlBatch], slice_bytes: int) -> int:
    """Into how many slices ``taken`` (one slice's batches, in a small mixture) is cut: a batch of
    ``slice_bytes`` or more into about ``slice_bytes`` each, every one parsing the batch (33 ms for a 10 MiB
    batch of chats, against about 2 s of tokenizing it on one core); else one. Rounded to the nearest: a
    10 MiB batch in slices of 8 MiB stays whole."""
    if len(taken) != 1:
        return 1
    return max(1, int((taken[0].end - taken[0].offset) / slice_bytes + 0.5))


def row_pieces(lo: int, hi: int, rows: np.ndarray | None, pieces: int) -> list[Rows]:
    """Rows ``[lo, hi)`` (or the selected ``rows`` of them) in ``pieces`` slices of nearly equal rows."""
    chosen = np.arange(lo, hi) if rows is None else rows
    out: list[Rows] = []
    for part in np.array_split(chosen, min(pieces, len(chosen))) if len(chosen) else []:
        out.append((int(part[0]), int(part[-1]) + 1, None if rows is None else part.tolist()))
    return out


def _slice_runs(batches: list[jsonl.JsonlBatch], slice_bytes: int) -> list[list[jsonl.JsonlBatch]]:
    """Consecutive batches cut into slices by :func:`slice_is_full` (the last, whatever is left)."""
    runs: list[list[jsonl.JsonlBatch]] = [[]]
    for batch in batches:
        if slice_is_full(runs[-1], slice_bytes):
            runs.append([])
        runs[-1].append(batch)
    return [run for run in runs if run]


def batch_groups(
    layout: jsonl.JsonlLayout, selected: np.ndarray | None, slice_bytes: int, cut_batches: bool = False
) -> list[Rows]:
    """(start, end, subset) per slice of a file read by batch: whole batches (:func:`batches_per_slice`),
    so each batch is parsed once; a file of one batch (small) is cut into slices of about ``slice_bytes``,
    each parsing it, and so is every batch of a small mixture (``cut_batches``: :func:`batch_pieces`). The
    batches of several files (their last ones short) are taken until they hold about ``slice_bytes``."""
    batches = [b for b in layout.batches if b.rows]
    single = len(layout.batches) == 1
    runs = [batches] if single else _slice_runs(batches, slice_bytes)
    groups: list[Rows] = []
    for taken in runs:
        lo, hi = taken[0].first_row, taken[-1].first_row + taken[-1].rows
        if cut_batches:
            pieces = batch_pieces(taken, slice_bytes)
        else:
            pieces = max(1, -(-layout.size // slice_bytes)) if single else 1
        rows = (
            None
            if selected is None
            else selected[np.searchsorted(selected, lo) : np.searchsorted(selected, hi)]
        )
        groups += row_pieces(lo, hi, rows, pieces)
    return groups


def scanned_files(
    files: JsonFiles, name: str, on_batch: jsonl.BatchListener | None = None, threads: int | None = None
) -> jsonl.JsonlLayout | None:
    """:func:`sftmix.sources.jsonl.scan_files` of ``files``, each read as it lands; a refusal or a stop stops
    their downloads, as does a dataset ``datasets`` reads instead (it downloads the files itself)."""
    with closed_on_error(files):
        layout = jsonl.scan_files(files.paths, name, on_batch, threads, files.follow, files.declared)
    if layout is None:
        files.close()
    return layout


def streamed_files(entry: DatasetEntry, datasets_cache: str) -> JsonFiles | None:
    """The file (or pinned ``gs://`` object), or a hub dataset's (or a directory's) files, whose slices
    can be cut while they are read: JSON Lines of several batches whose every row is selected whatever
    their count (a fraction of 1.0 or more, a token budget). Its slices are its batches (or, with ``slice_rows``, that
    many rows of a batch), so each is cut once its batch is counted. ``None`` for any other dataset."""
    if not every_row(entry.amount):
        return None
    files: JsonFiles | None
    if jsonl.reads_decompressed(entry.path, entry.split):  # its copy read as it is written
        files = compressed_file(entry, datasets_cache)
        with closed_on_error(files):
            small = files.sizes[0] <= jsonl_batches.BATCH_BYTES
        if small:
            files.close()  # (read whole, as before)
            return None
        return files
    if local_builder(entry.path) is None and not is_remote(entry.path):
        files = json_data_files(entry.path, entry.split, entry.revision, datasets_cache)
        if files is None or not files.paths:
            return None
        here = files.downloads is None and files.copies is None
        if here and not all(jsonl.applies(f, "train") for f in files.paths):  # (each a file: 'train')
            return None  # (a file still to land or be decompressed is asked then: the scan reads none)
        with closed_on_error(files):
            small = sum(files.sizes) <= jsonl_batches.BATCH_BYTES
        if small:
            files.close()
            return None
        return files
    path = pinned.pin(entry.path) if jsonl.reads_remote(entry.path, entry.split) else entry.path
    if jsonl.applies(path, entry.split) and pinned.size_of(path) > jsonl_batches.BATCH_BYTES:
        return JsonFiles([path])
    return None


def compressed_file(entry: DatasetEntry, datasets_cache: str) -> JsonFiles:
    """A compressed JSON Lines file (or pinned ``gs://`` object), its copy made (or being made, shared
    with the plan made ahead of the plan) in the datasets cache: :meth:`JsonFiles.follow` reads it as it
    is written."""
    path = pinned.pin(entry.path)
    return JsonFiles([path], None, copies_of(entry.path, [path], datasets_cache, None))


def batch_data(schema_b64: str, batches: list[jsonl.JsonlBatch]) -> str:
    """The data a slice of a JSON Lines file reads: its batches' bytes and the columns they are cast to."""
    return digest([schema_b64, [[b.offset, b.end, b.sha256] for b in batches]])


def bad_lines_warning(
    entry: DatasetEntry, on_bad_row: str, bad_lines: tuple[jsonl.BadLine, ...]
) -> str | None:
    """The plan's words for the lines of a file that are not rows: its error, or a warning (skip)."""
    if not bad_lines:
        return None
    if on_bad_row == "error":
        raise bad_lines[0].error(entry.path, more=len(bad_lines) - 1)
    n, lines = len(bad_lines), ", ".join(b.place for b in bad_lines[:10])
    w = (
        f"{entry.path}: {n:,} line{'s' if n != 1 else ''} that {'are' if n != 1 else 'is'} not a row "
        f"(line{'s' if n != 1 else ''} {lines}{', ...' if n > 10 else ''}) will be skipped "
        "(on_bad_row: skip), with any more the slices find"
    )
    logger.warning(w)
    return w
