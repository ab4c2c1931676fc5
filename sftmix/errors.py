"""Typed errors that name what a user must fix: the dataset, the row and the reason."""

from __future__ import annotations


class MixerError(Exception):
    """Base class: an error the user can act on, printed without a traceback by the CLI."""


class ConfigError(MixerError):
    """The mixer configuration or the command line is wrong."""


class TemplateError(MixerError):
    """A chat template cannot be found, loaded or rendered."""


class DatasetError(MixerError):
    """A dataset cannot be opened or read."""

    def __init__(self, dataset: str, reason: str) -> None:
        self.dataset = dataset
        self.reason = reason
        super().__init__(f"dataset {dataset!r}: {reason}")

    def __reduce__(self) -> tuple:  # picklable across worker processes
        return (type(self), (self.dataset, self.reason))


class BadLineError(DatasetError):
    """A line of a JSON Lines file that is not a row: named as editors name it, ``FILE:LINE``."""

    def __init__(self, dataset: str, line: int, reason: str, excerpt: str = "", more: int = 0) -> None:
        self.line = line
        self.excerpt = excerpt
        self.more = more
        super().__init__(dataset, reason)
        near = f" ({excerpt})" if excerpt else ""
        others = f"; {more} more line{'s' if more != 1 else ''} of the file are bad too" if more else ""
        skip = "; with on_bad_row skip, such lines are skipped and counted"
        self.args = (f"{dataset}:{line}: {reason}{near}{others}{skip}",)

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self) -> tuple:
        return (type(self), (self.dataset, self.line, self.reason, self.excerpt, self.more))


def row_label(row: int, line: int | None = None, file: str | None = None) -> str:
    """A row as users should read it: rows count from 0 (as ``inspect --row`` and the run report count
    them), file lines from 1, so a JSON Lines row says both (and, in a dataset of several files, which
    file)."""
    if line is None:
        return f"row {row} (0-based)"
    return f"row {row} (0-based; line {line} of {file or 'the file'})"


class BadRowError(MixerError):
    """One row of a dataset is malformed."""

    def __init__(
        self, dataset: str, row: int, reason: str, line: int | None = None, file: str | None = None
    ) -> None:
        self.dataset = dataset
        self.row = row
        self.reason = reason
        self.line = line
        self.file = file
        super().__init__(f"dataset {dataset!r}, {row_label(row, line, file)}: {reason}")

    def __reduce__(self) -> tuple:
        return (type(self), (self.dataset, self.row, self.reason, self.line, self.file))


class TokenDtypeError(MixerError):
    """A token id does not fit the dtype chosen for the output parts."""


class OutputConflictError(MixerError):
    """The output directory already holds different shards."""


class ChecksumError(MixerError):
    """A checkpoint or an output file does not match its recorded digest."""


class CheckFailedError(MixerError):
    """``run.check: strict`` and the staged output has findings; nothing was published. The command exits
    with ``exit_code``, the one ``tokenize-mixer check`` gives for the same findings (1 or 3)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def __reduce__(self) -> tuple:  # (a flow run's result may be pickled: the code goes with it)
        return (type(self), (str(self), self.exit_code))


class SliceFailuresError(MixerError):
    """Some slices failed after their retries; the others are checkpointed."""


class StorageError(MixerError):
    """A disk is full or a location is not writable: what was being written, where, and why."""


class WorkerDiedError(MixerError):
    """A slice killed the worker process tokenizing it, again and again (out of memory)."""
