"""What tokenize-mixer wrote, recognised by marker files of its own, never by a name or a PID alone.

Two markers decide what may ever be deleted:

- ``.tokenize-mixer-output.json`` lands inside every published local output (``sftmix.output.output_dir``):
  a directory is ours to replace only if it carries that marker and holds nothing the marker does not
  list, so a user's file dropped into an output is never deleted.
- ``.tokenize-mixer-lease.json`` (here) lands inside every staging or swap directory, and every
  temporary API's private directory, while a process uses it: host, boot id, PID, and a heartbeat
  (the file's mtime, touched every few seconds). A leftover is removed only when it is provably
  abandoned: its process is gone on *this* host (same host name and boot id), or its heartbeat is
  older than the lease, which works across machines sharing a file system. Our temp files are
  recognised by the writer tag in their names (host, boot and PID), the same way.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from sftmix.runtime import settings
from sftmix.runtime.processes import pid_alive
from sftmix.runtime.stopping import on_forced_exit
from sftmix.runtime.storage import TMP_MARK, atomic_write_bytes, boot_id, remove_tree, temp_name, writer_tag

logger = logging.getLogger(__name__)

LEASE_MARKER = ".tokenize-mixer-lease.json"
HEARTBEAT_SECONDS = 10.0


def lease_seconds() -> float:
    """How long a lease lives without a heartbeat before another machine may call it abandoned."""
    return float(settings.LEASE_SECONDS.get())


# ---- leases on staging and swap directories -------------------------------------------------------


def write_lease(directory: Path) -> None:
    lease = {"host": socket.gethostname(), "boot_id": boot_id(), "pid": os.getpid(), "since": time.time()}
    atomic_write_bytes(directory / LEASE_MARKER, json.dumps(lease).encode("utf-8"))


def lease_abandoned(directory: Path, now: float | None = None) -> bool:
    """Whether ``directory`` carries our lease and nobody holds it any more. No lease: not ours, False."""
    path = directory / LEASE_MARKER
    try:
        lease = json.loads(path.read_text(encoding="utf-8"))
        heartbeat = path.stat().st_mtime
    except (OSError, ValueError):
        return False
    if not isinstance(lease, dict):
        return False
    same_boot = lease.get("host") == socket.gethostname() and lease.get("boot_id") == boot_id() != ""
    if same_boot and isinstance(lease.get("pid"), int) and not pid_alive(lease["pid"]):
        return True
    return ((now or time.time()) - heartbeat) > lease_seconds()


def remove_abandoned(parent: Path, prefix: str) -> list[Path]:
    """Remove the directories under ``parent`` whose names start with ``prefix`` and whose lease is
    abandoned, or whose temp name's writer is gone (one killed while making it); the prefix only narrows
    the scan, the lease or the writer tag decides."""
    removed: list[Path] = []
    if not parent.is_dir():
        return removed
    for leftover in parent.iterdir():
        if not (leftover.name.startswith(prefix) and leftover.is_dir()):
            continue
        if lease_abandoned(leftover) or (TMP_MARK in leftover.name and temp_abandoned(leftover)):
            logger.info("removing %s, left by an interrupted run", leftover)
            remove_tree(leftover)
            removed.append(leftover)
    return removed


class Heartbeat:
    """Touches the leases of the directories in use every few seconds, from one daemon thread."""

    def __init__(self) -> None:
        self._dirs: set[Path] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, directory: Path) -> None:
        with self._lock:
            self._dirs.add(directory)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._beat, name="tokenize-mixer-lease", daemon=True)
                self._thread.start()

    def discard(self, directory: Path) -> None:
        with self._lock:
            self._dirs.discard(directory)

    def _beat(self) -> None:
        while True:
            time.sleep(HEARTBEAT_SECONDS)
            with self._lock:
                dirs = list(self._dirs)
            for d in dirs:
                with contextlib.suppress(OSError):
                    os.utime(d / LEASE_MARKER)


HEARTBEAT = Heartbeat()


@contextlib.contextmanager
def leased(directory: Path, mode: int = 0o777) -> Iterator[Path]:
    """Hold a lease on ``directory`` (created, with ``mode``) while the block runs; the directory is
    removed after. It appears with its lease already in it (made under a temp name, then renamed): a
    process killed outright while writing the lease leaves a temp name that says whose it was, never a
    directory of ours that nothing marks as ours."""
    if directory.exists():
        raise FileExistsError(f"{directory} exists")
    staging = temp_name(directory)
    staging.mkdir(mode=mode)
    try:
        write_lease(staging)
        staging.rename(directory)
    except BaseException:
        remove_tree(staging)
        raise
    try:
        HEARTBEAT.add(directory)
        on_forced_exit(id(directory), functools.partial(remove_tree, directory))
        yield directory
    finally:
        on_forced_exit(id(directory), None)
        HEARTBEAT.discard(directory)
        remove_tree(directory)


def temp_abandoned(path: Path, now: float | None = None) -> bool:
    """Whether a temp file (named by :func:`sftmix.runtime.storage.temp_name`) has no live writer: written on
    this machine since its last boot by a process that is gone, or untouched for longer than a lease."""
    tag = path.name.rpartition(TMP_MARK)[2].split("-")
    if len(tag) != 3 or not tag[1].isdigit():
        return False  # not one of our temp names
    try:
        age = (now or time.time()) - path.stat().st_mtime
    except OSError:
        return False
    here = writer_tag().split("-")[0]
    return (tag[0] == here and not pid_alive(int(tag[1]))) or age > lease_seconds()


def remove_abandoned_temps(directory: Path) -> None:
    """Remove our temp files in ``directory`` whose writer is gone (e.g. a worker killed mid-write)."""
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        if TMP_MARK in entry.name and entry.is_file() and temp_abandoned(entry):
            logger.info("removing %s, left by a process that died while writing it", entry)
            entry.unlink(missing_ok=True)
