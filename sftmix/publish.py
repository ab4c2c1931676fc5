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
    """A fresh directory beside the output (same file system, so publishing is a rename)."""
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}{TMP_MARK}{uuid.uuid4().hex[:12]}"
    staging.mkdir()
    return staging


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
    old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:12]}"
    os.rename(out, old)
    os.rename(staging, out)
    fsync_dir(out.parent)
    remove_tree(old)
    return status
