"""The plan's count of a Parquet dataset from its footers (every row count at once) and the hashing of its row
groups on many threads, each handed on as it is hashed so that slices begin while the rest is read."""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

from sftmix.errors import DatasetError
from sftmix.runtime.parallel import available_cpus
from sftmix.runtime.storage import is_remote
from sftmix.sources import pinned
from sftmix.sources.downloads import Downloads, closed_on_error
from sftmix.sources.features import decodes, features_schema, schema_text
from sftmix.sources.parquet.decoding import opened_group, streamed_bytes
from sftmix.sources.parquet.ranges import (
    Ranges,
    chunk_bounds,
    column_bounds,
    hash_group,
    read_footer,
    record_sha256,
    remember_blocks,
)
from sftmix.sources.parquet.row_groups import MAGIC, GroupListener, ParquetFooter, ParquetLayout, RowGroup

logger = logging.getLogger(__name__)


T = TypeVar("T")


_SCANS: OrderedDict[tuple, ParquetLayout | None] = OrderedDict()


_SCANS_LOCK = threading.Lock()


_KEPT_SCANS = 16


def scan(path: str, threads: int | None = None) -> ParquetLayout | None:
    """One file's row groups and features: :func:`scan_files` of ``[path]``."""
    return scan_files([path], None, threads)


def scan_files(paths: list[str], declared: Any = None, threads: int | None = None) -> ParquetLayout | None:
    """The row groups of a dataset's files, in order, hashed, and its features: :func:`counted`, then
    :func:`hashed`. ``None`` when ``datasets`` is to read it."""
    layout = counted(paths, declared)
    return None if layout is None else hashed(layout, None, threads)


def counted(paths: list[str], declared: Any = None) -> ParquetLayout | None:
    """A dataset's row groups from its files' footers alone (every count, no row group read: their
    ``sha256`` is empty until :func:`hashed`), and its features: ``declared`` (an Arrow schema: the
    features a hub dataset's card declares) or the first file's. ``None`` when ``datasets`` is to read
    it: no rows, features that decode, files of different schemas, row groups recorded out of place."""
    stamps, footers, bounds, schemas, first_row = [], [], [], [], 0
    for path, (version, (offset, footer, meta)) in zip(paths, _footers(paths), strict=True):
        stamps.append((path, *version))
        footers.append(
            ParquetFooter(
                path=path, size=version[0], offset=offset, sha256=hashlib.sha256(footer).hexdigest()
            )
        )
        schemas.append(meta.schema.to_arrow_schema())
        for i in range(meta.num_row_groups):
            record = meta.row_group(i)
            start, end = chunk_bounds(record)
            if not len(MAGIC) <= start < end <= offset:
                return None  # recorded out of place: datasets reads (or refuses) it
            bounds.append((path, i, start, end, first_row, record.num_rows, record.total_byte_size, record))
            first_row += record.num_rows
    file_schema = schemas[0]
    if not first_row or any(not s.equals(file_schema, check_metadata=False) for s in schemas[1:]):
        return None  # no rows (datasets says so), or files datasets casts one to the other's features
    if declared is None and decodes(file_schema):
        return None  # features that decode: datasets' own to read
    schema = features_schema(file_schema) if declared is None else declared
    return ParquetLayout(
        footers=tuple(footers),
        file_schema_sha256=hashlib.sha256(file_schema.serialize().to_pybytes()).hexdigest(),
        schema_b64=schema_text(schema),
        row_groups=tuple(
            RowGroup(
                path=p,
                index=i,
                offset=o,
                end=e,
                first_row=r,
                rows=n,
                nbytes=max(0, b),
                sha256="",
                meta_sha256=record_sha256(record, o),
                chunks=tuple(sorted(column_bounds(record))),
            )
            for p, i, o, e, r, n, b, record in bounds
        ),
        stamps=tuple(stamps),
    )


def _footers(paths: list[str]) -> Iterator[tuple[tuple[Any, ...], tuple[int, bytes, Any]]]:
    """Each file's version and footer (:func:`read_footer`), in order."""

    def read(path: str) -> tuple[tuple[Any, ...], tuple[int, bytes, Any]]:
        try:
            version = pinned.version(path)
            return version, read_footer(path, version[0])
        except OSError as exc:
            raise DatasetError(path, f"cannot be read: {type(exc).__name__}: {exc}") from None

    return _each(read, paths)


def _each(fn: Callable[[str], T], paths: list[str]) -> Iterator[T]:
    """``fn`` of each path, in order; where some are remote, on as many threads as a network carries
    (each asks the store, tens of ms a request: a hub dataset has hundreds of files)."""
    if not any(is_remote(p) for p in paths):
        yield from map(fn, paths)
        return
    with ThreadPoolExecutor(max_workers=min(len(paths), pinned.READERS)) as pool:
        try:
            yield from pool.map(fn, paths)
        finally:
            pool.shutdown(cancel_futures=True)


def hashed(
    layout: ParquetLayout,
    on_group: GroupListener | None = None,
    threads: int | None = None,
    known: Sequence[RowGroup] = (),
) -> ParquetLayout | None:
    """``layout`` (from :func:`counted`) with every row group hashed on ``threads`` threads (default one
    per CPU). ``on_group`` is told each row group, in order, as soon as it and those before it are
    hashed: the plan cuts and starts slices while the rest is read. The first row group is decoded from
    its bytes before it is told (``None``: pyarrow reads it outside its recorded bytes; ``datasets`` is
    to read the dataset). Files hashed before (the same size, mtime and inode) are not read again, nor
    row groups ``known`` (hashed ahead: a sample's)."""
    key = (layout.stamps, layout.schema_b64)
    with _SCANS_LOCK:
        found = key in _SCANS
        done = _SCANS.get(key)
    if found:
        if done is not None and on_group is not None:
            for group in done.row_groups:
                on_group(group)
        return done
    done = _hashed(layout, on_group, threads or available_cpus(), {(g.path, g.index): g for g in known})
    with _SCANS_LOCK:
        _SCANS[key] = done
        while len(_SCANS) > _KEPT_SCANS:
            _SCANS.popitem(last=False)
    return done


def _hashed(
    layout: ParquetLayout,
    on_group: GroupListener | None,
    threads: int,
    known: dict[tuple[str, int], RowGroup],
) -> ParquetLayout | None:
    """``layout.stamps``: each file's path and version before the read; a file with another version after
    it (rewritten, grown, truncated, replaced by a rename) was read as no one version of it. A remote
    object's row groups are read on as many threads as a network carries, whatever the cores."""
    groups: list[RowGroup] = []
    todo = layout.row_groups
    if any(is_remote(f.path) for f in layout.footers):
        threads = max(threads, pinned.READERS)
    with ThreadPoolExecutor(max_workers=max(1, min(len(todo), threads))) as pool:
        try:
            with closed_on_error(layout.downloads):  # (and threads waiting for a file stop waiting)
                for group in pool.map(
                    lambda g: known.get((g.path, g.index)) or with_sha256(g, layout.downloads), todo
                ):
                    groups.append(group)
                    if len(groups) == 1 and not _decodes_alone(layout, groups[0]):
                        if layout.downloads is not None:
                            layout.downloads.close()  # datasets reads it, and downloads it itself
                        return None
                    if on_group is not None:
                        on_group(groups[-1])
        finally:
            pool.shutdown(cancel_futures=True)  # (a read that ends early reads no further)
    paths = [path for path, *_ in layout.stamps]
    for (path, *stamp), now in zip(layout.stamps, _each(pinned.version, paths), strict=True):
        if now != tuple(stamp):
            raise DatasetError(
                path, "the file changed while it was planned: plan it when it no longer changes"
            )
    return replace(layout, row_groups=tuple(groups))


def with_sha256(group: RowGroup, downloads: Downloads | None = None) -> RowGroup:
    """The row group with the sha256 of its bytes (one hashed ahead of the rest: a sample's), once its
    file has landed (:attr:`ParquetLayout.downloads`)."""
    if downloads is not None:
        downloads.wait(group.path)
    chunks = group.chunks if group.nbytes > streamed_bytes() else ()
    with Ranges(group.path) as ranges:
        whole, parts, blocks = hash_group(ranges, group, chunks)
    hashed = group.model_copy(update={"sha256": whole, "chunk_sha256": parts})
    if chunks:
        remember_blocks(hashed, blocks)
    return hashed


def _decodes_alone(layout: ParquetLayout, first: RowGroup) -> bool:
    """Whether the row group decodes from its recorded bytes alone (it stays open: the plan's sample)."""
    try:
        opened_group(layout.source([first]), first).rows([0])
    except DatasetError:
        raise
    except Exception as exc:
        logger.debug("%s: read through datasets (%s: %s)", first.path, type(exc).__name__, exc)
        return False
    return True
