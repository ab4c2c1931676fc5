"""Open a dataset (hub name, local .jsonl/.parquet, or such a file on gs://) and read rows from it.

Local files go through ``datasets.load_dataset`` exactly as the reference loads them, so rows reach the
template with the same fields (Arrow unifies the message keys across rows). The Arrow cache lives in the
work directory, so every worker process memory-maps the same files instead of re-parsing. A file on an
object store is fetched once per machine into that cache, named by the object's generation, and is then
a local file like any other.
"""

from __future__ import annotations

import codecs
import hashlib
import logging
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from .errors import DatasetError
from .storage import download_file, is_remote, remote_fs, sha256_stream

logger = logging.getLogger(__name__)

LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _quiet_datasets() -> None:
    import datasets

    datasets.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()


def local_builder(path: str) -> str | None:
    """The ``datasets`` builder for a local file, or ``None`` for a hub name."""
    for suffix, builder in LOCAL_SUFFIXES.items():
        if path.endswith(suffix):
            return builder
    return None


@dataclass(frozen=True)
class SourceInfo:
    n_rows: int
    fingerprint: str
    columns: tuple[str, ...]
    nbytes: int


class _Utf8Check:
    """Fed block by block: invalid UTF-8 is an error naming its line (the JSON loader would silently
    replace those bytes, and the reference with it)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.decoder = codecs.getincrementaldecoder("utf-8")("strict")
        self.offset = self.newlines = 0

    def __call__(self, block: bytes) -> None:
        try:
            self.decoder.decode(block)
        except UnicodeDecodeError as exc:
            line = self.newlines + block.count(b"\n", 0, exc.start) + 1
            raise DatasetError(
                self.path, f"line {line} is not valid UTF-8 (byte {self.offset + exc.start} of the file)"
            ) from None
        self.newlines += block.count(b"\n")
        self.offset += len(block)

    def finish(self) -> None:
        try:
            self.decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise DatasetError(self.path, "the file ends inside a UTF-8 character") from None


def file_sha256(path: str, check_utf8: bool = False) -> str:
    """sha256 of a file, checking on the same read that it is valid UTF-8 when asked (hashed once per
    process while the file's size and modification time stay the same)."""
    st = os.stat(path)
    return _file_sha256(path, check_utf8, (st.st_size, st.st_mtime_ns))


@lru_cache(maxsize=32)
def _file_sha256(path: str, check_utf8: bool, stamp: tuple[int, int]) -> str:
    check = _Utf8Check(path) if check_utf8 else None
    with open(path, "rb") as fh:
        digest = sha256_stream(fh, check)
    if check is not None:
        check.finish()
    return digest


def localize(path: str, cache_dir: str) -> str:
    """A local copy of a remote data file (fetched once, keyed by the object's generation); local
    paths and hub names come back unchanged."""
    if not is_remote(path):
        return path
    if local_builder(path) is None:
        raise DatasetError(path, "a remote dataset must be a .jsonl, .json or .parquet file")
    try:
        info = remote_fs(path).info(path)
    except FileNotFoundError:
        raise DatasetError(path, "object not found") from None
    except Exception as exc:
        raise DatasetError(path, f"cannot reach the object: {type(exc).__name__}: {exc}") from None
    if info.get("type") == "directory":
        raise DatasetError(path, "is a prefix, not an object; name the file")
    version = info.get("generation") or info.get("etag") or info.get("md5Hash") or info.get("mtime")
    tag = hashlib.sha256(f"{path}|{info.get('size')}|{version}".encode()).hexdigest()[:24]
    local = os.path.join(cache_dir, "remote-files", tag, path.rsplit("/", 1)[-1])
    if not os.path.isfile(local):
        logger.info("fetching %s (%s bytes)", path, info.get("size"))
        try:
            download_file(path, local)
        except Exception as exc:
            raise DatasetError(path, f"cannot download: {type(exc).__name__}: {exc}") from None
    return local


def open_dataset(path: str, split: str, revision: str | None, cache_dir: str) -> Any:
    """The ``datasets.Dataset`` behind a mixer entry (memory-mapped Arrow), reopened when the file changes."""
    return _open_localized(path, localize(path, cache_dir), split, revision, cache_dir)


def _open_localized(path: str, local: str, split: str, revision: str | None, cache_dir: str) -> Any:
    stamp = None
    if local_builder(local) is not None and os.path.isfile(local):
        st = os.stat(local)
        stamp = (st.st_size, st.st_mtime_ns)
    return _open_dataset(path, local, split, revision, cache_dir, stamp)


@lru_cache(maxsize=32)
def _open_dataset(
    name: str, path: str, split: str, revision: str | None, cache_dir: str, stamp: tuple | None
) -> Any:
    _quiet_datasets()
    import datasets

    builder = local_builder(path)
    try:
        if builder is not None:
            if not os.path.isfile(path):
                raise DatasetError(name, "file not found")
            if split.split("[", 1)[0].strip() != "train":
                raise DatasetError(
                    name, f"a local file has only the 'train' split, sliced or not (asked for {split!r})"
                )
            ds = datasets.load_dataset(builder, data_files=path, split=split, cache_dir=cache_dir)
        else:
            ds = datasets.load_dataset(path, split=split, revision=revision, cache_dir=cache_dir)
    except DatasetError:
        raise
    except (datasets.exceptions.DatasetGenerationError, ValueError, OSError, FileNotFoundError) as exc:
        cause = exc.__cause__ or exc
        raise DatasetError(name, f"cannot load split {split!r}: {type(cause).__name__}: {cause}") from None
    if not isinstance(ds, datasets.Dataset):
        raise DatasetError(name, f"split {split!r} did not load as a single dataset")
    return ds


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


def rows_fingerprint(
    path: str,
    split: str,
    revision: str | None,
    cache_dir: str,
    start: int,
    end: int,
    subset: list[int] | None,
) -> str:
    """Hash of the data of rows ``[start, end)`` (or of ``subset``), so an edit elsewhere in the file
    leaves this slice's checkpoint valid. The rows are hashed as one Arrow IPC stream of a single chunk,
    schema included (a new key in any row changes what the template sees)."""
    import pyarrow as pa

    ds = open_dataset(path, split, revision, cache_dir).with_format("arrow")
    table = (ds[start:end] if subset is None else ds[subset]).combine_chunks()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return hashlib.sha256(sink.getvalue()).hexdigest()


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
        table = _arrow_table(tuple(arrow_files))
        if rows and rows[-1] - rows[0] + 1 == len(rows):
            return table.slice(rows[0], len(rows)).to_pylist()
        return table.take(rows).to_pylist()
    ds = open_dataset(path, split, revision, cache_dir)
    if rows and rows[-1] - rows[0] + 1 == len(rows):
        sub = ds.select(range(rows[0], rows[-1] + 1))
    else:
        sub = ds.select(rows)
    return list(sub)
