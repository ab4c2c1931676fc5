"""Thin Prefect tasks over ``sftmix``: one module per stage."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from prefect.states import Failed

from sftmix.errors import MixerError

F = TypeVar("F", bound=Callable[..., Any])


def fail_cleanly(fn: F) -> F:
    """A user's error (bad row, missing file) fails the run with its message, not a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except MixerError as exc:
            return Failed(message=str(exc), data=exc)

    return wrapper  # type: ignore[return-value]  # wraps() keeps fn's signature


class _NoStateFailureDump(logging.Filter):
    """Prefect logs a task that returned a Failed state as ``Task run failed with state: Failed(...,
    result=...)`` plus an empty traceback (``NoneType: None``); the next line, ``Finished in state
    Failed('...')``, already says it once and cleanly. Drops only that record, only when it carries
    no exception."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.msg.startswith("Task run failed with state:")
            if isinstance(record.msg, str) and not (record.exc_info and record.exc_info[0])
            else False
        )


class _ResultRecordWriteFailure(logging.Filter):
    """Prefect logs a result record it could not write (a full disk) with the storage library's
    traceback, and carries on. For a slice that record is only the orchestrator's cache: the slice's
    own checkpoint is written before it, and a rerun finds it there. One line instead, same level."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and str(record.msg).startswith("An error was encountered while committing"):
            record.msg = (
                f"{record.getMessage()}: {type(exc).__name__}: {exc} (Prefect's result record is not "
                "written; the slice's own checkpoint is, and a rerun finds it)"
            )
            record.args = ()
            record.exc_info = record.exc_text = None
        return True


class _UserErrorTraceback(logging.Filter):
    """A flow run that ends Failed with a user's error (its state message says it in one line) is
    logged once more by Prefect's engine as ``Engine execution exited with unexpected exception`` with
    the error's traceback: the UI's logs end in a wall of Prefect frames for "this output holds other
    shards". Drops only that record, only for our own errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, MixerError) and str(record.msg).startswith("Engine execution exited"))


for _name, _filter in (
    ("prefect.flow_runs", _UserErrorTraceback()),
    ("prefect.engine", _UserErrorTraceback()),
    ("prefect.task_runs", _NoStateFailureDump()),
    ("prefect.task_runs", _ResultRecordWriteFailure()),
    ("prefect.transactions", _ResultRecordWriteFailure()),
):
    _logger = logging.getLogger(_name)
    if not any(type(f) is type(_filter) for f in _logger.filters):
        _logger.addFilter(_filter)
