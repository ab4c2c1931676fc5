"""Processes we start never outlive the process that started them: a child dies with its parent however
the parent dies (PDEATHSIG, or a worker's own watch of its parent), a stop kills what is left of them,
and stop signals reach the command, never its workers (they would die with a traceback each).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

#: The signals that stop a command (``sftmix.runtime.stopping`` turns each into a stop of the run).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

PR_SET_PDEATHSIG = 1


def die_with_parent_preexec() -> None:
    """For ``subprocess.Popen(preexec_fn=...)`` from the main thread: the child gets SIGTERM when this
    process dies, however it dies (Linux; elsewhere nothing)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


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
    """In a worker forked by multiprocessing's fork server (``flows.workers.worker_start``), whose parent is that
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
        server._forkserver_alive_fd = None  # type: ignore[union-attr]  # fd was found on it: server is not None


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


#: The named semaphores made and not yet let go of (:func:`start_resource_tracker` keeps the record),
#: each with the PID of the process that made it (a forked child inherits the record, not the
#: semaphores): what a stop that kills the resource tracker unlinks itself.
_held_semaphores: dict[str, int] = {}


def _keep_semaphore_record() -> None:
    """Every semaphore this process registers with the tracker (a pool's queues and locks) is also noted
    here until it is let go of. Once only; the tracker is still told of each."""
    from multiprocessing import resource_tracker

    if getattr(resource_tracker.register, "keeps_record", False):
        return
    tracker = resource_tracker._resource_tracker

    def register(name: str, rtype: str) -> None:
        if rtype == "semaphore":
            _held_semaphores[name] = os.getpid()
        tracker.register(name, rtype)

    def unregister(name: str, rtype: str) -> None:
        _held_semaphores.pop(name, None)
        tracker.unregister(name, rtype)

    register.keeps_record = True  # type: ignore[attr-defined]  # a mark on the function object
    resource_tracker.register = register  # type: ignore[assignment]  # typeshed says name: Sized; it is a str
    resource_tracker.unregister = unregister  # type: ignore[assignment]  # (as register)


def unlink_held_semaphores() -> None:
    """In a process about to end at once, after its descendants (the resource tracker among them) are
    killed: unlink the named semaphores it still holds. The tracker would have unlinked them at its own
    end; killed, it leaves each as a file in ``/dev/shm`` for good. The names are this process's own
    record (:func:`start_resource_tracker`), never a guess from ``/dev/shm``."""
    try:
        from _multiprocessing import sem_unlink  # type: ignore[import-not-found]  # a C module typeshed omits
    except ImportError:  # (no named semaphores here: Windows)
        return
    for name, maker in list(_held_semaphores.items()):
        if maker != os.getpid():
            continue
        with contextlib.suppress(OSError):  # (let go of meanwhile by its own clean-up)
            sem_unlink(name)


def end_resource_tracking() -> None:
    """In a process about to end at once, before its descendants are killed (multiprocessing's resource
    tracker with them): its semaphores are no longer reported to any tracker. A pool's thread that lets
    one go after the kill (it saw its workers die) would otherwise start a new tracker, which never saw
    the semaphore registered and prints a ``KeyError`` traceback for each. A semaphore is still unlinked
    by its own clean-up; only the report is dropped."""
    tracker = sys.modules.get("multiprocessing.resource_tracker")
    if tracker is None:
        return

    def untracked(*args: Any, **kwargs: Any) -> None:
        return None

    for name in ("register", "unregister", "ensure_running"):
        setattr(tracker, name, untracked)
        setattr(tracker._resource_tracker, name, untracked)


def kill_descendants(within: float = 0.0) -> None:
    """SIGKILL every process this one started, and theirs (workers, the fork server, the API server):
    their work is unfinished and a rerun redoes it. ``within``: seconds to wait for them to be gone (dead,
    if not yet reaped), so that what they were writing can be removed after them."""
    killed = descendants()
    for pid in killed:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + within
    while killed and time.monotonic() < deadline:
        killed = [pid for pid in killed if _running(pid)]
        if killed:
            time.sleep(0.01)


def _running(pid: int) -> bool:
    """Whether process ``pid`` still runs: not gone, and not a zombie waiting to be reaped (Linux's
    /proc; elsewhere, whether it exists)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rpartition(b")")[2].split()[:1] not in ([b"Z"], [b"X"])
    except FileNotFoundError:
        return False
    except OSError:
        return pid_alive(pid)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie too; one of another user's too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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


#: For multiprocessing's resource tracker: no warning of "leaked" semaphores when the command that started
#: it was killed outright (kill -9, the OOM killer). The tracker unlinks them, which is its job, and the
#: warning would follow the shell's "Killed" line with nothing in it for a person to do.
_LEAK_WARNING_OFF = "ignore:resource_tracker:UserWarning"


def start_resource_tracker() -> None:
    """Before a pool of worker processes: multiprocessing's resource tracker (it follows the pool's
    semaphores), started deaf to the stop signals. It ignores SIGINT and SIGTERM but not SIGHUP (a closed
    terminal, sent to the whole group); killed by one, it is started again by the next semaphore the
    stopping run lets go of, and the new one, which never saw them registered, prints a traceback for
    each. Born with the signals blocked, it never sees one (nor warns of what a killed command held:
    :data:`_LEAK_WARNING_OFF`). Its start unblocks SIGINT and SIGTERM in the calling thread: it gets a
    block of its own. (Once running, this returns at once.) From here on the semaphores this process
    makes are on its own record too (:func:`unlink_held_semaphores`)."""
    from multiprocessing import resource_tracker

    _keep_semaphore_record()
    sys.warnoptions.append(_LEAK_WARNING_OFF)  # (the tracker's command line carries this process's -W)
    try:
        with stop_signals_blocked():
            resource_tracker.ensure_running()
    finally:
        sys.warnoptions.remove(_LEAK_WARNING_OFF)
