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

    return wrapper  # type: ignore[return-value]


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


_quiet = _NoStateFailureDump()
if _quiet not in logging.getLogger("prefect.task_runs").filters:
    logging.getLogger("prefect.task_runs").addFilter(_quiet)
