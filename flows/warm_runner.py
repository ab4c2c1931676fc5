"""The warm runner (``python -m flows.warm_runner DIR KEY SECONDS SPAWNER``): a process that has imported
what a run needs and runs a temporary Prefect API, and forks one process per command that asks it.

Started by a cold command (:func:`sftmix.warm.start_runner`), it waits for that command to end, then
imports and starts the API, and only then makes its socket appear (renamed into place), so a command
either finds it ready or runs cold. It forks from a single thread (nothing is held by another thread
in the copy); each forked process becomes the command (:func:`_become_the_command`) in a session of its
own. The runner sends each command the exit status of its process, and ends after SECONDS without a
run, when its API server dies, when its socket is taken away, or on SIGTERM/SIGINT (its runs are
passed the signal and waited for first).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from sftmix.stopping import STOP_SIGNALS
from sftmix.warm import (
    WARM_API_ENV,
    lock_path,
    receive_request,
    runner_key,
    send_message,
    socket_fits,
    socket_path,
    staged_socket_path,
    state_path,
)

logger = logging.getLogger("tokenize_mixer.warm_runner")

#: Seconds the runs of a runner told to stop get to stop before their API goes.
RUNS_STOP_WITHIN = 15.0
_stopping = False


def _on_stop(signum: int, frame: Any) -> None:
    global _stopping
    _stopping = True


def _wait_for_exit(pid: int) -> None:
    with contextlib.suppress(OSError):
        fd = os.pidfd_open(pid)
        try:
            while not _stopping and not select.select([fd], [], [], 0.5)[0]:
                pass
        finally:
            os.close(fd)


def _import_what_a_run_needs() -> None:
    import flows.head_start  # noqa: F401
    import flows.tokenize_mixer  # noqa: F401
    import tasks.worker_preload  # noqa: F401
    from flows.runtime import _warm_imports
    from sftmix import cli, command, plan  # noqa: F401

    _warm_imports()


class Runner:
    def __init__(self, directory: Path, key: str, idle_seconds: float, lock: int) -> None:
        from flows.runtime import TemporaryServer

        self.directory = directory
        self.key = key
        self.idle_seconds = idle_seconds
        self.lock = lock  # held for the runner's life; not by its runs
        self.server = TemporaryServer(pass_settings=False)
        self.listener: socket.socket | None = None
        self.inode: int | None = None
        self.runs: dict[int, socket.socket] = {}
        self.last_run = time.monotonic()

    # -- life

    def serve(self) -> None:
        timeout = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120"))
        try:
            self.server.launch()
            self.server.wait_ready(timeout)
            if _stopping:
                return
            self._listen()
            logger.info(
                "warm runner %d ready: API %s, socket %s", os.getpid(), self.server.api_url, self._path
            )
            self.last_run = time.monotonic()
            while self._keep_going():
                self._accept()
                self._reap()
        finally:
            self._close()

    @property
    def _path(self) -> Path:
        return socket_path(self.directory, self.key)

    def _listen(self) -> None:
        temporary = staged_socket_path(self.directory, self.key, os.getpid())
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(os.fspath(temporary))
        os.chmod(temporary, 0o600)
        listener.listen(16)
        listener.settimeout(0.2)
        self.inode = os.stat(temporary).st_ino
        state = {
            "pid": os.getpid(),
            "api_pid": self.server.process.pid if self.server.process else None,
            "api_url": self.server.api_url,
            "idle_seconds": self.idle_seconds,
            "cwd": os.getcwd(),
            "started": time.time(),
        }
        staged = self.directory / f".{self.key}.{os.getpid()}.json"
        with open(os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(state, f)
        os.replace(staged, state_path(self.directory, self.key))
        os.replace(temporary, self._path)  # from now on commands find it
        self.listener = listener

    def _ours(self) -> bool:
        try:
            return os.stat(self._path).st_ino == self.inode
        except OSError:
            return False

    def _keep_going(self) -> bool:
        if _stopping:
            logger.info("stopping: told to")
            return False
        process = self.server.process
        if process is None or process.poll() is not None:
            logger.info("stopping: the API server ended")
            return False
        if self.runs:
            return True
        if not self._ours():
            logger.info("stopping: the socket was taken away")
            return False
        if time.monotonic() - self.last_run > self.idle_seconds:
            logger.info("stopping: %.0f s without a run", self.idle_seconds)
            return False
        return True

    def _close(self) -> None:
        if self._ours():
            with contextlib.suppress(OSError):
                self._path.unlink()
            with contextlib.suppress(OSError):
                state = state_path(self.directory, self.key)
                if json.loads(state.read_text()).get("pid") == os.getpid():
                    state.unlink()
        if self.listener is not None:
            self.listener.close()
        if self.runs:
            for pid in self.runs:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + RUNS_STOP_WITHIN
            while self.runs and time.monotonic() < deadline:
                self._reap()
                time.sleep(0.1)
        self.server.stop()

    # -- runs

    def _accept(self) -> None:
        assert self.listener is not None
        try:
            conn, _ = self.listener.accept()
        except (TimeoutError, InterruptedError):
            return
        except OSError:
            return
        try:
            self._start_run(conn)
        except Exception as exc:
            logger.info("a request was not taken: %s: %s", type(exc).__name__, exc)
            conn.close()

    def _start_run(self, conn: socket.socket) -> None:
        import struct

        conn.settimeout(5)
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if uid != os.getuid():
            raise PermissionError(f"a process of uid {uid} is not this runner's user")
        request, fds = receive_request(conn)
        try:
            if request.get("key") != self.key:
                raise ValueError("the request is for another runner")
            if threading.active_count() != 1:  # a fork must not copy locks another thread holds
                raise RuntimeError(f"this runner has threads: {threading.enumerate()}")
            previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
            pid = os.fork()
            if pid == 0:
                self._become_the_command(conn, fds, request)  # never returns
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        finally:
            for fd in fds:
                os.close(fd)
        self.runs[pid] = conn
        self.last_run = time.monotonic()
        send_message(conn, {"pid": pid})
        logger.info("run %d: %s", pid, " ".join(request["argv"][1:]))

    def _reap(self) -> None:
        for pid in list(self.runs):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 1 << 8
            if done == 0:
                continue
            conn = self.runs.pop(pid)
            self.last_run = time.monotonic()
            reply = (
                {"signal": os.WTERMSIG(status)}
                if os.WIFSIGNALED(status)
                else {"exit": os.waitstatus_to_exitcode(status)}
            )
            with contextlib.suppress(OSError):
                send_message(conn, reply)
            conn.close()
            logger.info("run %d ended: %s", pid, reply)

    def _become_the_command(self, conn: socket.socket, fds: list[int], request: dict[str, Any]) -> None:
        """In the forked process: become the command that asked, then run it and end with it."""
        code = 1
        try:
            os.setsid()
            assert self.listener is not None
            self.listener.close()
            os.close(self.lock)
            for other in self.runs.values():
                other.close()
            for number, fd in enumerate(fds):
                os.dup2(fd, number)
            for sig in (*STOP_SIGNALS, signal.SIGCHLD):
                signal.signal(sig, signal.SIG_DFL)
            if request.get("sighup_ignored"):
                signal.signal(signal.SIGHUP, signal.SIG_IGN)
            os.chdir(request["cwd"])
            os.umask(int(request["umask"]))
            os.environ.clear()
            os.environ.update(request["env"])
            import tempfile

            tempfile.tempdir = None  # (the runner's first use fixed it; the command's TMPDIR decides)
            process = self.server.process
            assert process is not None
            os.environ[WARM_API_ENV] = json.dumps(
                {
                    "url": self.server.api_url,
                    "auth": self.server.auth_string,
                    "pid": process.pid,
                    "runner": os.getppid(),
                }
            )
            self.server.process = None  # not this process's to stop or wait for
            self.server.log = None
            sys.argv = list(request["argv"])
            with contextlib.suppress(Exception):
                sys.stdout.reconfigure(line_buffering=os.isatty(1))  # type: ignore[union-attr]
            root = logging.getLogger()
            for handler in list(root.handlers):  # the command sets up its own console
                root.removeHandler(handler)
            from sftmix import command

            command.run_command(float(request["started"]), lambda: _follow_the_command(conn))
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)


def _follow_the_command(conn: socket.socket) -> None:
    """In a forked run: stop when the command that asked for it is gone (killed outright: its end of the
    connection closes). Its signals come through it; this is for the ones that cannot."""
    from sftmix.stopping import EXIT_SUPERVISOR_LOST, RunStopped, stop_run

    def watch() -> None:
        with contextlib.suppress(OSError):
            conn.settimeout(None)
            while conn.recv(4096):
                pass
        stop_run(
            RunStopped(
                "stopped: the tokenize-mixer command that asked for this run is gone", EXIT_SUPERVISOR_LOST
            )
        )

    threading.Thread(target=watch, name="follow-command", daemon=True).start()


def main(argv: list[str]) -> None:
    directory, key, idle, spawner = Path(argv[0]), argv[1], float(argv[2]), int(argv[3])
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_stop)
    # born with them blocked (the command blocks them until its handlers are in place): let them in
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    from sftmix.console import LINE_FORMAT, TIME_FORMAT

    # (before Prefect's import, as in the command: Prefect then leaves the root logger to us)
    logging.basicConfig(level=logging.INFO, format=LINE_FORMAT, datefmt=TIME_FORMAT)
    import fcntl

    lock = os.open(lock_path(directory, key), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return  # another runner for this key runs or starts
    if not socket_fits(directory, key):
        logger.info("not a warm runner: the socket's path would be too long for a Unix socket")
        return
    if runner_key() != key:
        logger.info("not a warm runner: this process differs from the command that started it")
        return
    _wait_for_exit(spawner)  # the command that started it is not slowed by it
    if _stopping:
        return
    started = time.monotonic()
    _import_what_a_run_needs()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # (importing sftmix.command blocked them)
    if threading.active_count() != 1:
        logger.info("not a warm runner: importing started threads (%s)", threading.enumerate())
        return
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    runner = Runner(directory, key, idle, lock)
    runner.serve()
    logger.info("warm runner %d ended after %.0f s", os.getpid(), time.monotonic() - started)


if __name__ == "__main__":
    main(sys.argv[1:])
