"""Plan a mixer: open each dataset, select its rows, and cut the work into content-keyed slices.

The plan is small and printable (``tokenize-mixer plan``). A slice's content key hashes everything
that changes its bytes, so an identical rerun finds every slice done and an edit recomputes only what
it touches.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from sftmix.config.byte_settings import for_slices, keyed
from sftmix.config.config import (
    DatasetEntry,
    MixerConfig,
    RunOptions,
    TokenizerSpec,
    default_work_dir,
    local_mirror,
)
from sftmix.config.selection import (
    selected_source_rows,
    selection_problem,
    small_count_warning,
    target_rows,
)
from sftmix.errors import ConfigError, DatasetError, TemplateError
from sftmix.planning.recipe import input_record, mixer_recipe
from sftmix.runtime.parallel import available_cpus, memory_limit
from sftmix.runtime.read_progress import ReadProgress
from sftmix.runtime.storage import atomic_write_bytes, is_remote, storage_errors
from sftmix.sources import jsonl, parquet, pinned
from sftmix.sources.dataset import (
    JsonFiles,
    RowsFingerprinter,
    SourceInfo,
    arrow_cache_files,
    copies_of,
    describe,
    forget_builders,
    hash_ahead,
    json_data_files,
    local_builder,
    localize,
    parquet_data_files,
    path_problem,
    release_mapped_data,
)
from sftmix.sources.downloads import closed_on_error
from sftmix.sources.formats import (
    MESSAGES_KEY,
    Conversation,
    RowFormatError,
    conversation_from_row,
    detect_format,
)
from sftmix.sources.growing import final_name
from sftmix.sources.spill import Spill, forget_spills, spill_group
from sftmix.tokenizing.encoders import same_encodings
from sftmix.tokenizing.slices import (
    SLICE_FORMAT_VERSION,
    SliceSpec,
    TokenizeContext,
    encoding_for,
    rows_of,
    workers_context,
)
from sftmix.tokenizing.templates import (
    ChatRenderer,
    ResolvedTemplate,
    check_template_name,
    has_generation_tags,
    read_template_file,
    resolve_template,
)
from sftmix.tokenizing.tokenizer import (
    TokenizerKey,
    ids_changed,
    load_worker_tokenizer,
    tokenizer_path_problem,
)
from sftmix.tokenizing.tokenizer_facts import TokenizerFacts, tokenizer_facts, worker_tokenizer_file
from sftmix.tokenizing.tokenizer_load import built_as, reference_note
from sftmix.tokenizing.unrendered import unrendered, what_it_reads

logger = logging.getLogger(__name__)


class DatasetPlan(BaseModel):
    index: int
    name: str
    split: str
    amount: float | int
    n_rows: int
    target: int
    fingerprint: str
    slices: list[int]

    @property
    def upsampled(self) -> bool:
        return self.target > self.n_rows


class Plan(BaseModel):
    mixer: MixerConfig
    context: TokenizeContext
    datasets: list[DatasetPlan]
    slices: list[SliceSpec]
    template_source: str
    template_sha256: str
    tokenizer_fingerprint: str
    warnings: list[str]
    unrendered: list[str] = []  # (also in warnings) data the template leaves out, in words
    tokenizer_load_note: str | None = None  # (also in warnings) the reference's tokenizer is not its files'
    inputs: dict | None = None  # the input files' stamps, taken before the plan read them (up_to_date)
    slicing: str = ""  # how the slices were sized, in words (the summary's)
    seconds: float = 0.0  # how long making it took
    made_ahead: bool = False  # made by the command while the Prefect API started, and handed to the flow

    def recipe(self) -> dict[str, Any]:
        """Everything the output's bytes follow from (and nothing they do not: run options, the
        encoder, overwrite, the output's own path): written into the published output's marker, so
        that a rerun into it can tell before any work whether it would make different shards."""
        return {
            "format": SLICE_FORMAT_VERSION,
            "mixer": mixer_recipe(self.mixer),
            "data": [d.fingerprint for d in self.datasets],
            "tokenizer": self.tokenizer_fingerprint,
            "template": self.template_sha256,
            "token_dtype": self.context.token_dtype,
        }

    def summary(self, warnings: bool = True) -> str:
        """The plan in lines; ``warnings=False`` leaves out what the plan logged as it found it."""
        m = self.mixer
        lines = [
            f"tokenizer   {m.tokenizer.name_or_path} (fingerprint {self.tokenizer_fingerprint[:12]})",
            f"template    {m.tokenizer.chat_template or '(tokenizer)'} -> {self.template_source} "
            f"(sha256 {self.template_sha256[:12]})",
            f"max length  {m.max_seq_length}; token dtype {self.context.token_dtype}; shuffle seed {m.shuffle_seed}"
            + (f"; first {m.num_examples} rows" if m.num_examples else ""),
            f"work dir    {self.context.remote_work_dir or self.context.work_dir}",
            f"output      {m.output.path}",
            "",
            f"{'#':>3}  {'dataset':<40} {'split':<8} {'amount':>8} {'rows':>9} {'selected':>9} {'slices':>6}",
        ]
        for d in self.datasets:
            lines.append(
                f"{d.index:>3}  {d.name:<40} {d.split:<8} {d.amount!s:>8} {d.n_rows:>9} {d.target:>9} {len(d.slices):>6}"
            )
        lines.append(f"\n{len(self.slices)} slices" + (f", {self.slicing}" if self.slicing else ""))
        for w in self.warnings if warnings else []:
            lines.append(f"warning: {w}")
        return "\n".join(lines)


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode("utf-8")).hexdigest()


MAX_AUTO_SLICE_ROWS = 20_000
#: While its slices begin, a large file is read by one thread per this many CPUs.
SCAN_SHARE = 8


#: Bytes per slice when the run leaves them to the tool: the smallest of these that cuts the mixture into
#: at most ``AUTO_SLICES`` slices (the largest one beyond that).
AUTO_SLICE_BYTES = (4 << 20, 8 << 20, 16 << 20, 32 << 20, 64 << 20)
AUTO_SLICES = 512


def slice_bytes_for(run: RunOptions, nbytes: int) -> int:
    """The bytes per slice of a mixture of ``nbytes``: the run's, or by the mixture's size. Each slice is a
    task run, and one Prefect API core dispatches ~25 a second whatever the cores: a mixture cut into at
    most ~512 slices (up to 32 GiB) costs at most ~20 s of dispatch; beyond, 64 MiB slices are dispatched
    as fast as 64 cores tokenize them. The whole mixture decides, not each dataset (20 Parquet datasets of
    1 GB each were ~4,800 task runs, over 3 minutes of dispatch for ~13 s of work on 64 cores), and not
    the workers, so finished slices are reused whatever the parallelism; in tiers, so a mixture that
    grows a little keeps its slices."""
    if run.slice_bytes is not None:
        return run.slice_bytes
    return next((b for b in AUTO_SLICE_BYTES if nbytes <= b * AUTO_SLICES), AUTO_SLICE_BYTES[-1])


def rows_per_slice(nbytes: int, n_rows: int, slice_bytes: int) -> int:
    """Rows that make about ``slice_bytes`` of this dataset's data."""
    per_row = max(1.0, nbytes / max(n_rows, 1))
    return max(1, min(MAX_AUTO_SLICE_ROWS, int(slice_bytes // per_row)))


def _row_groups(
    n_rows: int, selected: np.ndarray | None, slice_rows: int
) -> list[tuple[int, int, list[int] | None]]:
    """(start, end, subset) per slice: fixed ranges over all rows, or groups of the selected subset."""
    if selected is None:
        return [(a, min(a + slice_rows, n_rows), None) for a in range(0, n_rows, slice_rows)]
    groups = []
    for a in range(0, len(selected), slice_rows):
        chunk = selected[a : a + slice_rows].tolist()
        groups.append((chunk[0], chunk[-1] + 1, chunk))
    return groups


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
    def key(rows_key: dict) -> str:
        return _digest(rows_key)

    def remember(self, rows_key: dict, fingerprint: str) -> None:
        self.known[self.key(rows_key)] = fingerprint
        self.dirty = True

    def save(self) -> None:
        if self.dirty:
            atomic_write_bytes(self.path, json.dumps(self.known, sort_keys=True).encode("utf-8"))


def _work_dir_path(run: RunOptions) -> Path:
    """The local work directory (a remote one's local mirror), not created."""
    if run.work_dir and is_remote(run.work_dir):
        return local_mirror(run.work_dir)
    return Path(run.work_dir).expanduser() if run.work_dir else default_work_dir()


def _work_dir(run: RunOptions) -> tuple[Path, str | None]:
    """The local work directory (created) and the remote one it mirrors, if any."""
    remote = run.work_dir if is_remote(run.work_dir) else None
    work_dir = _work_dir_path(run)
    with storage_errors(f"work directory {work_dir} is not usable"):
        work_dir.mkdir(parents=True, exist_ok=True)
    return work_dir, remote


def _local_copy(entry: DatasetEntry, datasets_cache: str) -> str:
    """The file the plan reads: the entry's own path; a ``gs://`` JSON Lines or Parquet object's pinned
    generation (:func:`sftmix.sources.pinned.pin`); for another ``gs://`` object, this machine's copy of it in the
    cache ``datasets`` would read it from (fetched once per object generation). (A compressed JSON Lines
    file's copy: :func:`_compressed_file`.)"""
    if jsonl.reads_remote(entry.path, entry.split) or parquet.reads_remote(entry.path, entry.split):
        return pinned.pin(entry.path)  # read in place, by byte range
    whole = is_remote(entry.path) and local_builder(entry.path) is not None and entry.split.strip() == "train"
    return localize(entry.path, datasets_cache) if whole else entry.path


def _jsonl_layout(entry: DatasetEntry, datasets_cache: str) -> jsonl.JsonlLayout | None:
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
                layout = _scanned_files(files, entry.path, progress.batch_read)
        elif jsonl.reads_decompressed(entry.path, entry.split):  # counted as its copy is written
            files = _compressed_file(entry, datasets_cache)
            with closed_on_error(files), ReadProgress(entry.path, files.sizes[0]) as progress:
                layout = jsonl.scan_file(files.follow(0), progress.batch_read)
        else:
            path = _local_copy(entry, datasets_cache)
            if not jsonl.applies(path, entry.split):
                return None
            with ReadProgress(entry.path, pinned.size_of(path)) as progress:
                layout = jsonl.scan(path, progress.batch_read)
    except DatasetError as exc:
        raise _dataset_error(entry, exc) from None
    if layout is None or not layout.n_rows or not layout.columns:
        return None  # no rows, or only empty objects: datasets' path says why
    return layout


def _dataset_error(entry: DatasetEntry, exc: DatasetError) -> DatasetError:
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


def _parquet_counted(entry: DatasetEntry, datasets_cache: str) -> parquet.ParquetLayout | None:
    """The dataset's row groups, counted from the footers (not yet hashed), when it is Parquet read by
    row group (:mod:`sftmix.sources.parquet`): a local file or a ``gs://`` object (read in place), or the files
    of a hub dataset (or a directory laid out like one), fetched; else ``None``."""
    try:
        if local_builder(entry.path) == "parquet" and parquet.applies(
            path := _local_copy(entry, datasets_cache), entry.split
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
        raise _dataset_error(entry, exc) from None
    return None


def _read_by_us(entry: DatasetEntry) -> bool:
    """Whether the plan reads the dataset's local file itself (by batch or row group), not through
    ``datasets`` (whose file the plan hashes ahead)."""
    path, split = entry.path, entry.split
    return (
        jsonl.applies(path, split)
        or jsonl.reads_decompressed(path, split)
        or jsonl.reads_remote(path, split)
        or parquet.applies(path, split)
        or parquet.reads_remote(path, split)
    )


def batches_per_slice(slice_bytes: int) -> int:
    """The whole batches a slice of a file of several batches holds: about ``slice_bytes`` of them, at
    least one (so each batch is parsed by one slice). Larger slices mean fewer task runs: Prefect's
    per-task-run cost caps how many a run can dispatch per second, whatever the cores."""
    return max(1, round(slice_bytes / jsonl.BATCH_BYTES))


def _slice_is_full(taken: list[jsonl.JsonlBatch], slice_bytes: int) -> bool:
    """Whether ``taken``, consecutive batches, make a slice: :func:`batches_per_slice` of one file's, or
    of several files' (their last batches short) ``slice_bytes`` or a little more. The rule both the plan
    that counts first and the one that cuts as it counts follow."""
    if any(b.path for b in taken):
        return sum(b.end - b.offset for b in taken) >= slice_bytes
    return len(taken) >= batches_per_slice(slice_bytes)


def _slice_runs(batches: list[jsonl.JsonlBatch], slice_bytes: int) -> list[list[jsonl.JsonlBatch]]:
    """Consecutive batches cut into slices by :func:`_slice_is_full` (the last, whatever is left)."""
    runs: list[list[jsonl.JsonlBatch]] = [[]]
    for batch in batches:
        if _slice_is_full(runs[-1], slice_bytes):
            runs.append([])
        runs[-1].append(batch)
    return [run for run in runs if run]


def _batch_groups(
    layout: jsonl.JsonlLayout, selected: np.ndarray | None, slice_bytes: int
) -> list[tuple[int, int, list[int] | None]]:
    """(start, end, subset) per slice of a file read by batch: whole batches (:func:`batches_per_slice`),
    so each batch is parsed once; a file of one batch (small) is cut into slices of about
    ``slice_bytes``, each parsing it. The batches of several files (their last ones short) are taken
    until they hold about ``slice_bytes``."""
    batches = [b for b in layout.batches if b.rows]
    if len(layout.batches) == 1:
        pieces, runs = max(1, -(-layout.size // slice_bytes)), [batches]
    else:
        pieces, runs = 1, _slice_runs(batches, slice_bytes)
    groups: list[tuple[int, int, list[int] | None]] = []
    for taken in runs:
        lo, hi = taken[0].first_row, taken[-1].first_row + taken[-1].rows
        if selected is None:
            rows = np.arange(lo, hi)
        else:
            rows = selected[np.searchsorted(selected, lo) : np.searchsorted(selected, hi)]
        for part in np.array_split(rows, min(pieces, len(rows))) if len(rows) else []:
            start, end = int(part[0]), int(part[-1]) + 1
            groups.append((start, end, None if selected is None else part.tolist()))
    return groups


@dataclass
class _Opened:
    """A dataset opened by the plan: enough to sample its rows; ``plan`` and ``specs`` once its slices
    are cut (a streamed file's only while it is read, after every dataset is opened)."""

    index: int
    entry: DatasetEntry
    sampled: SliceSpec | None = None  # whose first rows are the dataset's sample
    plan: DatasetPlan | None = None
    specs: list[SliceSpec] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)  # what the template does not render, in words
    probes: list[str] = field(default_factory=list)
    samples: list[Conversation] = field(default_factory=list)
    row_format: str = "messages"
    messages_key: str = MESSAGES_KEY
    # Parquet: its row groups counted from the footers, and its slices' rows, cut as they are hashed
    row_groups: parquet.ParquetLayout | None = None
    cuts: list[tuple[int, int, list[int] | None]] = field(default_factory=list)
    streamed: JsonFiles | None = (
        None  # the JSON Lines file(s) (or pinned object) its slices are cut from as read
    )
    whole: _Whole | None = None  # read whole (counted, hashed) before its slices are cut
    selected: np.ndarray | None = None  # its rows selected by its amount (``None``: every row, once)
    nbytes: int = 0  # its data's size, as the mixture's size counts it (the slices' size)

    def counted(self, n_rows: int, target: int, fingerprint: str) -> None:
        """Its plan, once its rows are counted (slices numbered in mixer order later)."""
        entry = self.entry
        self.plan = DatasetPlan(
            index=self.index,
            name=entry.path,
            split=entry.split,
            amount=entry.amount,
            n_rows=n_rows,
            target=target,
            fingerprint=fingerprint,
            slices=[],
        )


class _SliceCutter:
    """Slice specs with their content keys: the row range, the rows' layout and the data they hold."""

    def __init__(self, shared_key: dict, work_dir: Path, run: RunOptions) -> None:
        self.shared_key, self.work_dir, self.run = shared_key, work_dir, run

    def spec(
        self,
        dataset: _Opened,
        rows: tuple[int, int, list[int] | None],
        data: str,
        est_bytes: int,
        **where: Any,
    ) -> SliceSpec:
        start, end, subset = rows
        rows_key = _rows_key(start, end, subset)
        layout = (
            {}
            if (dataset.row_format, dataset.messages_key) == ("messages", MESSAGES_KEY)
            else {"row_format": [dataset.row_format, dataset.messages_key]}
        )
        entry = dataset.entry
        return SliceSpec(
            key=_digest({**self.shared_key, **rows_key, **layout, "data": data}),
            index=-1,  # numbered once every dataset's slices are cut, in mixer order
            dataset_index=dataset.index,
            dataset=entry.path,
            split=entry.split,
            revision=entry.revision,
            row_format=dataset.row_format,
            messages_key=dataset.messages_key,
            row_start=start,
            row_end=end,
            rows=subset,
            est_bytes=est_bytes,
            **where,
        )


def _rows_key(start: int, end: int, subset: list[int] | None) -> dict:
    return {"rows": [start, end], "subset": None if subset is None else _digest(subset)}


def _batch_data(schema_b64: str, batches: list[jsonl.JsonlBatch]) -> str:
    """The data a slice of a JSON Lines file reads: its batches' bytes and the columns they are cast to."""
    return _digest([schema_b64, [[b.offset, b.end, b.sha256] for b in batches]])


def _format_of(entry: DatasetEntry, columns: Any) -> tuple[str, str]:
    try:
        return detect_format(columns, entry.messages_key, entry.format)
    except ValueError as exc:
        raise DatasetError(entry.path, str(exc)) from None


def _scanned_files(
    files: JsonFiles, name: str, on_batch: jsonl.BatchListener | None = None, threads: int | None = None
) -> jsonl.JsonlLayout | None:
    """:func:`sftmix.sources.jsonl.scan_files` of ``files``, each read as it lands; a refusal or a stop stops
    their downloads, as does a dataset ``datasets`` reads instead (it downloads the files itself)."""
    with closed_on_error(files):
        layout = jsonl.scan_files(files.paths, name, on_batch, threads, files.follow, files.declared)
    if layout is None:
        files.close()
    return layout


def _streamed_files(entry: DatasetEntry, datasets_cache: str) -> JsonFiles | None:
    """The file (or pinned ``gs://`` object), or a hub dataset's (or a directory's) files, whose slices
    can be cut while they are read: JSON Lines of several batches whose every row is selected whatever
    their count (a fraction of 1.0 or more). Its slices are its batches (or, with ``slice_rows``, that
    many rows of a batch), so each is cut once its batch is counted. ``None`` for any other dataset."""
    if not isinstance(entry.amount, float) or entry.amount < 1.0:
        return None
    if jsonl.reads_decompressed(entry.path, entry.split):  # its copy read as it is written
        files = _compressed_file(entry, datasets_cache)
        with closed_on_error(files):
            small = files.sizes[0] <= jsonl.BATCH_BYTES
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
            small = sum(files.sizes) <= jsonl.BATCH_BYTES
        if small:
            files.close()
            return None
        return files
    path = pinned.pin(entry.path) if jsonl.reads_remote(entry.path, entry.split) else entry.path
    if jsonl.applies(path, entry.split) and pinned.size_of(path) > jsonl.BATCH_BYTES:
        return JsonFiles([path])
    return None


def _compressed_file(entry: DatasetEntry, datasets_cache: str) -> JsonFiles:
    """A compressed JSON Lines file (or pinned ``gs://`` object), its copy made (or being made, shared
    with the plan made ahead of the plan) in the datasets cache: :meth:`JsonFiles.follow` reads it as it
    is written."""
    path = pinned.pin(entry.path)
    return JsonFiles([path], None, copies_of(entry.path, [path], datasets_cache, None))


def _source_path(dataset: _Opened) -> str:
    """What a streamed dataset's slices name as their file: the file, or the dataset of several files."""
    assert dataset.streamed is not None
    if len(dataset.streamed.paths) == 1:
        return final_name(dataset.streamed.follow(0))
    return dataset.entry.path


def _streamed_source(dataset: _Opened, schema_b64: str, batches: list[jsonl.JsonlBatch]) -> jsonl.JsonlSource:
    """What a slice of a streamed dataset reads: ``batches``, cast to the features ``schema_b64``."""
    assert dataset.streamed is not None
    declared = dataset.streamed.declared is not None
    return jsonl.JsonlSource(
        path=_source_path(dataset), schema_b64=schema_b64, batches=batches, declared=declared
    )


def _open_streamed(
    index: int, entry: DatasetEntry, run: RunOptions, cutter: _SliceCutter, memory: int | None
) -> _Opened | None:
    """A file (or files) whose slices are cut while it is read, opened from its first batch; ``None`` for
    any other (or one whose selection, estimated from its first batch, might be refused: it is counted
    first)."""
    try:
        if (files := _streamed_files(entry, str(cutter.work_dir / "datasets-cache"))) is None:
            return None
        with closed_on_error(files):
            dataset = _opened_streamed(index, entry, run, cutter, memory, files)
    except DatasetError as exc:
        raise _dataset_error(entry, exc) from None
    if dataset is None:
        files.close()  # (counted first: read again, as they land)
    return dataset


def _opened_streamed(
    index: int,
    entry: DatasetEntry,
    run: RunOptions,
    cutter: _SliceCutter,
    memory: int | None,
    files: JsonFiles,
) -> _Opened | None:
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
    if selection_problem(entry.amount, estimate, target, 2 * target, memory) is not None:
        return None  # (near a limit: counted first, so that a refusal comes before any work)
    row_format, messages_key = _format_of(entry, columns)
    dataset = _Opened(
        index,
        entry,
        row_format=row_format,
        messages_key=messages_key,
        streamed=files,
        nbytes=nbytes,
    )
    if len(files.paths) > 1:  # (each batch names its file)
        batch = batch.model_copy(update={"path": final_name(first)})
    source = _streamed_source(dataset, schema_b64, [batch])
    first = (0, min(batch.rows, run.slice_rows or batch.rows), None)  # the first slice's rows
    dataset.sampled = cutter.spec(dataset, first, _batch_data(schema_b64, [batch]), 0, jsonl=source)
    return dataset


def _bad_lines_warning(
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


def _check_selection(
    entry: DatasetEntry, n_rows: int, target: int, selected_total: int, memory: int | None
) -> None:
    if target == 0:
        raise DatasetError(entry.path, f"amount {entry.amount} of {n_rows} rows selects no rows")
    if (problem := selection_problem(entry.amount, n_rows, target, selected_total, memory)) is not None:
        raise DatasetError(entry.path, problem)


def _selected_rows(entry: DatasetEntry, n_rows: int, target: int, warnings: list[str]) -> np.ndarray | None:
    """The rows the entry's amount selects (``None``: every row, once), with the reference's warning for
    a small count that was probably meant as a fraction (:func:`small_count_warning`)."""
    if (w := small_count_warning(entry.path, entry.amount, n_rows)) is not None:
        warnings.append(w)
        logger.warning(w)
    return selected_source_rows(n_rows, target)


def _sampled_rows(
    n_rows: int, selected: np.ndarray | None, run: RunOptions
) -> tuple[int, int, list[int] | None]:
    """The rows a dataset's sample reads: its first selected rows, up to :data:`SAMPLE_ROWS` and no more
    than its first slice holds."""
    limit = min(SAMPLE_ROWS, run.slice_rows or SAMPLE_ROWS)
    if selected is None:
        return 0, min(n_rows, limit), None
    return _row_groups(n_rows, selected[:limit], limit)[0]


@dataclass
class _Whole:
    """What cutting a dataset read whole into slices needs: its count, its batches or Arrow files."""

    info: SourceInfo
    batched: jsonl.JsonlLayout | None
    arrow_files: list[str] | None


def _open_whole(
    index: int,
    entry: DatasetEntry,
    run: RunOptions,
    cutter: _SliceCutter,
    on_bad_row: str,
    selected_total: int,
    memory: int | None,
) -> _Opened:
    """A dataset read whole before its slices are cut (counted, hashed): counted and sampled here, its
    slices cut by :func:`_cut_whole` once the mixture's size is known."""
    datasets_cache = str(cutter.work_dir / "datasets-cache")
    warnings: list[str] = []
    batched = _jsonl_layout(entry, datasets_cache)
    if batched is not None:
        if (w := _bad_lines_warning(entry, on_bad_row, batched.bad_lines)) is not None:
            warnings.append(w)
        info = SourceInfo(batched.n_rows, batched.fingerprint, batched.columns, batched.size)
    else:
        info = describe(entry.path, entry.split, entry.revision, datasets_cache)
    if info.n_rows == 0:
        raise DatasetError(
            entry.path, f"split {entry.split!r} has no rows; remove it from the mixer or give it rows"
        )
    row_format, messages_key = _format_of(entry, info.columns)
    arrow_files = (
        None
        if batched is not None
        else arrow_cache_files(entry.path, entry.split, entry.revision, datasets_cache)
    )
    target = target_rows(entry.amount, info.n_rows)
    _check_selection(entry, info.n_rows, target, selected_total + target, memory)
    selected = _selected_rows(entry, info.n_rows, target, warnings)
    dataset = _Opened(
        index,
        entry,
        warnings=warnings,
        row_format=row_format,
        messages_key=messages_key,
        whole=_Whole(info, batched, arrow_files),
        selected=selected,
        nbytes=info.nbytes,
    )
    rows = _sampled_rows(info.n_rows, selected, run)
    source = None if batched is None else batched.source(jsonl.batches_for(batched, rows[0], rows[1]))
    dataset.sampled = cutter.spec(dataset, rows, "sample", 0, arrow_files=arrow_files, jsonl=source)
    dataset.counted(info.n_rows, target, info.fingerprint)
    return dataset


def _cut_whole(dataset: _Opened, run: RunOptions, cutter: _SliceCutter, slice_bytes: int) -> None:
    """The slices of a dataset read whole, each with the fingerprint of the rows it reads."""
    assert dataset.whole is not None
    entry, whole = dataset.entry, dataset.whole
    info, batched, arrow_files, selected = whole.info, whole.batched, whole.arrow_files, dataset.selected
    memo = FingerprintMemo(cutter.work_dir, info.fingerprint, entry.split)
    datasets_cache = str(cutter.work_dir / "datasets-cache")
    fingerprint_rows = RowsFingerprinter(entry.path, entry.split, entry.revision, datasets_cache, arrow_files)
    if batched is not None and not run.slice_rows:
        groups = _batch_groups(batched, selected, slice_bytes)
    else:
        per_slice = run.slice_rows or rows_per_slice(info.nbytes, info.n_rows, slice_bytes)
        groups = _row_groups(info.n_rows, selected, per_slice)
    for start, end, subset in groups:
        source = None
        if batched is not None:  # the bytes of the batches it reads, and the columns they are cast to
            source = batched.source(jsonl.batches_for(batched, start, end))
            data = _batch_data(batched.schema_b64, source.batches)
        elif (data := memo.known.get(memo.key(_rows_key(start, end, subset)))) is None:
            data = fingerprint_rows(start, end, subset)
            memo.remember(_rows_key(start, end, subset), data)
        size = round((end - start if subset is None else len(subset)) * info.nbytes / info.n_rows)
        dataset.specs.append(
            cutter.spec(dataset, (start, end, subset), data, size, arrow_files=arrow_files, jsonl=source)
        )
    memo.save()
    fingerprint_rows.close()


class _HandOn:
    """Slices cut while a dataset's files are read: numbered in mixer order from ``first_index`` and each
    handed to ``early`` (the head start) as soon as it is cut, after the slices of the datasets before it
    that became ready meanwhile (``unfinished``); ``early`` is dropped at its first failure (the flow then
    runs the slice itself)."""

    def __init__(
        self,
        dataset: _Opened,
        first_index: int,
        ctx: TokenizeContext,
        early: EarlySlice | None,
        unfinished: _Unfinished,
    ):
        self.dataset, self.first_index, self.ctx, self.early = dataset, first_index, ctx, early
        self.unfinished = unfinished
        self.made: list[SliceSpec] = []

    def reading_threads(self) -> int | None:
        """Threads that read the files: beside slices that already run on every core, a few, well ahead
        of them (a worker takes seconds per slice; a thread reads one in milliseconds); else all."""
        return None if self.early is None else max(1, available_cpus() // SCAN_SHARE)

    def __call__(self, spec: SliceSpec) -> None:
        self.unfinished.poll()
        spec.index = self.first_index + len(self.made)
        spec.unrendered = self.dataset.probes
        self.made.append(spec)
        if self.early is not None:
            try:
                self.early(spec, self.ctx)
            except Exception as exc:  # (the flow runs the slice itself)
                logger.debug("no early start for %s: %s: %s", spec.describe(), type(exc).__name__, exc)
                self.early = None


class _Unfinished:
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


def _read_whole_instead(
    dataset: _Opened,
    run: RunOptions,
    cutter: _SliceCutter,
    ctx: TokenizeContext,
    selected_total: int,
    memory: int | None,
    slice_bytes: int,
) -> None:
    """A dataset found, once its read began, to be one only ``datasets`` reads (before any slice was cut)."""
    whole = _open_whole(dataset.index, dataset.entry, run, cutter, ctx.on_bad_row, selected_total, memory)
    _cut_whole(whole, run, cutter, slice_bytes)
    dataset.plan, dataset.specs, dataset.warnings = whole.plan, whole.specs, whole.warnings


def _open_parquet(
    index: int,
    entry: DatasetEntry,
    run: RunOptions,
    cutter: _SliceCutter,
    selected_total: int,
    memory: int | None,
) -> _Opened | None:
    """A Parquet dataset opened from its footers: every count, so any amount is selected (and refused)
    before any row group is read; its slices are cut as its row groups are hashed (:func:`_cut_parquet`).
    ``None`` for a dataset ``datasets`` is to read."""
    layout = _parquet_counted(entry, str(cutter.work_dir / "datasets-cache"))
    if layout is None:
        return None
    with closed_on_error(layout.downloads):  # refused (or stopped): its files stop downloading
        row_format, messages_key = _format_of(entry, layout.columns)
        target = target_rows(entry.amount, layout.n_rows)
        _check_selection(entry, layout.n_rows, target, selected_total + target, memory)
        warnings: list[str] = []
        selected = _selected_rows(entry, layout.n_rows, target, warnings)
        dataset = _Opened(
            index,
            entry,
            warnings=warnings,
            row_format=row_format,
            messages_key=messages_key,
            row_groups=layout,
            selected=selected,
            nbytes=layout.nbytes,
        )
        rows = _sampled_rows(layout.n_rows, selected, run)
        first = [parquet.with_sha256(g, layout.downloads) for g in parquet.groups_for(layout, *rows[:2])]
        dataset.sampled = cutter.spec(dataset, rows, "sample", 0, parquet=layout.source(first))
        return dataset


def _cut_parquet(
    dataset: _Opened,
    run: RunOptions,
    cutter: _SliceCutter,
    ctx: TokenizeContext,
    hand_on: _HandOn,
    selected_total: int,
    memory: int | None,
    slice_bytes: int,
) -> int:
    """How many slices a Parquet dataset has. Each is numbered and handed to ``early`` as soon as its row
    groups are hashed (a spilled row group's, as its rows are written: those left when the last row group
    is hashed join ``hand_on.unfinished``); a dataset whose first row group does not decode from its
    recorded bytes alone is read by ``datasets`` instead (:func:`_open_whole`)."""
    entry, layout = dataset.entry, dataset.row_groups
    assert layout is not None
    target = target_rows(entry.amount, layout.n_rows)
    _check_selection(entry, layout.n_rows, target, selected_total + target, memory)
    spilling = not (run.work_dir and is_remote(run.work_dir))  # (else slices may run where its spill is not)
    if run.slice_rows:
        dataset.cuts = _row_groups(layout.n_rows, dataset.selected, run.slice_rows)
    else:
        dataset.cuts = parquet.slice_cuts(layout, dataset.selected, slice_bytes, spilling)
    made = hand_on.made
    hashed: dict[tuple[str, int], parquet.RowGroup] = {}
    waiting = [parquet.groups_for(layout, start, end) for start, end, _ in dataset.cuts]
    pieces = Counter((g.path, g.index) for groups in waiting for g in groups)
    spills: dict[tuple[str, int], Spill] = {}

    def source(i: int, wait: bool) -> parquet.ParquetSource | None:
        """Cut ``i``'s rows once its row groups are hashed (and the spilled ones' rows written)."""
        if not all((g.path, g.index) in hashed for g in waiting[i]):
            return None
        groups = [hashed[(g.path, g.index)] for g in waiting[i]]
        start, end, _ = dataset.cuts[i]
        spilled = []
        for g in groups:
            if (spill := spills.get((g.path, g.index))) is not None:
                lo, hi = max(start, g.first_row) - g.first_row, min(end, g.first_row + g.rows) - g.first_row
                if (rows := spill.rows(lo, hi, wait)) is None:
                    return None
                spilled.append(rows)
        return layout.source(groups, spilled)

    def hand_on_ready(wait: bool) -> None:
        while len(made) < len(waiting) and (found := source(len(made), wait)) is not None:
            start, end, subset = dataset.cuts[len(made)]
            size = round((end - start if subset is None else len(subset)) * layout.nbytes / layout.n_rows)
            data = _digest(layout.data_key(found.row_groups))
            hand_on(cutter.spec(dataset, (start, end, subset), data, size, parquet=found))

    def spilled_ready(wait: bool) -> None:
        """(After the last row group is hashed.) ``wait``: every slice, and the spills landed."""
        try:
            hand_on_ready(wait)
            if wait:
                assert len(made) == len(dataset.cuts)
                for written in spills.values():
                    written.wait()  # (a later plan reuses it; its writer's error, raised)
        except DatasetError as exc:
            raise _dataset_error(entry, exc) from None

    def on_group(group: parquet.RowGroup) -> None:
        key = (group.path, group.index)
        hashed[key] = group
        if spilling and pieces[key] > 1 and parquet.spilled(group):  # decoded once for all its slices
            spills[key] = spill_group(
                group.path,
                group.index,
                group.rows,
                str(cutter.work_dir / "datasets-cache"),
                _digest(layout.data_key([group])),
                lambda: parquet.decoded_tables(layout, group),
            )
        hand_on_ready(False)

    try:
        sampled = dataset.sampled.parquet if dataset.sampled is not None else None
        known = sampled.row_groups if sampled is not None else []
        done = parquet.hashed(layout, on_group, hand_on.reading_threads(), known)
    except DatasetError as exc:
        raise _dataset_error(entry, exc) from None
    if done is None:  # (found before any slice was cut)
        _read_whole_instead(dataset, run, cutter, ctx, selected_total, memory, slice_bytes)
        return len(dataset.specs)
    dataset.specs = made  # (its last slices may be handed on later: their number is known)
    dataset.counted(layout.n_rows, target, done.fingerprint)
    if spills:
        spilled_ready(False)
        hand_on.unfinished.add(spilled_ready)
    else:
        assert len(made) == len(dataset.cuts)
    return len(dataset.cuts)


def _cut_streamed(
    dataset: _Opened,
    run: RunOptions,
    cutter: _SliceCutter,
    ctx: TokenizeContext,
    hand_on: _HandOn,
    selected_total: int,
    memory: int | None,
    slice_bytes: int,
) -> None:
    """A streamed file's slices (whole batches, or ``slice_rows`` rows of one), each numbered and handed
    to ``early`` as soon as its batches are counted; the file is then a dataset like any other (or, found
    not to be JSON Lines pyarrow reads after all, is read whole as :func:`_open_whole` reads it)."""
    entry, files = dataset.entry, dataset.streamed
    assert files is not None
    made = hand_on.made

    waiting: list[jsonl.JsonlBatch] = []  # counted batches of the next slice

    def cut(batches: list[jsonl.JsonlBatch], schema_b64: str) -> None:
        source = _streamed_source(dataset, schema_b64, batches)
        data = _batch_data(schema_b64, batches)
        lo, hi = batches[0].first_row, batches[-1].first_row + batches[-1].rows
        nbytes, per = sum(b.end - b.offset for b in batches), run.slice_rows or hi - lo
        for start in range(lo, hi, per):
            end = min(start + per, hi)
            size = round(nbytes * (end - start) / (hi - lo))
            hand_on(cutter.spec(dataset, (start, end, None), data, size, jsonl=source))

    def counted(batch: jsonl.JsonlBatch, schema_b64: str) -> None:
        if not batch.rows:
            return
        waiting.append(batch)
        if run.slice_rows or _slice_is_full(
            waiting, slice_bytes
        ):  # (slice_rows: rows of one batch per slice)
            cut(waiting[:], schema_b64)
            waiting.clear()

    try:
        if len(files.paths) == 1:  # (its batches name no file)
            with closed_on_error(files):
                layout = jsonl.scan_file(files.follow(0), counted, hand_on.reading_threads(), files.declared)
            file = jsonl.lines_of(entry.path, _source_path(dataset))  # (as its slices name them)
            if layout is not None and layout.bad_lines and file != entry.path:  # (a directory's one file)
                layout = replace(layout, bad_lines=tuple(replace(b, file=file) for b in layout.bad_lines))
        else:
            layout = _scanned_files(files, entry.path, counted, hand_on.reading_threads())
    except DatasetError as exc:
        raise _dataset_error(entry, exc) from None
    if layout is not None and waiting:  # the file's last batches
        cut(waiting, layout.schema_b64)
    if layout is None or not layout.n_rows or not layout.columns:
        _read_whole_instead(dataset, run, cutter, ctx, selected_total, memory, slice_bytes)
        return
    if (w := _bad_lines_warning(entry, ctx.on_bad_row, layout.bad_lines)) is not None:
        dataset.warnings.append(w)
    target = target_rows(entry.amount, layout.n_rows)
    _check_selection(entry, layout.n_rows, target, selected_total + target, memory)
    dataset.specs = made
    dataset.counted(layout.n_rows, target, layout.fingerprint)


def check_inputs(mixer: MixerConfig, run: RunOptions | None = None) -> None:
    """Refuse what is wrong at a glance (a missing tokenizer directory, ``.jinja`` template or data
    file; a hub name with no hub to ask), in the plan's order and with its messages: the command checks
    this before it starts a Prefect API, in a fraction of a second, where the plan would meet it seconds
    later. Nothing is opened or downloaded (the plan does that, while the API starts); the hub is one
    name lookup, made only for a name that is not a local path."""
    spec = mixer.tokenizer
    if (problem := tokenizer_path_problem(spec.name_or_path)) is not None:
        raise ConfigError(problem)
    if spec.chat_template and spec.chat_template.endswith(".jinja"):
        read_template_file(spec.chat_template)
    check_template_name(spec.chat_template, spec.unknown_template)
    caches = [] if run is None else [str(_work_dir_path(run) / "datasets-cache")]
    for entry in mixer.datasets:
        if (problem := path_problem(entry.path, caches)) is not None:
            raise DatasetError(entry.path, problem)


def prepare_plan(mixer: MixerConfig, run: RunOptions) -> None:
    """Do the slow, cached part of :func:`build_plan` ahead of it (while the Prefect API starts): load
    the tokenizer and write the workers' copy, open every dataset (its Arrow conversion) and hash its
    file. Everything lands in this process's caches or in files the plan writes anyway, so the plan
    that follows produces the same result, only sooner. Errors are left for the plan to report."""
    forget_builders()
    try:
        work_dir, _ = _work_dir(run)
    except Exception as exc:  # the plan meets the same error and reports it properly
        logger.debug("preparing the plan stopped early: %s: %s", type(exc).__name__, exc)
        return
    datasets_cache = str(work_dir / "datasets-cache")

    def open_datasets() -> None:
        try:
            for entry in mixer.datasets:
                if _streamed_files(entry, datasets_cache) is not None:
                    continue  # read by the plan itself, its slices starting as it goes
                if _jsonl_layout(entry, datasets_cache) is not None:
                    continue
                if _parquet_counted(entry, datasets_cache) is not None:
                    continue  # fetched and counted; its row groups are hashed as its slices are cut
                describe(entry.path, entry.split, entry.revision, datasets_cache)
                arrow_cache_files(entry.path, entry.split, entry.revision, datasets_cache)
        except Exception as exc:
            logger.debug("opening the datasets ahead of the plan stopped: %s: %s", type(exc).__name__, exc)

    # The datasets' Arrow conversion (one core each, the longest part) beside the tokenizer's load.
    hash_ahead([entry.path for entry in mixer.datasets if not _read_by_us(entry)])
    datasets_ahead = threading.Thread(target=open_datasets, name="datasets-ahead", daemon=True)
    datasets_ahead.start()
    try:
        tk = TokenizerKey.of(mixer.tokenizer.name_or_path, mixer.tokenizer.revision, mixer.tokenizer.load)
        worker_tokenizer_file(tk, work_dir / "tokenizers")
    except Exception as exc:
        logger.debug("loading the tokenizer ahead of the plan stopped: %s: %s", type(exc).__name__, exc)
    finally:
        datasets_ahead.join()


def resolve_tokenizer(spec: TokenizerSpec) -> tuple[TokenizerKey, TokenizerFacts, ResolvedTemplate]:
    """The tokenizer (its key and what the run needs to know of it) and the chat template it renders with."""
    tk = TokenizerKey.of(spec.name_or_path, spec.revision, spec.load)
    facts = tokenizer_facts(tk)
    template = resolve_template(
        spec.chat_template,
        facts.chat_template,
        spec.name_or_path,
        unknown=spec.unknown_template,
        add_bos=spec.add_bos,
        bos_token=facts.bos_token,
    )
    return tk, facts, template


#: Rows of each dataset that the plan encodes with both encoders before trusting the fast one.
SAMPLE_ROWS = 32


def _sample_rows(spec: SliceSpec, datasets_cache: Path, on_bad_row: str) -> list[Conversation]:
    """The first rows of a dataset's first slice, as conversations (malformed ones are the slices' to
    report). A line that is not a row fails the plan where ``on_bad_row`` is error: its slice would fail
    on it, after the work before it (every row of a dataset whose card does not declare a column)."""
    rows = (spec.rows or list(range(spec.row_start, spec.row_end)))[:SAMPLE_ROWS]
    try:
        records = rows_of(spec, str(datasets_cache), rows)
    except DatasetError:
        return []  # the slice reports it, with its rows
    out = []
    for record in records:
        if isinstance(record, jsonl.BadLine):
            if on_bad_row == "error":
                assert spec.jsonl is not None
                raise record.error(jsonl.lines_of(spec.dataset, spec.jsonl.path))
            continue
        try:
            out.append(conversation_from_row(record, spec.row_format, spec.messages_key))  # type: ignore[arg-type]
        except RowFormatError:
            continue
    return out


def _load_note(tk: TokenizerKey, facts: TokenizerFacts, texts: list[str]) -> str | None:
    """Where the reference builds the tokenizer otherwise than its own files say and that changes the ids
    of this run's sample rows (``texts``, rendered): the warning (said once per process), else ``None``."""
    if not facts.load_changes:
        return None
    changed = ids_changed(tk, texts)
    note = reference_note(tk.name_or_path, facts.tokenizer_class, facts.load_changes, changed, len(texts))
    if note not in _SAID:
        _SAID.add(note)
        logger.log(logging.WARNING if changed else logging.INFO, note)
    return note if changed else None


_SAID: set[str] = set()


def _rendered(renderer: ChatRenderer, samples: list[Conversation]) -> list[str]:
    """The sample rows' full renders (a row the template cannot render is its slice's to report)."""
    texts = []
    for conv in samples:
        try:
            texts.append(renderer.render(conv.messages, conv.tools, False))
        except Exception:
            continue
    return texts


def choose_encoder(spec: TokenizerSpec, tk: TokenizerKey, ctx: TokenizeContext, texts: list[str]) -> str:
    """``fast`` where the fast encoder is proven this tokenizer (its analysis, then the run's own sample rows,
    ``texts`` rendered, encoded both ways, ids and offsets), else ``hf``; ``encoder: fast`` refuses the run
    instead."""
    if spec.encoder == "hf":
        return "hf"
    asked = (tk, ctx.tokenizer_file, spec.encoder, _digest(texts))
    if asked not in _ENCODER_CHOSEN:  # the head start and the plan task ask the same question
        _ENCODER_CHOSEN[asked] = _prove_encoder(spec, tk, ctx, texts)
    return _ENCODER_CHOSEN[asked]


_ENCODER_CHOSEN: dict[tuple, str] = {}


def _prove_encoder(spec: TokenizerSpec, tk: TokenizerKey, ctx: TokenizeContext, texts: list[str]) -> str:
    assert ctx.tokenizer_file is not None  # build_plan writes the workers' copy, with the proof
    found = load_worker_tokenizer(ctx.tokenizer_file).fast
    problem = found if isinstance(found, str) else None
    if problem is None:
        encoding = encoding_for(ctx, "fast")
        assert encoding.fast is not None
        if (differ := same_encodings(encoding.rust, encoding.fast, texts)) is not None:
            problem = f"the two encoders disagree on a sample row of this run ({differ})"
    if problem is None:
        assert not isinstance(found, str)
        if found.metaspace:
            how = f"SentencePiece-style BPE, prepend scheme {found.metaspace}; this run's sample rows agree"
        elif found.one_merge_per_token and not found.unsafe:
            how = "every token checked"
        else:
            how = f"texts with any of {len(found.unsafe)} tokens go to the tokenizers library"
        if found.splits:
            how += f"; its pre-tokenizer's {len(found.splits)} Splits in sequence, as fastokens runs them"
        logger.info(
            "encoder: %s, proven the same tokenizer as %s (%s; %s)",
            encoding.engine,
            tk.name_or_path,
            built_as(tk.load, tokenizer_facts(tk).tokenizer_class),
            how,
        )
        return "fast"
    if spec.encoder == "fast":
        raise ConfigError(
            f"tokenizer.encoder fast: the fast encoder is not proven the same tokenizer: {problem}"
        )
    logger.info("encoder: the tokenizers library (the fast encoder is not used: %s)", problem)
    return "hf"


#: What the plan hands each slice it cuts while a file is still being read (the head start's workers).
EarlySlice = Callable[[SliceSpec, TokenizeContext], None]


def _context(
    mixer: MixerConfig,
    tk: TokenizerKey,
    template: ResolvedTemplate,
    dtype: str,
    work_dir: Path,
    remote: str | None,
) -> TokenizeContext:
    """What every slice of the run shares (the workers' copy of the tokenizer written once, here)."""
    return workers_context(
        for_slices(mixer),
        tokenizer=tk.name_or_path,
        tokenizer_revision=tk.revision,
        tokenizer_load=tk.load,
        tokenizer_file=worker_tokenizer_file(tk, work_dir / "tokenizers"),
        template_text=template.text,
        token_dtype=dtype,
        work_dir=str(work_dir),
        remote_work_dir=remote,
        datasets_cache=str(work_dir / "datasets-cache"),
        template_source=template.source,
    )


def _cut(
    opened: list[_Opened],
    run: RunOptions,
    cutter: _SliceCutter,
    ctx: TokenizeContext,
    early: EarlySlice | None,
    memory: int | None,
    slice_bytes: int,
) -> tuple[list[DatasetPlan], list[SliceSpec]]:
    """Every dataset's slices, numbered in mixer order (a large file's first ones handed on to ``early``
    while it is read)."""
    datasets: list[DatasetPlan] = []
    unfinished, first_index = _Unfinished(), 0
    for dataset in opened:  # the slices, in mixer order (a large file's start while it is read)
        selected_total = sum(d.target for d in datasets)
        hand_on = _HandOn(dataset, first_index, ctx, early, unfinished)
        count = None
        if dataset.row_groups is not None:
            count = _cut_parquet(dataset, run, cutter, ctx, hand_on, selected_total, memory, slice_bytes)
        elif dataset.plan is None:
            _cut_streamed(dataset, run, cutter, ctx, hand_on, selected_total, memory, slice_bytes)
        else:  # (opened before the counts of streamed files before it were known)
            d = dataset.plan
            _check_selection(dataset.entry, d.n_rows, d.target, selected_total + d.target, memory)
            _cut_whole(dataset, run, cutter, slice_bytes)
        assert dataset.plan is not None
        for k, spec in enumerate(dataset.specs):
            if spec.index < 0:  # (a slice not handed on as it was cut)
                spec.index = first_index + k
                spec.unrendered = dataset.probes
        first_index += len(dataset.specs) if count is None else count
        unfinished.check()
        datasets.append(dataset.plan)
    unfinished.finish()
    slices = [spec for dataset in opened for spec in dataset.specs]
    assert [spec.index for spec in slices] == list(range(len(slices)))
    for dataset in opened:
        assert dataset.plan is not None
        dataset.plan.slices = [spec.index for spec in dataset.specs]
    return datasets, slices


def build_plan(mixer: MixerConfig, run: RunOptions, early: EarlySlice | None = None) -> Plan:
    """The plan. ``early`` is handed each slice of a large JSON Lines file as soon as it is cut, while the
    plan still reads the rest of the file (the same slices the plan returns)."""
    started = time.perf_counter()
    inputs = input_record(mixer)  # first: a file that changes while the plan reads it will not match
    forget_builders()
    work_dir, remote = _work_dir(run)
    datasets_cache = work_dir / "datasets-cache"
    tk, facts, template = resolve_tokenizer(mixer.tokenizer)
    if mixer.mask == "generation_tags" and not has_generation_tags(template.text):
        raise TemplateError(
            f"mask generation_tags needs a template that marks assistant text with {{% generation %}} ... "
            f"{{% endgeneration %}}; template {template.source} has no such block"
        )
    dtype = facts.token_dtype(mixer.output.token_dtype_rule)
    tok_fp = facts.fingerprint
    ctx = _context(mixer, tk, template, dtype.name, work_dir, remote)
    shared_key = {
        "format": SLICE_FORMAT_VERSION,
        "tokenizer": tok_fp,
        "template": template.sha256,
        "dtype": dtype.name,
        **keyed(mixer),  # the settings a slice's tokens follow from (sftmix/config/byte_settings.py)
    }
    # what the rows hold that the template never renders (a field, a role): said before any work
    renderer, reads = ChatRenderer(template.text, facts.special_tokens), what_it_reads(template.text)
    cutter = _SliceCutter(shared_key, work_dir, run)
    memory = memory_limit()
    hash_ahead([entry.path for entry in mixer.datasets if not _read_by_us(entry)])
    opened: list[_Opened] = []
    for index, entry in enumerate(mixer.datasets):  # each dataset's head: enough to sample its rows
        dataset = _open_streamed(index, entry, run, cutter, memory)
        selected_total = sum(d.plan.target for d in opened if d.plan is not None)
        if dataset is None:
            dataset = _open_parquet(index, entry, run, cutter, selected_total, memory)
        if dataset is None:
            dataset = _open_whole(index, entry, run, cutter, mixer.on_bad_row, selected_total, memory)
        assert dataset.sampled is not None
        sample = _sample_rows(dataset.sampled, datasets_cache, mixer.on_bad_row)
        for found in unrendered(renderer, sample):
            line = found.describe(entry.path, template.source, reads)
            if mixer.tokenizer.unrendered_data == "error":
                raise TemplateError(f"{line}; refused (unrendered_data: error): warn converts it anyway")
            dataset.left_out.append(line)
            dataset.probes.append(found.probe)
            logger.warning(line)
        dataset.samples = sample
        opened.append(dataset)
    texts = _rendered(renderer, [c for d in opened for c in d.samples])  # the sample rows, rendered once
    load_note = _load_note(tk, facts, texts)
    ctx.encoder = choose_encoder(mixer.tokenizer, tk, ctx, texts)
    data_bytes = sum(d.nbytes for d in opened)
    slice_bytes = slice_bytes_for(run, data_bytes)
    datasets, slices = _cut(opened, run, cutter, ctx, early, memory, slice_bytes)
    release_mapped_data(datasets_too=True)  # every row was read to fingerprint it; workers map their own
    jsonl.release()
    parquet.release()
    forget_spills()
    return Plan(
        mixer=mixer,
        context=ctx,
        datasets=datasets,
        slices=slices,
        template_source=template.source,
        template_sha256=template.sha256,
        tokenizer_fingerprint=tok_fp,
        warnings=[*([load_note] if load_note else []), *(w for d in opened for w in d.warnings)]
        + [line for d in opened for line in d.left_out],
        tokenizer_load_note=load_note,
        unrendered=[line for d in opened for line in d.left_out],
        inputs=inputs,
        slicing=_slicing(run, data_bytes, slices),
        seconds=round(time.perf_counter() - started, 3),
    )


def _slicing(run: RunOptions, data_bytes: int, slices: list[SliceSpec]) -> str:
    """How the slices were sized, for the plan's summary: what decided it, and what a person sets to
    change it (the size a mixture's slices get follows from its total, so adding a dataset can change it)."""
    if run.slice_rows:
        return f"{run.slice_rows:,} rows each (slice_rows)"
    average = sum(s.est_bytes for s in slices) / max(1, len(slices))
    how = (
        "slice_bytes"
        if run.slice_bytes
        else f"by the mixture's {data_bytes / 1e9:,.2f} GB; slice_bytes sets another"
    )
    return f"{average / 1e6:,.1f} MB of data each on average ({how})"
