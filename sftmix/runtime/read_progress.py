"""A line every few seconds while the plan reads a dataset before any of its slices can be cut.

A dataset whose rows are counted first (an amount below 1.0, or a row count) is read whole by the plan
before its slices are cut: at our users' ~100 GB a minute or more on any machine, minutes from
``gs://``, with nothing else on the console meanwhile. Each line says how far:
``/data/chats.jsonl: 45.2 of 100.0 GB read (2.1 GB/s), 20 s in, about 26 s left``. So does a compressed
file's decompression to a copy, and a dataset the ``datasets`` library loads says it still does.
"""

from __future__ import annotations

import logging
import threading
import time
from types import TracebackType
from typing import Any, Self

from sftmix.runtime.settings import progress_seconds

logger = logging.getLogger(__name__)


def duration_text(seconds: float) -> str:
    """Seconds as a person reads them: ``45 s``, ``3 min 07 s``, ``2 h 05 min``."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class EveryFewSeconds:
    """Within it (or from :meth:`start` to :meth:`end`), :meth:`_say` every
    :func:`sftmix.runtime.settings.progress_seconds` on a thread of its own (where :meth:`_wanted`)."""

    def __init__(self) -> None:
        self._ended = threading.Event()
        self._started = time.monotonic()

    def _wanted(self) -> bool:
        return True

    def _say(self, elapsed: float) -> None:
        raise NotImplementedError

    def start(self) -> None:
        if self._wanted():
            threading.Thread(target=self._report, name=type(self).__name__, daemon=True).start()

    def end(self) -> None:
        self._ended.set()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.end()

    def _report(self) -> None:
        while not self._ended.wait(progress_seconds()):
            self._say(time.monotonic() - self._started)


class ReadProgress(EveryFewSeconds):
    """Within it, a line every :func:`sftmix.runtime.settings.progress_seconds` saying how many of dataset
    ``name``'s ``total`` bytes were read (:meth:`read`), or ``doing`` otherwise (``decompressed``); none
    where ``total`` is unknown (0) or the read ends first."""

    def __init__(self, name: str, total: int, doing: str = "read") -> None:
        super().__init__()
        self.name, self.total, self.doing = name, total, doing
        self._done = 0
        self._lock = threading.Lock()

    def read(self, nbytes: int) -> None:
        with self._lock:
            self._done += nbytes

    @property
    def done(self) -> int:
        """Bytes read so far."""
        with self._lock:
            return self._done

    def batch_read(self, batch: Any, schema_b64: str) -> None:
        """:meth:`read` as a JSON Lines scan's listener (``sftmix.sources.jsonl.batches.BatchListener``)."""
        self.read(batch.end - batch.offset)

    def _wanted(self) -> bool:
        return self.total > 0

    def _say(self, elapsed: float) -> None:
        done = self.done
        rate = done / elapsed
        left = f", about {duration_text(max(0, self.total - done) / rate)} left" if rate > 0 else ""
        logger.info(
            "%s: %.1f of %.1f GB %s (%s), %s in%s",
            self.name,
            done / 1e9,
            self.total / 1e9,
            self.doing,
            rate_text(rate),
            duration_text(elapsed),
            left,
        )


def rate_text(rate: float) -> str:
    """Bytes a second as a person reads them: GB/s from 1 GB/s, MB/s below (a link's speed)."""
    return f"{rate / 1e9:.1f} GB/s" if rate >= 1e9 else f"{rate / 1e6:.0f} MB/s"


class StillLoading(EveryFewSeconds):
    """Within it, a line every :func:`sftmix.runtime.settings.progress_seconds` saying that dataset ``name`` is
    still being loaded by ``datasets``, which converts it on one core and says nothing meanwhile (at
    ~100 GB, many minutes); none where the load ends first (a cached one)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def _say(self, elapsed: float) -> None:
        logger.info(
            "%s: still being loaded by the datasets library (on one core), %s in",
            self.name,
            duration_text(elapsed),
        )
