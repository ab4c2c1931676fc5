"""How a run stops: every way it can end (a signal, a closed output pipe, a cancel, a lost API) becomes
one :class:`RunStopped` with a one-line reason and an exit code of its own; and processes we start
never outlive the process that started them.

Finished slices are checkpointed by their own manifests, so stopping only has to stop promptly: a
rerun of the same command reuses every finished slice and gives the same bytes.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import io
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

logger = logging.getLogger(__name__)

#: Exit codes of the CLI, one per way a run ends (shells report 128+N for a signal N).
EXIT_CANCELLED = 4  # cancelled through the Prefect API or UI
EXIT_API_LOST = 5  # the Prefect API stopped answering
EXIT_WORKERS_DIED = 6  # a slice kept killing its worker process
EXIT_SUPERVISOR_LOST = 7  # the process that started this one (a Prefect worker) died
EXIT_CLOSED_PIPE = 128 + signal.SIGPIPE


class RunStopped(BaseException):
    """The run was stopped before it finished; nothing was published, finished slices are kept.

    A ``BaseException`` like ``KeyboardInterrupt``: code in between must not swallow it, and Prefect
    ends the flow run Crashed (or Cancelled, when the flow returns that state itself)."""

    def __init__(self, reason: str, exit_code: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.exit_code = exit_code

    def __reduce__(self) -> tuple:
        return (type(self), (self.reason, self.exit_code))


_first_stop: RunStopped | None = None


def record_stop(stop: RunStopped) -> RunStopped:
    """Remember the first reason a run was stopped (later ones are consequences of it)."""
    global _first_stop
    if _first_stop is None:
        _first_stop = stop
    return _first_stop


def first_stop() -> RunStopped | None:
    return _first_stop


def _on_signal(signum: int, frame: Any) -> None:
    name = signal.Signals(signum).name
    raise record_stop(RunStopped(f"stopped by {name}", 128 + signum))


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def install_signal_handlers() -> None:
    """SIGINT, SIGTERM and SIGHUP raise :class:`RunStopped` in the main thread."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_signal)


# ---- a closed stdout or stderr ----------------------------------------------------------------------


class _PipeGuard(io.TextIOBase):
    """A stdout/stderr that turns a closed pipe (``cmd | head``) into a stop of the run, once, and then
    discards what is written instead of failing every later log line."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._closed_pipe = False

    def _broken(self) -> None:
        if self._closed_pipe:
            return
        self._closed_pipe = True
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())  # workers and children write to the same fd
            os.close(devnull)
        self._stream = open(os.devnull, "w")  # noqa: SIM115 (lives as long as the process)
        record_stop(RunStopped("stopped: the output pipe was closed", EXIT_CLOSED_PIPE))
        if threading.current_thread() is threading.main_thread():
            raise first_stop()  # type: ignore[misc]
        # A real signal wakes the main thread from any wait; its handler raises the recorded stop.
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]

    def write(self, text: str) -> int:
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


def guard_std_streams() -> None:
    """Install the closed-pipe guard on ``sys.stdout`` and ``sys.stderr`` (before logging is set up)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _PipeGuard):
            setattr(sys, name, _PipeGuard(stream))


# ---- children that die with their parent --------------------------------------------------------------

_PR_SET_PDEATHSIG = 1


def die_with_parent_preexec() -> None:
    """For ``subprocess.Popen(preexec_fn=...)`` from the main thread: the child gets SIGTERM when this
    process dies, however it dies (Linux; elsewhere nothing)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def follow_parent(poll_seconds: float = 1.0) -> None:
    """In a worker process: exit at once when the parent is gone (a kill -9 of the run), from a daemon
    thread, so no worker keeps tokenizing for a run that no longer exists."""
    _release_fork_server()
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_seconds)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="follow-parent", daemon=True).start()


def _release_fork_server() -> None:
    """In a worker forked by multiprocessing's fork server (``flows.worker_start``), whose parent is that
    server: close the worker's copy of the command's end of the server's pipe. The server ends when
    that pipe has no writer left, so it ends with the command, and the worker follows it; each forked
    process gets a copy (to start processes through the server itself, which a worker never does),
    and with it a command killed outright left the server and its workers waiting on each other."""
    forkserver = sys.modules.get("multiprocessing.forkserver")
    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None  # type: ignore[union-attr]


_supervisor_watched = False


def follow_supervisor(
    what: str,
    before_exit: Callable[[RunStopped], None] | None = None,
    poll_seconds: float = 0.2,
    grace_seconds: float = 8.0,
) -> None:
    """In a process started by a supervisor (a flow run started by ``prefect worker``): stop the run when
    the supervisor dies. Its output pipes are then dead, nothing could cancel the run any more, and
    the logging library's broken-pipe handling ends whichever thread logs next (a kill -9 of the
    worker once left a flow run hung for minutes).

    The stop is recorded (the run's own periodic checks raise it, see ``first_stop``) and the dead
    pipes are pointed at /dev/null. No signal is sent: an exception raised at an arbitrary point
    turned into an unrelated error inside a serializer. If the run has not ended after
    ``grace_seconds`` (busy in a long step), ``before_exit`` reports the stop and the process ends
    with the stop's exit code."""
    global _supervisor_watched
    if _supervisor_watched:
        return
    _supervisor_watched = True
    parent = os.getppid()
    gone = threading.Event()

    def notice() -> RunStopped | None:
        """Record the stop and silence the dead pipes, once; ``None`` while the supervisor lives."""
        if os.getppid() == parent:
            return None
        stop = record_stop(
            RunStopped(
                f"stopped: {what} (pid {parent}) is gone, so the run could be neither watched nor cancelled",
                EXIT_SUPERVISOR_LOST,
            )
        )
        if not gone.is_set():
            gone.set()
            with contextlib.suppress(OSError):
                devnull = os.open(os.devnull, os.O_WRONLY)
                for fd in (1, 2):
                    os.dup2(devnull, fd)
                os.close(devnull)
        return stop

    # The kernel's parent-death signal notices at once, before the next log line meets the dead pipe
    # (the handler runs in the main thread between two bytecodes and only records); polling is the
    # backstop (the signal follows the parent's thread, not the process, and needs the main thread).
    with contextlib.suppress(ValueError, OSError):
        signal.signal(signal.SIGUSR2, lambda signum, frame: notice())
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGUSR2, 0, 0, 0)

    def watch() -> None:
        while (stop := notice()) is None:
            time.sleep(poll_seconds)
        time.sleep(grace_seconds)
        if before_exit is not None:
            with contextlib.suppress(Exception):
                before_exit(stop)
        exit_now(stop)

    threading.Thread(target=watch, name="follow-supervisor", daemon=True).start()


def ignore_stop_signals() -> None:
    """In a worker process: a terminal's Ctrl-C or a group SIGTERM is for the run to handle (it stops
    the workers itself), not a reason for each worker to die with a traceback. Signals held back
    since the worker started (:func:`stop_signals_blocked`) are dropped, then let through again."""
    for sig in STOP_SIGNALS:
        with contextlib.suppress(ValueError, OSError):
            signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Around starting worker processes: they inherit the blocked stop signals, so a Ctrl-C that comes
    while one imports its modules cannot end it with a traceback before it ignores them itself
    (:func:`ignore_stop_signals`). In this thread they are only held back: one that comes meanwhile
    is delivered when the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def finish(code: int) -> None:
    """End the command with ``code`` once its work is done: the at-exit work still runs (log handlers,
    finalizers), the interpreter's teardown of every imported module does not. With Prefect,
    transformers and datasets imported that teardown alone took 0.6 s (measured: 1.67 s to the last
    line, 2.27 s to the exit; 1.71 s with this). Every thread left at the end of a run is a daemon
    (Prefect's event loops, the progress monitor, the staging lease's heartbeat)."""
    import atexit

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    run_exit_functions = getattr(atexit, "_run_exitfuncs", None)
    if run_exit_functions is None:  # not CPython: the usual exit
        sys.exit(code)
    run_exit_functions()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def exit_now(stop: RunStopped) -> None:
    """Print the stop's one line and end the process at once, skipping at-exit work: workers and
    servers we started follow us out (``follow_parent``, PDEATHSIG), staging is left with a lease
    that shows it abandoned, and Prefect's at-exit drains would retry against an API that is gone."""
    logging.disable(logging.CRITICAL)
    line = (
        f"error: {stop.reason}; nothing was published, finished slices are checkpointed: "
        "rerun the same command to resume\n"
    )
    with contextlib.suppress(OSError):
        os.write(2, line.encode("utf-8", "replace"))
    os._exit(stop.exit_code)
