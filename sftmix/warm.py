"""The warm runner, seen from the command: later runs start in a process that has imported everything.

A run of ``tokenize-mixer run``/``convert`` without a Prefect server spends most of a small job
starting: about 5 CPU-seconds importing Prefect, transformers and datasets, and a temporary Prefect API
that answers 8 s after launch (2 cores). The first such run from a terminal leaves a *warm runner*
behind (``flows.warm_runner``): once that run has ended, it imports those modules and starts the API,
then waits. A later command with the same interpreter, code, working directory, environment and
limits (:func:`runner_key`) hands it its arguments, working directory, environment and its three
standard streams; the runner forks a process that is that command from then on, with the command's
own output, exit codes and stops. This module is the command's half, and imports nothing heavy.

- Only the same user reaches a runner: its socket is in a directory only that user can enter, and the
  runner checks the peer's uid. The API's secret never leaves the runner and its runs.
- The command stays in charge: a Ctrl-C, a SIGTERM or a SIGHUP it receives is passed on to its run; if
  the command is killed outright, the run sees its connection close and stops (exit 7 for the
  record); the run's exit status comes back, and the command ends with it.
- It is gone by itself after ``TOKENIZE_MIXER_WARM_SECONDS`` (default 600) without a run, or as soon as
  its API server dies. ``TOKENIZE_MIXER_WARM_SECONDS=0`` neither starts nor uses one; a command not on
  a terminal (a batch job, CI) starts one only when the setting asks for it, so nothing lingers there.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import stat
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any

from sftmix.stopping import STOP_SIGNALS  # (imported already by the command's first step)

#: Seconds a warm runner waits for the next run; 0 turns warm runners off.
WARM_SECONDS_ENV = "TOKENIZE_MIXER_WARM_SECONDS"
DEFAULT_WARM_SECONDS = 600.0
#: The commands that run the flow, and so gain from a warm start.
WARM_COMMANDS = ("run", "convert")
#: Set by the runner in the process it forks for a command: its API (url, secret, server pid), as JSON.
WARM_API_ENV = "TOKENIZE_MIXER_WARM_API"
#: Variables that differ between two shells of one session and that nothing reads at import time: the
#: run gets the command's exact environment anyway; the key only guards what the runner's imports read.
_NOT_IN_KEY = frozenset({"_", "PWD", "OLDPWD", "SHLVL", "COLUMNS", "LINES", WARM_SECONDS_ENV})
#: Our own code, fingerprinted by each file's size and mtime (an edited file means another runner).
_PACKAGES = ("sftmix", "flows", "tasks")
_LENGTH = struct.Struct("!I")
#: Seconds the command waits for a runner to take its request before running cold instead.
HANDOFF_SECONDS = 10.0
#: The runner this command started for the next ones (its pid), for the command's log to mention.
started_runner: int | None = None
#: Exit status when the runner died before it could report how its run ended (its API died with it).
EXIT_RUNNER_LOST = 5


def warm_seconds() -> float | None:
    """Idle seconds for a runner this command would start; ``None`` when it starts none (not asked
    for, and not on a terminal), 0 when warm runners are off."""
    text = os.environ.get(WARM_SECONDS_ENV)
    if text is None:
        return DEFAULT_WARM_SECONDS if _on_terminal() else None
    try:
        return max(0.0, float(text))
    except ValueError:
        return 0.0


def _on_terminal() -> bool:
    with contextlib.suppress(OSError, ValueError):
        return os.isatty(2)
    return False


def wants_warm(argv: list[str]) -> bool:
    """Whether this command may run in a warm runner: a flow run with no configured API and warm runners
    not turned off."""
    command = next((a for a in argv[1:] if not a.startswith("-")), None)  # (after -v, the only global flag)
    if command not in WARM_COMMANDS or any(a in ("-h", "--help") for a in argv[1:]):
        return False
    return not os.environ.get("PREFECT_API_URL") and warm_seconds() != 0


def runner_dir() -> Path | None:
    """This user's directory of runners (``$XDG_RUNTIME_DIR`` or the temp directory), made private; ``None``
    where it is not ours alone (then there is no warm runner)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    directory = Path(base) / f"tokenize-mixer-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    try:
        info = os.lstat(directory)
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        return None
    return directory


def _code_fingerprint(h: Any) -> None:
    root = Path(__file__).resolve().parent.parent
    for package in _PACKAGES:
        for dirpath, dirnames, filenames in os.walk(root / package):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                with contextlib.suppress(OSError):
                    info = os.stat(os.path.join(dirpath, name))
                    h.update(f"{dirpath}/{name}:{info.st_size}:{info.st_mtime_ns}\n".encode())
    for entry in (
        sys.path if sys.flags.safe_path else sys.path[1:]
    ):  # an installed or removed package changes its directory
        with contextlib.suppress(OSError):
            h.update(f"{entry}:{os.stat(entry or '.').st_mtime_ns}\n".encode())


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def runner_key() -> str:
    """What a runner's imported modules and its process depend on, as a hash: the interpreter, our code
    and the installed packages, the working directory (Prefect reads settings files there), the
    environment, and the process's user, CPUs, limits, priority, cgroup and namespaces, which a forked
    run inherits from the runner rather than from the command."""
    import resource

    h = hashlib.sha256()
    parts: dict[str, Any] = {
        # (not the script's directory the command's interpreter put first; the runner starts with -P)
        "python": [
            os.path.realpath(sys.executable),
            sys.version,
            sys.path if sys.flags.safe_path else sys.path[1:],
        ],
        "cwd": os.getcwd(),
        "env": sorted((k, v) for k, v in os.environ.items() if k not in _NOT_IN_KEY),
        "ids": [os.getuid(), os.geteuid(), os.getgid(), sorted(os.getgroups())],
        "priority": os.getpriority(os.PRIO_PROCESS, 0),
        "limits": [
            resource.getrlimit(getattr(resource, n)) for n in dir(resource) if n.startswith("RLIMIT_")
        ],
        "cgroup": _read("/proc/self/cgroup"),
    }
    with contextlib.suppress(AttributeError, OSError):
        parts["cpus"] = sorted(os.sched_getaffinity(0))
    namespaces = {}
    for ns in ("mnt", "pid", "net", "user", "ipc", "uts"):
        with contextlib.suppress(OSError):
            namespaces[ns] = os.readlink(f"/proc/self/ns/{ns}")
    parts["namespaces"] = namespaces
    h.update(json.dumps(parts, sort_keys=True, default=str).encode())
    _code_fingerprint(h)
    return h.hexdigest()[:32]


def socket_path(directory: Path, key: str) -> Path:
    return directory / f"{key}.sock"


def staged_socket_path(directory: Path, key: str, pid: int) -> Path:
    return directory / f".{key}.{pid}.sock"


def socket_fits(directory: Path, key: str) -> bool:
    """Whether the runner's socket (and its staged name, the longer) fits a Unix socket address."""
    return len(os.fsencode(staged_socket_path(directory, key, 4194304))) < 108


def lock_path(directory: Path, key: str) -> Path:
    return directory / f"{key}.lock"


def state_path(directory: Path, key: str) -> Path:
    return directory / f"{key}.json"


def log_path(directory: Path, key: str) -> Path:
    return directory / f"{key}.log"


# ---- the request and the replies ------------------------------------------------------------------


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)


def receive_exactly(sock: socket.socket, size: int) -> bytes:
    chunks = []
    while size:
        chunk = sock.recv(size)
        if not chunk:
            raise EOFError("the connection closed")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def receive_message(sock: socket.socket) -> dict[str, Any]:
    (size,) = _LENGTH.unpack(receive_exactly(sock, _LENGTH.size))
    return json.loads(receive_exactly(sock, size))


def send_request(sock: socket.socket, request: dict[str, Any]) -> None:
    """The request, with this process's standard streams: their descriptors ride with its length."""
    data = json.dumps(request).encode()
    socket.send_fds(sock, [_LENGTH.pack(len(data))], [0, 1, 2])
    sock.sendall(data)


def receive_request(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """What :func:`send_request` sent: the request and the three descriptors (the caller closes them)."""
    header, fds, _, _ = socket.recv_fds(sock, _LENGTH.size, 3)
    try:
        if len(fds) != 3 or len(header) != _LENGTH.size:
            raise ValueError("the request did not carry the command's three streams")
        (size,) = _LENGTH.unpack(header)
        return json.loads(receive_exactly(sock, size)), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _request(argv: list[str], started: float, key: str) -> dict[str, Any]:
    umask = os.umask(0)
    os.umask(umask)
    return {
        "key": key,
        "argv": argv,
        "started": started,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "umask": umask,
        "sighup_ignored": signal.getsignal(signal.SIGHUP) is signal.SIG_IGN,
    }


def runner_place(argv: list[str]) -> tuple[Path, str] | None:
    """Where this command's runner is or would be (its directory and key); ``None`` when the command is
    not for a runner, or the place is not private or its socket's path too long."""
    if not wants_warm(argv):
        return None
    directory = runner_dir()
    if directory is None:
        return None
    key = runner_key()
    return (directory, key) if socket_fits(directory, key) else None


def run_warm(place: tuple[Path, str], argv: list[str], started: float) -> int | None:
    """Hand this command to the warm runner at ``place`` and return its run's exit status; ``None`` when
    no runner took it (none ready), and the command runs cold. Signals are expected blocked on entry
    (``sftmix.command``); they are let through once the run exists, and passed on to it."""
    directory, key = place
    path = socket_path(directory, key)
    if not path.exists():
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(HANDOFF_SECONDS)
        sock.connect(os.fspath(path))
        send_request(sock, _request(argv, started, key))
        reply = receive_message(sock)
    except (OSError, EOFError, ValueError):
        sock.close()  # a run forked meanwhile sees the connection close and stops
        return None
    if "pid" not in reply:
        sock.close()
        return None
    sock.settimeout(None)
    return _follow(sock, int(reply["pid"]))


def _follow(sock: socket.socket, pid: int) -> int:
    """Pass this command's stop signals on to its run until the runner says how the run ended."""

    def pass_on(signum: int, frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, pass_on)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    try:
        reply = receive_message(sock)
    except (OSError, EOFError, ValueError):
        return _runner_lost(pid)
    if "signal" in reply:  # the run died of a signal: so does the command, as a shell would show
        signum = int(reply["signal"])
        with contextlib.suppress(OSError, ValueError):
            signal.signal(signum, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, (signum,))
            os.kill(os.getpid(), signum)
        return 128 + signum
    return int(reply.get("exit", 1))


def _runner_lost(pid: int) -> int:
    """The runner died before reporting: its API died with it, so the run stops too; wait for it."""
    import select

    with contextlib.suppress(OSError, AttributeError):
        fd = os.pidfd_open(pid)
        select.select([fd], [], [], 30.0)
        os.close(fd)
    with contextlib.suppress(OSError):
        os.write(
            2,
            b"error: stopped: the warm runner died (its Prefect API with it) before its run could say how it "
            b"ended; finished slices are kept, run the same command again to continue\n",
        )
    return EXIT_RUNNER_LOST


# ---- starting one ---------------------------------------------------------------------------------


def start_runner(place: tuple[Path, str]) -> None:
    """After a cold start: leave a runner at ``place`` for the next command, unless one runs or starts
    already, or this command starts none. It waits for this command to end before it imports anything,
    so this run is not slowed."""
    seconds = warm_seconds()
    directory, key = place
    if not seconds or runner_alive(directory, key):
        return
    import subprocess

    global started_runner
    log = os.open(log_path(directory, key), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        started_runner = subprocess.Popen(
            runner_argv(directory, key, seconds, os.getpid()),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,  # not in the terminal's group: its Ctrl-C is for the commands
            close_fds=True,
        ).pid
    except OSError:
        pass
    finally:
        os.close(log)


def runner_argv(directory: Path, key: str, seconds: float, spawner: int) -> list[str]:
    """The runner's command line: ``-P``, so that nothing in the working directory shadows our modules
    (and the key it computes, like the command's, leaves out the script's directory)."""
    return [
        sys.executable,
        "-P",
        "-m",
        "flows.warm_runner",
        os.fspath(directory),
        key,
        str(seconds),
        str(spawner),
    ]


def runner_alive(directory: Path, key: str) -> bool:
    """Whether a runner for ``key`` holds its lock (running, or starting)."""
    import fcntl

    try:
        fd = os.open(lock_path(directory, key), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return True  # cannot tell: start none
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # (releases the lock when it was taken)
    return False
