"""One version of an input file, read by byte range: a local file, a ``gs://`` object named with the
generation the plan read (``url#generation``, gsutil's way of naming a version), or a hub dataset's file
named at a commit (``hf://datasets/owner/name@<commit>/path``: that commit's bytes never change), read
from this machine's hub cache when the file is there (:func:`local_copy`).

The plan and every slice read that version, wherever they run, so an object replaced meanwhile is an
error where it is read, never rows of two versions; and a slice reads only its own ranges of it, never
the whole object (minutes at 100 GB, and once per machine of a cluster).
"""

from __future__ import annotations

import io
import itertools
import re
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from sftmix.errors import DatasetError
from sftmix.runtime.storage import file_version, is_remote, remote_fs

#: A remote object is read in ranges of this many bytes, on this many threads at once: one stream from
#: a store is slow (each request waits tens of ms); these many are what a machine's network carries.
RANGE_BYTES = 8 << 20
READERS = 16


def object_info(path: str, fresh: bool = False) -> dict[str, Any]:
    """The store's description of object ``path`` (``fresh``: not from fsspec's listing cache)."""
    fs = remote_fs(path)
    if fresh:
        fs.invalidate_cache(path)
    try:
        return fs.info(path)
    except FileNotFoundError:
        raise DatasetError(path, "object not found") from None
    except Exception as exc:
        raise DatasetError(path, f"cannot reach the object: {type(exc).__name__}: {exc}") from None


def object_version(info: dict[str, Any]) -> Any:
    return (
        info.get("generation")
        or info.get("etag")
        or info.get("md5Hash")
        or info.get("blob_id")
        or info.get("mtime")
    )


#: A hub file named at a commit, as ``datasets`` names a hub dataset's data files.
_AT_COMMIT = re.compile(r"hf://(datasets|models|spaces)/([^/@]+/[^/@]+)@([0-9a-f]{40})/(.+)")


def at_commit(path: str) -> bool:
    """Whether ``path`` is a hub file named at a commit (its bytes never change)."""
    return _AT_COMMIT.fullmatch(path) is not None


def hub_repo(path: str) -> tuple[str, str] | None:
    """A hub file named at a commit's kind of repository (``datasets``, ``models``, ``spaces``) and
    repository (``owner/name``); ``None`` for any other path."""
    found = _AT_COMMIT.fullmatch(path)
    return None if found is None else (found.group(1), found.group(2))


def hub_file_name(path: str) -> str | None:
    """A hub file named at a commit's path in its repository (``data/train-00001.parquet``); ``None``
    for any other path."""
    found = _AT_COMMIT.fullmatch(path)
    return None if found is None else found.group(4)


def local_copy(path: str) -> str | None:
    """This machine's copy of a hub file named at a commit: the hub cache's, where ``datasets`` (and
    :mod:`sftmix.sources.downloads`) put it, read in place of the hub. ``None`` for any other path, or a file
    the cache does not hold."""
    found = _AT_COMMIT.fullmatch(path)
    if found is None:
        return None
    from huggingface_hub import try_to_load_from_cache

    kind, repo, commit, name = found.groups()
    copy = try_to_load_from_cache(repo, name, revision=commit, repo_type=kind.rstrip("s"))
    return copy if isinstance(copy, str) else None


def pin(path: str) -> str:
    """A remote object's path with the generation it has now (``url#generation``). A local path, or an
    object whose store keeps no generations, comes back as it is."""
    if not is_remote(path):
        return path
    generation = object_info(path, fresh=True).get("generation")
    return f"{path}#{generation}" if generation else path


def unpinned(path: str) -> tuple[str, str | None]:
    """A pinned object's URL and generation; any other path and ``None``."""
    if is_remote(path):
        url, mark, generation = path.rpartition("#")
        if mark and generation.isdigit():
            return url, generation
    return path, None


def version(path: str) -> tuple[Any, ...]:
    """What tells this version of the file from another: a local file's size, mtime and inode; an
    object's size and generation (or etag), asked of the store now. A pinned object that is no longer
    that generation is refused."""
    if not is_remote(path):
        return file_version(path)
    url, generation = unpinned(path)
    info = object_info(url, fresh=True)
    if generation is not None and str(info.get("generation")) != generation:
        raise DatasetError(url, "the object changed while it was planned: plan it when it no longer changes")
    return int(info.get("size") or 0), object_version(info)


def size_of(path: str) -> int:
    """The file's (or pinned object's) size in bytes; 0 when it cannot be read (the read says why)."""
    try:
        return version(path)[0]
    except (OSError, DatasetError):
        return 0


def read_remote(path: str, offset: int, end: int, changed: str) -> bytes:
    """Bytes ``[offset, end)`` of a remote object, of its pinned generation where it has one (fewer where
    the object ends first). ``changed``: the error's words when that generation is gone."""
    if end <= offset:
        return b""
    url, generation = unpinned(path)
    options: dict[str, Any] = {"generation": generation} if generation else {}
    if url.startswith("hf://"):
        options["cache_type"] = "none"  # the range asked for, not a block of read-ahead around it
    try:
        return remote_fs(url).cat_file(url, start=offset, end=end, **options)
    except FileNotFoundError:  # its pinned generation is gone: replaced or deleted
        raise DatasetError(path, changed) from None
    except Exception as exc:
        raise DatasetError(path, f"cannot read bytes {offset}-{end}: {type(exc).__name__}: {exc}") from None


def fetched(
    read: Callable[[int, int], bytes], size: int, chunk: int = RANGE_BYTES, readers: int = READERS
) -> Generator[bytes]:
    """An object's bytes in order, ``chunk`` at a time, each ``read(offset, end)`` on one of ``readers``
    threads ahead of the caller (at most ``readers`` chunks held)."""
    offsets = iter(range(0, size, chunk))
    pool = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="range-fetch")
    ahead: deque[Future[bytes]] = deque()

    def fetch(offset: int) -> None:
        ahead.append(pool.submit(read, offset, min(size, offset + chunk)))

    try:
        for offset in itertools.islice(offsets, readers):
            fetch(offset)
        while ahead:
            data = ahead.popleft().result()
            if (following := next(offsets, None)) is not None:
                fetch(following)
            yield data
    finally:
        pool.shutdown(cancel_futures=True)


class Stream(io.RawIOBase):
    """A pinned object read in order as a file (what a decompressor reads), its ranges fetched ahead
    (:func:`fetched`); one that ends before ``size`` bytes is an error, not a shorter file."""

    def __init__(self, path: str, size: int, changed: str) -> None:
        super().__init__()
        self.path, self._changed = path, changed
        self._chunks = fetched(lambda offset, end: self._read(offset, end), size, RANGE_BYTES, READERS)
        self._held = memoryview(b"")
        self._at = 0  # bytes read so far

    def _read(self, offset: int, end: int) -> bytes:
        data = read_remote(self.path, offset, end, self._changed)
        if len(data) != end - offset:
            raise DatasetError(self.path, self._changed)
        return data

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if not self._held:
            self._held = memoryview(next(self._chunks, b""))
        n = min(len(b), len(self._held))
        b[:n] = self._held[:n]
        self._held = self._held[n:]
        self._at += n
        return n

    def tell(self) -> int:
        return self._at

    def close(self) -> None:
        self._chunks.close()
        super().close()
