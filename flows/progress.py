"""Progress a person can watch: a Prefect progress artifact in the UI, and listeners (the CLI's bar)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from prefect.artifacts import create_progress_artifact, update_progress_artifact

from flows.watch import no_retries

logger = logging.getLogger(__name__)


@dataclass
class ProgressEvent:
    done: int
    total: int
    rows: int
    tokens: int
    elapsed: float
    label: str


Listener = Callable[[ProgressEvent], None]
_listeners: list[Listener] = []


def add_listener(listener: Listener) -> None:
    _listeners.append(listener)


def remove_listener(listener: Listener) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


class SliceProgress:
    """Counts finished slices; updates the UI artifact at most every few seconds."""

    def __init__(self, total: int, every_seconds: float = 2.0) -> None:
        self.total = total
        self.done = self.rows = self.tokens = self.computed_tokens = 0
        self.started = self._last = time.perf_counter()
        self.every = every_seconds
        self.artifact = None
        with contextlib.suppress(Exception):  # progress in the UI is a view: never a reason to fail
            self.artifact = create_progress_artifact(
                progress=0.0, key="tokenize-mixer-progress", description=f"Slices tokenized (of {total})"
            )
        self._emit("started")

    def _emit(self, label: str) -> None:
        event = ProgressEvent(
            self.done, self.total, self.rows, self.tokens, time.perf_counter() - self.started, label
        )
        for listener in list(_listeners):
            listener(event)

    def advance(self, rows: int, tokens: int, label: str, reused: bool = False) -> None:
        self.done += 1
        self.rows += rows
        self.tokens += tokens
        self.computed_tokens += 0 if reused else tokens
        self._emit(label)
        now = time.perf_counter()
        if now - self._last >= self.every or self.done == self.total:
            self._last = now
            elapsed = max(now - self.started, 1e-9)
            self._update_artifact(
                progress=100.0 * self.done / max(self.total, 1),
                description=f"{self.done}/{self.total} slices, "
                + (
                    f"{self.computed_tokens / elapsed:,.0f} tokens/s tokenized"
                    if self.computed_tokens
                    else "reused from checkpoints"
                ),
            )

    def _update_artifact(self, **fields: object) -> None:
        if self.artifact is None:
            return
        try:
            with no_retries():  # an API that does not answer at once: skip this update, not wait
                update_progress_artifact(self.artifact, **fields)  # type: ignore[arg-type]
        except Exception as exc:  # the API may be gone; the run's own watch decides what that means
            logger.warning("could not update the progress artifact: %s: %s", type(exc).__name__, exc)
