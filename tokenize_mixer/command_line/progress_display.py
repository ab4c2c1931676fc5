"""The command's progress while a run goes: a live bar on a terminal, elsewhere a summary line every few
seconds, with the log lines written above the bar.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def progress_bar() -> Iterator[None]:
    """The command's progress: a live bar on a terminal (slices, share of the input, the recent rate,
    time left), elsewhere a summary line every few seconds (``flows.progress``); both count the head
    start's slices as they finish, before the flow run exists."""
    # (plain generators, delegated to: their try/finally runs as if written here)
    if not sys.stderr.isatty():
        yield from _progress_lines()
        return
    yield from _live_bar()


def _progress_lines() -> Iterator[None]:
    """A summary line every few seconds while it runs, and the last slice's line at once."""
    from tokenize_mixer.flows.progress import BOARD, line_seconds

    stop, wake = threading.Event(), threading.Event()

    def complete(facts: Any) -> None:  # the last slice's line at once, not at the next tick
        if facts.done >= facts.total:
            wake.set()

    def lines() -> None:
        said_complete = False
        while not stop.is_set():
            wake.wait(line_seconds())
            wake.clear()
            if BOARD.active and not said_complete and not stop.is_set():
                facts = BOARD.facts()
                logging.getLogger("tokenize_mixer.progress").info(facts.line())
                said_complete = facts.done >= facts.total

    BOARD.add_listener(complete)
    ticker = threading.Thread(target=lines, name="progress-lines", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        BOARD.remove_listener(complete)
        stop.set()
        wake.set()


def _live_bar() -> Iterator[None]:
    """A live bar on the terminal while it runs; log lines are written above it."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, TaskProgressColumn
    from rich.text import Text

    from tokenize_mixer.flows.progress import BOARD

    class Facts(ProgressColumn):  # read at every refresh: the rate and the time left move between slices
        def render(self, task: Any) -> Text:
            if not BOARD.active:
                return Text("planning, starting the Prefect API")
            facts = BOARD.facts()
            return Text(facts.short())

    bar = Progress(
        SpinnerColumn(),
        BarColumn(),
        TaskProgressColumn(),
        Facts(),
        console=Console(stderr=True),
        refresh_per_second=4,
    )
    task_id = bar.add_task("slices", total=1.0)

    def update(facts: Any) -> None:
        bar.update(task_id, completed=facts.fraction)

    BOARD.add_listener(update)
    stderr = sys.stderr
    try:
        with bar, _log_handlers_writing_to(stderr, sys.stderr):  # (the bar's stderr: lines above it)
            yield
    finally:
        BOARD.remove_listener(update)


@contextlib.contextmanager
def _log_handlers_writing_to(stream: Any, instead: Any) -> Iterator[None]:
    """Every log handler that writes to ``stream`` writes to ``instead`` meanwhile. A live bar's console
    puts what is written to its stderr above the bar; a handler holding the stream it was made with
    (ours, Prefect's) would write over the bar, its line glued to the bar's text."""
    loggers = [logging.getLogger()] + [
        each for each in logging.Logger.manager.loggerDict.values() if isinstance(each, logging.Logger)
    ]
    moved = [
        handler
        for logger in loggers
        for handler in logger.handlers
        if isinstance(handler, logging.StreamHandler) and handler.stream is stream
    ]
    if instead is stream:  # (no terminal: nothing to move)
        moved = []
    for handler in moved:
        handler.setStream(instead)
    try:
        yield
    finally:
        for handler in moved:
            handler.setStream(stream)
