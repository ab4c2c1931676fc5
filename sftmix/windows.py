"""The output written window by window: each window's documents read from their slices' files straight
into memory (``pread``), then written once, sequentially, into its part.

A window is planned by the assembling process (which documents, from where, to where: numpy over the
document table) and filled anywhere: on a thread, or in a worker process when the output is large
enough to pay for starting them. Filling is a Python loop over documents (two reads each); in threads
that loop would hold one GIL for the whole output, so on many cores a big output is written by
processes. This module imports only numpy, so a worker starts in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import ChecksumError
from .stopping import ignore_stop_signals, stop_signals_blocked


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
    views = (memoryview(tokens).cast("B"), memoryview(mask).cast("B"))
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
    for path, data, position in (
        (job.tokens_file, tokens, job.at * tokens.dtype.itemsize),
        (job.mask_file, mask, job.at),
    ):
        fd = os.open(path, os.O_WRONLY)
        try:
            view = memoryview(data).cast("B")
            while view:  # pwrite may write less than asked
                written = os.pwrite(fd, view, position)
                view, position = view[written:], position + written
        finally:
            os.close(fd)


def _data_offset(fd: int, path: str) -> int:
    head = os.pread(fd, 12, 0)
    if len(head) < 12 or head[:6] != b"\x93NUMPY":
        raise ChecksumError(f"{path} is not a .npy file; rerun (its slice is recomputed)")
    if head[6] == 1:
        return 10 + int.from_bytes(head[8:10], "little")
    return 12 + int.from_bytes(head[8:12], "little")


def _read_into(fd: int, view: memoryview, position: int, path: str) -> None:
    while view:
        got = os.preadv(fd, [view], position)
        if not got:
            raise ChecksumError(f"{path} ended at byte {position} while the output was assembled; rerun")
        view, position = view[got:], position + got


@contextlib.contextmanager
def window_processes(workers: int) -> Iterator[ProcessPoolExecutor]:
    """Worker processes for windows: spawned (the run's process has threads, which forking copies
    badly), deaf to the stop signals (a stopped run kills them: their windows were going into a staging
    directory that is removed with them), gone when the output is written."""
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


def run_bounded(executor: Executor, fn: Callable[[Any], None], items: Iterable[Any], in_flight: int) -> None:
    """``fn`` over ``items`` on ``executor``, at most ``in_flight`` submitted and not yet done (a job
    holds its window's plan; an output of thousands of windows is not planned all at once)."""
    pending: deque[Future[None]] = deque()
    for item in items:
        with stop_signals_blocked():  # a worker this starts ignores them before it can be interrupted
            pending.append(executor.submit(fn, item))
        while len(pending) >= in_flight:
            pending.popleft().result()
    while pending:
        pending.popleft().result()
