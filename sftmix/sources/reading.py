"""What every reader of the plan implements and shares: a dataset opened (what it holds, its sample),
then cut into slices (each the rows it reads and what they hold), its fingerprint counted.

A reader holds only what differs between formats: where the rows are, how they are counted and hashed,
and where a slice's boundaries fall. Selecting rows by the entry's amount, naming a dataset's file in an
error and handing cuts on as they are made are done here, once; the plan keys each cut into a slice
(:mod:`sftmix.planning.slicing`), so a reader knows nothing of tokenizers or keys.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from pydantic import BaseModel

from sftmix.config.config import DatasetEntry
from sftmix.config.run_options import RunOptions
from sftmix.config.selection import (
    Amount,
    large_upsample_warning,
    selected_source_rows,
    selection_problem,
    small_count_warning,
)
from sftmix.errors import DatasetError
from sftmix.runtime.parallel import available_cpus
from sftmix.runtime.storage import is_remote
from sftmix.sources import pinned
from sftmix.sources.formats import MESSAGES_KEY, Conversation, detect_format
from sftmix.sources.paths import local_builder

logger = logging.getLogger(__name__)

#: Rows of each dataset that the plan encodes with both encoders before trusting the fast one.
SAMPLE_ROWS = 32
#: While its slices begin, a large file is read by one thread per this many CPUs.
SCAN_SHARE = 8

#: A slice's rows: ``[start, end)``, or the listed subset of it.
Rows = tuple[int, int, list[int] | None]


class DatasetPlan(BaseModel):
    index: int
    name: str
    split: str
    amount: Amount
    max_repeats: float | None = None  # (a token budget's cap)
    n_rows: int
    target: int  # rows selected (a token budget: estimated from the sampled rows' tokens, chosen at assembly)
    fingerprint: str
    slices: list[int]
    tokens_per_row: float = 0.0  # its sampled rows' tokens on average, cut at the max length (an estimate)
    over_length_share: float = 0.0  # the share of its sampled rows longer than the max length

    @property
    def upsampled(self) -> bool:
        return self.target > self.n_rows

    def estimated_tokens(self, distinct: bool = False) -> int:
        """Tokens its rows make in the output (``distinct``: in its slices, each row tokenized once)."""
        rows = min(self.target, self.n_rows) if distinct else self.target
        return round(rows * self.tokens_per_row)


def digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode("utf-8")).hexdigest()


def rows_key(start: int, end: int, subset: list[int] | None) -> dict:
    return {"rows": [start, end], "subset": None if subset is None else digest(subset)}


class RowSource(BaseModel):
    """Where a slice's rows are, as its format reads them in a worker: each format's own model (a JSON Lines
    file's batches, a Parquet file's row groups, a dataset ``datasets`` opens), told apart by its
    ``data_format`` (a file's format, not a row's layout: that is ``row_format``)."""

    data_format: str


@dataclass(frozen=True)
class RowsAt:
    """The slice's dataset, for a format that reads its rows through it: its path, split and revision as
    the mixer names them, and the datasets cache."""

    path: str
    split: str
    revision: str | None
    datasets_cache: str


@dataclass(frozen=True)
class DataFormat:
    """A format as the plan and the workers know it: its ``source`` model, the plan's ``reader`` of it, and
    what a worker asks of it: a slice's rows by index (a line that is not a row comes back as the format's
    record of it), the source as this machine reads it (``None``: read through ``datasets`` instead), the file
    and line of a row for an error (``None``: not known), a check once the slice's rows are read, and its
    caches released between slices."""

    source: type[RowSource]
    reader: Reader
    read_rows: Callable[[Any, RowsAt, list[int]], Sequence[Any]]
    here: Callable[[Any], RowSource | None]
    row_place: Callable[[Any, RowsAt, int], tuple[str | None, int] | None] = lambda source, at, row: None
    finish: Callable[[], None] = lambda: None
    release: Callable[[], None] = lambda: None

    @property
    def name(self) -> str:
        """Its sources' ``data_format``."""
        return str(self.source.model_fields["data_format"].default)


@dataclass
class Cut:
    """A slice as a reader cuts it: rows of one dataset, what they hold (``data``, keyed with them; the
    sample's is ``"sample"``), their source bytes estimated (``est_bytes``: bigger slices start first) and
    where a worker reads them (``source``: its format's own)."""

    rows: Rows
    data: str
    est_bytes: int
    source: RowSource


@dataclass
class Planning:
    """What every reader is handed: the run, where the plan works, what a bad row does, the machine's
    memory and, as the plan goes, the rows selected before this dataset and the slices' size."""

    run: RunOptions
    work_dir: Path
    on_bad_row: str
    memory: int | None
    whole: Reader  # the reader of any dataset: a reader finding its dataset is not its own hands it on
    selected_total: int = 0  # rows the datasets before this one select
    slice_bytes: int = 0  # known once every dataset is opened
    cut_batches: bool = (
        False  # a small mixture's JSON Lines batches are cut into slices (slice_sizes.cuts_batches)
    )

    @property
    def datasets_cache(self) -> str:
        return str(self.work_dir / "datasets-cache")

    def check_selection(self, entry: DatasetEntry, n_rows: int, target: int) -> None:
        """Refuse an amount that selects no rows, or more than this machine can assemble."""
        if target == 0:
            raise DatasetError(entry.path, f"amount {entry.amount} of {n_rows} rows selects no rows")
        total = self.selected_total + target
        if (problem := selection_problem(entry.amount, n_rows, target, total, self.memory)) is not None:
            raise DatasetError(entry.path, problem)

    def sampled_rows(self, n_rows: int, selected: np.ndarray | None) -> Rows:
        """The rows a dataset's sample reads: its first selected rows, up to :data:`SAMPLE_ROWS` and no
        more than its first slice holds."""
        limit = min(SAMPLE_ROWS, self.run.slice_rows or SAMPLE_ROWS)
        if selected is None:
            return 0, min(n_rows, limit), None
        return row_groups(n_rows, selected[:limit], limit)[0]


@dataclass
class Opened:
    """A dataset opened by a reader: enough to sample its rows; ``plan`` and ``cuts`` once its slices
    are cut (a streamed file's only while it is read, after every dataset is opened)."""

    index: int
    entry: DatasetEntry
    reader: Reader
    held: Any = None  # what its reader keeps between opening and cutting it
    sampled: Cut | None = None  # whose first rows are the dataset's sample
    plan: DatasetPlan | None = None
    cuts: list[Cut] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)  # what the template does not render, in words
    probes: list[str] = field(default_factory=list)
    samples: list[tuple[int, Conversation]] = field(default_factory=list)  # sampled rows, by row number
    row_format: str = "messages"
    messages_key: str = MESSAGES_KEY
    selected: np.ndarray | None = None  # its rows selected by its amount (``None``: every row, once)
    nbytes: int = 0  # its data's size, as the mixture's size counts it (the slices' size)

    def counted(self, n_rows: int, target: int, fingerprint: str) -> None:
        """Its plan, once its rows are counted (slices numbered in mixer order later); an upsampling
        of each row a hundred times or more is said as it is found."""
        entry = self.entry
        if (w := large_upsample_warning(entry.path, entry.amount, n_rows, target)) is not None:
            self.warnings.append(w)
            logger.warning(w)
        self.plan = DatasetPlan(
            index=self.index,
            name=entry.path,
            split=entry.split,
            amount=entry.amount,
            max_repeats=entry.max_repeats,
            n_rows=n_rows,
            target=target,
            fingerprint=fingerprint,
            slices=[],
        )


class Reader(Protocol):
    """One way the plan reads a dataset. ``open`` returns ``None`` for a dataset it does not read (the
    next reader is asked); ``cut`` makes its slices, handing each on as it is cut where it can, counts
    its rows and fingerprint (``dataset.plan``), and says how many slices it has (some may be handed on
    later); ``ahead`` does the slow part of ``open`` before the plan (while the API starts)."""

    def ahead(self, entry: DatasetEntry, datasets_cache: str) -> bool: ...

    def open(self, index: int, entry: DatasetEntry, at: Planning) -> Opened | None: ...

    def cut(self, dataset: Opened, at: Planning, hand_on: HandOn) -> int: ...


class HandOn:
    """Cuts made while a dataset's files are read, each handed to ``deliver`` (the plan keys it into a slice
    and hands that to the head start) as soon as it is made, after the cuts of the datasets before it that
    became ready meanwhile (``unfinished``). ``deliver`` says whether it goes on: it is dropped at its first
    failure (the flow then runs the slice itself)."""

    def __init__(self, deliver: Callable[[Cut, int], bool] | None, unfinished: Unfinished):
        self.deliver, self.unfinished = deliver, unfinished
        self.made: list[Cut] = []

    def reading_threads(self) -> int | None:
        """Threads that read the files: beside slices that already run on every core, a few, well ahead
        of them (a worker takes seconds per slice; a thread reads one in milliseconds); else all."""
        return None if self.deliver is None else max(1, available_cpus() // SCAN_SHARE)

    def __call__(self, cut: Cut) -> None:
        self.unfinished.poll()
        self.made.append(cut)
        if self.deliver is not None and not self.deliver(cut, len(self.made) - 1):
            self.deliver = None


class Unfinished:
    """Parquet datasets whose spills are still being written when their row groups are all hashed: the
    plan cuts the datasets after them meanwhile (their spills run beside it, and the cores take the later
    datasets' slices), handing on their slices as the spills' rows are written (:meth:`poll`, on the
    plan's thread whenever it hands on a slice), and waits for the rest once every dataset is cut.

    A failure met in :meth:`poll` is raised by :meth:`check`, once the dataset being cut is: raised
    where it is met, the later dataset's reader would take it for its own."""

    def __init__(self) -> None:
        self._left: list[Callable[[bool], None]] = []
        self._polling = False
        self._failed: DatasetError | None = None

    def add(self, hand_on_ready: Callable[[bool], None]) -> None:
        self._left.append(hand_on_ready)

    def poll(self) -> None:
        if self._polling or self._failed is not None:  # (a slice they hand on polls again)
            return
        self._polling = True
        try:
            for hand_on_ready in self._left:
                hand_on_ready(False)
        except DatasetError as exc:
            self._failed = exc
        finally:
            self._polling = False

    def check(self) -> None:
        if self._failed is not None:
            raise self._failed

    def finish(self) -> None:
        """Each one's slices handed on, in mixer order, as its rows are written; its spills landed."""
        self.check()
        self._polling = True  # (they come in order now)
        while self._left:
            self._left.pop(0)(True)


def row_groups(n_rows: int, selected: np.ndarray | None, slice_rows: int) -> list[Rows]:
    """(start, end, subset) per slice: fixed ranges over all rows, or groups of the selected subset."""
    if selected is None:
        return [(a, min(a + slice_rows, n_rows), None) for a in range(0, n_rows, slice_rows)]
    groups: list[Rows] = []
    for a in range(0, len(selected), slice_rows):
        chunk = selected[a : a + slice_rows].tolist()
        groups.append((chunk[0], chunk[-1] + 1, chunk))
    return groups


def format_of(entry: DatasetEntry, columns: Any) -> tuple[str, str]:
    """The entry's row format and messages column, from its columns (or refused, naming the dataset)."""
    try:
        return detect_format(columns, entry.messages_key, entry.format)
    except ValueError as exc:
        raise DatasetError(entry.path, str(exc)) from None


def selected_rows(entry: DatasetEntry, n_rows: int, target: int, warnings: list[str]) -> np.ndarray | None:
    """The rows the entry's amount selects (``None``: every row, once), with the reference's warning for
    a small count that was probably meant as a fraction (:func:`small_count_warning`)."""
    if (w := small_count_warning(entry.path, entry.amount, n_rows)) is not None:
        warnings.append(w)
        logger.warning(w)
    return selected_source_rows(n_rows, target)


def dataset_error(entry: DatasetEntry, exc: DatasetError) -> DatasetError:
    """``exc`` said of the mixer's dataset ``entry``; where one of the dataset's several files (a hub
    dataset's, or a directory's) is what is wrong, the reason names it, so the user knows which to fix."""
    file = _file_of(entry, exc.dataset)
    if file is None or file in exc.reason:
        return DatasetError(entry.path, exc.reason)
    return DatasetError(entry.path, f"{file}: {exc.reason}")


_HUB_CACHE_COPY = re.compile(r".*/snapshots/[0-9a-f]{40}/(.+)")


def _file_of(entry: DatasetEntry, path: str) -> str | None:
    """``path`` as one of the files of hub dataset (or directory) ``entry``: its path there (a hub file at
    a commit, the hub cache's copy of one, a file in the directory); ``None`` for the dataset itself or a
    single file's copy (its name says it)."""
    if path == entry.path or local_builder(entry.path) is not None or is_remote(entry.path):
        return None
    if (name := pinned.hub_file_name(path)) is not None:
        return name
    if (copy := _HUB_CACHE_COPY.fullmatch(path.replace(os.sep, "/"))) is not None:
        return copy.group(1)
    folder = os.path.abspath(entry.path)
    if os.path.isdir(folder) and os.path.abspath(path).startswith(folder + os.sep):
        return os.path.relpath(path, folder)
    return None


def read_whole_instead(dataset: Opened, at: Planning) -> int:
    """A dataset found, once its read began, to be one only ``datasets`` reads (before any slice was cut):
    opened and cut by the reader of any dataset instead."""
    whole = at.whole.open(dataset.index, dataset.entry, at)
    assert whole is not None
    count = at.whole.cut(whole, at, HandOn(None, Unfinished()))
    dataset.plan, dataset.cuts, dataset.warnings = whole.plan, whole.cuts, whole.warnings
    return count
