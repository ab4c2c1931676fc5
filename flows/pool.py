"""Prefect's process pool, made to stop at once and to survive a dead worker.

- When the run stops (a signal, a cancel, an error), the workers are killed rather than waited for:
  their slices were unfinished and a rerun recomputes them from scratch.
- A worker that dies (the OOM killer's SIGKILL) breaks a ``ProcessPoolExecutor`` and fails every
  slice in flight with ``BrokenProcessPool``; :func:`worker_died` tells those failures apart so the
  flow can rebuild the pool and retry them.
- A pool started ahead of the flow (``flows.head_start``) is handed to it already running.

Also here: which slices still need computing, in which order, and on how many workers.
"""

from __future__ import annotations

import contextlib
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from prefect.task_runners import ProcessPoolTaskRunner

from sftmix.config import RunOptions
from sftmix.parallel import available_cpus
from sftmix.slices import SliceSpec, TokenizeContext, read_manifest

#: Below this many rows to tokenize, worker start-up (imports, tokenizer load) costs more than it saves.
SMALL_JOB_ROWS = 2000


def slices_to_compute(specs: list[SliceSpec], ctx: TokenizeContext, run: RunOptions) -> list[SliceSpec]:
    """The slices without a checkpoint on disk (the others are cache hits, answered in milliseconds)."""
    if run.force_recache or run.disable_cache:
        return specs
    return [s for s in specs if read_manifest(ctx.work_dir, s.key, ctx.remote_work_dir) is None]


def pool_size(todo: list[SliceSpec], run: RunOptions) -> tuple[int, bool]:
    """How many workers ``todo`` gets, and whether they are processes: only when there is enough work
    to pay for their start-up (otherwise one in-process worker)."""
    workers = min(run.workers or available_cpus(), max(1, len(todo)))
    rows = sum(s.row_end - s.row_start if s.rows is None else len(s.rows) for s in todo)
    if run.runner == "process" or (run.runner == "auto" and workers > 1 and rows >= SMALL_JOB_ROWS):
        return workers, True
    return workers, False


def run_order(specs: list[SliceSpec]) -> list[SliceSpec]:
    """Biggest first, so the last slices to start are the small remainders and none straggles."""
    return sorted(specs, key=lambda s: (-s.est_bytes, s.index))


class ProcessPool(ProcessPoolTaskRunner):
    def __enter__(self) -> ProcessPool:
        if self._started:  # begun ahead of the flow (flows.head_start): its workers are already busy
            return self
        return super().__enter__()

    def kill_workers(self) -> None:
        processes = getattr(self._executor, "_processes", None) or {}
        for process in list(processes.values()):
            with contextlib.suppress(Exception):
                process.kill()

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        if exc_type is not None:
            self.kill_workers()
        super().__exit__(exc_type, exc_value, traceback)


def worker_died(exc: BaseException) -> bool:
    return isinstance(exc, BrokenProcessPool)


def was_running(future: Any) -> bool:
    """Whether a slice lost to a dead worker had started (a queued one only waited in line)."""
    try:
        return bool(future.state.is_running())
    except Exception:  # the state cannot be read: count it, so a culprit is never missed
        return True
