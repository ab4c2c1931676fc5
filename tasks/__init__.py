"""Thin Prefect tasks over ``sftmix``: one module per stage."""

from __future__ import annotations

import functools
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
