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

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from pydantic import Field

from sftmix.errors import DatasetError
from sftmix.runtime.read_progress import StillLoading
from sftmix.runtime.storage import is_remote
from sftmix.sources.copies import localize
from sftmix.sources.data_files import (
    MIXED_TYPES,
    builder_options,
    dataset_builder,
    download_manager,
    quiet_datasets,
    reference_json_options,
)
from sftmix.sources.downloads import closed_on_error, downloads_of
from sftmix.sources.hashing import file_sha256
from sftmix.sources.hub import offline
from sftmix.sources.paths import hub_name_problem, local_builder, local_file_problem, relative_note
from sftmix.sources.pinned import (
    at_commit,
    local_copy,
)
from sftmix.sources.reading import RowSource
from sftmix.sources.tables import table_rows

logger = logging.getLogger(__name__)


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


class ArrowSource(RowSource):
    """A slice's rows read through ``datasets``: from the dataset's Arrow cache files when they hold exactly
    its rows (and are on this machine), else from the dataset ``datasets`` opens."""

    data_format: Literal["arrow"] = "arrow"
    arrow_files: list[str] | None = Field(
        default=None, description="The dataset's Arrow cache files, when they hold exactly its rows."
    )


@dataclass(frozen=True)
class SourceInfo:
    n_rows: int
    fingerprint: str
    columns: tuple[str, ...]
    nbytes: int


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
    quiet_datasets()
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
            options = reference_json_options() if builder == "json" else {}
            with StillLoading(name):
                ds = datasets.load_dataset(
                    builder, data_files=path, split=split, cache_dir=cache_dir, **options
                )
        else:
            if (problem := hub_name_problem(path, [cache_dir] if cache_dir else [])) is not None:
                raise DatasetError(name, problem)
            options = builder_options(path, revision, cache_dir)
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
            reason += f"; nor is there a local file or directory of that name{relative_note(path)}"
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
        builder = dataset_builder(name, revision, cache_dir)
        files = (builder.config.data_files or {}).get(split.split("[", 1)[0].strip()) or []
        missing = [str(f) for f in files if at_commit(str(f)) and local_copy(str(f)) is None]
        if not missing:
            return
        manager = download_manager(builder, cache_dir)
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
