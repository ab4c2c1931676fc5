"""Open a dataset (hub name, local .jsonl/.json/.parquet, or such a file on gs://) and read rows from it.

Local files go through ``datasets.load_dataset`` exactly as the reference loads them, so rows reach the
template with the same fields (Arrow unifies the message keys across rows). The Arrow cache lives in the
work directory, so every worker process memory-maps the same files instead of re-parsing. A file on an
object store is fetched once per machine into that cache, named by the object's generation, and is then
a local file like any other.

JSON files may be compressed (``.jsonl.gz``, ``.json.bz2``, ``.jsonl.xz``; ``.zst`` and ``.lz4`` when
their packages are installed): ``datasets`` decompresses them on the fly (fsspec infers the codec from
the name) into the same Arrow cache, so workers read them as they read any file. A name that can only
be a local path (a data-file suffix, an explicit ``./`` or absolute path, more than one ``/``) is never
looked up on the hub: a missing file, a directory, an empty file or a format we do not read is said at
once, by name.
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Protocol, TypeVar

from sftmix.errors import DatasetError
from sftmix.runtime import settings
from sftmix.runtime.ownership import remove_abandoned_temps
from sftmix.runtime.read_progress import ReadProgress, StillLoading
from sftmix.runtime.storage import atomic_open, download_file, is_remote, sha256_stream
from sftmix.sources import hub_files
from sftmix.sources.downloads import Downloads, closed_on_error, downloads_of
from sftmix.sources.growing import GrowingFile
from sftmix.sources.hub import offline, offline_cache_problem, unreachable_hub_problem
from sftmix.sources.pinned import (
    Stream,
    at_commit,
    local_copy,
    object_info,
    object_version,
    read_remote,
    size_of,
    unpinned,
    version,
)

logger = logging.getLogger(__name__)

#: ``datasets``' JsonConfig.chunksize: the batch its JSON builder reads before finishing the line (what
#: ``sftmix.sources.jsonl`` reads as it does).
BATCH_BYTES = 10 << 20

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


def _quiet_datasets() -> None:
    import datasets

    datasets.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    # Every load_dataset("json", ...) of a local file would send a HEAD request to S3 (a download count):
    # it names nothing of the user's, but costs up to its 3 s timeout, plus the name lookup, on a
    # machine whose outbound traffic is dropped rather than refused.
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False


def _split_compression(path: str) -> tuple[str, str | None]:
    """The name without its compression suffix, and that suffix (lower case) or ``None``."""
    lower = path.lower()
    for suffix in COMPRESSED_SUFFIXES:
        if lower.endswith(suffix):
            return path[: -len(suffix)], suffix
    return path, None


def local_builder(path: str) -> str | None:
    """The ``datasets`` builder for a local file, or ``None`` for a hub name."""
    base, compression = _split_compression(path)
    base = base.lower()
    for suffix, builder in LOCAL_SUFFIXES.items():
        if base.endswith(suffix):
            return None if compression is not None and builder != "json" else builder
    return None


def compression_of(path: str) -> str | None:
    """The compression suffix of a data file we read (``.gz``, ...; a pinned object's, by its URL),
    ``None`` for a plain file."""
    url = unpinned(path)[0]
    return _split_compression(url)[1] if local_builder(url) is not None else None


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


def _relative_note(path: str) -> str:
    where = "" if os.path.isabs(path) else f" (relative to the current directory {os.getcwd()})"
    tilde = "; a leading '~' is not expanded: write the full path" if path.startswith("~") else ""
    return where + tilde


def _missing(path: str, what: str = "file") -> str:
    return f"no such local {what}{_relative_note(path)}"  # the error names the dataset, once


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
    base, compression = _split_compression(path)
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


def _no_rows(path: str) -> str:
    """What an unreadable JSON file without rows holds, for the message that replaces the loader's
    StopIteration ("coroutine raised StopIteration" under Prefect) or "corresponds to no data"."""
    import fsspec

    try:
        with fsspec.open(path, "rb", compression="infer") as fh:
            head = fh.read(1 << 20)
            size = len(head)
            blank = not head.strip()
            while blank and (block := fh.read(1 << 22)):
                size += len(block)
                blank = not block.strip()
    except Exception:  # unreadable as well: say no more than the loader found
        return "the file has no rows; remove it from the mixer or give it rows"
    if size == 0:
        return "the file decompresses to nothing (0 bytes); remove it from the mixer or give it rows"
    if blank:
        return "the file has no rows, only blank lines; remove it from the mixer or give it rows"
    return "the file has no rows (an empty JSON array, or only empty objects); remove it from the mixer or give it rows"


def _parquet_rows(path: str) -> int | None:
    """Rows of a parquet file from its footer, ``None`` when it cannot be read (``datasets`` says why)."""
    import pyarrow.parquet as pq

    try:
        return pq.read_metadata(path).num_rows
    except Exception:
        return None


def row_line(path: str, split: str, row: int) -> int | None:
    """The 1-based line of a local JSON Lines file that holds ``row`` (0-based, blank lines skipped as
    the loader skips them), for error messages. ``None`` when rows are not lines (parquet, a JSON
    array or a pretty-printed object), for a sliced split, a remote file, or one that cannot be read.
    Scans the file up to the row: called only to report an error."""
    import fsspec

    if (
        local_builder(path) != "json"
        or split.strip() != "train"
        or is_remote(path)
        or not os.path.isfile(path)
    ):
        return None
    try:
        seen = -1
        with fsspec.open(path, "rb", compression="infer") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                seen += 1
                if seen in (0, row) and not isinstance(json.loads(line), dict):
                    return None  # a JSON array, or one object over many lines: rows are not lines
                if seen == row:
                    return number
    except Exception:
        return None
    return None


@dataclass(frozen=True)
class SourceInfo:
    n_rows: int
    fingerprint: str
    columns: tuple[str, ...]
    nbytes: int


class _Utf8Check:
    """Fed block by block: invalid UTF-8 is an error naming its line (the JSON loader would silently
    replace those bytes, and the reference with it).

    Arrow validates each block up to its last complete character (the rest waits for the next block):
    measured 4x faster than decoding it (0.8 s for 462 MiB), and without holding the GIL while the
    Arrow conversion runs beside it. Only an invalid block is decoded, to name the line."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.carry = b""
        self.offset = self.newlines = 0  # of the file before ``carry``

    def __call__(self, block: bytes) -> None:
        data = self.carry + block if self.carry else block
        cut = _complete_prefix(data)
        head, self.carry = data[:cut], data[cut:]
        if head and not valid_utf8(head):
            try:
                head.decode("utf-8")
            except UnicodeDecodeError as exc:
                self._fail(head, exc.start)
        self.newlines += head.count(b"\n")
        self.offset += len(head)

    def _fail(self, data: bytes, start: int) -> None:
        line = self.newlines + data.count(b"\n", 0, start) + 1
        raise DatasetError(
            self.path, f"line {line} is not valid UTF-8 (byte {self.offset + start} of the file)"
        ) from None

    def finish(self) -> None:
        try:
            _, consumed = codecs.utf_8_decode(self.carry, "strict", False)
        except UnicodeDecodeError as exc:
            self._fail(self.carry, exc.start)
        if consumed < len(self.carry):
            raise DatasetError(self.path, "the file ends inside a UTF-8 character") from None


def _complete_prefix(data: bytes) -> int:
    """Length of ``data`` less a UTF-8 character cut off at its end (at most 3 bytes: the next block
    completes it). Anything else, valid or not, is left to the validation."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:  # ASCII: no character continues past it
            return len(data)
        if byte >= 0xC0:  # the lead byte of the last character
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return len(data) - back if back < need else len(data)
    return len(data)


def valid_utf8(data: bytes) -> bool:
    import pyarrow as pa

    offsets = pa.py_buffer(b"\x00\x00\x00\x00" + len(data).to_bytes(4, "little"))
    try:
        pa.Array.from_buffers(pa.binary(), 1, [None, offsets, pa.py_buffer(data)]).cast(pa.string())
    except pa.ArrowInvalid:
        return False
    return True


_hashing: dict[tuple[str, bool, tuple[int, int]], Future] = {}
_hashing_lock = threading.Lock()


def file_sha256(path: str, check_utf8: bool = False) -> str:
    """sha256 of a file, checking on the same read that it is valid UTF-8 when asked (hashed once per
    process while the file's size and modification time stay the same; a caller that comes while
    another thread hashes the file waits for that result). A compressed file is hashed as stored and
    checked as decompressed."""
    st = os.stat(path)
    key = (path, check_utf8, (st.st_size, st.st_mtime_ns))
    with _hashing_lock:
        running = _hashing.get(key)
        mine = running is None
        if running is None:
            running = _hashing[key] = Future()
    if not mine:
        return running.result()
    try:
        digest = _file_sha256(*key)
    except BaseException as exc:
        running.set_exception(exc)
        raise
    finally:
        with _hashing_lock:
            _hashing.pop(key, None)
    running.set_result(digest)
    return digest


def hash_ahead(paths: list[str]) -> None:
    """Hash the local data files among ``paths`` on a thread of their own, so the hash and UTF-8 check
    of a large file run beside its Arrow conversion instead of after it (the conversion is one core's
    work). ``describe`` then finds the hash done, or waits for it; an error reaches it the same way."""
    todo = [
        (path, builder == "json")
        for path in paths
        if (builder := local_builder(path)) is not None and not is_remote(path) and os.path.isfile(path)
    ]

    def run() -> None:
        for path, check_utf8 in todo:
            with contextlib.suppress(Exception):  # the caller that needs the hash meets the error
                file_sha256(path, check_utf8)

    if todo:
        threading.Thread(target=run, name="hash-ahead", daemon=True).start()


@lru_cache(maxsize=32)
def _file_sha256(path: str, check_utf8: bool, stamp: tuple[int, int]) -> str:
    compressed = compression_of(path) is not None
    check = _Utf8Check(path) if check_utf8 else None
    with open(path, "rb") as fh:
        digest = sha256_stream(fh, None if compressed else check)
    if check is not None:
        if compressed:
            _check_decompressed(path, check)
        check.finish()
    return digest


def _check_decompressed(path: str, check: _Utf8Check) -> None:
    import fsspec

    try:
        with fsspec.open(path, "rb", compression="infer") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                check(block)
    except DatasetError:
        raise
    except Exception as exc:
        raise DatasetError(path, f"cannot decompress the file: {type(exc).__name__}: {exc}") from None


def localize(path: str, cache_dir: str) -> str:
    """A local copy of a remote data file (fetched once, keyed by the object's generation); local
    paths and hub names come back unchanged."""
    if not is_remote(path):
        return path
    if local_builder(path) is None:
        raise DatasetError(path, f"a remote dataset must be a file: {READABLE}")
    info = object_info(path)
    if info.get("type") == "directory":
        raise DatasetError(path, "is a prefix, not an object; name the file")
    tag = hashlib.sha256(f"{path}|{info.get('size')}|{object_version(info)}".encode()).hexdigest()[:24]
    local = os.path.join(cache_dir, "remote-files", tag, path.rsplit("/", 1)[-1])
    if not os.path.isfile(local):
        fetch_version(path, info, local)
    return local


def fetched_copy(path: str, split: str, cache_dir: str) -> str:
    """The file a reader reads when it cannot read ``path`` in place: for a ``gs://`` data file of the
    'train' split, this machine's copy of it in the cache ``datasets`` would read it from (fetched once
    per object generation, :func:`localize`); anything else as it is."""
    whole = is_remote(path) and local_builder(path) is not None and split.strip() == "train"
    return localize(path, cache_dir) if whole else path


def fetch_version(path: str, info: dict[str, Any], local: str) -> None:
    """Fetch the version of object ``path`` that ``info`` describes to ``local``, or refuse: the
    download is pinned to that generation where the store keeps one, and the object is asked again
    after it, so a copy never holds another version's bytes under this version's name."""
    logger.info("fetching %s (%s bytes)", path, info.get("size"))
    remove_abandoned_temps(Path(local).parent)  # a run killed while it fetched this version

    def same_version(fetched: Path) -> None:
        now = object_info(path, fresh=True)
        if object_version(now) != object_version(info) or fetched.stat().st_size != info.get("size"):
            raise DatasetError(path, _CHANGED_WHILE_FETCHED)

    try:
        download_file(path, local, generation=info.get("generation"), check=same_version)
    except DatasetError:
        raise
    except FileNotFoundError:  # the pinned generation is gone
        raise DatasetError(path, _CHANGED_WHILE_FETCHED) from None
    except Exception as exc:
        raise DatasetError(path, f"cannot download: {type(exc).__name__}: {exc}") from None


_CHANGED_WHILE_FETCHED = "the object changed while it was fetched: rerun when it no longer changes"


def decompressed_copy(
    path: str,
    cache_dir: str,
    progress: ReadProgress | None = None,
    begun: Callable[[GrowingFile], None] | None = None,
) -> str:
    """A compressed data file's decompressed copy, made once per version of the file (a local file's
    path, size, modification time and inode; a pinned ``gs://`` object's URL, size and generation, read
    by range as it is decompressed, never fetched whole first) in ``cache_dir``, so that it is read like a
    plain file: by batch on every core, where ``datasets`` decompresses and converts it on one. The copy
    lands whole or not at all (temp name, fsync, rename); a file that changes while it is decompressed is
    refused. ``progress`` counts the compressed bytes read (a line of its own every few seconds where
    none is given: ~100 GB take minutes); ``begun`` is handed the copy as it is written, when this call
    makes it (:mod:`sftmix.sources.growing`: its reader need not wait for the rest)."""
    url, found = unpinned(path)[0], version(path)
    where = url if is_remote(path) else os.path.abspath(path)
    tag = hashlib.sha256(f"{where}|{found}".encode()).hexdigest()[:24]
    local = Path(cache_dir, "decompressed", tag, _split_compression(url.rsplit("/", 1)[-1])[0])
    own = None if progress is not None or local.is_file() else ReadProgress(url, found[0], "decompressed")
    line = progress if progress is not None else own
    with own or contextlib.nullcontext(), _making(local, line) as making:  # (another may be making it)
        if not local.is_file():
            _decompress(path, url, found, local, making, begun)
    return str(local)


class _Making:
    """Copy ``local`` being made in this process (one thread at a time), and the lines of everyone who
    waits for it (a plan made ahead of the plan and the plan may both want it): each counts its bytes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lines: list[ReadProgress] = []
        self.done = 0  # compressed bytes read by the copy being made

    def read(self, nbytes: int) -> None:
        with _MAKING_LOCK:
            self.done += nbytes
            lines = list(self.lines)
        for line in lines:
            line.read(nbytes)


_MAKING: dict[Path, _Making] = {}
_MAKING_LOCK = threading.Lock()


@contextlib.contextmanager
def _making(local: Path, progress: ReadProgress | None) -> Iterator[_Making]:
    """Within it, this thread alone makes copy ``local`` in this process; ``progress`` counts its bytes
    read, by whichever thread makes it, from the start."""
    with _MAKING_LOCK:
        making = _MAKING.setdefault(local, _Making())
        if progress is not None:
            making.lines.append(progress)
            if making.done:  # (what another thread read of it before)
                progress.read(making.done)
    try:
        with making.lock:
            with _MAKING_LOCK:
                making.done = 0
            yield making
    finally:
        with _MAKING_LOCK:
            if progress is not None:
                making.lines.remove(progress)


def _decompress(
    path: str,
    url: str,
    found: tuple[Any, ...],
    local: Path,
    making: _Making,
    begun: Callable[[GrowingFile], None] | None,
) -> None:
    logger.info("decompressing %s (%s bytes)", url, found[0])
    remove_abandoned_temps(local.parent)  # a run killed while it decompressed this version
    growing: GrowingFile | None = None
    try:
        with _decompressing(path, found[0]) as (src, consumed), atomic_open(local) as dst:
            growing = GrowingFile(dst.name, str(local))
            if begun is not None:
                begun(growing)
            try:
                _copy_out(src, consumed, dst, growing, making)
                if version(path) != found:
                    raise DatasetError(path, _CHANGED_WHILE_DECOMPRESSED)
            except BaseException as exc:  # (told before the temp file is removed: GrowingFile.failing)
                growing.failing(_decompress_error(path, exc))
                raise
    except BaseException as exc:
        error = _decompress_error(path, exc)
        if growing is not None:
            growing.ended(error)
        if isinstance(exc, DatasetError) or not isinstance(exc, Exception):
            raise
        raise error from None
    if growing is not None:
        growing.ended()


def _copy_out(src: Any, consumed: Callable[[], int], dst: Any, growing: GrowingFile, making: _Making) -> None:
    """The decompressed bytes of ``src`` written to ``dst``, each block told to its readers as flushed."""
    counted = 0
    while block := src.read(_DECOMPRESS_BLOCK):
        dst.write(block)
        dst.flush()  # (its readers read the file)
        growing.grew(len(block))
        now = consumed()
        making.read(now - counted)
        counted = now


def _decompress_error(path: str, exc: BaseException) -> DatasetError:
    """What a failed decompression says: our own error as it is; another wrapped, naming the file."""
    if isinstance(exc, DatasetError):
        return exc
    return DatasetError(path, f"cannot decompress the file: {type(exc).__name__}: {exc}")


_DECOMPRESS_BLOCK = 16 << 20


_CHANGED_WHILE_DECOMPRESSED = "the file changed while it was decompressed: rerun when it no longer changes"


@contextlib.contextmanager
def _decompressing(path: str, size: int) -> Iterator[tuple[Any, Callable[[], int]]]:
    """``path`` (``size`` bytes) opened to read its decompressed bytes, and how many of its own bytes were
    read so far: gzip through ISA-L where it is
    installed (~3x the gzip module's speed: 0.84 against 0.28-0.32 GB/s of output on this VM's cores),
    else as ``datasets`` opens it (fsspec's codecs). The same bytes either way: gzip checks each member's
    CRC-32 and length. A pinned object is read in order by range, fetched ahead on many threads."""
    import io

    with contextlib.ExitStack() as stack:  # (a decompressor leaves the file it was given open)
        if is_remote(path):
            stream = Stream(path, size, _CHANGED_WHILE_DECOMPRESSED)
            raw: Any = stack.enter_context(io.BufferedReader(stream, _DECOMPRESS_BLOCK))
        else:
            raw = stack.enter_context(open(path, "rb"))
        if compression_of(path) == ".gz":
            try:
                from isal import igzip
            except ImportError:
                import gzip as igzip  # type: ignore[no-redef]  # the same open(), where isal ships no wheel
            yield stack.enter_context(igzip.open(raw, "rb")), raw.tell
        else:
            yield stack.enter_context(_codec(path)(raw, mode="rb")), raw.tell


def _codec(path: str) -> Callable[..., Any]:
    """fsspec's opener for the compression ``path``'s suffix names (as ``datasets`` opens such a file)."""
    import fsspec.compression
    import fsspec.utils

    compression = _split_compression(unpinned(path)[0])[1]
    return fsspec.compression.compr[fsspec.utils.infer_compression(f"x{compression}")]


def open_dataset(path: str, split: str, revision: str | None, cache_dir: str) -> Any:
    """The ``datasets.Dataset`` behind a mixer entry (memory-mapped Arrow), reopened when the file changes."""
    return _open_localized(path, localize(path, cache_dir), split, revision, cache_dir)


def _open_localized(path: str, local: str, split: str, revision: str | None, cache_dir: str) -> Any:
    stamp = None
    if local_builder(local) is not None and os.path.isfile(local):
        st = os.stat(local)
        stamp = (st.st_size, st.st_mtime_ns)
    return _open_dataset(path, local, split, revision, cache_dir, stamp)


MIXED_TYPES = re.compile(r"Column\((?P<field>[^)]*)\) changed from (?P<a>\w+) to (?P<b>\w+)")


@lru_cache(maxsize=1)
def _reference_json_options() -> dict[str, Any]:
    """JSON-loader options that make datasets 5 build the rows datasets 4 builds (the reference pins
    datasets 4.5): objects whose keys differ between rows become one struct with every key, missing ones
    null, as a chat template then sees them (tool schemas, tool-call arguments), rather than datasets 5's
    JSON-typed cells that keep each row's own keys; and no agent-trace reshaping of messages/tools."""
    from dataclasses import fields

    from datasets.packaged_modules.json.json import JsonConfig

    known = {f.name for f in fields(JsonConfig)}
    wanted = {"on_mixed_types": None, "parse_agent_traces": False}
    return {k: v for k, v in wanted.items() if k in known}


@lru_cache(maxsize=32)
def _open_dataset(
    name: str, path: str, split: str, revision: str | None, cache_dir: str, stamp: tuple | None
) -> Any:
    _quiet_datasets()
    import datasets

    builder = local_builder(path)
    try:
        if builder is not None:
            if (problem := local_file_problem(path)) is not None:
                raise DatasetError(name, problem)
            if split.split("[", 1)[0].strip() != "train":
                raise DatasetError(
                    name, f"a local file has only the 'train' split, sliced or not (asked for {split!r})"
                )
            if builder == "parquet" and _parquet_rows(path) == 0:  # datasets fails on it ("BatchSize ... 0")
                raise DatasetError(name, "the file has no rows; remove it from the mixer or give it rows")
            options = _reference_json_options() if builder == "json" else {}
            with StillLoading(name):
                ds = datasets.load_dataset(
                    builder, data_files=path, split=split, cache_dir=cache_dir, **options
                )
        else:
            if (problem := hub_name_problem(path, [cache_dir] if cache_dir else [])) is not None:
                raise DatasetError(name, problem)
            options = _builder_options(path, revision, cache_dir)
            _fetch_first(path, split, revision, cache_dir)
            with StillLoading(path):
                ds = datasets.load_dataset(
                    path, split=split, revision=revision, cache_dir=cache_dir, **options
                )
    except DatasetError:
        raise
    except StopIteration:  # the json builder finds no table at all in the file
        raise DatasetError(name, _no_rows(path) if builder == "json" else "the dataset has no rows") from None
    except (datasets.exceptions.DatasetGenerationError, ValueError, OSError, FileNotFoundError) as exc:
        cause = exc.__cause__ or exc
        if builder == "json" and "corresponds to no data" in str(cause):
            raise DatasetError(name, _no_rows(path)) from None
        if builder == "json" and (changed := MIXED_TYPES.search(str(cause))) is not None:
            raise DatasetError(
                name,
                f"field '{changed['field']}' holds {changed['a']}s in some rows and {changed['b']}s in others "
                f"({cause}); a field must have one type in every row, as the reference's loader (datasets 4) "
                "also requires: write it one way everywhere (e.g. tools or tool-call arguments as JSON strings)",
            ) from None
        if builder is None and offline() and _part_cached(cause):
            raise DatasetError(name, _PART_CACHED + f" ({type(cause).__name__}: {cause})") from None
        reason = f"cannot load split {split!r}: {type(cause).__name__}: {cause}"
        if builder is None and isinstance(cause, ConnectionError | FileNotFoundError):
            reason += f"; nor is there a local file or directory of that name{_relative_note(path)}"
        raise DatasetError(name, reason) from None
    if not isinstance(ds, datasets.Dataset):
        raise DatasetError(name, f"split {split!r} did not load as a single dataset")
    return ds


def _fetch_first(name: str, split: str, revision: str | None, cache_dir: str) -> None:
    """Download the files of hub dataset ``name``'s ``split`` that ``datasets`` is about to load (one it
    does not read by file: features that decode, another builder, a sliced split), a few at a time with a line
    every few seconds (:mod:`sftmix.sources.downloads`): ``datasets`` downloads fewer than 16 files, or files over
    20 MB, one after another and in silence, then finds these in the hub cache."""
    if offline() or os.path.isdir(name):
        return
    try:
        builder = _builder(name, revision, cache_dir)
        files = (builder.config.data_files or {}).get(split.split("[", 1)[0].strip()) or []
        missing = [str(f) for f in files if at_commit(str(f)) and local_copy(str(f)) is None]
        if not missing:
            return
        manager = _download_manager(builder, cache_dir)
    except Exception as exc:  # datasets' own load meets it again, and says what it is
        logger.debug("%s: not downloaded first (%s: %s)", name, type(exc).__name__, exc)
        return
    downloads = downloads_of(name, missing, lambda url: str(manager.download(url)))
    with closed_on_error(downloads):
        for url in missing:
            downloads.wait(url)


_PART_CACHED = (
    "HF_HUB_OFFLINE is set, and this machine's caches hold only part of it (a download, or a run, stopped "
    "before it ended?): run it once where the hub can be reached, or unset HF_HUB_OFFLINE"
)


def _part_cached(cause: BaseException) -> bool:
    """Whether ``datasets``' offline load of a hub dataset (one some local cache holds) failed because
    the caches hold only part of it: a file not downloaded (it asks the hub: "Couldn't reach"), or the
    library's conversion stopped before it ended (a folder it left: "Couldn't find cache", or its
    ``dataset_info.json`` missing)."""
    return isinstance(cause, ConnectionError | FileNotFoundError) or (
        isinstance(cause, ValueError) and str(cause).startswith("Couldn't find cache for ")
    )


@dataclass(frozen=True)
class ParquetFiles:
    """A hub dataset's (or a local directory's) Parquet files for one split, in the order ``datasets``
    reads them, and the features its card declares (an Arrow schema), if any. A hub dataset's files are
    local copies where this machine's hub cache has them all; otherwise they are named on the hub at
    their commit (read by range, and from the cache once there) and ``downloads`` is fetching them."""

    paths: list[str]
    declared: Any = None
    downloads: Downloads | None = None


def _decode(features: Any) -> bool:
    """Whether some of the features a dataset's card declares decode their cells (an Image, a JSON-typed
    field): such rows are ``datasets``' own to read."""
    from datasets.features.features import require_decoding

    return features is not None and any(require_decoding(f) for f in features.values())


def _builder(name: str, revision: str | None, cache_dir: str) -> Any:
    """``datasets``' builder for hub name (or local directory) ``name``: what it reads, and how. A hub
    name's is resolved once a plan (each reader asks for it; each resolution asks the hub several
    things), a local directory's each time (its files may change; it asks no one)."""
    if os.path.isdir(name):
        return _resolved_builder(name, revision, cache_dir)
    return _hub_builder(name, revision, cache_dir)


def _resolved_builder(name: str, revision: str | None, cache_dir: str) -> Any:
    _quiet_datasets()
    import datasets

    return datasets.load_dataset_builder(name, revision=revision, cache_dir=cache_dir)


_hub_builder = lru_cache(maxsize=16)(_resolved_builder)


def forget_builders() -> None:
    """Resolve hub names afresh: a plan reads a dataset's commit of now, not an earlier plan's."""
    _hub_builder.cache_clear()


def _download_manager(builder: Any, cache_dir: str) -> Any:
    """A download manager that fetches a builder's files into the cache its own download uses."""
    import datasets

    return datasets.DownloadManager(
        dataset_name=builder.dataset_name,
        download_config=datasets.DownloadConfig(
            cache_dir=os.path.join(cache_dir, "downloads"), use_etag=False, token=builder.token
        ),
        data_dir=builder.config.data_dir,
        base_path=builder.base_path,
    )


def _read_by_files(name: str, split: str, cache_dir: str) -> bool:
    """Whether hub name (or local directory) ``name``'s split may be read from its files, not loaded
    through ``datasets``: a whole split of a name that resolves."""
    if local_builder(name) is not None or is_remote(name) or "[" in split:
        return False
    return hub_name_problem(name, [cache_dir] if cache_dir else []) is None


def parquet_data_files(name: str, split: str, revision: str | None, cache_dir: str) -> ParquetFiles | None:
    """Where ``datasets.load_dataset(name, split=split)`` would read Parquet files with its Parquet
    builder (a hub dataset as the hub serves most, or a local directory laid out like one): the files,
    fetched into the same cache its download uses (in the background, :class:`ParquetFiles`), so they
    are read by row group instead of converted whole on one core. ``None`` for anything else (another
    builder, a sliced split, a builder configured to filter or select columns, features that decode, a
    name that cannot be resolved): ``datasets`` then loads it as before, and says what is wrong."""
    if not _read_by_files(name, split, cache_dir):
        return None
    if offline() and (kept := hub_files.recalled(cache_dir, name, revision, split, "parquet")) is not None:
        return ParquetFiles(*kept)  # (``datasets`` never prepared it: its loader has nothing offline)
    try:
        builder = _builder(name, revision, cache_dir)
        config = builder.config
        files = (config.data_files or {}).get(split.strip())
        if builder.name != "parquet" or not files or config.columns is not None or config.filters is not None:
            return None
        features = builder.info.features
        if _decode(features):
            return None
        manager = _download_manager(builder, cache_dir)
        files = [str(f) for f in files]
        hub = [f for f in files if at_commit(f)]
        downloads = None
        if not offline() and any(local_copy(f) is None for f in hub):  # downloaded as the plan reads them
            paths = [f if f in hub else str(manager.download(f)) for f in files]
            downloads = downloads_of(name, hub, lambda url: str(manager.download(url)))
        else:
            paths = [str(p) for p in manager.download(files)]
    except Exception as exc:  # datasets' own load meets it again, and says what it is
        logger.debug("%s: not read by row group (%s: %s)", name, type(exc).__name__, exc)
        return None
    if not all((at_commit(p) or os.path.isfile(p)) and p.lower().endswith(".parquet") for p in paths):
        if downloads is not None:
            downloads.close()
        return None
    declared = None if features is None else features.arrow_schema
    if not offline():
        hub_files.remember(cache_dir, name, revision, split, files, declared, "parquet")
    return ParquetFiles(paths, declared, downloads)


@dataclass(frozen=True)
class JsonFiles:
    """A hub dataset's (or a local directory's) JSON Lines files for a split, in the order
    ``datasets`` reads them: local files, or hub files named at their commit that ``downloads`` is
    fetching into the hub cache while the plan reads them; compressed ones read from the decompressed
    copies ``copies`` makes as each file is here (:meth:`local` waits for one)."""

    paths: list[str]
    downloads: Downloads | None = None
    copies: DecompressedCopies | None = None
    declared: Any = None  # the features its card declares (an Arrow schema), if any

    def local(self, k: int) -> str:
        """File ``k``'s copy on this machine, once it has landed (and, compressed, been decompressed)."""
        if self.copies is not None:
            return self.copies.wait(k)
        path = self.paths[k]
        return path if self.downloads is None else self.downloads.wait(path)

    def follow(self, k: int) -> str | GrowingFile:
        """:meth:`local`, or, for a compressed file, its copy as soon as it is being made (as it grows)."""
        return self.local(k) if self.copies is None else self.copies.follow(k)

    def close(self) -> None:
        """No more downloads or decompressions start (for a plan that will not read the files)."""
        if self.downloads is not None:
            self.downloads.close()
        if self.copies is not None:
            self.copies.close()

    @cached_property
    def sizes(self) -> list[int]:
        """Each file's size in bytes as the plan sizes slices by: a plain file's own (its copy's, or, not
        landed yet, the hub's, asked side by side); a compressed file's own times the first compressed
        file's ratio of copy to file (that copy's size as the file says it, :func:`copy_size`). So the
        first slices need not wait for any copy (~100 GB take minutes to download or decompress), and the
        same files give the same sizes, online or offline."""
        from concurrent.futures import ThreadPoolExecutor

        def size(path: str) -> int:
            if (copy := local_copy(path)) is not None:
                return os.path.getsize(copy)
            return int(object_info(path).get("size") or 0) if at_commit(path) else size_of(path)

        if not any(at_commit(p) for p in self.paths):  # (local files, or one pinned object)
            own = [size_of(p) for p in self.paths]
        else:
            with ThreadPoolExecutor(max_workers=min(16, len(self.paths))) as pool:
                own = list(pool.map(size, self.paths))
        compressed = [compression_of(p) is not None for p in self.paths]
        if not any(compressed):
            return own
        first = compressed.index(True)
        here = self.paths[first] if self.downloads is None else self.downloads.wait(self.paths[first])
        ratio = copy_size(here, lambda: os.path.getsize(self.local(first))) / max(1, own[first])
        return [round(n * ratio) if c else n for n, c in zip(own, compressed, strict=True)]


#: A guess of how much larger JSON Lines of chats are than their gzip (only to tell a gzip file's size
#: mod 4 GiB, which it records, from another multiple of 4 GiB).
_GZIP_RATIO = 4


#: Bytes from a compressed file's start whose decompression tells its copy's size (not gzip: its trailer
#: does), several of a codec's blocks (bzip2's are up to 900 kB).
_SIZE_SAMPLE = 4 << 20


def copy_size(path: str, made: Callable[[], int]) -> int:
    """The size of compressed file ``path``'s decompressed copy, without making it where the file says it:
    a gzip file (one member) records its size mod 4 GiB in its last 4 bytes (exact below 4 GiB, and for
    a larger one the multiple of 4 GiB nearest a guess from the file's size); any other, the file's size
    times the ratio of its first :data:`_SIZE_SAMPLE` bytes (:func:`_sampled_copy_size`). Where neither
    tells it: ``made()``. Slices are sized by it, so no slice waits for the whole copy, and the same file
    gives the same size."""
    size = size_of(path)
    if compression_of(path) != ".gz":
        return _sampled_copy_size(path, size) or made()
    if size < 18:  # (shorter than gzip's own header and trailer)
        return made()
    tail = _read_bytes(path, size - 4, size)
    recorded = int.from_bytes(tail, "little")
    wraps = max(0, round((size * _GZIP_RATIO - recorded) / (1 << 32)))
    told = recorded + wraps * (1 << 32)
    return told if told >= size else size * _GZIP_RATIO  # (smaller than its gzip: several members)


def _read_bytes(path: str, offset: int, end: int) -> bytes:
    if is_remote(path):
        return read_remote(path, offset, end, "the object changed while it was planned")
    with open(path, "rb") as fh:
        fh.seek(offset)
        return fh.read(end - offset)


def _sampled_copy_size(path: str, size: int) -> int | None:
    """The decompressed size of a whole file that fits in the sample; else ``size`` times the ratio of
    what the sample decompressed to the compressed bytes read to make it (a codec gives a block's bytes
    once it has read all of it); ``None`` where it decompressed nothing (the copy then meets the error)."""
    import io

    raw = io.BytesIO(_read_bytes(path, 0, min(size, _SIZE_SAMPLE)))
    made = read_then = 0
    whole = size <= _SIZE_SAMPLE
    try:
        with _codec(path)(raw, mode="rb") as stream:
            while block := stream.read(1 << 16):
                made += len(block)
                read_then = raw.tell()
                if made >= _SIZE_SAMPLE << 6:  # (enough to tell the ratio of data that packs so well)
                    whole = False
                    break
    except Exception:  # (the sample ends within a block, or the file is damaged: the copy says which)
        whole = False
    if whole:
        return made
    if not made:
        return None
    return round(size * made / max(1, read_then))


class DecompressedCopies:
    """The decompressed copies of a dataset's compressed files (a plain file is its own), each made as
    soon as its file is here (a hub file once it has landed: ``downloads``), side by side on every core;
    :meth:`wait` gives one once it is made. At ~100 GB the first files' slices start while the last
    files still download or decompress. One line every few seconds says how far (none while they
    download: the downloads say how far)."""

    def __init__(self, name: str, paths: list[str], cache_dir: str, downloads: Downloads | None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from sftmix.runtime.parallel import available_cpus

        self.name, self.paths = name, paths
        total = (
            0 if downloads is not None else sum(size_of(p) for p in paths if compression_of(p) is not None)
        )
        self._progress = ReadProgress(name, total, "decompressed")
        self._progress.start()

        def plain(k: int, path: str) -> str:
            local = path if downloads is None else downloads.wait(path)
            if compression_of(local) is None:
                return local
            return decompressed_copy(local, cache_dir, self._progress, lambda copy: self._begun(k, copy))

        self._lock = threading.Condition()
        self._left, self._failed = len(paths), False
        self._growing: list[GrowingFile | None] = [None] * len(paths)
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, min(len(paths), available_cpus())), thread_name_prefix="decompress"
        )
        self._copies = [self._pool.submit(plain, k, path) for k, path in enumerate(paths)]
        self._pool.shutdown(wait=False)  # (its threads end once these are made)
        for copy in self._copies:
            copy.add_done_callback(self._settled)

    def _begun(self, k: int, copy: GrowingFile) -> None:
        with self._lock:
            self._growing[k] = copy
            self._lock.notify_all()

    def _settled(self, copy: Future[str]) -> None:
        """(Called on the thread that settles a copy, or that cancels it holding the pool's lock.)"""
        with self._lock:
            self._left -= 1
            self._failed |= copy.cancelled() or copy.exception() is not None
            self._lock.notify_all()
            if self._left and not self._failed:
                return
        if not self._left:
            self._progress.end()
        _forget_copies(self)  # (all made: nothing to share; one failed: a later plan tries again)

    @property
    def _finished(self) -> bool:
        with self._lock:
            return not self._left or self._failed

    def wait(self, k: int) -> str:
        """File ``k``'s copy, once it is made."""
        try:
            return self._copies[k].result()
        except CancelledError:
            raise DatasetError(self.name, f"{self.paths[k]}: its decompression was stopped") from None

    def follow(self, k: int) -> str | GrowingFile:
        """File ``k``'s copy once it is made, or, as soon as it is being made here, the copy as it grows."""
        with self._lock:
            while self._growing[k] is None and not self._copies[k].done():
                self._lock.wait()
            growing = self._growing[k]
        return self.wait(k) if growing is None else growing

    def close(self) -> None:
        """No more copies start, and no one waits for those being made (each lands whole or not)."""
        self._progress.end()
        _forget_copies(self)
        self._pool.shutdown(wait=False, cancel_futures=True)


_COPYING: dict[tuple[str, tuple[str, ...], str], DecompressedCopies] = {}
_COPYING_LOCK = threading.RLock()  # (a copy settled at once forgets its copies on the thread that made them)


def copies_of(name: str, paths: list[str], cache_dir: str, downloads: Downloads | None) -> DecompressedCopies:
    """The copies of dataset ``name``'s files ``paths`` being made in this process (the plan made ahead
    of the plan started them), else new ones: one line says how far."""
    key = (name, tuple(paths), cache_dir)
    with _COPYING_LOCK:
        found = _COPYING.get(key)
        if found is None:
            found = DecompressedCopies(name, paths, cache_dir, downloads)
            if not found._finished:  # (settled later: forgotten then, once this lock is let go)
                _COPYING[key] = found
        return found


def _forget_copies(copies: DecompressedCopies) -> None:
    """Copies all made, closed or failed are not handed to a later plan."""
    with _COPYING_LOCK:
        for key, running in list(_COPYING.items()):
            if running is copies:
                del _COPYING[key]


def json_data_files(name: str, split: str, revision: str | None, cache_dir: str) -> JsonFiles | None:
    """Where ``datasets.load_dataset(name, split=split)`` would read JSON files with its JSON builder,
    taking the features its card declares, or else those of the first batch of the first file (a hub
    dataset of JSON Lines files, or a local directory of them): the files, downloaded as ``datasets`` downloads them, for the plan to read
    by batch on all cores (:func:`sftmix.sources.jsonl.batches.scan_files`) instead of ``datasets`` converting them whole
    on one core. Plain files download in the background, in order, each read as soon as it has landed;
    compressed ones download the same way and are decompressed to copies (as :func:`decompressed_copy`
    makes one of a local file) as each lands, side by side. ``None`` for anything else (a split not the
    builder's first where the card declares no features: ``datasets`` casts it to the features it found in
    the first; declared features that decode; a JSON field to read rows from; another encoding or batch
    size): ``datasets`` then loads it as before."""
    if settings.JSON_READER.get() == "datasets":
        return None
    if not _read_by_files(name, split, cache_dir):
        return None
    if offline() and (kept := hub_files.recalled(cache_dir, name, revision, split, "json")) is not None:
        return _json_files(name, kept[0], cache_dir, declared=kept[1])
    try:
        builder = _builder(name, revision, cache_dir)
        config = builder.config
        splits, wanted = list(config.data_files or {}), split.strip()
        features = builder.info.features
        if builder.name != "json" or wanted not in splits or _decode(features):
            return None
        if features is None and splits[0] != wanted:
            return None
        if config.field is not None or config.encoding.lower().replace("-", "") != "utf8":
            return None
        if config.encoding_errors is not None or config.chunksize != BATCH_BYTES:
            return None
        manager = _download_manager(builder, cache_dir)
        files = [str(f) for f in config.data_files[wanted]]
        hub = [f for f in files if at_commit(f)]
        downloads = None
        if not offline() and any(local_copy(f) is None for f in hub):  # read as they land
            paths = [f if f in hub else str(manager.download(f)) for f in files]
            downloads = downloads_of(name, hub, lambda url: str(manager.download(url)))
        else:
            paths = [str(p) for p in manager.download(files)]
    except Exception as exc:  # datasets' own load meets it again, and says what it is
        logger.debug("%s: not read by batch (%s: %s)", name, type(exc).__name__, exc)
        return None
    if not paths or not all((downloads is not None and at_commit(p)) or os.path.isfile(p) for p in paths):
        if downloads is not None:
            downloads.close()
        return None
    declared = None if features is None else features.arrow_schema
    if not offline():
        hub_files.remember(cache_dir, name, revision, split, files, declared, "json")
    return _json_files(name, paths, cache_dir, downloads, declared)


def _json_files(
    name: str, paths: list[str], cache_dir: str, downloads: Downloads | None = None, declared: Any = None
) -> JsonFiles:
    """``paths`` to read, compressed ones from their copies, made as each file is here."""
    if all(compression_of(p) is None for p in paths):
        return JsonFiles(paths, downloads, None, declared)
    return JsonFiles(paths, downloads, copies_of(name, paths, cache_dir, downloads), declared)


def _builder_options(name: str, revision: str | None, cache_dir: str) -> dict[str, Any]:
    """The options :func:`_reference_json_options` gives a hub dataset (or local directory) that
    ``datasets`` reads with its JSON builder, as it gives a local JSON file; none for any other."""
    try:
        return _reference_json_options() if _builder(name, revision, cache_dir).name == "json" else {}
    except Exception:  # the load meets it again, and says what it is
        return {}


def describe(path: str, split: str, revision: str | None, cache_dir: str) -> SourceInfo:
    """Row count and a content fingerprint (file sha256 for local files, the Arrow fingerprint otherwise)."""
    local = localize(path, cache_dir)  # once: for a gs:// object each call asks the store
    ds = _open_localized(path, local, split, revision, cache_dir)
    if local_builder(path) is not None:
        try:
            fingerprint = "sha256:" + file_sha256(local, check_utf8=local_builder(path) == "json")
        except DatasetError as exc:
            raise DatasetError(path, exc.reason) from None
    else:
        fingerprint = f"hf:{revision or 'main'}:{ds._fingerprint}"
    return SourceInfo(
        n_rows=len(ds), fingerprint=fingerprint, columns=tuple(ds.column_names), nbytes=ds.data.nbytes
    )


#: Row data hashed through one memory map before it is closed: the pages a map has read stay in the
#: process's resident memory while it is open, so planning a file larger than memory keeps it flat.
HASH_REMAP_BYTES = 256 << 20


def _hash_rows(table: Any) -> str:
    """sha256 of ``table`` as one Arrow IPC stream of a single chunk, schema included (a new key in any
    row changes what the template sees)."""
    import pyarrow as pa

    table = table.combine_chunks()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return hashlib.sha256(sink.getvalue()).hexdigest()


class RowsFingerprinter:
    """Hash of the data of rows ``[start, end)`` (or of ``subset``) of one split, so an edit elsewhere in
    the file leaves a slice's checkpoint valid.

    Planning reads every selected row once. Through ``datasets`` the whole Arrow cache would stay mapped
    (and resident) until planning ends; with the split's own cache files (:func:`arrow_cache_files`) the
    rows are read through a map that is closed every :data:`HASH_REMAP_BYTES`, with the same bytes hashed
    (the files' schema is checked against the dataset's once)."""

    def __init__(
        self, path: str, split: str, revision: str | None, cache_dir: str, arrow_files: list[str] | None
    ) -> None:
        self._source = (path, split, revision, cache_dir)
        self._files = tuple(arrow_files) if arrow_files else None
        self._table: Any = None
        self._read = 0

    def __call__(self, start: int, end: int, subset: list[int] | None) -> str:
        table = self._mapped()
        if table is None:
            ds = open_dataset(*self._source).with_format("arrow")
            return _hash_rows(ds[start:end] if subset is None else ds[subset])
        rows = table.slice(start, end - start) if subset is None else table.take(subset)
        digest = _hash_rows(rows)
        self._read += rows.nbytes
        if self._read >= HASH_REMAP_BYTES:
            self.close()
        return digest

    def _mapped(self) -> Any:
        if self._files is None or not all(os.path.isfile(f) for f in self._files):
            return None
        if self._table is None:
            table = _map_arrow_files(self._files)  # its own map (not the cached one), closed by close()
            expected = open_dataset(*self._source).data.schema
            if not table.schema.equals(expected, check_metadata=True):
                self._files = None  # rows as datasets gives them, or the hash would change
                return None
            self._table = table
        return self._table

    def close(self) -> None:
        self._table = None
        self._read = 0


def arrow_cache_files(path: str, split: str, revision: str | None, cache_dir: str) -> list[str] | None:
    """The Arrow files that hold exactly this split's rows in order, for workers to memory-map without
    importing ``datasets``; ``None`` when the rows are a view (a sliced split, an index mapping)."""
    import pyarrow as pa
    from datasets.features.features import require_decoding

    ds = open_dataset(path, split, revision, cache_dir)
    if "[" in split or ds._indices is not None or not ds.cache_files:
        return None
    if any(require_decoding(f) for f in ds.features.values()):  # e.g. a Json column of mixed types
        return None
    files = [f["filename"] for f in ds.cache_files]
    try:
        n = _arrow_table(tuple(files)).num_rows  # the table workers will read, opened the same way
    except (OSError, pa.ArrowInvalid):
        return None
    return files if n == len(ds) and ds.data.num_rows == n else None


@lru_cache(maxsize=8)
def _arrow_table(files: tuple[str, ...]) -> Any:
    return _map_arrow_files(files)


def _map_arrow_files(files: tuple[str, ...]) -> Any:
    """The rows of Arrow stream files as one table, memory-mapped (nothing is read until used)."""
    import pyarrow as pa

    tables = [pa.ipc.open_stream(pa.memory_map(f)).read_all() for f in files]
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables)


def release_mapped_data(datasets_too: bool = False) -> None:
    """Close the memory maps this process holds (Arrow tables; with ``datasets_too`` the opened
    datasets as well): pages read through a map stay in the process's resident memory while it is
    open, so a worker that kept it open would grow with every slice it read."""
    _arrow_table.cache_clear()
    if datasets_too:
        _open_dataset.cache_clear()


class Part(Protocol):
    """A piece of a file that holds consecutive rows: a JSON Lines batch, a Parquet row group."""

    # (read only, as a frozen model's fields are)
    @property
    def first_row(self) -> int: ...

    @property
    def rows(self) -> int: ...


P = TypeVar("P", bound=Part)


def runs_in_parts(rows: list[int], parts: Sequence[P]) -> Iterator[tuple[P | None, list[int]]]:
    """``rows`` (in the order given) as runs that each lie in one part, with the run's rows counted from
    the part's start; a row in no part comes alone with ``None`` (the caller says so)."""
    i = 0
    while i < len(rows):
        part = next((p for p in parts if p.first_row <= rows[i] < p.first_row + p.rows), None)
        if part is None:
            yield None, [rows[i]]
            return
        j = i
        while j < len(rows) and part.first_row <= rows[j] < part.first_row + part.rows:
            j += 1
        yield part, [r - part.first_row for r in rows[i:j]]
        i = j


def table_rows(table: Any, rows: list[int]) -> list[dict[str, Any]]:
    """Rows of an Arrow table as Python objects, in the order given: consecutive rows as one slice, any
    other order by one take, its index built from a numpy buffer (from a list, pyarrow imports pandas
    to ask whether it is one of its objects: 0.2 s of a small run's planning)."""
    import numpy as np
    import pyarrow as pa

    if rows and rows[-1] - rows[0] + 1 == len(rows):
        return table.slice(rows[0], len(rows)).to_pylist()
    index = pa.Array.from_buffers(
        pa.int64(), len(rows), [None, pa.py_buffer(np.asarray(rows, dtype=np.int64))]
    )
    return table.take(index).to_pylist()


def read_rows(
    path: str,
    split: str,
    revision: str | None,
    cache_dir: str,
    rows: list[int],
    arrow_files: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Rows by index, in the order given (contiguous ranges read as one slice of the Arrow table).

    With ``arrow_files`` (from :func:`arrow_cache_files`) the rows come straight from the memory-mapped
    cache, as the same Python objects ``datasets`` builds from it (its python format is ``to_pylist``)."""
    if arrow_files and all(os.path.isfile(f) for f in arrow_files):
        return table_rows(_arrow_table(tuple(arrow_files)), rows)
    ds = open_dataset(path, split, revision, cache_dir)
    if rows and rows[-1] - rows[0] + 1 == len(rows):
        sub = ds.select(range(rows[0], rows[-1] + 1))
    else:
        sub = ds.select(rows)
    return list(sub)
