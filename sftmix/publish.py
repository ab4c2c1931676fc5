"""Make a finished output visible in one step, and never clobber different shards by accident."""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

from .digest import output_digests
from .errors import OutputConflictError
from .storage import TMP_MARK, fsync_dir, remove_tree

logger = logging.getLogger(__name__)


def new_staging_dir(output: str | Path) -> Path:
    """A fresh directory beside the output (same file system, so publishing is a rename), named with
    this process's id so that leftovers of killed runs can be told from live ones."""
    out = Path(output)
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
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise OutputConflictError(f"output {out} exists and is not a directory")


def publish_local(staging: Path, output: str | Path, overwrite: bool) -> str:
    """Rename ``staging`` to ``output``: 'created', 'replaced' (identical or overwrite) or an error."""
    out = Path(output)
    if not out.exists():
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
    old = out.parent / f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    os.rename(out, old)
    os.rename(staging, out)
    fsync_dir(out.parent)
    remove_tree(old)
    return status
