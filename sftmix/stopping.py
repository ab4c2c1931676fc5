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
import select
import signal
import stat
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
_stop_lock = threading.RLock()  # reentrant: the signal handler runs in the main thread, maybe inside
_stopped = threading.Event()


def record_stop(stop: RunStopped) -> RunStopped:
    """Remember the first reason a run was stopped (later ones are consequences of it); in a process
    with a watchdog armed, the first one starts its countdown."""
    global _first_stop
    with _stop_lock:
        first = _first_stop is None
        if first:
            _first_stop = stop
    if first:  # once: a signal handler that runs meanwhile in this thread finds it recorded
        _stopped.set()
    return _first_stop  # type: ignore[return-value]


# ---- the last resort: a recorded stop ends the process in bounded time ---------------------------------

_cleanups: dict[int, Callable[[], None]] = {}


def arm_watchdog(seconds: float = 7.0) -> None:
    """In a process that ends with its run (the command): once a stop is recorded, the process ends
    within ``seconds`` (plus a bounded clean-up) with the stop's exit code, even if a thread is wedged
    and the stop never reaches the place that would end the run. A thread that dies or waits for ever
    can freeze a run that was told to stop; this cannot. (Its thread starts now: starting one from a
    signal handler could wait on a lock the interrupted code holds.)"""
    global _watchdog_armed
    if _watchdog_armed:
        return
    _watchdog_armed = True

    def watch() -> None:
        _stopped.wait()
        time.sleep(seconds)
        stop = first_stop()
        if stop is not None:
            exit_now(stop, forced=True)

    threading.Thread(target=watch, name="stop-watchdog", daemon=True).start()


_watchdog_armed = False


def on_forced_exit(key: int, cleanup: Callable[[], None] | None) -> None:
    """Register (or, with ``None``, drop) a clean-up for an exit that skips the usual unwinding (the
    watchdog's): e.g. removing this run's staging directory."""
    if cleanup is None:
        _cleanups.pop(key, None)
    else:
        _cleanups[key] = cleanup


def _run_cleanups(within: float = 2.0) -> None:
    def run_all() -> None:
        for cleanup in list(_cleanups.values()):
            with contextlib.suppress(Exception):
                cleanup()

    worker = threading.Thread(target=run_all, name="forced-exit-cleanup", daemon=True)
    worker.start()
    worker.join(within)


def descendants(pid: int | None = None) -> list[int]:
    """The processes started by ``pid`` (this process) and theirs, from /proc (Linux; elsewhere none)."""
    found: list[int] = []
    parents = [os.getpid() if pid is None else pid]
    while parents:
        parent = parents.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as fh:
                    children = [int(c) for c in fh.read().split()]
            except (OSError, ValueError):
                continue
            found += children
            parents += children
    return found


def kill_descendants() -> None:
    """SIGKILL every process this one started, and theirs (workers, the fork server, the API server):
    their work is unfinished and a rerun redoes it."""
    for pid in descendants():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


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
    global _deferring, _deferred_stop
    if not _deferring and (stop := look_for_stop()) is not None:
        raise stop
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


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def stop_run(stop: RunStopped) -> None:
    """Record ``stop`` and make the main thread raise it now: at once when called there, else by a real
    signal, which wakes it from any wait (its handler raises the first recorded stop). In a process
    without our handlers (a caller of the flow in-process), the process ends here instead."""
    stop = record_stop(stop)
    if threading.current_thread() is threading.main_thread():
        _raise_unless_deferred(stop)
        return
    if signal.getsignal(signal.SIGINT) is _on_signal:
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]
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
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]

    threading.Thread(target=again, name="stop-again", daemon=True).start()


# ---- a closed stdout or stderr ----------------------------------------------------------------------


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
        if self.quiet_after_stop and _first_stop is not None:
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

    _stop_lookers.append(notice)
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
    (Prefect's event loops, the progress monitor, the staging lease's heartbeat).

    The code is decided here: a stop that comes meanwhile (a reader that went away after the last
    line) is recorded, never raised into this work (it once turned a published run into exit 1)."""
    import atexit

    global _deferring
    _deferring += 1  # for good: the process ends below
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
    run did not unwind, so the clean-ups registered for that (its staging directory) run first.

    A stop after the output was published does not undo it: exit 0, and the line says so."""
    # One line, one exit, whichever thread comes first; the others wait for ever. No other lock is
    # taken here (not logging's: a stop raised into the main thread while it held it keeps it for good).
    _exit_lock.acquire()
    if forced:
        _run_cleanups()
    kill_descendants()
    _remove_multiprocessing_tempdir()
    output = published_output()
    if output is not None:
        line = f"note: {stop.reason} after the output was published: {output} is complete\n"
        code = 0
    else:
        line = f"error: {stop.reason}" + (f"; {_stop_note}" if _stop_note else "") + "\n"
        code = stop.exit_code
    line = new_line_if_needed() + line
    with contextlib.suppress(OSError):  # (a closed stderr was pointed at /dev/null)
        os.write(2, line.encode("utf-8", "replace"))
    os._exit(code)
