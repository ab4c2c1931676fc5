"""Files land atomically: written under a unique temporary name, then renamed into place."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

TMP_MARK = ".tmp-"


def temp_name(path: Path) -> Path:
    return path.with_name(f"{path.name}{TMP_MARK}{uuid.uuid4().hex[:12]}")


def is_temp(name: str) -> bool:
    return TMP_MARK in name


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """Open a temp file for writing; on success fsync and rename it to ``path``."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(final)
    try:
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


def atomic_write_with(path: str | os.PathLike[str], write: Callable[[BinaryIO], None]) -> None:
    with atomic_open(path) as fh:
        write(fh)


def sha256_stream(fh: BinaryIO, visit: Callable[[bytes], None] | None = None) -> str:
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


def fsync_dir(path: str | os.PathLike[str]) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def remove_tree(path: str | os.PathLike[str]) -> None:
    shutil.rmtree(path, ignore_errors=True)
