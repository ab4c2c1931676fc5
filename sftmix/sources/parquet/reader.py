"""The reader of a Parquet dataset read by row group (a local file, a ``gs://`` object read in place, a
hub dataset's or directory's files, fetched): counted from its footers, so any amount is selected (and
refused) before any row group is read; its slices cut as its row groups are hashed, each handed on as
soon as the row groups it reads are (a row group several slices share, decoded once into a spill)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from sftmix.config.config import DatasetEntry
from sftmix.config.selection import target_rows
from sftmix.errors import DatasetError
from sftmix.runtime.storage import is_remote
from sftmix.sources import parquet
from sftmix.sources.copies import readable_copy
from sftmix.sources.data_files import parquet_data_files
from sftmix.sources.downloads import closed_on_error
from sftmix.sources.parquet.spill import Spill, spill_group
from sftmix.sources.paths import local_builder, readable_here
from sftmix.sources.reading import (
    Cut,
    DataFormat,
    HandOn,
    Opened,
    Planning,
    Rows,
    RowsAt,
    dataset_error,
    digest,
    format_of,
    read_whole_instead,
    row_groups,
    selected_rows,
)


def counted_parquet(entry: DatasetEntry, datasets_cache: str) -> parquet.ParquetLayout | None:
    """The dataset's row groups, counted from the footers (not yet hashed), when it is Parquet read by
    row group (:mod:`sftmix.sources.parquet`): a local file or a ``gs://`` object (read in place), or the files
    of a hub dataset (or a directory laid out like one), fetched; else ``None``."""
    try:
        if local_builder(entry.path) == "parquet" and parquet.applies(
            path := readable_copy(
                entry.path, entry.split, datasets_cache, parquet.reads_remote(entry.path, entry.split)
            ),
            entry.split,
        ):
            return parquet.counted([path])
        if local_builder(entry.path) is None and not parquet.disabled():
            found = parquet_data_files(entry.path, entry.split, entry.revision, datasets_cache)
            if found is None:
                return None
            layout = parquet.counted(found.paths, found.declared)
            if found.downloads is None:
                return layout
            if layout is None:  # datasets reads it, and downloads it itself
                found.downloads.close()
                return None
            return replace(layout, downloads=found.downloads)
    except DatasetError as exc:
        raise dataset_error(entry, exc) from None
    return None


def _layout(dataset: Opened) -> parquet.ParquetLayout:
    assert isinstance(dataset.held, parquet.ParquetLayout)
    return dataset.held


class ParquetReader:
    def ahead(self, entry: DatasetEntry, datasets_cache: str) -> bool:
        return counted_parquet(entry, datasets_cache) is not None  # (its row groups hashed as it is cut)

    def open(self, index: int, entry: DatasetEntry, at: Planning) -> Opened | None:
        """Opened from its footers; ``None`` for a dataset ``datasets`` is to read."""
        layout = counted_parquet(entry, at.datasets_cache)
        if layout is None:
            return None
        with closed_on_error(layout.downloads):  # refused (or stopped): its files stop downloading
            row_format, messages_key = format_of(entry, layout.columns)
            target = target_rows(entry.amount, layout.n_rows)
            at.check_selection(entry, layout.n_rows, target)
            warnings: list[str] = []
            dataset = Opened(
                index,
                entry,
                self,
                held=layout,
                warnings=warnings,
                row_format=row_format,
                messages_key=messages_key,
                selected=selected_rows(entry, layout.n_rows, target, warnings),
                nbytes=layout.nbytes,
            )
            rows = at.sampled_rows(layout.n_rows, dataset.selected)
            first = [parquet.with_sha256(g, layout.downloads) for g in parquet.groups_for(layout, *rows[:2])]
            dataset.sampled = Cut(rows, "sample", 0, layout.source(first))
            return dataset

    def cut(self, dataset: Opened, at: Planning, hand_on: HandOn) -> int:
        """How many slices it has. Each is handed on as soon as its row groups are hashed (a spilled row
        group's, as its rows are written: those left when the last row group is hashed join
        ``hand_on.unfinished``); a dataset whose first row group does not decode from its recorded bytes
        alone is read by ``datasets`` instead."""
        entry, layout = dataset.entry, _layout(dataset)
        target = target_rows(entry.amount, layout.n_rows)
        at.check_selection(entry, layout.n_rows, target)
        cutting = _Cutting(dataset, at, hand_on)
        try:
            sampled = dataset.sampled.source if dataset.sampled is not None else None
            known = sampled.row_groups if isinstance(sampled, parquet.ParquetSource) else []
            done = parquet.hashed(layout, cutting.on_group, hand_on.reading_threads(), known)
        except DatasetError as exc:
            raise dataset_error(entry, exc) from None
        if done is None:  # (found before any slice was cut)
            return read_whole_instead(dataset, at)
        dataset.cuts = hand_on.made  # (its last slices may be handed on later: their number is known)
        dataset.counted(layout.n_rows, target, done.fingerprint)
        if cutting.spills:
            cutting.spilled_ready(False)
            hand_on.unfinished.add(cutting.spilled_ready)
        else:
            assert len(hand_on.made) == len(cutting.cuts)
        return len(cutting.cuts)


class _Cutting:
    """One Parquet dataset's slices as its row groups are hashed: each cut handed on once every row group
    it reads is hashed (and a spilled one's rows written)."""

    def __init__(self, dataset: Opened, at: Planning, hand_on: HandOn) -> None:
        self.dataset, self.at, self.hand_on = dataset, at, hand_on
        layout = self.layout = _layout(dataset)
        # (a remote work directory: slices may run where a spill is not)
        self.spilling = not (at.run.work_dir and is_remote(at.run.work_dir))
        self.cuts: list[Rows] = (
            row_groups(layout.n_rows, dataset.selected, at.run.slice_rows)
            if at.run.slice_rows
            else parquet.slice_cuts(layout, dataset.selected, at.slice_bytes, self.spilling)
        )
        self.hashed: dict[tuple[str, int], parquet.RowGroup] = {}
        self.waiting = [parquet.groups_for(layout, start, end) for start, end, _ in self.cuts]
        self.pieces = Counter((g.path, g.index) for groups in self.waiting for g in groups)
        self.spills: dict[tuple[str, int], Spill] = {}

    def source(self, i: int, wait: bool) -> parquet.ParquetSource | None:
        """Cut ``i``'s rows once its row groups are hashed (and the spilled ones' rows written)."""
        if not all((g.path, g.index) in self.hashed for g in self.waiting[i]):
            return None
        groups = [self.hashed[(g.path, g.index)] for g in self.waiting[i]]
        start, end, _ = self.cuts[i]
        spilled = []
        for g in groups:
            if (spill := self.spills.get((g.path, g.index))) is not None:
                lo, hi = max(start, g.first_row) - g.first_row, min(end, g.first_row + g.rows) - g.first_row
                if (rows := spill.rows(lo, hi, wait)) is None:
                    return None
                spilled.append(rows)
        return self.layout.source(groups, spilled)

    def hand_on_ready(self, wait: bool) -> None:
        made, layout = self.hand_on.made, self.layout
        while len(made) < len(self.waiting) and (found := self.source(len(made), wait)) is not None:
            start, end, subset = self.cuts[len(made)]
            size = round((end - start if subset is None else len(subset)) * layout.nbytes / layout.n_rows)
            data = digest(layout.data_key(found.row_groups))
            self.hand_on(Cut((start, end, subset), data, size, found))

    def spilled_ready(self, wait: bool) -> None:
        """(After the last row group is hashed.) ``wait``: every slice, and the spills landed."""
        try:
            self.hand_on_ready(wait)
            if wait:
                assert len(self.hand_on.made) == len(self.cuts)
                for written in self.spills.values():
                    written.wait()  # (a later plan reuses it; its writer's error, raised)
        except DatasetError as exc:
            raise dataset_error(self.dataset.entry, exc) from None

    def on_group(self, group: parquet.RowGroup) -> None:
        key, layout = (group.path, group.index), self.layout
        self.hashed[key] = group
        if (
            self.spilling and self.pieces[key] > 1 and parquet.spilled(group)
        ):  # decoded once for all its slices
            self.spills[key] = spill_group(
                group.path,
                group.index,
                group.rows,
                self.at.datasets_cache,
                digest(layout.data_key([group])),
                lambda: parquet.decoded_tables(layout, group),
            )
        self.hand_on_ready(False)


BY_ROW_GROUP = ParquetReader()


def _rows(source: parquet.ParquetSource, at: RowsAt, rows: list[int]) -> Sequence[dict[str, Any]]:
    return parquet.read_rows(source, rows)


def _here(source: parquet.ParquetSource) -> parquet.ParquetSource | None:
    """Read as planned where its files are on this machine (or on ``gs://``), without the planner's spills
    (they lie in its work directory); else ``datasets`` opens it."""
    if not readable_here(f.path for f in source.footers):
        return None
    return source.model_copy(update={"spilled": []}) if source.spilled else source


FORMAT = DataFormat(
    parquet.ParquetSource,
    BY_ROW_GROUP,
    _rows,
    _here,
    finish=parquet.confirm,
    release=parquet.release,
)
