"""A hub dataset's files downloaded in the background while the plan reads them.

``datasets`` downloads every file of a split before anything reads one (files over 20 MB one at a
time): at ~100 GB that is minutes before the first slice, while the cores wait. Here the plan reads the
files' footers by range from the hub (every count at once), the files download in order into the hub
cache ``datasets`` uses, a few at a time, and each file's row groups are hashed (or its JSON Lines
batches scanned), and its slices start, as soon as it has landed
(:attr:`sftmix.sources.parquet.row_groups.ParquetLayout.downloads`, :class:`sftmix.sources.data_files.JsonFiles`). While files are
still to come, a line every few seconds says how far the downloads are.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future
from pathlib import Path
from typing import Protocol

from sftmix.errors import DatasetError
from sftmix.runtime.read_progress import EveryFewSeconds, duration_text, rate_text

logger = logging.getLogger(__name__)

#: Files downloaded at once: each download is already parallel within the file (the hub's transfer
#: client); a few at once keep the link busy between files.
AT_ONCE = 4
_POLL = 0.2  # seconds between a waiter's looks at whether the downloads were closed
#: Seconds waited before each new try of a download that failed in a way that goes by (the hub too busy,
#: the link dropped): a run of hours does not end on one busy minute of the hub's.
RETRY_SECONDS = (2.0, 8.0, 30.0)


class Downloads(EveryFewSeconds):
    """Files ``urls`` of dataset ``name`` downloaded in order by ``download`` (url -> local path),
    ``at_once`` at a time, on daemon threads: a stopped run does not wait for a download (the hub
    cache's own partial file is resumed by the next download). While files are still to come, a line
    every few seconds says how far: a large dataset's downloads take minutes, and the plan shows
    nothing else meanwhile where it waits for them."""

    def __init__(
        self, name: str, urls: list[str], download: Callable[[str], str], at_once: int = AT_ONCE
    ) -> None:
        super().__init__()
        self.name = name
        self._download = download
        self._landed: dict[str, Future[str]] = {url: Future() for url in urls}
        self._queue = deque(urls)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._folders = {folder for url in urls if (folder := _blobs_folder(url)) is not None}
        self._settled = self._failed = self._bytes = 0  # files landed, failed, and the bytes landed
        for _ in range(min(at_once, len(urls))):
            threading.Thread(target=self._work, name="hub-download", daemon=True).start()
        self.start()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    return
                url = self._queue.popleft()
                landed = self._landed[url]
                if not landed.set_running_or_notify_cancel():
                    continue
            try:
                path = self._tried(url)
                nbytes = os.path.getsize(path)
                landed.set_result(path)
            except BaseException as exc:  # (told to whoever waits for the file)
                _forget(self)  # (a later plan tries it again)
                with self._lock:
                    self._failed += 1
                landed.set_exception(exc)
                continue
            with self._lock:
                self._settled += 1
                self._bytes += nbytes
                done = self._settled == len(self._landed)
            if done:
                _forget(self)

    def _tried(self, url: str) -> str:
        """``url`` downloaded, tried again after each of :data:`RETRY_SECONDS` where it failed in a way
        that :func:`passes` (the hub cache's client resumes the partial file); not once the downloads
        are closed."""
        for wait in (*RETRY_SECONDS, None):
            try:
                return self._download(url)
            except Exception as exc:
                if wait is None or not passes(exc) or self._closed.is_set():
                    raise
                logger.warning(
                    "%s: downloading %s failed (%s), trying again in %s",
                    self.name,
                    url,
                    _said(exc),
                    duration_text(wait),
                )
                if self._closed.wait(wait):
                    raise
        raise AssertionError("unreachable")

    def _wanted(self) -> bool:
        return bool(self._landed)

    def _say(self, elapsed: float) -> None:
        with self._lock:
            landed, failed, nbytes, total = self._settled, self._failed, self._bytes, len(self._landed)
        if landed + failed >= total or self._closed.is_set():  # (nothing more is coming)
            self.end()
            return
        arriving = _arriving(self._folders)
        rate = (nbytes + arriving) / elapsed
        left = None
        if landed and rate:
            left = max(0.0, ((total - landed) * nbytes / landed - arriving) / rate)
        logger.info(
            "%s: %d of %d files downloaded from the hub (%.2f GB, %.2f GB more arriving, %s), %s in%s",
            self.name,
            landed,
            total,
            nbytes / 1e9,
            arriving / 1e9,
            rate_text(rate),
            duration_text(elapsed),
            "" if left is None else f", about {duration_text(left)} left",
        )

    def wait(self, url: str) -> str:
        """``url``'s copy in the hub cache, once it has landed (``url`` itself, at once, for a file not
        downloaded here); a wait ends when the downloads are closed (the plan stopped), not when a
        download running then does."""
        landed = self._landed.get(url)
        if landed is None:
            return url
        while True:
            try:
                return landed.result(timeout=_POLL)
            except TimeoutError:
                if self._closed.is_set():
                    raise DatasetError(self.name, f"{url}: its download was stopped") from None
            except CancelledError:
                raise DatasetError(self.name, f"{url}: its download was stopped") from None
            except Exception as exc:
                raise DatasetError(self.name, f"cannot download {url}: {_said(exc)}") from None

    def close(self) -> None:
        """No more downloads start, and no one waits for those running (they finish on their threads)."""
        with self._lock:
            self._closed.set()
            self.end()
            self._queue.clear()
            for landed in self._landed.values():
                landed.cancel()
        _forget(self)


def passes(exc: BaseException) -> bool:
    """Whether download failure ``exc`` (or what caused it) goes by, so that trying again may succeed:
    the hub too busy or failing for a while (HTTP 408, 429, 5xx), or the link dropped or timed out; not a
    file that is not there or not ours to read (another 4xx)."""
    import httpx
    import requests

    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        status = getattr(getattr(cause, "response", None), "status_code", None)
        if isinstance(status, int):
            return status in (408, 429) or status >= 500
        transient = (ConnectionError, TimeoutError, httpx.TransportError)
        if isinstance(cause, transient + (requests.ConnectionError, requests.Timeout)):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def _said(exc: BaseException) -> str:
    """``exc`` in one line: a hub error's first line (the rest is a link and the answer's body)."""
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


def _blobs_folder(url: str) -> Path | None:
    """Where the hub cache keeps hub file ``url``'s bytes (``None``: not a hub file at a commit): the
    hub's client writes a download there as ``<blob>.incomplete`` until it lands."""
    from huggingface_hub.constants import HF_HUB_CACHE

    from sftmix.sources.pinned import hub_repo

    found = hub_repo(url)
    if found is None:
        return None
    kind, repo = found
    return Path(HF_HUB_CACHE) / f"{kind}--{repo.replace('/', '--')}" / "blobs"


def _arriving(folders: set[Path]) -> int:
    """Bytes of downloads not landed yet in ``folders`` (a file that lands meanwhile counts 0)."""
    total = 0
    for folder in folders:
        with contextlib.suppress(OSError):
            for entry in os.scandir(folder):
                if entry.name.endswith(".incomplete"):
                    with contextlib.suppress(OSError):
                        total += entry.stat().st_size
    return total


_RUNNING: dict[tuple[str, tuple[str, ...]], Downloads] = {}
_RUNNING_LOCK = threading.Lock()


def downloads_of(name: str, urls: list[str], download: Callable[[str], str]) -> Downloads:
    """The downloads of dataset ``name``'s files ``urls`` in this process: those already running (the
    plan made ahead of the plan started them, :func:`sftmix.planning.plan.prepare_plan`), else new ones. So a file
    downloads once, and one line says how far."""
    key = (name, tuple(urls))
    with _RUNNING_LOCK:
        found = _RUNNING.get(key)
        if found is None or found.closed:
            found = _RUNNING[key] = Downloads(name, urls, download)
        return found


def _forget(downloads: Downloads) -> None:
    """Downloads that are done (every file landed), closed or failed are not handed to a later plan."""
    with _RUNNING_LOCK:
        for key, running in list(_RUNNING.items()):
            if running is downloads:
                del _RUNNING[key]


class Closable(Protocol):
    def close(self) -> None: ...


@contextlib.contextmanager
def closed_on_error(fetching: Closable | None) -> Iterator[None]:
    """Within it, an error (a refusal, a stop) closes ``fetching`` (downloads, or files being
    downloaded and decompressed): no file is fetched for a plan that will not read it."""
    try:
        yield
    except BaseException:
        if fetching is not None:
            fetching.close()
        raise
