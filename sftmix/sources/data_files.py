"""A hub dataset's (or a directory's) data files as ``datasets``' builders resolve them, for the readers that
read them by batch or by row group, and the reference's options for its JSON builder."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

from sftmix.runtime import settings
from sftmix.runtime.storage import is_remote
from sftmix.sources import hub_files
from sftmix.sources.copies import DecompressedCopies, copies_of, copy_size
from sftmix.sources.downloads import Downloads, downloads_of
from sftmix.sources.growing import GrowingFile
from sftmix.sources.hub import offline
from sftmix.sources.paths import compression_of, hub_name_problem, local_builder
from sftmix.sources.pinned import (
    at_commit,
    local_copy,
    object_info,
    size_of,
)

logger = logging.getLogger(__name__)


#: ``datasets``' JsonConfig.chunksize: the batch its JSON builder reads before finishing the line (what
#: ``sftmix.sources.jsonl`` reads as it does).
BATCH_BYTES = 10 << 20


def quiet_datasets() -> None:
    import datasets

    datasets.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    # Every load_dataset("json", ...) of a local file would send a HEAD request to S3 (a download count):
    # it names nothing of the user's, but costs up to its 3 s timeout, plus the name lookup, on a
    # machine whose outbound traffic is dropped rather than refused.
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False


MIXED_TYPES = re.compile(r"Column\((?P<field>[^)]*)\) changed from (?P<a>\w+) to (?P<b>\w+)")


@lru_cache(maxsize=1)
def reference_json_options() -> dict[str, Any]:
    """JSON-loader options that make datasets 5 build the rows datasets 4 builds (the reference pins
    datasets 4.5): objects whose keys differ between rows become one struct with every key, missing ones
    null, as a chat template then sees them (tool schemas, tool-call arguments), rather than datasets 5's
    JSON-typed cells that keep each row's own keys; and no agent-trace reshaping of messages/tools."""
    from dataclasses import fields

    from datasets.packaged_modules.json.json import JsonConfig

    known = {f.name for f in fields(JsonConfig)}
    wanted = {"on_mixed_types": None, "parse_agent_traces": False}
    return {k: v for k, v in wanted.items() if k in known}


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


def dataset_builder(name: str, revision: str | None, cache_dir: str) -> Any:
    """``datasets``' builder for hub name (or local directory) ``name``: what it reads, and how. A hub
    name's is resolved once a plan (each reader asks for it; each resolution asks the hub several
    things), a local directory's each time (its files may change; it asks no one)."""
    if os.path.isdir(name):
        return _resolved_builder(name, revision, cache_dir)
    return _hub_builder(name, revision, cache_dir)


def _resolved_builder(name: str, revision: str | None, cache_dir: str) -> Any:
    quiet_datasets()
    import datasets

    return datasets.load_dataset_builder(name, revision=revision, cache_dir=cache_dir)


_hub_builder = lru_cache(maxsize=16)(_resolved_builder)


def forget_builders() -> None:
    """Resolve hub names afresh: a plan reads a dataset's commit of now, not an earlier plan's."""
    _hub_builder.cache_clear()


def download_manager(builder: Any, cache_dir: str) -> Any:
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
        builder = dataset_builder(name, revision, cache_dir)
        config = builder.config
        files = (config.data_files or {}).get(split.strip())
        if builder.name != "parquet" or not files or config.columns is not None or config.filters is not None:
            return None
        features = builder.info.features
        if _decode(features):
            return None
        manager = download_manager(builder, cache_dir)
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


def json_data_files(name: str, split: str, revision: str | None, cache_dir: str) -> JsonFiles | None:
    """Where ``datasets.load_dataset(name, split=split)`` would read JSON files with its JSON builder,
    taking the features its card declares, or else those of the first batch of the first file (a hub
    dataset of JSON Lines files, or a local directory of them): the files, downloaded as ``datasets`` downloads them, for the plan to read
    by batch on all cores (:func:`sftmix.sources.jsonl.scan_files`) instead of ``datasets`` converting them whole
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
        builder = dataset_builder(name, revision, cache_dir)
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
        manager = download_manager(builder, cache_dir)
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


def builder_options(name: str, revision: str | None, cache_dir: str) -> dict[str, Any]:
    """The options :func:`reference_json_options` gives a hub dataset (or local directory) that
    ``datasets`` reads with its JSON builder, as it gives a local JSON file; none for any other."""
    try:
        return reference_json_options() if dataset_builder(name, revision, cache_dir).name == "json" else {}
    except Exception:  # the load meets it again, and says what it is
        return {}
