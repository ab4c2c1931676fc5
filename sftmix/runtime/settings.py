"""Every ``TOKENIZE_MIXER_*`` environment setting: what it does and its default, read here and nowhere
else. Each is read when it is asked for, not at import (a test, or the command for its workers, sets
them in a process that has imported us already). What a user writes in a mixer config or on the
command line is ``sftmix.config.config``'s; these are for a machine, a cluster's profile or a test.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    name: str
    help: str
    default: str = ""

    def raw(self) -> str | None:
        """The value as the environment holds it (``None``: not set)."""
        return os.environ.get(self.name)

    def get(self) -> str:
        """The value, or the default where it is unset or empty."""
        return os.environ.get(self.name) or self.default

    def put(self, value: str) -> None:
        """Set it for this process and the processes it starts."""
        os.environ[self.name] = value


def progress_seconds() -> float:
    """Seconds between two progress lines (:data:`PROGRESS_SECONDS`; 10 where it is not a number)."""
    try:
        return max(0.5, float(PROGRESS_SECONDS.get()))
    except ValueError:
        return 10.0


WORK_DIR = Setting(
    "TOKENIZE_MIXER_WORK_DIR",
    "the checkpoint directory when the run names none (else the user cache directory's tokenize-mixer/)",
)
ALLOWED_ROOTS = Setting(
    "TOKENIZE_MIXER_ALLOWED_ROOTS",
    "where a flow run on this machine may read and write (paths and gs:// prefixes, separated by ':'); a "
    "deployment's run may only narrow it (sftmix.planning.roots)",
)
UNKNOWN_TEMPLATE = Setting(
    "TOKENIZE_MIXER_UNKNOWN_TEMPLATE",
    "convert's --unknown_template default: fallback (the reference's way) or error",
    "fallback",
)
PROGRESS_SECONDS = Setting(
    "TOKENIZE_MIXER_PROGRESS_SECONDS", "seconds between two progress lines when not on a terminal", "10"
)
LEASE_SECONDS = Setting(
    "TOKENIZE_MIXER_LEASE_SECONDS",
    "how long a staging directory's lease lives without a heartbeat before another machine may call it "
    "abandoned",
    "600",
)
FAST_ENGINE = Setting(
    "TOKENIZE_MIXER_FAST_ENGINE", "the fast BPE engine: auto, fastokens or tiktoken", "auto"
)
JSON_READER = Setting(
    "TOKENIZE_MIXER_JSON_READER",
    "datasets: read local JSON Lines through datasets' Arrow conversion instead of our batch reader",
)
PARQUET_READER = Setting(
    "TOKENIZE_MIXER_PARQUET_READER",
    "datasets: read Parquet (a local file, a hub dataset's files) through datasets' Arrow conversion instead of by row group",
)
PARQUET_STREAMED_BYTES = Setting(
    "TOKENIZE_MIXER_PARQUET_STREAMED_BYTES",
    "a Parquet row group holding more than this many bytes of data (uncompressed) is read batch by batch, "
    "never whole (default 64 MiB; a machine short of memory per worker, or the fault soak, lowers it)",
)
WORKER_START = Setting(
    "TOKENIZE_MIXER_WORKER_START",
    "spawn: start workers as Prefect does instead of forking them from a preloaded server",
)
PROCESSES_FROM_TOKENS = Setting(
    "TOKENIZE_MIXER_PROCESSES_FROM_TOKENS",
    "from this many output tokens the parts are written by worker processes (the fault soak lowers it)",
)
CONSOLE = Setting(
    "TOKENIZE_MIXER_CONSOLE",
    "set by the command for the workers it starts: quiet or verbose, as its own console",
)
AUTH_STRING = Setting(
    "TOKENIZE_MIXER_AUTH_STRING",
    "infra/local_up.sh's API auth string (a secret: never logged, sftmix.runtime.redaction)",
)
DISK_CHECK = Setting(
    "TOKENIZE_MIXER_DISK_CHECK",
    "on: a run whose local disks cannot hold its estimated slices and output is refused before work; off: "
    "not checked (where the estimate from sampled rows is known to be high)",
    "on",
)

ALL = (
    WORK_DIR,
    ALLOWED_ROOTS,
    UNKNOWN_TEMPLATE,
    PROGRESS_SECONDS,
    LEASE_SECONDS,
    FAST_ENGINE,
    JSON_READER,
    PARQUET_READER,
    PARQUET_STREAMED_BYTES,
    WORKER_START,
    PROCESSES_FROM_TOKENS,
    CONSOLE,
    AUTH_STRING,
    DISK_CHECK,
)
