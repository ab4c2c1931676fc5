"""The output's parts written from the slices' files, on every core, one of two ways.

- **By window** (``WindowJob``): a 4 Mi-token window of a part at a time, its documents read where they
  lie in the slices (two ``pread`` per document) straight into memory, then written with one sequential
  ``pwrite``. Fast while the slices are in the page cache (they were just written); from a disk it is
  a random read per document.
- **By slice** (``SliceJob``): each slice read once, sequentially, and each of its documents written at
  its place in the parts (the page cache gathers the writes). Its cost per document is higher, but it
  reads a disk only sequentially: a resumed run, or slices larger than the page cache.

``cached_share`` tells which: it asks the page cache for a sample of the documents (``RWF_NOWAIT``).
``WrittenParts`` says how far each part is written, so the check can read each chunk right after it is
written, while the writers go on (the tail then costs about the writing alone).
Jobs are planned by the assembling process (numpy over the document table) and run on threads, or on
spawned worker processes when the output is large enough to pay for starting them: the loop over
documents holds the GIL, so threads would write a big output on one core. This module imports only
numpy and light modules of ours, so a worker starts in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sftmix.errors import ChecksumError
from sftmix.output.olmo_format import PartLayout
from sftmix.runtime.processes import ignore_stop_signals, start_resource_tracker, stop_signals_blocked
from sftmix.runtime.storage import npy_header, pread_into, pwrite_all


@dataclass(frozen=True)
class Edits:
    """What ``over_length_strategy`` changes in documents as they are written (``sftmix.assembly.over_length``),
    in a job's own coordinates: the tokens at ``eos_at`` become ``eos``; the mask is zero over each
    ``[start, end)`` of ``unmask`` (shape (k, 2))."""

    eos: int = 0
    eos_at: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    unmask: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))

    def apply(self, tokens: np.ndarray, mask: np.ndarray, base: int = 0) -> None:
        """Onto ``tokens`` and ``mask``, which hold the coordinates from ``base`` on."""
        if self.eos_at.size:
            tokens[self.eos_at - base] = self.eos
        for start, end in (self.unmask - base).tolist():
            mask[max(start, 0) : max(end, 0)] = 0

    def within(self, lo: int, hi: int) -> Edits:
        """Those that touch ``[lo, hi)``, moved so that ``lo`` is 0 and clipped to it (``eos_at`` sorted,
        ``unmask`` documents' ranges in order: found by search, not by a pass over all of them)."""
        at = self.eos_at[np.searchsorted(self.eos_at, lo) : np.searchsorted(self.eos_at, hi)]
        first = np.searchsorted(self.unmask[:, 1], lo, side="right")
        ranges = self.unmask[first : np.searchsorted(self.unmask[:, 0], hi, side="left")]
        return Edits(self.eos, at - lo, np.clip(ranges - lo, 0, hi - lo))

    def __bool__(self) -> bool:
        return bool(self.eos_at.size or self.unmask.size)


@dataclass
class WindowJob:
    """Tokens ``[lo, hi)`` of the output, at ``at`` (tokens) in the part files ``tokens_file`` and
    ``mask_file``; for each slice that holds some of them (``slice_dirs``), the documents' pieces:
    ``src`` token offsets in the slice, ``dst`` offsets in the window, ``n`` lengths, grouped by slice
    (``groups[i]`` is where slice ``i``'s pieces end)."""

    lo: int
    hi: int
    at: int
    tokens_file: str
    mask_file: str
    dtype: str
    slice_dirs: list[str]
    groups: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    n: np.ndarray
    edits: Edits = field(default_factory=Edits)  # in the window's coordinates


def plan_window(
    lo: int,
    hi: int,
    starts: np.ndarray,
    ends: np.ndarray,
    slices: np.ndarray,
    offsets: np.ndarray,
    slice_dirs: list[str],
) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Which pieces of which documents (``starts``/``ends`` in the output, ``slices``/``offsets`` where
    they were tokenized) fill tokens ``[lo, hi)``, grouped by slice (see :class:`WindowJob`)."""
    first = int(np.searchsorted(ends, lo, side="right"))
    last = int(np.searchsorted(starts, hi, side="left"))
    begin = starts[first:last]
    cut = np.maximum(lo - begin, 0)  # the first document may begin before the window
    dst = begin + cut - lo
    n = np.minimum(ends[first:last], hi) - lo - dst
    src = offsets[first:last] + cut
    owner = slices[first:last]
    by_slice = np.argsort(owner, kind="stable")
    ids, first_of = np.unique(owner[by_slice], return_index=True)
    groups = np.append(first_of[1:], by_slice.shape[0])
    return [slice_dirs[i] for i in ids.tolist()], groups, src[by_slice], dst[by_slice], n[by_slice]


def fill_window(job: WindowJob) -> tuple[np.ndarray, np.ndarray]:
    """The window's tokens and mask."""
    dtype = np.dtype(job.dtype)
    tokens, mask = np.empty(job.hi - job.lo, dtype), np.empty(job.hi - job.lo, np.uint8)
    # (``a.data``: ``memoryview(a)``, which numpy's stubs allow from Python 3.12 only)
    views = (tokens.data.cast("B"), mask.data.cast("B"))
    begin = 0
    for directory, end in zip(job.slice_dirs, job.groups.tolist(), strict=True):
        src, dst, n = job.src[begin:end], job.dst[begin:end], job.n[begin:end]
        begin = end
        for name, view, size in zip(("tokens.npy", "mask.npy"), views, (dtype.itemsize, 1), strict=True):
            path = os.path.join(directory, name)
            fd = os.open(path, os.O_RDONLY)
            try:
                base = _data_offset(fd, path)  # after the .npy header
                froms, tos, stops = (
                    (src * size + base).tolist(),
                    (dst * size).tolist(),
                    ((dst + n) * size).tolist(),
                )
                for p, x, y in zip(froms, tos, stops, strict=True):
                    piece = view[x:y]
                    if os.preadv(fd, [piece], p) != y - x:  # a short read: the rest, or an error
                        _read_into(fd, piece, p, path)
            finally:
                os.close(fd)
    return tokens, mask


def write_window(job: WindowJob) -> None:
    """Fill the window and write it into its part (the part files exist at their full size)."""
    tokens, mask = fill_window(job)
    job.edits.apply(tokens, mask)
    for path, data, position in (
        (job.tokens_file, tokens, job.at * tokens.dtype.itemsize),
        (job.mask_file, mask, job.at),
    ):
        fd = os.open(path, os.O_WRONLY)
        try:
            pwrite_all(fd, data.data.cast("B"), position)
        finally:
            os.close(fd)


@dataclass
class SliceJob:
    """The documents of one slice (``slice_dir``), written where the output's order puts them: ``src``
    token offsets in the slice (ascending), ``dst`` global token offsets, ``n`` lengths; part ``k``'s
    token and mask files are ``part_files[k]``, its tokens where ``layout`` says."""

    slice_dir: str
    dtype: str
    layout: PartLayout
    part_files: list[tuple[str, str]]
    src: np.ndarray
    dst: np.ndarray
    n: np.ndarray
    edits: Edits = field(default_factory=Edits)  # in the slice's token offsets


def write_slice(job: SliceJob) -> None:
    """Read the slice's documents in one sequential read, then write each at its place (cut where a
    part ends)."""
    if not job.n.size:
        return
    dtype = np.dtype(job.dtype)
    lo, hi = int(job.src[0]), int((job.src + job.n).max())
    read = []
    for name, item in (("tokens.npy", dtype), ("mask.npy", np.dtype(np.uint8))):
        path = os.path.join(job.slice_dir, name)
        data = np.empty(hi - lo, item)
        fd = os.open(path, os.O_RDONLY)
        try:
            _read_into(fd, data.data.cast("B"), _data_offset(fd, path) + lo * item.itemsize, path)
        finally:
            os.close(fd)
        read.append(data)
    job.edits.apply(read[0], read[1], lo)
    tokens, mask = (data.data.cast("B") for data in read)
    size = dtype.itemsize
    fds: dict[str, int] = {}
    try:
        for s, d, k in zip((job.src - lo).tolist(), job.dst.tolist(), job.n.tolist(), strict=True):
            for part, local, done, take in job.layout.spans(d, k):  # cut where a part ends
                tokens_file, mask_file = job.part_files[part]
                a, b = s + done, s + done + take
                for path, view, width in ((tokens_file, tokens, size), (mask_file, mask, 1)):
                    out = fds.get(path)
                    if out is None:
                        out = fds[path] = os.open(path, os.O_WRONLY)
                    pwrite_all(out, view[a * width : b * width], local * width)
    finally:
        for fd in fds.values():
            os.close(fd)


#: Documents whose first bytes ``cached_share`` asks the page cache for.
CACHE_SAMPLE = 64


def cached_share(paths: list[str], offsets: list[int]) -> float | None:
    """The share of reads at ``offsets`` of ``paths`` that the page cache answers without a disk
    (``RWF_NOWAIT``); ``None`` where that cannot be asked."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None or not paths:
        return None
    buffer, hits = bytearray(4096), 0
    for path, offset in zip(paths, offsets, strict=True):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # a missing slice fails where it is read, with its name
        try:
            hits += os.preadv(fd, [buffer], _data_offset(fd, path) + offset, flag) > 0
        except BlockingIOError:
            pass  # not in the page cache
        except (OSError, ChecksumError):
            return None
        finally:
            os.close(fd)
    return hits / len(paths)


def _data_offset(fd: int, path: str) -> int:
    span = npy_header(os.pread(fd, 12, 0))
    if span is None:
        raise ChecksumError(f"{path} is not a .npy file; rerun (its slice is recomputed)")
    return sum(span)


def _read_into(fd: int, view: memoryview, position: int, path: str) -> None:
    left = pread_into(fd, view, position)
    if left:
        ended = position + len(view) - left
        raise ChecksumError(f"{path} ended at byte {ended} while the output was assembled; rerun")


@contextlib.contextmanager
def worker_processes(workers: int) -> Iterator[ProcessPoolExecutor]:
    """Worker processes for the jobs: spawned (the run's process has threads, which forking copies
    badly), deaf to the stop signals (a stopped run kills them: their windows were going into a staging
    directory that is removed with them), gone when the parts are written."""
    start_resource_tracker()
    pool = ProcessPoolExecutor(
        max_workers=workers, mp_context=multiprocessing.get_context("spawn"), initializer=ignore_stop_signals
    )
    try:
        yield pool
    except BaseException:
        for process in list((getattr(pool, "_processes", None) or {}).values()):
            with contextlib.suppress(Exception):
                process.kill()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def run_bounded(
    executor: Executor,
    fn: Callable[[Any], None],
    items: Iterable[Any],
    in_flight: int,
    done: Callable[[Any], None] | None = None,
) -> None:
    """``fn`` over ``items`` on ``executor``, at most ``in_flight`` submitted and not yet done (a job
    holds its part of the plan; an output of thousands of jobs is not planned all at once). ``done`` is
    called with each item once it and every item before it are done, in the items' order."""
    pending: deque[tuple[Any, Future[None]]] = deque()

    def oldest() -> None:
        item, future = pending.popleft()
        future.result()
        if done is not None:
            done(item)

    for item in items:
        with stop_signals_blocked():  # a worker this starts ignores them before it can be interrupted
            pending.append((item, executor.submit(fn, item)))
        while len(pending) >= in_flight:
            oldest()
    while pending:
        oldest()


class WritingStopped(Exception):
    """The parts will not be written to the end: the writing failed or the run was stopped."""


class WrittenParts:
    """How far each part's files are written from their start (in tokens), for a reader that follows the
    writers: it reads no byte before it is written, and stops when the writing does; it says how far it
    has read (:meth:`read`)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._upto: dict[int, int] = {}
        self._read: dict[int, int] = {}
        self._complete = False
        self._stopped = False

    def advance(self, part: int, upto: int) -> None:
        with self._changed:
            self._upto[part] = max(upto, self._upto.get(part, 0))
            self._changed.notify_all()

    def progress(self) -> dict[int, int]:
        """Tokens of each part written from its start, now."""
        with self._changed:
            return dict(self._upto)

    def read(self, part: int, upto: int) -> None:
        """The reader that follows has read ``part`` through token ``upto``."""
        with self._changed:
            self._read[part] = max(upto, self._read.get(part, 0))

    def read_upto(self, part: int) -> int:
        """Tokens of ``part`` the reader that follows has read from its start."""
        with self._changed:
            return self._read.get(part, 0)

    def complete(self) -> None:
        """Every part is written."""
        with self._changed:
            self._complete = True
            self._changed.notify_all()

    def stop(self) -> None:
        """The writing ended before the end: readers waiting, or about to wait, raise ``WritingStopped``."""
        with self._changed:
            self._stopped = True
            self._changed.notify_all()

    @property
    def stopped(self) -> bool:
        return self._stopped

    def wait(self, part: int, upto: int | None = None) -> None:
        """Until part ``part`` is written through token ``upto`` (``None``: every part is written)."""
        with self._changed:
            while not self._stopped:
                if self._complete or (upto is not None and self._upto.get(part, 0) >= upto):
                    return
                self._changed.wait()
            raise WritingStopped("the output's parts were not written to the end")


#: Bytes written between two syncs behind the writers.
SYNC_EVERY = 256 << 20


class SyncBehind:
    """Makes the parts durable behind the writers, on one thread (``fdatasync`` waits for the disk, not
    for a core): the page cache would otherwise hold the whole output until the final ``fsync``, and
    the disk would idle while the cores write and then the cores while the disk does.

    With ``written`` (a reader follows the writers and reads every part once) it then drops from the page
    cache what is durable and read, as ``dd oflag=nocache`` does: nothing here reads it again, so its pages
    would only push out the slices and the input (a 22 B-token output is ~110 GB), and the writers reuse
    the pages just freed instead of taking fresh ones (on a VM whose host backs a page only when it is
    first touched, fresh pages took most of the tail's CPU: bench/results/history.md, session 31)."""

    def __init__(
        self,
        fds: Callable[[int], tuple[int, int]],
        every: int = SYNC_EVERY,
        written: WrittenParts | None = None,
        itemsize: int = 4,
    ) -> None:
        """``fds(part)``: the open token and mask files of a part (``itemsize`` bytes a token id)."""
        self._fds = fds
        self._every = every
        self._new = 0
        self._parts: set[int] = set()
        self._written = written
        self._widths = (itemsize, 1)
        self._dropped: dict[int, int] = {}  # tokens of each part dropped from the page cache
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sync-behind")
        self._running: Future[None] | None = None

    def wrote(self, parts: Iterable[int], nbytes: int) -> None:
        """``nbytes`` more are written into ``parts``: a sync starts when enough are new and none runs."""
        self._parts.update(parts)
        self._new += nbytes
        if self._new < self._every or (self._running is not None and not self._running.done()):
            return
        if self._running is not None:
            self._running.result()  # (an error of the last one: the final fsync meets it again)
        fds = [fd for part in sorted(self._parts) for fd in self._fds(part)]
        synced = {} if self._written is None else self._written.progress()
        self._parts.clear()
        self._new = 0
        self._running = self._thread.submit(self._sync, fds, synced)

    def _sync(self, fds: list[int], synced: dict[int, int]) -> None:
        """Sync ``fds``; then drop what was written before the sync began (``synced``, tokens per part:
        now durable: what was written to a part since the last sync began is in ``fds``) and is read."""
        for fd in fds:
            with contextlib.suppress(OSError):  # the final fsync reports it (closed on the way out: EBADF)
                os.fdatasync(fd)
        if self._written is None or not hasattr(os, "posix_fadvise"):
            return
        for part, upto in synced.items():
            lo, hi = self._dropped.get(part, 0), min(upto, self._written.read_upto(part))
            if hi <= lo:
                continue
            for fd, width in zip(self._fds(part), self._widths, strict=True):
                with contextlib.suppress(OSError):  # advice only (closed on the way out: EBADF)
                    os.posix_fadvise(fd, lo * width, (hi - lo) * width, os.POSIX_FADV_DONTNEED)
            self._dropped[part] = hi

    def close(self) -> None:
        """Wait for the running sync, if any (its error is the final ``fsync``'s to meet)."""
        self._thread.shutdown(wait=True)
