"""A hub dataset's files downloaded in the background while the plan reads them.

``datasets`` downloads every file of a split before anything reads one (files over 20 MB one at a
time): at ~100 GB that is minutes before the first slice, while the cores wait. Here the plan reads the
files' footers by range from the hub (every count at once), the files download in order into the hub
cache ``datasets`` uses, a few at a time, and each file's row groups are hashed, and its slices start,
as soon as it has landed (:attr:`sftmix.parquet.ParquetLayout.downloads`).
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future

from .errors import DatasetError

#: Files downloaded at once: each download is already parallel within the file (the hub's transfer
#: client); a few at once keep the link busy between files.
AT_ONCE = 4
_POLL = 0.2  # seconds between a waiter's looks at whether the downloads were closed


class Downloads:
    """Files ``urls`` of dataset ``name`` downloaded in order by ``download`` (url -> local path),
    ``at_once`` at a time, on daemon threads: a stopped run does not wait for a download (the hub
    cache's own partial file is resumed by the next download)."""

    def __init__(
        self, name: str, urls: list[str], download: Callable[[str], str], at_once: int = AT_ONCE
    ) -> None:
        self.name = name
        self._download = download
        self._landed: dict[str, Future[str]] = {url: Future() for url in urls}
        self._queue = deque(urls)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        for _ in range(min(at_once, len(urls))):
            threading.Thread(target=self._work, name="hub-download", daemon=True).start()

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
                landed.set_result(self._download(url))
            except BaseException as exc:  # (told to whoever waits for the file)
                landed.set_exception(exc)

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
                raise DatasetError(self.name, f"cannot download {url}: {type(exc).__name__}: {exc}") from None

    def close(self) -> None:
        """No more downloads start, and no one waits for those running (they finish on their threads)."""
        with self._lock:
            self._closed.set()
            self._queue.clear()
            for landed in self._landed.values():
                landed.cancel()


@contextlib.contextmanager
def closed_on_error(downloads: Downloads | None) -> Iterator[None]:
    """Within it, an error (a refusal, a stop) closes ``downloads``: no file downloads for a plan that
    will not read it."""
    try:
        yield
    except BaseException:
        if downloads is not None:
            downloads.close()
        raise
