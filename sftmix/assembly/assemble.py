"""From slice manifests to the final shards: global order first, then a streamed scatter.

The order (kept rows per dataset in selection order, concatenated in mixer order, shuffled with
``numpy.random.default_rng(seed).permutation``, cut to ``num_examples``) needs only the slices' row
records, read through their memory maps: what the tail holds per output document is one 41-byte record
(:data:`DOCUMENT_DTYPE`) and its start and end (about 90 bytes a document at the peak, measured in
bench/results). Tokens are then copied by window or slice into the parts at precomputed offsets, so the
tokens in memory are bounded by a window or a slice, not by the dataset.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sftmix.assembly.document_order import DatasetTally, global_order
from sftmix.assembly.over_length import TERMINATED, UNMASKED
from sftmix.check.findings import CheckReport
from sftmix.config.selection import TokenBudget, amount_text
from sftmix.output.hf_output import remove_olmo_parts, write_hf_parquet
from sftmix.output.olmo_format import (
    MASK_PART,
    TOKENS_PART,
    DocumentTotals,
    PartLayout,
    PartSet,
    dataset_statistics,
    part_layout,
    write_boundaries,
    write_statistics,
)
from sftmix.output.part_writing import (
    CACHE_SAMPLE,
    Edits,
    SliceJob,
    SyncBehind,
    WindowJob,
    WritingStopped,
    WrittenParts,
    cached_share,
    plan_window,
    run_bounded,
    worker_processes,
    write_slice,
    write_window,
)
from sftmix.planning.plan import Plan
from sftmix.runtime import settings
from sftmix.runtime.parallel import available_cpus
from sftmix.runtime.storage import storage_errors, temp_name
from sftmix.tokenizing.slices import SliceManifest, slice_dir
from sftmix.tokenizing.tokenizer_facts import write_tokenizer_dir

logger = logging.getLogger(__name__)


DOCUMENTS_FILE = "documents.npy"


DOC_DTYPE = np.dtype([("dataset", "<i4"), ("row", "<i8"), ("start", "<i8"), ("length", "<i8")])


@dataclass
class AssembleResult:
    documents: int
    tokens: int
    trainable_tokens: int
    untrainable_documents: int  # kept, written with an all-zero mask (UNTRAINABLE_KEPT)
    parts: int
    statistics: dict[str, Any]
    tallies: list[DatasetTally]
    documents_path: str
    written_seconds: float = 0.0  # from the start until every part was written
    checked: CheckReport | None = None  # the check made while the parts were written


#: Tokens of the output gathered at once (per worker: a window's tokens and mask in memory).
WINDOW = 1 << 22


#: Windows gathered at once; ``None``: every CPU this process may use.
ASSEMBLE_THREADS: int | None = None


#: From this many tokens the output is written by worker processes (threads would share one GIL for the
#: loop over documents), below it on threads (starting processes costs more than it saves); the
#: environment's ``TOKENIZE_MIXER_PROCESSES_FROM_TOKENS`` sets it (the fault soak writes small outputs so).
PROCESSES_FROM_TOKENS = 16 * WINDOW


PROCESSES_FROM_ENV = settings.PROCESSES_FROM_TOKENS.name


#: How the parts are written: ``window``, ``slice``, or ``None``: by what the page cache holds.
ASSEMBLE_BY: str | None = None


#: The share of sampled documents in the page cache from which the output is written by window.
CACHED_ENOUGH = 0.9


def assemble(
    plan: Plan,
    manifests: list[SliceManifest],
    staging: Path,
    documents_path: Path,
    check: Callable[..., CheckReport] | None = None,
) -> AssembleResult:
    """Write parts, boundaries and statistics for ``plan`` into ``staging``. ``check`` (an OLMo-core
    output only) checks the staging while the parts are written, each chunk once it is written."""
    with storage_errors(f"cannot write the output (staged in {staging.parent})"):
        return _assemble(plan, manifests, staging, documents_path, check)


def _assemble(
    plan: Plan,
    manifests: list[SliceManifest],
    staging: Path,
    documents_path: Path,
    check: Callable[..., CheckReport] | None,
) -> AssembleResult:
    started = time.perf_counter()
    docs, tallies = global_order(plan, manifests)
    table = DocumentTable.of(docs)
    dtype = np.dtype(plan.context.output.token_dtype)
    spec = plan.mixer.output
    layout = part_layout(spec.parts, spec.part_bytes, dtype, table.ends)
    olmo = spec.format == "olmo"
    parts = PartSet(staging, layout, dtype)
    at = _Staging(staging, documents_path, layout, WrittenParts())
    # What does not need the parts is written beside them, and the check follows the writers.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="assemble-beside") as beside:
        besides = beside.submit(_beside_the_parts, plan, table, tallies, at, check if olmo else None)
        # What the check has read leaves the page cache once durable. Without the check, the digests
        # (or another format's writer) read the parts after they are written: their pages stay.
        followed = at.written if olmo and check is not None else None
        sync = SyncBehind(parts.files, written=followed, itemsize=dtype.itemsize)
        try:
            _PartWriting(plan, manifests, table, at, sync).run()
        except BaseException:
            at.written.stop()  # the check stops at its next chunk; what is beside ends its step
            sync.close()
            parts.close(sync=False)
            with contextlib.suppress(BaseException):
                besides.result()
            raise
        at.written.complete()
        sync.close()
        parts.close()
        written_seconds = time.perf_counter() - started
        stats, checked = besides.result()
    if not olmo:
        pack_to = plan.mixer.max_seq_length if plan.mixer.output.packing != "none" else None
        stats["hf_output"] = write_hf_parquet(staging, table.starts, docs["length"], dtype, layout, pack_to)
        remove_olmo_parts(staging)
        write_statistics(staging, stats)
    return AssembleResult(
        documents=int(docs.shape[0]),
        tokens=table.total,
        trainable_tokens=int(docs["trainable"].sum()),
        untrainable_documents=int((docs["trainable"] == 0).sum()),
        parts=len(layout),
        statistics=stats,
        tallies=tallies,
        documents_path=str(documents_path),
        written_seconds=round(written_seconds, 3),
        checked=checked,
    )


@dataclass(frozen=True)
class DocumentTable:
    """Every document of the output in its global order (:data:`DOCUMENT_DTYPE` records) with where each
    starts and ends among the output's tokens: what the parts, their boundaries, the document map and the
    statistics are written from."""

    docs: np.ndarray
    starts: np.ndarray
    ends: np.ndarray

    @classmethod
    def of(cls, docs: np.ndarray) -> DocumentTable:
        ends = np.cumsum(docs["length"], dtype=np.int64)
        return cls(docs, ends - docs["length"], ends)

    @property
    def total(self) -> int:
        """The output's tokens."""
        return int(self.ends[-1]) if self.ends.size else 0


@dataclass(frozen=True)
class _Staging:
    """Where the output is being written: its folder, the run's document map, the parts' layout, and how
    far the parts are written (what the check follows)."""

    path: Path
    documents_path: Path
    layout: PartLayout
    written: WrittenParts


def _beside_the_parts(
    plan: Plan,
    table: DocumentTable,
    tallies: list[DatasetTally],
    at: _Staging,
    check: Callable[..., CheckReport] | None,
) -> tuple[dict[str, Any], CheckReport | None]:
    """Boundaries, the tokenizer, the document map and (an OLMo-core output's) statistics: they need only
    the document table; then ``check``, which reads each chunk of the parts once it is written."""
    docs = table.docs
    lineage = (docs["dataset"], docs["row"]) if plan.mixer.output.lineage else None
    steps = (
        lambda: write_boundaries(at.path, table.starts, table.ends, at.layout, lineage),
        lambda: write_tokenizer_dir(
            plan.context.tokenizer.key(), plan.context.template.text, at.path / "tokenizer"
        ),
        lambda: _write_documents(at.documents_path, docs, table.starts),
    )
    at.documents_path.parent.mkdir(parents=True, exist_ok=True)
    for step in steps:
        if at.written.stopped:
            raise WritingStopped("the output's parts were not written to the end")
        step()
    stats = _statistics(plan, table, tallies)
    if plan.mixer.output.format == "olmo":
        write_statistics(at.path, stats)  # (before the check, which reads them)
    return stats, None if check is None else check(written=at.written)


#: A writer of jobs, and what follows each one done: by window or by slice.
_Jobs = tuple[int, Callable[[Any], None], Callable[[], Iterator[Any]], Callable[[Any], None]]


@dataclass
class _PartWriting:
    """The parts, written on every core (``sftmix.output.part_writing``): by window while the slices are in
    the page cache, else slice by slice (sequential reads of a disk). By window, ``written`` follows the
    windows done in order; by slice, every part is written only at the end. ``sync`` makes what is
    written durable behind the writers."""

    plan: Plan
    manifests: list[SliceManifest]
    table: DocumentTable
    at: _Staging
    sync: SyncBehind

    def __post_init__(self) -> None:
        self.dtype = np.dtype(self.plan.context.output.token_dtype)
        self.slice_dirs = [str(slice_dir(self.plan.context.output.work_dir, m.key)) for m in self.manifests]
        self.part_files = [
            (str(self.at.path / TOKENS_PART.format(k)), str(self.at.path / MASK_PART.format(k)))
            for k in range(len(self.at.layout))
        ]
        table = self.table
        self.changes = _edits(self.plan, table.docs["edit"], table.starts, table.ends)

    def run(self) -> None:
        how = ASSEMBLE_BY or _way_to_write(self.table.docs, self.slice_dirs, self.dtype)
        count, fn, jobs, done = self._by_window() if how == "window" else self._by_slice()
        workers = max(1, min(count, ASSEMBLE_THREADS or available_cpus()))
        logger.debug("writing %d tokens by %s on %d workers", self.table.total, how, workers)
        if workers > 1 and self.table.total >= int(
            settings.PROCESSES_FROM_TOKENS.get() or PROCESSES_FROM_TOKENS
        ):
            try:
                with worker_processes(workers) as pool:
                    run_bounded(pool, fn, jobs(), 2 * workers, done)
                return
            except BrokenProcessPool:
                # A worker died (the OOM killer, a kill): a job writes the same bytes at the same places
                # however often it runs, so the parts are written again, on threads.
                logger.warning(
                    "a worker process writing the output died; writing the output again on threads"
                )
        with ThreadPoolExecutor(max_workers=workers) as threads:
            run_bounded(threads, fn, jobs(), 2 * workers, done)

    def _by_window(self) -> _Jobs:
        table, layout = self.table, self.at.layout
        windows = [
            (lo, min(lo + WINDOW, end), k)
            for k, (first, end) in enumerate(map(layout.bounds, range(len(layout))))
            for lo in range(first, end, WINDOW)
        ]

        def window(lo: int, hi: int, part: int) -> WindowJob:
            docs = table.docs
            found = plan_window(
                lo, hi, table.starts, table.ends, docs["slice"], docs["offset"], self.slice_dirs
            )
            tokens_file, mask_file = self.part_files[part]
            job = WindowJob(lo, hi, lo - layout.firsts[part], tokens_file, mask_file, self.dtype.str, *found)
            job.edits = self.changes.within(lo, hi)
            return job

        def done(job: WindowJob) -> None:
            part = layout.part_of(job.lo)
            self.at.written.advance(part, job.at + job.hi - job.lo)
            self.sync.wrote([part], (job.hi - job.lo) * (self.dtype.itemsize + 1))

        return len(windows), write_window, lambda: (window(*w) for w in windows), done

    def _by_slice(self) -> _Jobs:
        docs = self.table.docs
        by_slice = np.lexsort((docs["offset"], docs["slice"]))  # each slice's documents in its order
        ids, first = np.unique(docs["slice"][by_slice], return_index=True)
        bounds = list(
            zip(ids.tolist(), first.tolist(), [*first[1:].tolist(), by_slice.shape[0]], strict=True)
        )

        def one_slice(sid: int, a: int, b: int) -> SliceJob:
            group = by_slice[a:b]
            offsets, lengths = docs["offset"][group], docs["length"][group]
            edits = (
                _edits(self.plan, docs["edit"][group], offsets, offsets + lengths)
                if self.changes
                else self.changes
            )
            return SliceJob(
                self.slice_dirs[sid], self.dtype.str, self.at.layout, self.part_files, offsets,
                self.table.starts[group], lengths, edits,
            )  # fmt: skip

        every_part = range(len(self.part_files))

        def done(job: SliceJob) -> None:
            self.sync.wrote(every_part, int(job.n.sum()) * (self.dtype.itemsize + 1))

        return len(bounds), write_slice, lambda: (one_slice(*g) for g in bounds), done


def _edits(plan: Plan, edit: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> Edits:
    """What over_length_strategy changes in documents ``[starts, ends)`` as they are written (``edit``: each
    one's change), in the coordinates of ``starts`` and ``ends``."""
    terminated, unmasked = edit == TERMINATED, edit == UNMASKED
    if not (terminated.any() or unmasked.any()):
        return Edits()
    assert plan.eos_id is not None or not terminated.any()  # (the plan refuses terminate without an EOS)
    return Edits(
        plan.eos_id or 0,
        ends[terminated] - 1,
        np.stack([starts[unmasked], ends[unmasked]], axis=1),
    )


def _way_to_write(docs: np.ndarray, slice_dirs: list[str], dtype: np.dtype) -> str:
    """``window`` when the page cache holds (nearly) every sampled document's tokens, else ``slice``."""
    if not docs.shape[0]:
        return "window"
    sample = np.unique(np.linspace(0, docs.shape[0] - 1, CACHE_SAMPLE).astype(np.int64))
    share = cached_share(
        [os.path.join(slice_dirs[i], "tokens.npy") for i in docs["slice"][sample].tolist()],
        (docs["offset"][sample] * dtype.itemsize).tolist(),
    )
    return "window" if share is not None and share >= CACHED_ENOUGH else "slice"


def _write_documents(path: Path, docs: np.ndarray, starts: np.ndarray) -> None:
    """The run's document map (:data:`DOC_DTYPE`, ``np.save``'s format), filled in place through a memory
    map: not one more array of every document in memory."""
    staging = temp_name(path)
    out = np.lib.format.open_memmap(staging, mode="w+", dtype=DOC_DTYPE, shape=(docs.shape[0],))
    for name in ("dataset", "row", "length"):
        out[name] = docs[name]
    out["start"] = starts
    out.flush()
    del out
    os.replace(staging, path)


def _statistics(plan: Plan, table: DocumentTable, tallies: list[DatasetTally]) -> dict:
    docs = table.docs
    pre: dict[str, dict[str, Any]] = {}
    for d, t in zip(plan.datasets, tallies, strict=True):  # (t.selected: d.target, or what a budget chose)
        pre[d.name] = {
            "dataset_split": d.split,
            "initial_instances": t.selected,
            "final_instances": t.kept,
            "instances_filtered": t.selected - t.kept,
            "frac_or_num_samples": amount_text(d.amount) if isinstance(d.amount, TokenBudget) else d.amount,
            "original_dataset_size": d.n_rows,
            "is_upsampled": t.selected > d.n_rows,
            "upsampling_factor": t.selected / d.n_rows if d.n_rows > 0 else 1.0,
        }
    # per dataset by its index (numpy over every document), then by name in order of first appearance
    which, n = docs["dataset"], len(plan.datasets)
    by_index = [
        np.bincount(which, minlength=n).tolist(),
        _sum_by(which, docs["length"], n),
        _sum_by(which, docs["trainable"], n),
        np.bincount(which[docs["trainable"] == 0], minlength=n).tolist(),
    ]
    totals = DocumentTotals(
        instances=int(docs.shape[0]),
        tokens=table.total,
        trainable=int(docs["trainable"].sum()),
        filtered=int((docs["trainable"] == 0).sum()),
    )
    present, first = np.unique(which, return_index=True)
    for i in present[np.argsort(first, kind="stable")].tolist():
        totals.add(plan.datasets[i].name, *(column[i] for column in by_index))
    stats = dataset_statistics(
        output_dir=str(Path(plan.mixer.output.path)),
        tokenizer=plan.mixer.tokenizer.name_or_path,
        max_seq_length=plan.mixer.max_seq_length,
        chat_template=plan.mixer.tokenizer.chat_template,
        pre=pre,
        totals=totals,
    )
    if plan.mixer.output.lineage:
        stats["lineage"] = _lineage(plan)
    return stats


def _lineage(plan: Plan) -> dict[str, Any]:
    """What ``output.lineage``'s columns name: each dataset by its index, with what it was read from."""
    return {
        "columns": ["start", "end", "dataset", "row"],
        "datasets": [
            {
                "dataset": d.index,
                "name": d.name,
                "split": d.split,
                "revision": plan.mixer.datasets[d.index].revision,
                "fingerprint": d.fingerprint,
            }
            for d in plan.datasets
        ],
    }


def _sum_by(which: np.ndarray, values: np.ndarray, n: int) -> list[int]:
    """``values`` summed per index in ``which``, exactly (int64, not bincount's float weights)."""
    sums = np.zeros(n, dtype=np.int64)
    np.add.at(sums, which, values.astype(np.int64))
    return sums.tolist()
