"""Make a finished output visible in one step, and never clobber different shards by accident."""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from sftmix.errors import OutputConflictError
from sftmix.output.digest import (
    OUTPUT_MANIFEST,
    RUN_REPORT,
    in_parallel,
    is_shard,
    output_digests,
    read_output_manifest,
)
from sftmix.output.output_dir import (
    OUTPUT_MARKER,
    changed_since_published,
    check_replaceable,
    output_id,
    read_output_marker,
    utc_stamp,
    write_marker,
    write_output_marker,
)
from sftmix.runtime.ownership import LEASE_MARKER, leased, remove_abandoned, write_lease
from sftmix.runtime.stopping import mark_published, stops_deferred
from sftmix.runtime.storage import (
    TMP_MARK,
    atomic_write_bytes,
    fsync_dir,
    is_remote,
    is_temp,
    join_url,
    read_remote_bytes,
    remote_fs,
    remove_tree,
    storage_errors,
    write_remote_bytes,
)

logger = logging.getLogger(__name__)

OUTPUT_MANIFEST_FORMAT = "tokenize-mixer-output/1"


def staging_parent(output: str | Path, local_root: str | Path) -> Path:
    return Path(local_root) / "staging" / "remote-output" if is_remote(output) else Path(output)


@contextlib.contextmanager
def staging_dir(output: str | Path, local_root: str | Path) -> Iterator[Path]:
    """A fresh, leased directory beside the output (same file system, so publishing is a rename),
    removed afterwards. A remote output is staged under ``local_root`` (the work directory). Staging
    left by runs that died is removed once its lease is provably abandoned."""
    out = staging_parent(output, local_root)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(out.parent, f".{out.name}.")
    with leased(out.parent / f".{out.name}{TMP_MARK}{uuid.uuid4().hex[:12]}") as staging:
        yield staging


#: ``seen_id`` value that skips the check for an output published by another run meanwhile.
UNCHECKED = "unchecked"


def publish(
    staging: Path,
    output: str,
    overwrite: bool,
    seen_id: str | None = UNCHECKED,
    recipe: dict | None = None,
    inputs: dict | None = None,
) -> str:
    """Make ``staging`` the output (local rename, or objects + manifest last); returns what happened."""
    if is_remote(output):
        return publish_remote(staging, output, overwrite)
    with storage_errors(f"cannot publish to {output}"):
        return publish_local(staging, output, overwrite, seen_id, recipe, inputs)


@contextlib.contextmanager
def _publish_lock(out: Path) -> Iterator[None]:
    """Serialise publishes into one output (across processes, and machines where the file system
    supports locks), with a lock file beside it that is gone again when the publish is: removed while
    still held, and a process that locked a file since removed (it waited on it) locks the new one. Only a
    file that holds our marker is removed."""
    path = out.parent / f".{out.name}.tokenize-mixer-lock"
    while True:
        fh = open(path, "a+b")  # noqa: SIM115 (closed below, after the unlink)
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        except OSError as exc:  # a file system without locks: the checks below still run; the file stays
            logger.warning("cannot lock %s (%s); publishing without the lock", fh.name, exc.strerror)
            with fh:
                yield
            return
        try:
            here = os.stat(path)
            mine = os.fstat(fh.fileno())
            if (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino):
                break
        except FileNotFoundError:
            pass
        fh.close()  # the holder before us removed it: lock the file that is there now
    ours = False
    try:
        fh.seek(0)
        held = fh.read()
        if held == b"":
            fh.write(_LOCK_MARKER)
            fh.flush()
        # a file of that name that we did not write is used as a lock, never removed
        ours = held in (b"", _LOCK_MARKER)
        yield
    finally:
        if ours:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        fh.close()


#: What a publish lock file holds: how a later run knows it is ours to remove.
_LOCK_MARKER = b"tokenize-mixer publish lock\n"


def publish_local(
    staging: Path,
    output: str | Path,
    overwrite: bool,
    seen_id: str | None = UNCHECKED,
    recipe: dict | None = None,
    inputs: dict | None = None,
) -> str:
    """Rename ``staging`` to ``output``: 'created', 'replaced' (identical) or 'overwritten', or an error.

    ``seen_id`` is the output's publish id when the run started: an output published by another run
    meanwhile is never replaced by different shards, even with ``overwrite``."""
    out = Path(output)
    with _publish_lock(out):
        if out.exists() and not out.is_dir():
            raise OutputConflictError(f"output {out} exists and is not a directory")
        status = "created"
        if out.is_dir() and any(out.iterdir()):
            check_replaceable(out)
            if _published_digests(out) == _staged_digests(staging):
                status = "replaced"
            else:
                current = output_id(out)
                if seen_id != UNCHECKED and current != seen_id:
                    raise OutputConflictError(
                        f"output directory {out} was published by another run while this one worked, "
                        "with different shards; this run leaves it as it is (its slices are checkpointed: "
                        "choose another directory and rerun to publish them)"
                    )
                if not overwrite:
                    raise OutputConflictError(
                        f"output directory {out} already holds different shards; choose another directory, "
                        "or set overwrite (--overwrite, or 'Replace different shards' under Output in the UI) to replace them"
                    )
                status = "overwritten"
        published_at = utc_stamp()
        stamp_report(staging, status, published_at)
        # last: it records every file's size and mtime
        write_output_marker(staging, recipe, inputs, published_at)
        old: Path | None = None
        with stops_deferred():  # published or not, never half-way (a stop meanwhile is raised after)
            if not out.exists():
                os.rename(staging, out)
            else:
                old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:12]}"
                write_lease(out)  # travels with the old output, so a kill mid-swap leaves it removable
                try:
                    os.rename(out, old)
                except OSError:
                    (out / LEASE_MARKER).unlink(missing_ok=True)
                    raise
                os.rename(staging, out)
            mark_published(out)
            (out / LEASE_MARKER).unlink(missing_ok=True)
            fsync_dir(out.parent)
            if old is not None:  # (ours: it held our marker and nothing else, check_replaceable)
                remove_tree(old)
    return status


def update_output_marker(directory: Path, update: Callable[[dict], bool]) -> None:
    """Change the marker of the output in ``directory`` under the publish lock (``update`` edits it in
    place and says whether it changed anything); nothing happens when the directory holds no output."""
    with _publish_lock(directory):
        marker = read_output_marker(directory)
        if marker is not None and update(marker):
            write_marker(directory, marker)


# ---- object stores ----------------------------------------------------------------------------------
#
# There is no atomic rename of many objects: shards go up first, the manifest object (every file with
# its size, md5 and sha256, and the output's digests) last. Readers that start from the manifest (our
# `compare`/`digest`, and the documented way for OLMo-core users) see a complete output or none: to
# replace different shards the old manifest is deleted before the first object changes.


def _local_files(staging: Path) -> dict[str, Path]:
    return {
        p.relative_to(staging).as_posix(): p
        for p in sorted(staging.rglob("*"))
        if p.is_file()
        and not is_temp(p.name)
        and p.name not in (OUTPUT_MANIFEST, LEASE_MARKER, OUTPUT_MARKER)
    }


def _published_digests(out: Path) -> dict[str, str]:
    """The digests of the output in ``out``: as its run report gives them when its marker shows every
    file as published (no read of a large output), else read now."""
    marker = read_output_marker(out)
    if marker is not None and changed_since_published(out, marker) is None:
        try:
            digests = json.loads((out / RUN_REPORT).read_text(encoding="utf-8")).get("digests")
        except (OSError, ValueError, AttributeError):
            digests = None
        if isinstance(digests, dict) and digests:
            return digests
    return output_digests(out)


def _staged_digests(staging: Path) -> dict[str, str]:
    """The digests the run computed for this staging (in its run report), or computed now."""
    try:
        digests = json.loads((staging / RUN_REPORT).read_text(encoding="utf-8")).get("digests")
    except (OSError, ValueError):
        digests = None
    return digests if isinstance(digests, dict) and digests else output_digests(staging)


def _md5_b64(path: Path) -> str:
    """An object store's md5 (base64), to tell which objects are already up."""
    with open(path, "rb") as fh:
        digest = hashlib.file_digest(fh, lambda: hashlib.md5(usedforsecurity=False)).digest()
    return base64.b64encode(digest).decode("ascii")


#: Written first when publishing to an object store: every object the prefix holds that we wrote or are
#: writing (the old manifest's and the new output's), so an interrupted publish can be resumed and
#: objects anyone else put there are never deleted or overwritten.
PUBLISHING_MARKER = ".tokenize-mixer-publishing.json"


def _remote_ours(url: str, manifest: dict | None) -> set[str]:
    ours = {OUTPUT_MANIFEST, PUBLISHING_MARKER} | set((manifest or {}).get("files", {}))
    pending = read_remote_bytes(join_url(url, PUBLISHING_MARKER))
    if pending is not None:
        with contextlib.suppress(ValueError, TypeError):
            ours |= {str(name) for name in json.loads(pending)["files"]}
    return ours


def remote_publish_status(
    staging: Path, url: str, overwrite: bool, digests: dict[str, str], existing: set[str]
) -> str:
    """What publishing ``staging`` to ``url`` will do ('created', 'replaced', 'overwritten'), or an
    error when the prefix holds objects we did not write (overwrite or not) or different shards
    (without overwrite)."""
    manifest = read_output_manifest(url)
    foreign = sorted(existing - _remote_ours(url, manifest))
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise OutputConflictError(
            f"output {url} holds objects tokenize-mixer did not write ({shown}); choose another prefix, "
            "or remove them yourself"
        )
    if manifest is None:
        return "created"
    if manifest.get("digests") == digests:
        return "replaced"
    if not overwrite:
        raise OutputConflictError(
            f"output {url} already holds different shards; choose another prefix, or set overwrite "
            "(--overwrite, or 'Replace different shards' under Output in the UI) to replace them"
        )
    return "overwritten"


def _relative(url: str, found: str) -> str:
    base = url.split("://", 1)[-1].rstrip("/") + "/"
    found = found.split("://", 1)[-1]
    return found[len(base) :] if found.startswith(base) else found


def publish_remote(staging: Path, url: str, overwrite: bool) -> str:
    """Upload ``staging`` to ``url``, manifest object last; objects already there with the same md5
    are kept (an interrupted publish resumes where it stopped)."""
    digests = _staged_digests(staging)  # the status check and the manifest both need them
    fs = remote_fs(url)
    existing = {}
    if fs.exists(url):
        existing = {_relative(url, p): info for p, info in fs.find(url, detail=True).items()}
    status = remote_publish_status(staging, url, overwrite, digests, set(existing))
    published_at = utc_stamp()
    stamp_report(staging, status, published_at)
    files = _local_files(staging)
    ours = sorted((set(existing) | set(files)) - {OUTPUT_MANIFEST, PUBLISHING_MARKER})
    write_remote_bytes(join_url(url, PUBLISHING_MARKER), json.dumps({"files": ours}).encode())
    entries = {}
    todo_local, todo_remote = [], []
    for (name, path), md5 in zip(files.items(), in_parallel(_md5_b64, list(files.values())), strict=True):
        entries[name] = {"bytes": path.stat().st_size, "md5": md5}
        have = existing.get(name)
        if have is None or have.get("md5Hash") != md5 or int(have.get("size", -1)) != path.stat().st_size:
            todo_local.append(str(path))
            todo_remote.append(join_url(url, name))
    stale = sorted(set(existing) - set(files) - {OUTPUT_MANIFEST, PUBLISHING_MARKER})  # all ours (above)
    changes_shards = any(is_shard(n) for n in stale) or any(is_shard(_relative(url, r)) for r in todo_remote)
    if OUTPUT_MANIFEST in existing and (status == "overwritten" or changes_shards):
        fs.rm_file(join_url(url, OUTPUT_MANIFEST))  # from here on readers see no complete output
    if todo_local:
        fs.put(todo_local, todo_remote)
    for name in stale:
        fs.rm_file(join_url(url, name))
    manifest = {
        "format": OUTPUT_MANIFEST_FORMAT,
        "published_at": published_at,
        "files": entries,
        "digests": digests,
    }
    with stops_deferred():  # the manifest makes the output complete: written whole, then known as such
        write_remote_bytes(
            join_url(url, OUTPUT_MANIFEST), json.dumps(manifest, indent=1, sort_keys=True).encode()
        )
        mark_published(url)
    fs.rm_file(join_url(url, PUBLISHING_MARKER))
    logger.info(
        "published %s: %d objects uploaded, %d unchanged", url, len(todo_local), len(files) - len(todo_local)
    )
    return status


def stamp_report(staging: Path, status: str, published_at: str) -> None:
    """Record the publish outcome and time in the staged run report before it becomes visible."""
    path = staging / RUN_REPORT
    if path.is_file():
        report = json.loads(path.read_text(encoding="utf-8"))
        report["publish"] = status
        report["published_at"] = published_at
        atomic_write_bytes(path, json.dumps(report, indent=2).encode("utf-8"))
