"""Which data files we read and what a dataset's path names (a local file, a hub dataset, a ``gs://`` object):
a path that cannot be read is said at once, by name, before any work."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable, Sequence

from sftmix.runtime.storage import is_remote
from sftmix.sources.hub import offline_cache_problem, unreachable_hub_problem
from sftmix.sources.pinned import (
    unpinned,
)

LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


#: Compression around a JSON file, by suffix: the package fsspec needs for it (None: the standard library).
COMPRESSED_SUFFIXES = {
    ".gz": None,
    ".bz2": None,
    ".xz": None,
    ".lzma": None,
    ".zst": "zstandard",
    ".lz4": "lz4",
}


#: Data files we do not read: named at once instead of being looked up on the hub.
OTHER_DATA_SUFFIXES = (
    ".csv", ".tsv", ".txt", ".ndjson", ".arrow", ".feather", ".orc", ".avro", ".xlsx", ".pkl", ".pickle",
    ".zip", ".tar", ".tgz", ".7z",
)  # fmt: skip


READABLE = ".jsonl, .json or .parquet (JSON may be compressed: .gz, .bz2, .xz, .zst)"


def split_compression(path: str) -> tuple[str, str | None]:
    """The name without its compression suffix, and that suffix (lower case) or ``None``."""
    lower = path.lower()
    for suffix in COMPRESSED_SUFFIXES:
        if lower.endswith(suffix):
            return path[: -len(suffix)], suffix
    return path, None


def local_builder(path: str) -> str | None:
    """The ``datasets`` builder for a local file, or ``None`` for a hub name."""
    base, compression = split_compression(path)
    base = base.lower()
    for suffix, builder in LOCAL_SUFFIXES.items():
        if base.endswith(suffix):
            return None if compression is not None and builder != "json" else builder
    return None


def compression_of(path: str) -> str | None:
    """The compression suffix of a data file we read (``.gz``, ...; a pinned object's, by its URL),
    ``None`` for a plain file."""
    url = unpinned(path)[0]
    return split_compression(url)[1] if local_builder(url) is not None else None


def looks_local(path: str) -> bool:
    """A name that can only be a local path: a data-file or compression suffix, an explicit path
    (absolute, ``./``, ``../``, ``~``, a backslash) or more than one ``/`` (hub ids are ``name`` or
    ``owner/name``)."""
    lower = path.lower()
    suffixes = (*LOCAL_SUFFIXES, *COMPRESSED_SUFFIXES, *OTHER_DATA_SUFFIXES)
    return (
        lower.endswith(suffixes)
        or os.path.isabs(path)
        or path.startswith(("./", "../", "~", ".\\", "..\\"))
        or path in (".", "..")
        or "\\" in path
        or path.count("/") > 1
    )


def relative_note(path: str) -> str:
    where = "" if os.path.isabs(path) else f" (relative to the current directory {os.getcwd()})"
    tilde = "; a leading '~' is not expanded: write the full path" if path.startswith("~") else ""
    return where + tilde


def _missing(path: str, what: str = "file") -> str:
    return f"no such local {what}{relative_note(path)}"  # the error names the dataset, once


def local_file_problem(path: str) -> str | None:
    """Why a local data file cannot be read, found before ``datasets`` tries (which would say "file not
    found" for a directory, or crash on an empty file): ``None`` when it can be.

    An empty file is an error, not a dataset of no rows: a mixer entry that selects nothing is a
    mistake the user must see (the plan refuses a split without rows for the same reason)."""
    if not os.path.lexists(path):
        return _missing(path)
    if os.path.isdir(path):
        return (
            "is a directory, not a file: name the data file inside it "
            "(a directory laid out as on the hub is read when its name has no data-file suffix)"
        )
    if not os.path.isfile(path):
        return "is not a regular file (a broken link?)"
    if os.path.getsize(path) == 0:
        return "the file is empty (0 bytes); remove it from the mixer or give it rows"
    compression = compression_of(path)
    package = COMPRESSED_SUFFIXES.get(compression or "")
    if package is not None and importlib.util.find_spec(package) is None:
        return (
            f"reading {compression} files needs the {package!r} package (pip install {package}), "
            "or decompress the file first"
        )
    return None


def _not_readable(path: str) -> str:
    base, compression = split_compression(path)
    if compression is not None and base.lower().endswith(".parquet"):
        return f"a compressed parquet file is not read: decompress it (parquet compresses inside); we read {READABLE}"
    if path.lower().endswith((".zip", ".tar", ".tgz", ".7z")):
        return f"an archive is not read: extract the data file and name it; we read {READABLE}"
    if path.lower().endswith(".ndjson"):
        return "not a data file we read: JSON Lines must end in .jsonl (rename it)"
    return f"not a data file we read: we read {READABLE}"


def hub_name_problem(path: str, caches: Sequence[str] = ()) -> str | None:
    """Why a name without a data-file suffix cannot go to ``datasets.load_dataset``: a local file we do
    not read, a local path that does not exist, a hub that cannot be reached, or offline, a name no local
    cache holds (``caches``: the run's ``datasets`` cache directories). ``None`` for a local directory or
    a hub name the hub (or a cache) may answer."""
    if os.path.isdir(path):
        return None  # a local directory laid out as on the hub
    if os.path.lexists(path):
        return _not_readable(path)
    if looks_local(path):
        return _missing(path, "file" if path.lower().endswith(OTHER_DATA_SUFFIXES) else "file or directory")
    return unreachable_hub_problem() or offline_cache_problem(path, "dataset", caches)


def path_problem(path: str, caches: Sequence[str] = ()) -> str | None:
    """Why a dataset cannot be opened, found at once, with the messages opening it gives: a local file
    that is missing or unreadable, or a hub name with no hub to ask. ``None`` for a readable local
    file or directory, a remote object (its store is asked when it is opened) and a hub name the hub
    may answer."""
    if is_remote(path):
        return None
    if local_builder(path) is not None:
        return local_file_problem(path)
    return hub_name_problem(path, caches)


def readable_here(paths: Iterable[str]) -> bool:
    """Whether a worker reads these files as the plan did: each on this machine, or a ``gs://`` object
    (read in place anywhere); a machine that lacks one (the planner's copies) opens the dataset itself."""
    return all(is_remote(path) or os.path.isfile(path) for path in paths)
