"""Local copies of remote and compressed files: a ``gs://`` object fetched once per generation, a compressed
JSON file decompressed once into the datasets cache, read by the plan as it is written."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future
from pathlib import Path
from typing import Any

from sftmix.errors import DatasetError
from sftmix.runtime.ownership import remove_abandoned_temps
from sftmix.runtime.read_progress import ReadProgress
from sftmix.runtime.storage import atomic_open, download_file, is_remote
from sftmix.sources.downloads import Downloads
from sftmix.sources.growing import GrowingFile
from sftmix.sources.paths import READABLE, compression_of, local_builder, split_compression
from sftmix.sources.pinned import (
    Stream,
    object_info,
    object_version,
    pin,
    read_remote,
    size_of,
    unpinned,
    version,
)

logger = logging.getLogger(__name__)


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


def readable_copy(path: str, split: str, cache_dir: str, in_place: bool) -> str:
    """The file a reader reads: ``path`` itself; a ``gs://`` object it reads in place, by byte range
    (``in_place``), pinned to the generation it has now (:func:`sftmix.sources.pinned.pin`); another
    ``gs://`` data file of the 'train' split, this machine's copy of it in the cache ``datasets`` would read
    it from (fetched once per object generation, :func:`localize`)."""
    if in_place:
        return pin(path)
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
    local = Path(cache_dir, "decompressed", tag, split_compression(url.rsplit("/", 1)[-1])[0])
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

    compression = split_compression(unpinned(path)[0])[1]
    return fsspec.compression.compr[fsspec.utils.infer_compression(f"x{compression}")]


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
