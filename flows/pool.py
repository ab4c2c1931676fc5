"""Prefect's process pool, made to stop at once and to survive a dead worker.

- When the run stops (a signal, a cancel, an error), the workers are killed rather than waited for:
  their slices were unfinished and a rerun recomputes them from scratch.
- A worker that dies (the OOM killer's SIGKILL) breaks a ``ProcessPoolExecutor`` and fails every
  slice in flight with ``BrokenProcessPool``; :func:`worker_died` tells those failures apart so the
  flow can rebuild the pool and retry them.
"""

from __future__ import annotations

import contextlib
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from prefect.task_runners import ProcessPoolTaskRunner


class ProcessPool(ProcessPoolTaskRunner):
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
