"""What tokenize-mixer wrote, recognised by marker files of its own, never by a name or a PID alone.

Two markers decide what may ever be deleted:

- ``.tokenize-mixer-output.json`` lands inside every published local output (with the list of files
  it published and an id per publish). A directory is ours to replace only if it carries that marker
  and holds nothing the marker does not list: a user's file dropped into an output is never deleted.
- ``.tokenize-mixer-lease.json`` lands inside every staging or swap directory while a process uses
  it: host, boot id, PID, and a heartbeat (the file's mtime, touched every few seconds). A leftover is
  removed only when it is provably abandoned: its process is gone on *this* host (same host name and
  boot id), or its heartbeat is older than the lease, which works across machines sharing a file
  system.

Outputs must also never be the work directory, an input, ``/``, ``$HOME`` or an ancestor of one of
them; :func:`refuse_dangerous_output` checks that before any work.
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
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

from . import settings
from .errors import ConfigError, OutputConflictError
from .stopping import on_forced_exit
from .storage import TMP_MARK, atomic_write_bytes, boot_id, remove_tree, writer_tag

logger = logging.getLogger(__name__)

OUTPUT_MARKER = ".tokenize-mixer-output.json"
OUTPUT_MARKER_FORMAT = "tokenize-mixer-output-marker/1"
LEASE_MARKER = ".tokenize-mixer-lease.json"
HEARTBEAT_SECONDS = 10.0


def lease_seconds() -> float:
    """How long a lease lives without a heartbeat before another machine may call it abandoned."""
    return float(settings.LEASE_SECONDS.get())


# ---- outputs --------------------------------------------------------------------------------------


def _relative_files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if not p.is_dir())


def write_output_marker(staging: Path, recipe: dict | None = None, inputs: dict | None = None) -> str:
    """Mark ``staging`` (about to be published, every file in place) as our output; returns the publish
    id. ``recipe``: what its bytes follow from (``Plan.recipe``), for the next run into it to compare
    before any work; ``inputs``: the stamps of the files it was computed from
    (:func:`sftmix.up_to_date.input_record`). The size and mtime of every file are recorded too, so a
    rerun can tell the output is still as published (a rename keeps both)."""
    ident = uuid.uuid4().hex
    files = [f for f in _relative_files(staging) if f not in (OUTPUT_MARKER, LEASE_MARKER)]
    marker = {
        "format": OUTPUT_MARKER_FORMAT,
        "id": ident,
        "published_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": files,
        "stamps": {f: [(st := (staging / f).stat()).st_size, st.st_mtime_ns] for f in files},
        **({} if recipe is None else {"recipe": recipe}),
        **({} if inputs is None else {"inputs": inputs}),
    }
    write_marker(staging, marker)
    return ident


def write_marker(directory: Path, marker: dict) -> None:
    """The output marker of ``directory``, written whole (atomically)."""
    atomic_write_bytes(directory / OUTPUT_MARKER, json.dumps(marker, indent=1).encode("utf-8"))


def changed_since_published(directory: Path, marker: dict) -> str | None:
    """Why the output in ``directory`` is not as it was published (``None``: every file it published is
    there with the size and mtime it had then)."""
    stamps = marker.get("stamps")
    if not isinstance(stamps, dict) or not stamps:
        return "its marker records no file stamps (published by an older version)"
    for name, recorded in stamps.items():
        try:
            st = os.stat(directory / name)
        except OSError:
            return f"{name} is missing"
        if [st.st_size, st.st_mtime_ns] != recorded:
            return f"{name} changed since it was published"
    return None


def read_output_marker(directory: Path) -> dict | None:
    try:
        marker = json.loads((directory / OUTPUT_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("format") != OUTPUT_MARKER_FORMAT:
        return None
    return marker if isinstance(marker.get("files"), list) else None


def record_output_files(directory: Path, names: Iterable[str]) -> None:
    """Add files we wrote into an existing output (e.g. the report) to its marker."""
    marker = read_output_marker(directory)
    if marker is None:
        return
    marker["files"] = sorted(set(marker["files"]) | set(names))
    write_marker(directory, marker)


def output_id(directory: Path) -> str | None:
    """The publish id of the output in ``directory`` (None: absent, empty, or not ours)."""
    marker = read_output_marker(directory)
    return None if marker is None else str(marker.get("id"))


def foreign_entries(directory: Path) -> list[str]:
    """Entries of ``directory`` that tokenize-mixer did not write (all of them without our marker)."""
    marker = read_output_marker(directory)
    present = _relative_files(directory)
    if marker is None:
        return present or sorted(p.name + "/" for p in directory.iterdir())
    ours = set(marker["files"]) | {OUTPUT_MARKER, LEASE_MARKER}
    return [f for f in present if f not in ours]


def check_replaceable(directory: Path) -> None:
    """Refuse to replace a non-empty directory that is not wholly a tokenize-mixer output."""
    if not directory.is_dir() or not any(directory.iterdir()):
        return
    foreign = foreign_entries(directory)
    if not foreign:
        return
    shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
    if read_output_marker(directory) is None:
        why = f"it is not a tokenize-mixer output (no {OUTPUT_MARKER}; it holds {shown})"
    else:
        why = f"it holds files tokenize-mixer did not write there: {shown}"
    raise OutputConflictError(
        f"output directory {directory} will not be replaced: {why}. Choose a new or empty directory, "
        "or move those files away yourself."
    )


def _ancestor_or_same(a: Path, b: Path) -> bool:
    return a == b or a in b.parents


def refuse_dangerous_output(output: str | Path, protected: Iterable[tuple[str, str | Path]]) -> None:
    """Refuse an output that is ``/``, ``$HOME``, the work directory, an input, or an ancestor of one.

    ``protected`` names each path that must survive the run (what it is, where it is)."""
    out = Path(os.path.realpath(Path(output).expanduser()))
    everything = [("the file system root", Path("/")), ("your home directory", Path.home())]
    everything += [(what, Path(where)) for what, where in protected]
    for what, where in everything:
        resolved = Path(os.path.realpath(Path(where).expanduser()))
        if _ancestor_or_same(out, resolved):
            relation = "is" if out == resolved else "contains"
            raise ConfigError(
                f"output {output} {relation} {what} ({resolved}): publishing replaces the whole output "
                f"directory, so it must be a directory of its own, e.g. {out / 'shards'}"
            )


# ---- leases on staging and swap directories -------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
    if same_boot and isinstance(lease.get("pid"), int) and not _pid_alive(lease["pid"]):
        return True
    return ((now or time.time()) - heartbeat) > lease_seconds()


def remove_abandoned(parent: Path, prefix: str) -> list[Path]:
    """Remove the directories under ``parent`` whose names start with ``prefix`` and whose lease is
    abandoned; the prefix only narrows the scan, the lease decides."""
    removed = []
    if not parent.is_dir():
        return removed
    for leftover in parent.iterdir():
        if leftover.name.startswith(prefix) and leftover.is_dir() and lease_abandoned(leftover):
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
    removed after."""
    directory.mkdir(mode=mode)
    write_lease(directory)
    HEARTBEAT.add(directory)
    on_forced_exit(id(directory), functools.partial(remove_tree, directory))
    try:
        yield directory
    finally:
        on_forced_exit(id(directory), None)
        HEARTBEAT.discard(directory)
        remove_tree(directory)


def temp_abandoned(path: Path, now: float | None = None) -> bool:
    """Whether a temp file (named by :func:`sftmix.storage.temp_name`) has no live writer: written on
    this machine since its last boot by a process that is gone, or untouched for longer than a lease."""
    tag = path.name.rpartition(TMP_MARK)[2].split("-")
    if len(tag) != 3 or not tag[1].isdigit():
        return False  # not one of our temp names
    try:
        age = (now or time.time()) - path.stat().st_mtime
    except OSError:
        return False
    here = writer_tag().split("-")[0]
    return (tag[0] == here and not _pid_alive(int(tag[1]))) or age > lease_seconds()


def remove_abandoned_temps(directory: Path) -> None:
    """Remove our temp files in ``directory`` whose writer is gone (e.g. a worker killed mid-write)."""
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        if TMP_MARK in entry.name and entry.is_file() and temp_abandoned(entry):
            logger.info("removing %s, left by a process that died while writing it", entry)
            entry.unlink(missing_ok=True)
