"""Make a finished output visible in one step, and never clobber different shards by accident."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import time
import uuid
from pathlib import Path

from .digest import OUTPUT_MANIFEST, RUN_REPORT, is_shard, output_digests, read_output_manifest
from .errors import ConfigError, OutputConflictError
from .storage import (
    TMP_MARK,
    atomic_write_bytes,
    fsync_dir,
    is_remote,
    is_temp,
    join_url,
    remote_fs,
    remove_tree,
    storage_errors,
    write_remote_bytes,
)

logger = logging.getLogger(__name__)

OUTPUT_MANIFEST_FORMAT = "tokenize-mixer-output/1"


def new_staging_dir(output: str | Path, local_root: str | Path) -> Path:
    """A fresh directory beside the output (same file system, so publishing is a rename), named with
    this process's id so that leftovers of killed runs can be told from live ones. A remote output is
    staged under ``local_root`` (the work directory)."""
    out = Path(local_root) / "staging" / "remote-output" if is_remote(output) else Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out)
    staging = out.parent / f".{out.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:12]}"
    staging.mkdir()
    return staging


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_staging(output: Path) -> None:
    """Delete staging and swap directories of this output left by runs that were killed."""
    for prefix in (f".{output.name}{TMP_MARK}", f".{output.name}.old-"):
        for leftover in output.parent.glob(f"{prefix}*"):
            pid_text = leftover.name[len(prefix) :].split("-", 1)[0]
            if not pid_text.isdigit() or not _alive(int(pid_text)):
                logger.info("removing %s, left by an interrupted run", leftover)
                remove_tree(leftover)


def check_output_free(output: str | Path) -> None:
    """Fail early (before any work) when the output path cannot become a directory."""
    if is_remote(output):
        url = str(output)
        bucket = url.split("://", 1)[1].split("/", 1)[0]
        try:
            reachable = remote_fs(url).exists(url.split("://", 1)[0] + "://" + bucket)
        except Exception as exc:
            raise ConfigError(f"output {url}: cannot reach the bucket: {type(exc).__name__}: {exc}") from None
        if not reachable:
            raise ConfigError(f"output {url}: bucket {bucket!r} does not exist")
        return
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise OutputConflictError(f"output {out} exists and is not a directory")
    with storage_errors(f"output {out} is not writable"):  # probe now, not after hours of work
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = out.parent / f".{out.name}{TMP_MARK}probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        probe.mkdir()
        probe.rmdir()


def publish(staging: Path, output: str, overwrite: bool) -> str:
    """Make ``staging`` the output (local rename, or objects + manifest last); returns what happened."""
    if is_remote(output):
        return publish_remote(staging, output, overwrite)
    with storage_errors(f"cannot publish to {output}"):
        return publish_local(staging, output, overwrite)


def publish_local(staging: Path, output: str | Path, overwrite: bool) -> str:
    """Rename ``staging`` to ``output``: 'created', 'replaced' (identical or overwrite) or an error."""
    out = Path(output)
    if not out.exists():
        stamp_report(staging, "created")
        os.rename(staging, out)
        fsync_dir(out.parent)
        return "created"
    if not out.is_dir():
        raise OutputConflictError(f"output {out} exists and is not a directory")
    if any(out.iterdir()):
        same = output_digests(out) == output_digests(staging)
        if not same and not overwrite:
            raise OutputConflictError(
                f"output directory {out} already holds different shards; choose another directory, "
                "delete it, or pass --overwrite"
            )
        status = "replaced" if same else "overwritten"
    else:
        status = "created"
    stamp_report(staging, status)
    old = out.parent / f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    os.rename(out, old)
    os.rename(staging, out)
    fsync_dir(out.parent)
    remove_tree(old)
    return status


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
        if p.is_file() and not is_temp(p.name) and p.name != OUTPUT_MANIFEST
    }


def _md5_b64(path: Path) -> str:
    """An object store's md5 (base64), to tell which objects are already up."""
    with open(path, "rb") as fh:
        digest = hashlib.file_digest(fh, lambda: hashlib.md5(usedforsecurity=False)).digest()
    return base64.b64encode(digest).decode("ascii")


def remote_publish_status(staging: Path, url: str, overwrite: bool, digests: dict[str, str]) -> str:
    """What publishing ``staging`` to ``url`` will do ('created', 'replaced', 'overwritten'), or an
    error when the prefix holds something else and ``overwrite`` is off."""
    manifest = read_output_manifest(url)
    if manifest is not None:
        if manifest.get("digests") == digests:
            return "replaced"
        if not overwrite:
            raise OutputConflictError(
                f"output {url} already holds different shards; choose another prefix, delete it, or pass "
                "--overwrite"
            )
        return "overwritten"
    fs = remote_fs(url)
    existing = [_relative(url, p) for p in fs.find(url)] if fs.exists(url) else []
    foreign = sorted(set(existing) - set(_local_files(staging)))
    if foreign and not overwrite:
        raise OutputConflictError(
            f"output {url} holds objects but no {OUTPUT_MANIFEST} (e.g. {foreign[0]!r}); choose another "
            "prefix, delete them, or pass --overwrite"
        )
    return "created"


def _relative(url: str, found: str) -> str:
    base = url.split("://", 1)[-1].rstrip("/") + "/"
    found = found.split("://", 1)[-1]
    return found[len(base) :] if found.startswith(base) else found


def publish_remote(staging: Path, url: str, overwrite: bool) -> str:
    """Upload ``staging`` to ``url``, manifest object last; objects already there with the same md5
    are kept (an interrupted publish resumes where it stopped)."""
    digests = output_digests(staging)  # read once: the status check and the manifest both need them
    status = remote_publish_status(staging, url, overwrite, digests)
    stamp_report(staging, status)
    fs = remote_fs(url)
    files = _local_files(staging)
    existing = {}
    if fs.exists(url):
        existing = {_relative(url, p): info for p, info in fs.find(url, detail=True).items()}
    entries = {}
    todo_local, todo_remote = [], []
    for name, path in files.items():
        md5 = _md5_b64(path)
        entries[name] = {"bytes": path.stat().st_size, "md5": md5}
        have = existing.get(name)
        if have is None or have.get("md5Hash") != md5 or int(have.get("size", -1)) != path.stat().st_size:
            todo_local.append(str(path))
            todo_remote.append(join_url(url, name))
    stale = sorted(set(existing) - set(files) - {OUTPUT_MANIFEST})
    changes_shards = any(is_shard(n) for n in stale) or any(is_shard(_relative(url, r)) for r in todo_remote)
    if OUTPUT_MANIFEST in existing and (status == "overwritten" or changes_shards):
        fs.rm_file(join_url(url, OUTPUT_MANIFEST))  # from here on readers see no complete output
    if todo_local:
        fs.put(todo_local, todo_remote)
    for name in stale:
        fs.rm_file(join_url(url, name))
    manifest = {
        "format": OUTPUT_MANIFEST_FORMAT,
        "published_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": entries,
        "digests": digests,
    }
    write_remote_bytes(
        join_url(url, OUTPUT_MANIFEST), json.dumps(manifest, indent=1, sort_keys=True).encode()
    )
    logger.info(
        "published %s: %d objects uploaded, %d unchanged", url, len(todo_local), len(files) - len(todo_local)
    )
    return status


def stamp_report(staging: Path, status: str) -> None:
    """Record the publish outcome in the staged run report before it becomes visible."""
    path = staging / RUN_REPORT
    if path.is_file():
        report = json.loads(path.read_text(encoding="utf-8"))
        report["publish"] = status
        atomic_write_bytes(path, json.dumps(report, indent=2).encode("utf-8"))
