"""A hub dataset's files as a plan with the hub in reach found them, kept for a plan without it.

The plan reads a hub dataset's Parquet or JSON Lines files itself (:func:`sftmix.sources.data_files.parquet_data_files`,
:func:`sftmix.sources.data_files.json_data_files`), so
``datasets`` never prepares the dataset in its own cache; under ``HF_HUB_OFFLINE`` its loader finds
nothing to start from and the rerun fails, where the reference (which prepared it) reruns offline. So
each plan that resolves a hub dataset online keeps what it found (the files at their commit, the
features the card declares) in the work directory's datasets cache, and an offline plan reads those
same files from this machine's hub cache: the bytes of that commit, nothing guessed from what the
cache happens to hold. A file the cache lacks is one clear error, never a dataset with fewer files.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from sftmix.errors import DatasetError
from sftmix.sources.features import schema_of, schema_text
from sftmix.sources.pinned import at_commit, local_copy

logger = logging.getLogger(__name__)

#: Bump when a record's meaning or layout changes: records of another version are not read.
RECORD_FORMAT = 1


def _record_path(cache_dir: str, name: str, revision: str | None, split: str) -> Path:
    key = hashlib.sha256(json.dumps([name, revision, split.strip()]).encode("utf-8")).hexdigest()
    return Path(cache_dir) / "hub-files" / f"{key[:32]}.json"


def remember(
    cache_dir: str, name: str, revision: str | None, split: str, files: list[str], declared: Any, builder: str
) -> None:
    """Keep what an online plan found for ``name``'s ``split``: its files, each named at its commit, and
    the ``datasets`` builder that reads them (``parquet`` or ``json``)."""
    if not files or not all(at_commit(f) for f in files):
        return  # (a local directory laid out like the hub: nothing to keep)
    record = {
        "format": RECORD_FORMAT,
        "dataset": [name, revision, split.strip()],
        "files": files,
        "declared": None if declared is None else schema_text(declared),
        "builder": builder,
    }
    data = json.dumps(record, indent=1).encode("utf-8")
    path = _record_path(cache_dir, name, revision, split)
    try:
        if path.is_file() and path.read_bytes() == data:
            return
        from sftmix.runtime.storage import atomic_write_bytes

        atomic_write_bytes(path, data)  # (its folder made as needed)
    except OSError as exc:  # a full or read-only disk: only an offline rerun needs it
        logger.debug("cannot keep the files of %s in %s: %s", name, path, exc)


def recalled(
    cache_dir: str, name: str, revision: str | None, split: str, builder: str
) -> tuple[list[str], Any] | None:
    """The local copies of the files an online plan found for ``name``'s ``split`` (read by ``builder``),
    and the features its card declared; ``None`` where no plan kept them. A file this machine's hub
    cache lacks is a :class:`DatasetError` naming it."""
    path = _record_path(cache_dir, name, revision, split)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        if record["format"] != RECORD_FORMAT or record["dataset"] != [name, revision, split.strip()]:
            return None
        if record.get("builder", "parquet") != builder:  # (records before JSON's were all Parquet's)
            return None
        files = [str(f) for f in record["files"]]
        declared = None if record["declared"] is None else schema_of(record["declared"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    copies = [local_copy(f) for f in files]
    missing = [f for f, c in zip(files, copies, strict=True) if c is None]
    if missing:
        raise DatasetError(
            name,
            f"HF_HUB_OFFLINE is set and {len(missing)} of the {len(files)} files of split {split.strip()!r} "
            f"are not in this machine's hub cache (first: {missing[0]}); run with the hub in reach once, "
            "or download them into the cache",
        )
    logger.info(
        "%s: HF_HUB_OFFLINE is set; reading the %d files an earlier plan found, from the hub cache",
        name,
        len(files),
    )
    return [c for c in copies if c is not None], declared
