"""A file read while it is written: a compressed file's decompressed copy is scanned, and its slices read,
as its bytes land, not once it is whole. One core decompresses ~1 GB/s, so a single 100 GB file held
every other core idle for minutes before its first slice.

The copy is written under a temp name and renamed once whole (:func:`sftmix.runtime.storage.atomic_open`), so
a reader that started before the rename follows the temp file (its open descriptor outlives the
rename), and one that opens it by name tries the final name, then the temp, then the final again
(:func:`open_landing`): whichever it opens holds the same bytes, which each slice checks by digest.
"""

from __future__ import annotations

import os
import threading

from sftmix.errors import DatasetError


class GrowingFile:
    """File ``temp``, being written, to be renamed ``final`` once whole: how many bytes it holds, and how
    its writing ended. The writer calls :meth:`grew` after each block it has flushed, then :meth:`ended`
    (after the rename, or after removing the file: :meth:`failing` first); readers follow it with :meth:`opened` and :meth:`wait`."""

    def __init__(self, temp: str, final: str) -> None:
        self.temp, self.final = temp, final
        self._changed = threading.Condition()
        self._written = 0
        self._ended = False
        self._error: BaseException | None = None

    def grew(self, nbytes: int) -> None:
        with self._changed:
            self._written += nbytes
            self._changed.notify_all()

    def failing(self, error: BaseException) -> None:
        """A writer about to remove the file says why first, so a reader that finds it gone finds the
        reason (:meth:`failed`); readers waiting for bytes wake at :meth:`ended`, once it is removed (no
        error reaches anyone while the writer's temp file is still there)."""
        with self._changed:
            if self._error is None and not self._ended:
                self._error = error

    def ended(self, error: BaseException | None = None) -> None:
        """How the writing ended (the first report counts, :meth:`failing`'s included)."""
        with self._changed:
            if self._ended:
                return
            self._ended, self._error = True, self._error or error
            self._changed.notify_all()

    def wait(self, at: int | None) -> int:
        """The bytes written, once it holds more than ``at`` (``None``: all it will) or has ended (then
        at most ``at``); its writer's error, raised."""
        with self._changed:
            while (at is None or self._written <= at) and not self._ended:
                self._changed.wait()
            written = self._written
        self.failed()
        return written

    def failed(self) -> None:
        """Its writer's error, raised, where its writing ended with one (a reader that finds the file gone
        or cut short asks why)."""
        with self._changed:
            error = self._error
        if error is None:
            return
        if isinstance(error, DatasetError):
            raise DatasetError(error.dataset, error.reason) from None
        raise DatasetError(self.final, f"its copy was not made: {type(error).__name__}: {error}")

    def opened(self) -> int:
        """A read descriptor of the file, whether it is still being written or renamed since."""
        try:
            return os.open(self.temp, os.O_RDONLY)
        except FileNotFoundError:  # renamed already (or removed: its error says why)
            self.wait(None)
            return os.open(self.final, os.O_RDONLY)


def open_landing(final: str, temp: str) -> int:
    """A read descriptor of file ``final``, or, while it is still being written, of ``temp`` (which becomes
    ``final`` by a rename: tried in that order, then ``final`` again)."""
    try:
        return os.open(final, os.O_RDONLY)
    except FileNotFoundError:
        if not temp:
            raise
    try:
        return os.open(temp, os.O_RDONLY)
    except FileNotFoundError:
        return os.open(final, os.O_RDONLY)


def final_name(file: str | GrowingFile) -> str:
    """A file's path; a copy still being written: the name it will have."""
    return file.final if isinstance(file, GrowingFile) else file
