"""A data file's digest, taken once per file version (the fingerprint of a file read whole), its UTF-8 checked
as it is read: the JSON loader would silently replace invalid bytes, and the reference with it."""

from __future__ import annotations

import codecs
import contextlib
import os
import threading
from concurrent.futures import Future
from functools import lru_cache

from sftmix.errors import DatasetError
from sftmix.runtime.storage import is_remote, sha256_stream
from sftmix.sources.paths import compression_of, local_builder


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
