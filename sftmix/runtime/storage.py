"""Files land atomically: written under a unique temporary name, then renamed into place."""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import logging
import os
import shutil
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, Protocol, TypeGuard

from sftmix.errors import StorageError
from sftmix.runtime.stopping import removed_at_exit

logger = logging.getLogger(__name__)

TMP_MARK = ".tmp-"

#: OS errors a user fixes (free space, permissions), reported as one line instead of a traceback.
RESOURCE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}


@contextlib.contextmanager
def storage_errors(what: str) -> Iterator[None]:
    """Turn a full disk or an unwritable location into a :class:`StorageError` naming ``what``."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in RESOURCE_ERRNOS:
            raise
        where = f" ({exc.filename})" if exc.filename else ""
        raise StorageError(f"{what}: {exc.strerror}{where}") from None


def reserve_file(path: str | os.PathLike[str], nbytes: int) -> None:
    """Create ``path`` with ``nbytes`` allocated up front, so a full disk is an error here and not a
    SIGBUS later while writing through a memory map."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if nbytes:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise OSError(exc.errno, exc.strerror, str(path)) from None
                os.ftruncate(fd, nbytes)  # a file system without fallocate
    finally:
        os.close(fd)


@functools.cache
def boot_id() -> str:
    """This boot of this machine (Linux; '' elsewhere): a PID names a process only within one boot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def writer_tag() -> str:
    """This machine (host name and boot, hashed) and process, for temp names: a temp file whose
    writer is provably gone may be removed (see ownership.temp_abandoned)."""
    machine = hashlib.sha256(f"{socket.gethostname()}/{boot_id()}".encode()).hexdigest()[:10]
    return f"{machine}-{os.getpid()}"


def temp_name(path: Path) -> Path:
    return path.with_name(f"{path.name}{TMP_MARK}{writer_tag()}-{uuid.uuid4().hex[:12]}")


def is_temp(name: str) -> bool:
    return TMP_MARK in name


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """Open a temp file for writing; on success fsync and rename it to ``path``."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(final)
    try:
        with removed_at_exit(tmp):
            with open(tmp, "wb") as fh:
                yield fh
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    with atomic_open(path) as fh:
        fh.write(data)


def write_cache_file(path: str | os.PathLike[str], data: bytes) -> None:
    """A file of a cache that can be made again, written atomically; where it cannot be written (a
    read-only home) it is left out, and made again next time."""
    try:
        atomic_write_bytes(path, data)
    except OSError as exc:
        logger.debug("cannot keep %s: %s", path, exc)


def atomic_write_with(path: str | os.PathLike[str], write: Callable[[BinaryIO], None]) -> None:
    with atomic_open(path) as fh:
        write(fh)


_NPY_HEADERS = threading.Lock()


def file_version(path: str | os.PathLike[str]) -> tuple[int, int, int]:
    """A file's size, modification time and inode: what tells one version of it from another without
    reading it (a rewrite, an append, a cut or a rename over it changes one of them)."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino


def open_npy(path: str | os.PathLike[str]) -> Any:
    """``np.load(path, mmap_mode="r")``, one thread at a time: numpy parses the header with
    ``ast.literal_eval``, whose AST builder in CPython 3.11 keeps one recursion counter for every
    thread (cf. CPython gh-106905). Threads of ``assemble`` failed a CI golden run with "SystemError:
    AST constructor recursion depth mismatch (before=36, after=31)"."""
    import numpy as np

    with _NPY_HEADERS:
        return np.load(path, mmap_mode="r")


def npy_header(head: bytes) -> tuple[int, int] | None:
    """Where an ``.npy`` file's header lies, from its first 12 bytes: (its first byte, its length), the
    data following it; ``None`` where they are not an ``.npy`` file's (versions 1 to 3)."""
    if len(head) < 12 or head[:6] != b"\x93NUMPY" or head[6] not in (1, 2, 3):
        return None
    start = 10 if head[6] == 1 else 12
    return start, int.from_bytes(head[8:start], "little")


def read_npy_of(path: str | os.PathLike[str], dtype: Any) -> Any:
    """A small one-dimensional ``.npy`` file of ``dtype``, read into memory in one read: its header is
    matched against the one numpy writes for such an array, without ``np.load``'s parse of it (~0.2 ms a
    file, on one core under :func:`open_npy`'s lock: the tail reads the records of every slice). A
    header of any other form is read by ``np.load``."""
    import numpy as np

    data = Path(path).read_bytes()
    descr = np.lib.format.dtype_to_descr(np.dtype(dtype))
    prefix = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': ("
    span = npy_header(data[:12])
    if span is not None:
        start, size = span
        header = data[start : start + size].decode("latin1")
        if header.startswith(prefix):
            count, _, rest = header[len(prefix) :].partition(",), }")
            whole = count.isdigit() and len(data) == start + size + int(count) * np.dtype(dtype).itemsize
            if whole and not rest.strip():
                return np.frombuffer(data, dtype=dtype, count=int(count), offset=start + size)
    return np.asarray(open_npy(path), dtype=dtype)


def pread_into(fd: int, view: memoryview, position: int) -> int:
    """Fill ``view`` from ``fd`` at ``position`` (``pread`` may read less than asked); the bytes left
    unfilled where the file ended (0: all read)."""
    while view:
        got = os.preadv(fd, [view], position)
        if not got:
            break
        view, position = view[got:], position + got
    return len(view)


def pwrite_all(fd: int, view: memoryview, position: int) -> None:
    """Write all of ``view`` into ``fd`` at ``position`` (``pwrite`` may write less than asked)."""
    while view:
        written = os.pwrite(fd, view, position)
        view, position = view[written:], position + written


class ReadsBytes(Protocol):
    """A binary stream, as far as :func:`sha256_stream` reads it: a file, a gzip stream, an fsspec file."""

    def read(self, size: int = -1, /) -> bytes: ...


def sha256_stream(fh: ReadsBytes, visit: Callable[[bytes], None] | None = None) -> str:
    """sha256 of a binary stream read in 4 MiB blocks; ``visit`` sees each block too."""
    h = hashlib.sha256()
    for block in iter(lambda: fh.read(1 << 22), b""):
        h.update(block)
        if visit is not None:
            visit(block)
    return h.hexdigest()


def sha256_file(path: str | os.PathLike[str]) -> str:
    with open(path, "rb") as fh:
        return sha256_stream(fh)


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Make a file's bytes (a directory's: its entries) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """A rename made durable where the file system allows it (some refuse to open a directory)."""
    with contextlib.suppress(OSError):
        fsync_path(path)


def remove_tree(path: str | os.PathLike[str]) -> None:
    shutil.rmtree(path, ignore_errors=True)


# ---- object stores (gs:// and any other fsspec URL) -------------------------------------------------
#
# Objects land whole or not at all, so a single object needs no temp name; a group of objects (a
# slice, an output) is made visible by writing its manifest object last.


def is_remote(path: str | os.PathLike[str] | None) -> TypeGuard[str]:
    return path is not None and "://" in str(path) and not str(path).startswith("file://")


def remote_fs(url: str):  # -> fsspec.AbstractFileSystem
    """The fsspec file system of ``url``; credentials and options come from fsspec's own settings
    (e.g. ``FSSPEC_GS_TOKEN=anon``, ``STORAGE_EMULATOR_HOST``) or the environment's default login."""
    import fsspec

    fs, _ = fsspec.core.url_to_fs(url)
    return fs


def join_url(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])


def upload_file(local: str | os.PathLike[str], url: str) -> None:
    remote_fs(url).put_file(str(local), url)


def download_file(
    url: str,
    local: str | os.PathLike[str],
    *,
    generation: str | None = None,
    check: Callable[[Path], None] | None = None,
) -> None:
    """Fetch an object to a local path atomically (temp name, fsync, rename). ``generation`` pins the
    object's version on a store that keeps versions (GCS); ``check`` may refuse the fetched temp file
    before it lands."""
    final = Path(local)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(final)
    try:
        with removed_at_exit(tmp):
            pinned = {"generation": generation} if generation else {}
            remote_fs(url).get_file(url, str(tmp), **pinned)
            if check is not None:
                check(tmp)
            fsync_path(tmp)
            os.replace(tmp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def read_remote_bytes(url: str) -> bytes | None:
    """An object's bytes, or ``None`` when it does not exist."""
    try:
        return remote_fs(url).cat_file(url)
    except FileNotFoundError:
        return None


def write_remote_bytes(url: str, data: bytes) -> None:
    remote_fs(url).pipe_file(url, data)
