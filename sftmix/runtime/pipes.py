"""A closed stdout or stderr (``tokenize-mixer run ... | head``): in the command, a stop of the run with its
own exit code, noticed as soon as the reader is gone; in a worker, silenced, never raised.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import select
import stat
import sys
import threading
import time
from typing import Any, TextIO

from sftmix.runtime.stopping import EXIT_CLOSED_PIPE, RunStopped, first_stop, stop_run


class _PipeGuard(io.TextIOBase):
    """A stdout/stderr that turns a closed pipe (``cmd | head``) into a stop of the run, once, and then
    discards what is written instead of failing every later log line.

    ``stops_run=False`` (a worker process): the closed pipe is only silenced. A worker's output is not
    the user's terminal, and a worker must never end its task run over it: ``rich``, through which
    Prefect prints, answers a closed pipe with ``SystemExit``, which crossed back into the command as
    a slice's outcome and silently ended its pool's management thread (a run frozen for good). The
    command notices the closed pipe itself (:func:`watch_output_pipes`)."""

    def __init__(self, stream: TextIO, stops_run: bool = True) -> None:
        self._stream = stream
        self._closed_pipe = False
        self._stops_run = stops_run
        self._lock = threading.Lock()
        #: Once the run is stopped, nothing more is printed: what follows a stop is its consequences
        #: (a task's crash, an exception a library made of the stop), not news.
        self.quiet_after_stop = False
        #: Whether what was last written ended its line. Not always: Prefect reports a failed log
        #: upload as a message with no newline, and the stop's line must not be glued to it.
        self.at_line_start = True

    def reader_gone(self) -> bool:
        """Whether this stream is a pipe (or socket) nobody reads any more, without writing to it."""
        if self._closed_pipe:
            return False
        try:
            fd = self._stream.fileno()
            mode = os.fstat(fd).st_mode
            if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
                return False
            poller = select.poll()
            poller.register(fd, 0)  # no events asked: only an error or a hang-up is reported
            return any(mask & (select.POLLERR | select.POLLHUP) for _, mask in poller.poll(0))
        except (OSError, ValueError):
            return False

    def _broken(self) -> None:
        with self._lock:
            if self._closed_pipe:
                return
            self._closed_pipe = True
            with contextlib.suppress(OSError, ValueError):
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, self._stream.fileno())  # children write to the same fd
                os.close(devnull)
            self._stream = open(os.devnull, "w")  # noqa: SIM115 (lives as long as the process)
        if not self._stops_run:
            return
        stop_run(RunStopped("stopped: the output pipe was closed", EXIT_CLOSED_PIPE))

    def write(self, text: str) -> int:
        if self.quiet_after_stop and first_stop() is not None:
            return len(text)  # the stop's one line says it all (exit_now writes it past this guard)
        if text:
            self.at_line_start = text.endswith("\n")
        try:
            return self._stream.write(text)
        except OSError as exc:
            if exc.errno != errno.EPIPE:
                raise
            self._broken()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            if exc.errno != errno.EPIPE:
                raise
            self._broken()

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def writable(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def new_line_if_needed() -> str:
    """What goes before a line of our own on stderr so that it starts a line: a newline where the last
    write through ``sys.stderr`` did not end one."""
    stream = sys.stderr
    return "" if not isinstance(stream, _PipeGuard) or stream.at_line_start else "\n"


def guard_std_streams() -> None:
    """Install the closed-pipe guard on ``sys.stdout`` and ``sys.stderr`` (before logging is set up)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _PipeGuard):
            setattr(sys, name, _PipeGuard(stream))


def quiet_after_stop() -> None:
    """In the command: once a stop is recorded, stdout and stderr print nothing more but its line."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, _PipeGuard):
            stream.quiet_after_stop = True


def watch_output_pipes(poll_seconds: float = 0.25) -> None:
    """In the command: stop the run as soon as the reader of its stdout or stderr is gone (``| grep -m1``,
    ``| head``), not at its next write, which may come only after hours of tokenizing or assembling."""

    def watch() -> None:
        while first_stop() is None:
            for stream in (sys.stdout, sys.stderr):
                if isinstance(stream, _PipeGuard) and stream.reader_gone():
                    stream._broken()
            time.sleep(poll_seconds)

    threading.Thread(target=watch, name="output-pipe-watch", daemon=True).start()


def silence_closed_pipes() -> None:
    """In a worker process: a closed stdout or stderr is silenced, never raised (see :class:`_PipeGuard`).
    Log handlers made before (Prefect's console handler, which prints through ``rich``) are pointed at
    the guarded streams too."""
    replaced = {}
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _PipeGuard):
            replaced[id(stream)] = guard = _PipeGuard(stream, stops_run=False)
            setattr(sys, name, guard)
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for log in loggers:
        for handler in getattr(log, "handlers", []):
            stream = getattr(handler, "stream", None)
            if id(stream) in replaced:
                handler.stream = replaced[id(stream)]
            console = getattr(handler, "console", None)  # a rich Console keeps its own reference
            if console is not None and id(getattr(console, "file", None)) in replaced:
                console.file = replaced[id(console.file)]
