"""An iterator run ahead of its reader on a thread of its own. Reading a file's next batch (a copy still
being written, a slow object, a row group's decode) then overlaps the reader's work on the one before,
and the reader is told each item as soon as it is made, not when the next one comes."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Generator, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class _Failed:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()


def ahead(items: Iterator[T], depth: int, name: str) -> Generator[T]:
    """``items``, read on a thread named ``name`` at most ``depth`` items ahead. Its error is raised here,
    after the items before it. Once it ends, or the reader stops (closes this generator, or lets it go),
    ``items`` is closed on that thread (a generator's ``close``): a file it reads is closed even where the
    reader stopped first."""
    ready: queue.Queue[Any] = queue.Queue(max(1, depth))
    stopped = threading.Event()

    def put(item: Any) -> bool:
        while not stopped.is_set():
            with contextlib.suppress(queue.Full):
                ready.put(item, timeout=0.1)
                return True
        return False

    def read() -> None:  # (holds no reference to the generator, so letting it go stops this)
        last: Any = _END
        try:
            for item in items:
                if not put(item):
                    return
        except BaseException as exc:
            last = _Failed(exc)
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()
        put(last)

    threading.Thread(target=read, name=name, daemon=True).start()
    try:
        while (item := ready.get()) is not _END:
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        stopped.set()
