"""How a run stops: every way it can end (a signal, a closed output pipe, a cancel, a lost API or
supervisor) becomes one :class:`RunStopped` with a one-line reason and an exit code of its own, and the
command ends with that line and code (:func:`exit_now`, :func:`finish`).

The neighbours: ``sftmix.runtime.pipes`` turns a closed stdout or stderr into a stop, ``sftmix.runtime.processes``
keeps the processes we start from outliving us, ``sftmix.runtime.watchdog`` ends a command whose stop never
reached the place that would end its run.

Finished slices are checkpointed by their own manifests, so stopping only has to stop promptly: a
rerun of the same command reuses every finished slice and gives the same bytes.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from sftmix.runtime.processes import (
    PR_SET_PDEATHSIG,
    STOP_SIGNALS,
    end_resource_tracking,
    kill_descendants,
    unlink_held_semaphores,
)

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
_stop_lock = threading.RLock()  # reentrant: the signal handler runs in the main thread, maybe inside
#: Set once a stop is recorded (``sftmix.runtime.watchdog`` waits on it).
stop_recorded = threading.Event()


def record_stop(stop: RunStopped) -> RunStopped:
    """Remember the first reason a run was stopped (later ones are consequences of it); in a process
    with a watchdog armed, the first one starts its countdown."""
    global _first_stop
    with _stop_lock:
        first = _first_stop is None
        if first:
            _first_stop = stop
    if first:  # once: a signal handler that runs meanwhile in this thread finds it recorded
        stop_recorded.set()
    return _first_stop  # type: ignore[return-value]  # set above, under the lock, and never unset


# ---- the last resort: a recorded stop ends the process in bounded time ---------------------------------

_cleanups: dict[int, Callable[[], None]] = {}


def on_forced_exit(key: int, cleanup: Callable[[], None] | None) -> None:
    """Register (or, with ``None``, drop) a clean-up for an exit that skips the usual unwinding (the
    watchdog's): e.g. removing this run's staging directory."""
    if cleanup is None:
        _cleanups.pop(key, None)
    else:
        _cleanups[key] = cleanup


#: Temp files being written (each landing under its final name by a rename), by the process writing them.
_being_written: dict[str, int] = {}


@contextlib.contextmanager
def removed_at_exit(path: str | os.PathLike[str]) -> Iterator[None]:
    """While in this block, the temp file ``path`` is removed should the process end first: a stop ends
    it at once (:func:`exit_now`), and a thread that writes beside the run (a daemon thread decompressing
    or fetching an input ahead of the plan) never unwinds. Only the process that wrote it removes it: a
    forked worker inherits this table, not the files."""
    key = os.fspath(path)
    _being_written[key] = os.getpid()
    try:
        yield
    finally:
        _being_written.pop(key, None)


def _remove_written() -> None:
    pid = os.getpid()
    for path, writer in list(_being_written.items()):
        if writer == pid:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _run_cleanups(within: float = 2.0) -> None:
    def run_all() -> None:
        for cleanup in list(_cleanups.values()):
            with contextlib.suppress(Exception):
                cleanup()

    worker = threading.Thread(target=run_all, name="forced-exit-cleanup", daemon=True)
    worker.start()
    worker.join(within)


def first_stop() -> RunStopped | None:
    return _first_stop


#: Watchers that notice a stop by polling (:func:`follow_supervisor`): :func:`look_for_stop` asks them
#: now rather than waiting for their next round.
_stop_lookers: list[Callable[[], object]] = []


def look_for_stop() -> RunStopped | None:
    """The first recorded stop, after every polling watcher has looked once more: a supervisor that
    died a moment ago is a stop here, not at the watcher's next round (a flow run once published in
    that moment though its worker was gone)."""
    for look in list(_stop_lookers):
        with contextlib.suppress(Exception):
            look()
    return first_stop()


_deferring = 0  # > 0 inside stops_deferred() (a stop is recorded, raised when the step is done) and finish()
_deferred_stop = False


def _on_signal(signum: int, frame: Any) -> None:
    name = signal.Signals(signum).name
    _raise_unless_deferred(record_stop(RunStopped(f"stopped by {name}", 128 + signum)))


def _raise_unless_deferred(stop: RunStopped) -> None:
    """In the main thread: raise ``stop`` now, or, inside :func:`stops_deferred`, when its step is done."""
    global _deferred_stop
    if _deferring:
        _deferred_stop = True
        return
    raise stop


@contextlib.contextmanager
def stops_deferred() -> Iterator[None]:
    """Around a step that must either happen whole or not at all, and takes no time (the renames that
    publish an output): a stop recorded before it starts keeps it from starting (raised here, a
    polling watcher's included, :func:`look_for_stop`); one that comes meanwhile is raised once the
    step is done."""
    if not _deferring and (stop := look_for_stop()) is not None:
        raise stop
    with stops_held():
        yield


@contextlib.contextmanager
def stops_held() -> Iterator[None]:
    """Around cleanup that must run whole once begun (removing what the command made, on its way out of
    a stop too): a stop recorded before does not keep it from running, and one that comes meanwhile
    (a signal, a closed pipe noticed by another thread) is raised once it is done."""
    global _deferring, _deferred_stop
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
    if not _deferring and _deferred_stop:
        _deferred_stop = False
        stop = first_stop()
        if stop is not None:
            raise stop


_published: str | None = None


def mark_published(output: str | os.PathLike[str]) -> None:
    """The output is in place: a stop from here on does not undo it, and the command says so (exit 0)."""
    global _published
    _published = str(output)


def published_output() -> str | None:
    return _published


def stop_run(stop: RunStopped) -> None:
    """Record ``stop`` and make the main thread raise it now: at once when called there, else by a real
    signal, which wakes it from any wait (its handler raises the first recorded stop). In a process
    without our handlers (a caller of the flow in-process), the process ends here instead."""
    stop = record_stop(stop)
    if threading.current_thread() is threading.main_thread():
        _raise_unless_deferred(stop)
        return
    if signal.getsignal(signal.SIGINT) is _on_signal:
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]  # the main thread's ident is set
    else:
        exit_now(stop)


def install_signal_handlers() -> None:
    """SIGINT, SIGTERM and SIGHUP raise :class:`RunStopped` in the main thread; SIGHUP not when this
    process was started with it ignored (``nohup``: a closed terminal must not end the run)."""
    for sig in STOP_SIGNALS:
        if sig == signal.SIGHUP and signal.getsignal(sig) is signal.SIG_IGN:
            continue
        signal.signal(sig, _on_signal)
    if sys.unraisablehook is not _unraisable:
        global _default_unraisable
        _default_unraisable = sys.unraisablehook
        sys.unraisablehook = _unraisable


@contextlib.contextmanager
def handlers_given_back() -> Iterator[None]:
    """Around a call in someone else's process that may :func:`install_signal_handlers`: their signal
    handlers and unraisable hook are theirs again after it. Only the main thread sets handlers, so
    elsewhere there is nothing to give back; a handler set from C (``None``) is not ours to restore."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    theirs, their_hook = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}, sys.unraisablehook
    try:
        yield
    finally:
        for sig, handler in theirs.items():
            if handler is not None:
                signal.signal(sig, handler)
        sys.unraisablehook = their_hook


@contextlib.contextmanager
def our_sigterm() -> Iterator[None]:
    """Inside a Prefect flow run of the command: SIGTERM is ours again. Prefect's flow engine swaps in a
    handler of its own that raises ``TerminationSignal``, which records no stop; raised inside a
    library call it can come out as another error (pydantic's serializer wraps it in one) and the run
    ended with exit 1 and a traceback instead of 143. Elsewhere (a flow run a Prefect worker started,
    which Prefect cancels with SIGTERM) nothing changes."""
    swap = (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is _on_signal
    )
    previous = signal.signal(signal.SIGTERM, _on_signal) if swap else None
    try:
        yield
    finally:
        if swap and previous is not None:
            signal.signal(signal.SIGTERM, previous)


_default_unraisable = sys.unraisablehook


def _unraisable(unraisable: Any) -> None:
    """A stop raised while the main thread ran a finalizer or a weakref callback (importlib's module
    locks have one) cannot leave it: Python prints it as "Exception ignored in ..." and goes on. It is
    recorded; it is raised again a moment later, from wherever the main thread is then."""
    if not isinstance(unraisable.exc_value, RunStopped):
        _default_unraisable(unraisable)
        return

    def again() -> None:
        time.sleep(0.05)
        with contextlib.suppress(Exception):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]  # the main thread's ident is set

    threading.Thread(target=again, name="stop-again", daemon=True).start()


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

    _stop_lookers.append(notice)
    # The kernel's parent-death signal notices at once, before the next log line meets the dead pipe
    # (the handler runs in the main thread between two bytecodes and only records); polling is the
    # backstop (the signal follows the parent's thread, not the process, and needs the main thread).
    with contextlib.suppress(ValueError, OSError):
        signal.signal(signal.SIGUSR2, lambda signum, frame: notice())
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGUSR2, 0, 0, 0)

    def watch() -> None:
        while (stop := notice()) is None:
            time.sleep(poll_seconds)
        time.sleep(grace_seconds)
        if before_exit is not None:
            with contextlib.suppress(Exception):
                before_exit(stop)
        exit_now(stop)

    threading.Thread(target=watch, name="follow-supervisor", daemon=True).start()


def finish(code: int) -> None:
    """End the command with ``code`` once its work is done: the at-exit work still runs (log handlers,
    finalizers), the interpreter's teardown of every imported module does not. With Prefect,
    transformers and datasets imported that teardown alone took 0.6 s (measured: 1.67 s to the last
    line, 2.27 s to the exit; 1.71 s with this). Every thread left at the end of a run is a daemon
    (Prefect's event loops, the progress monitor, the staging lease's heartbeat).

    The code is decided here: a stop that comes meanwhile (a reader that went away after the last
    line) is recorded, never raised into this work (it once turned a published run into exit 1)."""
    import atexit

    global _deferring
    _deferring += 1  # for good: the process ends below
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    _remove_written()
    run_exit_functions = getattr(atexit, "_run_exitfuncs", None)
    if run_exit_functions is None:  # not CPython: the usual exit
        sys.exit(code)
    run_exit_functions()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


_exit_lock = threading.Lock()

#: What the stop line adds after the reason, for the command that runs: set with :func:`set_stop_note`.
_stop_note = ""

RUN_STOP_NOTE = "nothing was published, finished slices are checkpointed: rerun the same command to resume"


def set_stop_note(note: str) -> None:
    global _stop_note
    _stop_note = note


def _remove_multiprocessing_tempdir() -> None:
    """multiprocessing's ``pymp-*`` directory of this process (the fork server's socket): removed by a
    finalizer at a normal exit, which :func:`exit_now` skips."""
    process = sys.modules.get("multiprocessing.process")
    tempdir = getattr(process.current_process(), "_config", {}).get("tempdir") if process else None
    if tempdir:
        import shutil

        shutil.rmtree(tempdir, ignore_errors=True)


def exit_now(stop: RunStopped, forced: bool = False) -> None:
    """Print the stop's one line and end the process at once, skipping at-exit work (Prefect's at-exit
    drains would retry against an API that may be gone). The processes it started are killed (they
    also follow it out by themselves: ``follow_parent``, PDEATHSIG). ``forced`` (the watchdog): the
    run did not unwind, so the clean-ups registered for that (its staging directory) run, once the
    processes that may write there are gone.

    A stop after the output was published does not undo it: exit 0, and the line says so."""
    # One line, one exit, whichever thread comes first; the others wait for ever. No other lock is
    # taken here (not logging's: a stop raised into the main thread while it held it keeps it for good).
    _exit_lock.acquire()
    end_resource_tracking()  # (killed below: a semaphore let go of after that would start another)
    kill_descendants(within=1.0)  # (first: a clean-up must not race a process still writing there)
    if forced:
        _run_cleanups()
    _remove_written()
    unlink_held_semaphores()  # (the tracker, killed, no longer does)
    _remove_multiprocessing_tempdir()
    output = published_output()
    if output is not None:
        line = f"note: {stop.reason} after the output was published: {output} is complete\n"
        code = 0
    else:
        line = f"error: {stop.reason}" + (f"; {_stop_note}" if _stop_note else "") + "\n"
        code = stop.exit_code
    if not getattr(sys.stderr, "at_line_start", True):  # (sftmix.runtime.pipes' guard knows)
        line = "\n" + line
    with contextlib.suppress(OSError):  # (a closed stderr was pointed at /dev/null)
        os.write(2, line.encode("utf-8", "replace"))
    os._exit(code)
