"""A seeded, randomized fault soak of the real command: each trial runs `tokenize-mixer convert` (or a
deployment run on a real local Prefect stack) on a generated dataset, injects ONE fault at a drawn
moment (a closed pipe, a signal, a killed worker or API server, a cancel, a killed `prefect worker`),
checks the stop against docs/stopping.md's stop table, then reruns without a fault and checks the bytes.

Why: tests/test_stopping.py stops runs at one chosen moment each; races live at the moments nobody
chose (before the API answers, during the head start, while publishing). Drawing the moment, the kind
and the workers' start method from one seed finds them, and the seed replays them.

The harness makes itself a child subreaper, so every process a trial leaves behind is reparented to
it and found; whatever a trial leaves is recorded, then killed by its pid. Every wait is bounded.
"""

from __future__ import annotations

import base64
import bz2
import contextlib
import ctypes
import gzip
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from sftmix.assembly.assemble import PROCESSES_FROM_ENV
from sftmix.output.digest import compare
from sftmix.output.output_dir import output_id
from sftmix.runtime import settings
from sftmix.sources.jsonl.batches import BATCH_BYTES
from tests.cli_runs import left_in_shm, semaphores
from tests.hub_emulator import DECLARED_CARD, LOADED_CARD, PLAIN_CARD, HubEmulator
from tokenize_mixer.flows.api.runtime import PRIVATE_DIR_PREFIX

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
#: What users run: the console script next to the interpreter.
COMMAND = BIN / "tokenize-mixer"
PREFECT = BIN / "prefect"

#: Appended to a trial's start when its output is written by worker processes (``PROCESSES_FROM_ENV``).
TAIL_IN_PROCESSES = ", tail in processes"
#: Rows of generated chats and rows per slice: a full run takes about 10 s on 2 cores (64 slices).
ROWS = 8_000
SLICE_ROWS = 125
#: Characters of each row's id (the template never renders it): the file spans two of the JSON Lines
#: reader's batches, so the plan cuts its slices while it reads it and they begin before it is read whole.
ID_CHARS = 1_500
#: Seconds a stop may take, from the fault (a pipe: its reader's exit) to the command's exit.
STOP_WITHIN = 10.0
#: After this long without an exit, the trial is a HANG: its process group is killed.
HANG_AFTER = 60.0
#: Seconds every process of a trial has to be gone after the trial's command ended.
GONE_WITHIN = 5.0
#: A rerun (no fault) that takes longer than this is killed and counted as a rerun failure.
RERUN_TIMEOUT = 240.0
#: Characters of stderr kept in a failure.
TAIL = 3000
#: A flow run may publish after its worker's kill only when it was already publishing: its last look
#: for a stop came before the worker was gone (which takes the kernel a moment after the kill), and
#: the output's directory changed within this many seconds of the kill.
PUBLISHING_AT_THE_KILL = 0.1

#: The output's layouts and row fates a trial on the generated dataset may be drawn with (half the trials
#: keep the reference's), each with its own expected output made once by a plain run: the convert flags,
#: and the amount its dataset is given. A rerun after the stop must give that output's bytes.
LAYOUTS: dict[str, tuple[tuple[str, ...], str]] = {
    "reference": ((), "1.0"),
    "whole-documents": (("--parts", "whole_documents", "--part_bytes", "262144"), "1.0"),
    "lineage": (("--lineage",), "1.0"),
    "budget": ((), "600k tokens"),
    "terminate": (("--over_length_strategy", "terminate"), "1.0"),
    "drop": (("--over_length_strategy", "drop"), "1.0"),
}
#: Kinds whose trials draw a layout (the others' inputs or patterns are their own).
LAYOUT_KINDS = (
    "sigint-group",
    "sigterm",
    "sighup-group",
    "kill-worker",
    "kill-api-early",
    "kill-api-late",
    "sigterm-tail",
    "sigterm-rerun",
)

PIPE_KINDS = ("pipe-grep", "pipe-head")
LOCAL_KINDS = (
    *PIPE_KINDS,
    *LAYOUT_KINDS,
    "change-input",
    "change-parquet",
    "change-gzip",
    "change-gcs",
    "sigint-hub",
    "sigint-mixture",
)
#: Kinds whose fault is aimed at the tail (the output's assembly, check and publish) or at a rerun of a
#: published output (found up to date, or `--force`): stops there must leave the published output whole.
RERUN_KINDS = ("sigterm-rerun",)
#: Kinds whose fault is a Ctrl-C to the command's process group (as sigint-group), each with an input
#: of its own.
SIGINT_TO_GROUP = ("sigint-hub", "sigint-mixture")
SERVER_KINDS = ("cancel", "kill-prefect-worker")
KINDS = LOCAL_KINDS + SERVER_KINDS

#: docs/stopping.md's stop table. kill-prefect-worker has no exit code of the run: its flow run must end Crashed.
EXPECTED_CODE: dict[str, int | None] = {
    "pipe-grep": 128 + signal.SIGPIPE,
    "pipe-head": 128 + signal.SIGPIPE,
    "sigint-group": 128 + signal.SIGINT,
    "sigterm": 128 + signal.SIGTERM,
    "sighup-group": 128 + signal.SIGHUP,
    "kill-worker": 0,
    "kill-api-early": 5,
    "kill-api-late": 5,
    "sigterm-tail": 128 + signal.SIGTERM,
    "sigterm-rerun": 128 + signal.SIGTERM,
    "change-input": 2,  # the file changed while the run read it (or exit 0: before or after it read it)
    "change-parquet": 2,  # the same, the input a Parquet file read by row group
    "change-gzip": 2,  # the same, the input gzipped JSON Lines (decompressed to a copy by the plan)
    "change-gcs": 2,  # the same, the input a gs:// object (JSON Lines, Parquet, gzipped) on an emulator
    "sigint-hub": 128 + signal.SIGINT,  # Ctrl-C, the input a hub dataset whose files download meanwhile
    "sigint-mixture": 128 + signal.SIGINT,  # Ctrl-C, the input two datasets, one counted first
    "cancel": 4,
    "kill-prefect-worker": None,
}

#: Problems a trial can show, in the order a verdict names them (the table has a column for each).
PROBLEMS = ("hang", "slow", "code", "stderr", "leftover", "staging", "mixed", "rerun", "error")

#: How change-input changes the run's copy of the data: cut to its first half of lines, a row appended,
#: or replaced by a rename with a copy that differs in one row of its second batch. change-parquet's
#: Parquet copy: cut to half its bytes, rewritten in place with a row appended, or replaced by a rename
#: with a copy that differs in one row of its second half. change-gzip's gzipped copy: cut to half its
#: bytes, a gzip member of one row appended, or replaced by a rename with change-input's edited copy.
#: change-gcs's object, JSON Lines, its Parquet copy or its gzipped copy (a third of the trials each):
#: replaced by the file's copy as change-input, change-parquet or change-gzip changes it (an object is
#: only ever replaced whole: each change is a new generation).
CHANGES = ("truncate", "append", "replace")
CHANGE_KINDS = ("change-input", "change-parquet", "change-gzip", "change-gcs")
#: The share of change-gzip's trials whose file is bzip2, not gzip.
CHANGE_BZIP2 = 0.4
#: The share of change-parquet's spilled trials in which the spills (``datasets-cache/spilled`` of the
#: work dir, landed or being written) are damaged instead of the input: slices that meet a damaged batch
#: read the row group from the file instead, so the run ends as if nothing happened (exit 0, the bytes).
DAMAGE_SPILL = 0.4


def damage_spills(work: Path) -> int:
    """8 bytes in the middle of each spill file in ``work`` zeroed in place; how many there were."""
    damaged = 0
    for path in (work / "datasets-cache" / "spilled").rglob("*.arrows*"):
        with contextlib.suppress(OSError), open(path, "r+b") as fh:  # (one renamed or removed meanwhile)
            size = fh.seek(0, os.SEEK_END)
            if size > 64:
                fh.seek(size // 2)
                fh.write(b"\0" * 8)
                damaged += 1
    return damaged


#: Where change-gcs's objects lie on the soak's GCS emulator (each read by range, never fetched whole).
GCS_DATA = "gs://soak/chats.jsonl"
GCS_PARQUET = "gs://soak/chats.parquet"
GCS_GZIP = "gs://soak/chats.jsonl.gz"
#: sigint-hub's datasets, one drawn a trial: the Parquet copy's row groups in files of a hub dataset on a
#: hub emulator, or the soak's JSON Lines rows in files of another, plain, gzipped, with a card that
#: declares their features, or with one that names an encoding (the ``datasets`` library loads those:
#: ``sftmix.sources.whole.arrow._fetch_first``) (its own hub cache each trial, so they download during the run), each
#: answer sent at a link's speed.
HUB_DATASET = "soak/chats"
HUB_JSON_DATASET = "soak/chats-jsonl"
HUB_GZIP_DATASET = "soak/chats-jsonl-gz"
HUB_DECLARED_DATASET = "soak/chats-declared"
HUB_LOADED_DATASET = "soak/chats-loaded"
HUB_KINDS = {
    HUB_DATASET: "Parquet files",
    HUB_JSON_DATASET: "JSON Lines files",
    HUB_GZIP_DATASET: "gzipped JSON Lines files",
    HUB_DECLARED_DATASET: "JSON Lines files cast to the features their card declares",
    HUB_LOADED_DATASET: "JSON Lines files the datasets library loads (its card names an encoding)",
}
HUB_FILES = 4
HUB_RATE = 2e6
#: The share of sigint-hub trials in which the hub is too busy (503) for one file's download once: the
#: run tries it again (``sftmix.sources.downloads.RETRY_SECONDS``), and a stop may land while it waits to.
HUB_BUSY = 0.4
#: Seconds from the command's start within which sigint-hub draws most of its moments: its downloads.
HUB_WINDOW = 4.0
#: sigint-mixture's slicings, one drawn a trial: the mixture's own size (the plan cuts its datasets after
#: opening them all), a size in bytes, rows. Each gives the bytes of the first (``Mixture``).
MIXTURE_SLICINGS: tuple[tuple[str, ...], ...] = (
    (),
    ("--slice_bytes", str(1 << 18)),
    ("--slice_rows", str(SLICE_ROWS)),
)


#: The share of sigint-mixture trials whose first dataset is the soak's Parquet copy, its row groups
#: spilled (:data:`PARQUET_STREAMED_BYTES`) where cut into several slices: the plan cuts the second
#: dataset while the spills are written.
MIXTURE_PARQUET = 0.5


@dataclass(frozen=True)
class Mixture:
    """sigint-mixture's input, two directories of JSON Lines files (read by batch as a hub dataset's
    files are): the soak's rows in two files (more than a batch: cut as its batches are counted, the
    head start beginning them), or in the Parquet copy (:data:`MIXTURE_PARQUET`), and its first half of
    rows in two files at 0.5 (counted first, then a sample of it selected)."""

    whole: Path
    half: Path

    def mixer_list(self) -> list[str]:
        return [str(self.whole), "1.0", str(self.half), "0.5"]


#: Rows a row group of the soak's Parquet copy (8,000 rows: 16 row groups, about 1 MiB each).
PARQUET_GROUP_ROWS = 500
#: Half of change-parquet's trials read every row group batch by batch, as only a large one is (and, cut
#: into several slices, decode each once into a spill: sftmix.sources.parquet.spill), and so do half of sigint-hub's of
#: its Parquet dataset.
PARQUET_STREAMED_BYTES = 1 << 16

#: Lines the command prints that a `grep -m1` may wait for (kept when the baseline printed them).
MARKERS = (
    "starting a temporary",
    "Beginning flow run",
    "Finished in state",
    "Created task run",
    "tokenizer   ",
    "template    ",
    "work dir",
    "slices on",
    "begun while",
    "Task run 'tokenize",
    "check [",
    "output      ",
    "slices      ",
    "documents   ",
    "time        ",
    "stopping the temporary",
)

#: A slice's progress line: "[12/64] chats.jsonl rows ...".
PROGRESS = re.compile(r"\[\d+/(\d+)\] ")

_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


# --------------------------------------------------------------------------------------------------
# processes


@dataclass
class Proc:
    pid: int
    ppid: int
    sid: int
    state: str
    cmdline: str


def processes() -> dict[int, Proc]:
    """Every process of the machine from /proc (those that end meanwhile are skipped)."""
    table: dict[int, Proc] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
            raw = Path(f"/proc/{entry.name}/cmdline").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        cmd = raw.replace(b"\0", b" ").decode("utf-8", "replace").strip() or stat[: stat.rfind(")") + 1]
        pid = int(entry.name)
        table[pid] = Proc(pid, int(fields[1]), int(fields[3]), fields[0], cmd)
    return table


def descendants(root: int, table: dict[int, Proc] | None = None) -> list[Proc]:
    table = processes() if table is None else table
    kids: dict[int, list[Proc]] = {}
    for p in table.values():
        kids.setdefault(p.ppid, []).append(p)
    found, todo = [], [root]
    while todo:
        for p in kids.get(todo.pop(), []):
            found.append(p)
            todo.append(p.pid)
    return found


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (of all its threads): cheap enough to poll every few ms."""
    found: list[int] = []
    try:
        for task in os.scandir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                found += [int(c) for c in Path(f"{task.path}/children").read_text().split()]
    except OSError:
        pass
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def workers_of(pid: int) -> list[int]:
    """The pool's workers of the command ``pid``: spawned by it (``spawn_main``), or forked by its child
    that runs multiprocessing's fork server."""
    found = []
    for child in children(pid):
        line = cmdline(child)
        if "spawn_main" in line:
            found.append(child)
        elif "multiprocessing.forkserver" in line:
            found += children(child)
    return found


def api_server_of(pid: int) -> list[int]:
    return [c for c in children(pid) if "uvicorn" in cmdline(c)]


def evidence(procs: Iterable[Proc]) -> list[str]:
    """What each process is and where its threads wait (for a hang or a leftover)."""
    lines = []
    for p in procs:
        waits: dict[str, int] = {}
        with contextlib.suppress(OSError):
            for task in os.scandir(f"/proc/{p.pid}/task"):
                with contextlib.suppress(OSError):
                    w = Path(f"{task.path}/wchan").read_text().strip() or "running"
                    waits[w] = waits.get(w, 0) + 1
        where = ", ".join(f"{w} x{n}" for w, n in sorted(waits.items()))
        lines.append(f"pid {p.pid} ppid {p.ppid} {p.state} [{where}]: {p.cmdline[:300]}")
    return lines


class Reaper:
    """The harness as a child subreaper: orphans of every trial become its children. It reaps the
    zombies among them, but never a child some Popen here holds (its wait would lose the status)."""

    def __init__(self) -> None:
        self.me = os.getpid()
        self.held: list[subprocess.Popen[Any]] = []
        self.libc = ctypes.CDLL(None, use_errno=True)
        previous = ctypes.c_int(0)
        self.libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(previous), 0, 0, 0)
        self.previous = previous.value
        if self.libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
        self.preexisting = {p.pid for p in descendants(self.me)}

    def hold(self, proc: subprocess.Popen[Any]) -> subprocess.Popen[Any]:
        self.held.append(proc)
        return proc

    def reap(self) -> None:
        self.held = [p for p in self.held if p.poll() is None]
        held = {p.pid for p in self.held}
        for p in processes().values():
            if p.ppid == self.me and p.state == "Z" and p.pid not in held:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(p.pid, os.WNOHANG)

    def others(self, owned_sessions: set[int]) -> list[Proc]:
        """Live descendants that are neither the long-lived stack's nor there before the soak."""
        self.reap()
        return [
            p
            for p in descendants(self.me)
            if p.state not in "ZX" and p.sid not in owned_sessions and p.pid not in self.preexisting
        ]

    def gone(self, owned_sessions: set[int], within: float = GONE_WITHIN) -> list[Proc]:
        """[] once every other descendant has ended (within ``within`` s); else those still there."""
        deadline = time.monotonic() + within
        while True:
            left = self.others(owned_sessions)
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.2)

    def kill(self, procs: Iterable[Proc]) -> None:
        """SIGKILL each by its pid, then reap them."""
        pids = [p.pid for p in procs]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        for proc in self.held:
            if proc.pid in pids:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(1)
        self.reap()

    def close(self) -> None:
        self.reap()
        self.libc.prctl(_PR_SET_CHILD_SUBREAPER, self.previous, 0, 0, 0)


# --------------------------------------------------------------------------------------------------
# one command, its output read as it comes


class Capture:
    """A pipe read in a thread, each line time-stamped as it arrives."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream
        self.data = bytearray()
        self.lines: list[tuple[float, str]] = []
        self.eof: float | None = None
        self.chunks: list[tuple[float, int]] = []  # (arrival, bytes read so far)
        self.cond = threading.Condition()
        self._partial = b""
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        fd = self.stream.fileno()
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:
                chunk = b""
            now = time.monotonic()
            with self.cond:
                if not chunk:
                    self.eof = now
                    self.cond.notify_all()
                    break
                self.data += chunk
                self.chunks.append((now, len(self.data)))
                *whole, self._partial = (self._partial + chunk).split(b"\n")
                self.lines += [(now, w.decode("utf-8", "replace")) for w in whole]
                self.cond.notify_all()
        with contextlib.suppress(OSError):
            self.stream.close()

    def arrived(self, nbytes: int) -> float | None:
        """When the first ``nbytes`` bytes had all arrived."""
        with self.cond:
            return next((t for t, n in self.chunks if n >= nbytes), None)

    def first(self, needle: str) -> float | None:
        """When the first line containing ``needle`` arrived."""
        with self.cond:
            return next((t for t, line in self.lines if needle in line), None)

    def wait(self, ready: Callable[[], bool], timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: ready() or self.eof is not None, timeout) and ready()

    def text(self) -> str:
        with self.cond:
            return self.data.decode("utf-8", "replace")


class Command:
    """A command in a process group (and session) of its own, as a shell starts a job."""

    def __init__(self, reaper: Reaper, argv: Sequence[str], env: dict[str, str], cwd: Path) -> None:
        self.argv = list(argv)
        self.started = time.monotonic()
        self.proc = reaper.hold(
            subprocess.Popen(
                self.argv,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.out = Capture(self.proc.stdout)
        self.err = Capture(self.proc.stderr)
        self.ended: float | None = None
        self.semaphores: set[int] = set()  # every named semaphore it held (under a shell: its child)
        threading.Thread(target=self._note_semaphores, daemon=True).start()

    def _note_semaphores(self) -> None:
        while alive(self.pid):
            for pid in (self.pid, *children(self.pid)):
                self.semaphores |= semaphores(pid)
            time.sleep(0.2)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        if self.proc.poll() is None:
            return True
        if self.ended is None:
            self.ended = time.monotonic()
        return False

    def _reached(self, when: float, period: float) -> bool:
        """Poll every ``period`` while the command runs: True when ``when`` came, False when it exited."""
        while self.running():
            if time.monotonic() >= when:
                return True
            time.sleep(period)
        return False

    def wait(self, deadline: float) -> bool:
        """Poll (20 ms) until the command exits or ``deadline`` passes: True when it exited."""
        return not self._reached(deadline, 0.02)

    def wait_for(self, ready: Callable[[], bool], timeout: float) -> bool:
        """Poll (5 ms) until ``ready()`` while the command runs: False when it exited or timed out first."""
        deadline = time.monotonic() + timeout
        while self.running() and time.monotonic() < deadline:
            if ready():
                return True
            time.sleep(0.005)
        return False

    def sleep_until(self, when: float) -> bool:
        """Sleep until ``when`` while the command runs: False when it exited first."""
        return self._reached(when, 0.005)

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self.running()

    @property
    def code(self) -> int | None:
        """The exit status as a shell reports it (128+N for signal N)."""
        rc = self.proc.returncode
        return None if rc is None else (128 - rc if rc < 0 else rc)

    def finish(self) -> None:
        for capture in (self.out, self.err):
            capture.thread.join(5)


# --------------------------------------------------------------------------------------------------
# records


@dataclass
class TrialRecord:
    index: int
    kind: str
    start: str  # forked | spawned | n/a, then TAIL_IN_PROCESSES when the output is written by processes
    fault: str  # what was drawn, in words
    moment: float | None = None  # seconds from the command's start to the fault; None: it never landed
    landed: bool = False
    elapsed: float | None = None  # seconds from the fault to the command's exit (None: hang / no fault)
    code: int | None = None
    expected: int | None = None
    published: bool = False
    verdict: str = "pass"
    problems: list[str] = field(default_factory=list)
    detail: str = ""
    seconds: float = 0.0  # the whole trial, rerun included
    rerun_seconds: float | None = None
    reused: int | None = None
    finished_before_rerun: int | None = None
    tmp_left: list[str] = field(default_factory=list)  # TMPDIR entries the stopped run left (a note)
    #: A signal sent before the command's first line ran: it met Python's own start (docs/stopping.md).
    before_our_code: bool = False

    def problem(self, kind: str, text: str) -> None:
        if kind not in self.problems:
            self.problems.append(kind)
        self.detail += f"[{kind}] {text}\n"


@dataclass
class SoakResult:
    seed: int
    kinds: list[str]
    setup: dict[str, Any]
    records: list[TrialRecord] = field(default_factory=list)
    aborted: str = ""  # why the soak ended early: its setup failed, or a signal stopped it

    @property
    def ok(self) -> bool:
        return not self.aborted and all(r.verdict == "pass" for r in self.records)

    def table(self) -> str:
        """Per kind: trials, passes, each problem, and the slowest exit after a fault."""
        head = ["kind", "trials", "pass", *PROBLEMS, "max s to exit", "mean s/trial"]
        rows = [head, ["---"] * len(head)]
        for kind in [*dict.fromkeys(self.kinds), "all"]:  # (a kind may be dealt twice per deck)
            recs = [r for r in self.records if kind in ("all", r.kind)]
            if not recs:
                continue
            exits = [r.elapsed for r in recs if r.elapsed is not None]
            rows.append(
                [
                    kind,
                    str(len(recs)),
                    str(sum(r.verdict == "pass" for r in recs)),
                    *[str(sum(p in r.problems for r in recs)) for p in PROBLEMS],
                    f"{max(exits):.1f}" if exits else "-",
                    f"{sum(r.seconds for r in recs) / len(recs):.1f}",
                ]
            )
        return "\n".join("| " + " | ".join(row) + " |" for row in rows)

    def trial_lines(self) -> str:
        head = "| # | kind | start | fault | moment s | exit s | code | expected | published | verdict |"
        rows = [head, "|" + "---|" * 10]
        for r in self.records:
            moment = "-" if r.moment is None else f"{r.moment:.2f}"
            exit_s = "-" if r.elapsed is None else f"{r.elapsed:.2f}"
            fault = r.fault.replace("|", "\\|")
            rows.append(
                f"| {r.index} | {r.kind} | {r.start} | {fault} | {moment} | {exit_s} | {r.code} | "
                f"{r.expected} | {'yes' if r.published else 'no'} | {r.verdict} |"
            )
        return "\n".join(rows)

    def failures(self) -> str:
        out = [f"the soak ended early (seed {self.seed}):\n{self.aborted}"] if self.aborted else []
        for r in self.records:
            if r.verdict != "pass":
                out.append(
                    f"seed {self.seed} trial {r.index} {r.kind} ({r.start}; {r.fault}; moment {r.moment}): "
                    f"{', '.join(r.problems)}\n{r.detail}"
                )
        return "\n".join(out)

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "kinds": self.kinds,
            "setup": self.setup,
            "aborted": self.aborted,
            "records": [asdict(r) for r in self.records],
        }


# --------------------------------------------------------------------------------------------------
# the soak's fixed parts: data, a baseline run, the local Prefect stack


@dataclass
class Baseline:
    """One clean run: its output is the expected bytes, its timeline the moments faults are drawn in."""

    wall: float
    output_bytes: int  # stdout + stderr, what a pipe's reader gets
    lines: list[tuple[float, str]]  # stderr, seconds since the start
    api_at: float  # the temporary API server first seen
    workers_at: float  # the pool's workers first seen
    beginning_at: float  # "Beginning flow run" printed
    manifest_at: float  # the first slice checkpointed
    published_at: float  # run_report.json seen in the output
    tail_at: float  # the output's staging directory first seen: its assembly began
    up_to_date_wall: float  # a rerun of the published output (found up to date)
    force_wall: float  # a rerun with --force (every slice reused, the tail again)

    def first(self, needle: str) -> float | None:
        return next((t for t, line in self.lines if needle in line), None)


def write_parquet_copy(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=PARQUET_GROUP_ROWS)


def write_hub_copy(parquet: Path, repo: Path) -> Path:
    """The Parquet copy's row groups dealt in order into :data:`HUB_FILES` files of a hub dataset."""
    import pyarrow.parquet as pq

    source = pq.ParquetFile(parquet)
    groups = source.num_row_groups
    (repo / "data").mkdir(parents=True)
    for k in range(HUB_FILES):
        with pq.ParquetWriter(
            repo / "data" / f"train-{k:05d}-of-{HUB_FILES:05d}.parquet", source.schema_arrow
        ) as w:
            for g in range(k * groups // HUB_FILES, (k + 1) * groups // HUB_FILES):
                w.write_table(source.read_row_group(g))
    (repo / "README.md").write_text(PLAIN_CARD)
    return repo


def write_hub_json_copy(data: Path, repo: Path, gzipped: bool = False, card: str = PLAIN_CARD) -> Path:
    """The soak's JSON Lines rows dealt in order into :data:`HUB_FILES` files of a hub dataset (more
    than a batch in all: its slices are cut as its files land and are read), gzipped or not."""
    lines = data.read_bytes().splitlines(keepends=True)
    (repo / "data").mkdir(parents=True)
    for k in range(HUB_FILES):
        part = b"".join(lines[k * len(lines) // HUB_FILES : (k + 1) * len(lines) // HUB_FILES])
        name = repo / "data" / f"train-{k:05d}-of-{HUB_FILES:05d}.jsonl"
        if gzipped:
            name.with_name(name.name + ".gz").write_bytes(gzip.compress(part, mtime=0))
        else:
            name.write_bytes(part)
    (repo / "README.md").write_text(card)
    return repo


def _parquet_rows(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def change_parquet(change: str, path: Path, tdir: Path) -> None:
    """One of :data:`CHANGES` to the Parquet file at ``path`` (each always the same change)."""
    if change == "truncate":
        os.truncate(path, path.stat().st_size // 2)
        return
    rows = _parquet_rows(path)
    if change == "append":
        rows.append({**rows[-1], "id": "appended".ljust(ID_CHARS, ".")})
        write_parquet_copy(rows, path)  # in place
        return
    row = rows[len(rows) * 3 // 4]
    row["messages"][0]["content"] = "Edited: " + row["messages"][0]["content"]
    other = tdir / "replacement.parquet"
    write_parquet_copy(rows, other)
    os.replace(other, path)


def change_data(change: str, path: Path, tdir: Path) -> None:
    """One of :data:`CHANGES` to the data file at ``path`` (each always the same change)."""
    if path.suffix == ".parquet":
        change_parquet(change, path, tdir)
    elif path.suffix in (".gz", ".bz2"):
        change_gzip(change, path, tdir)
    elif change == "truncate":
        with open(path, "rb") as fh:
            lines = fh.read().split(b"\n")
        os.truncate(path, sum(len(line) + 1 for line in lines[: len(lines) // 2]))
    elif change == "append":
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": "Appended?"},
                            {"role": "assistant", "content": "Yes."},
                        ]
                    }
                )
                + "\n"
            )
    else:
        data = bytearray(path.read_bytes())
        at = data.index(b'"content": "', BATCH_BYTES + 1) + len(b'"content": "')
        data[at:at] = b"Edited: "
        other = tdir / "replacement.jsonl"
        other.write_bytes(bytes(data))
        os.replace(other, path)


def change_gzip(change: str, path: Path, tdir: Path) -> None:
    """One of :data:`CHANGES` to the gzipped (or bzip2) data file at ``path``: change-input's own change to
    its lines, compressed again, except a cut (half its bytes: a stream cut short)."""
    if change == "truncate":
        os.truncate(path, path.stat().st_size // 2)
        return
    compress, decompress = _codec(path)
    lines = tdir / "lines.jsonl"
    lines.write_bytes(decompress(path.read_bytes()))
    change_data(change, lines, tdir)
    if change == "append":  # a second member (stream): what `cat a.gz b.gz` makes
        with open(path, "ab") as fh:
            fh.write(compress(lines.read_bytes()[len(decompress(path.read_bytes())) :]))
    else:
        other = tdir / f"replacement.jsonl{path.suffix}"
        other.write_bytes(compress(lines.read_bytes()))
        os.replace(other, path)
    lines.unlink()


def _codec(path: Path) -> tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]:
    """(compress, decompress) of a gzip or bzip2 file (gzip's with no time in its header)."""
    if path.suffix == ".bz2":
        return (lambda data: bz2.compress(data, 1)), bz2.decompress
    return (lambda data: gzip.compress(data, mtime=0)), gzip.decompress


def said_changed(line: str, data: Path, change: str) -> bool:
    """Whether a run's error line says its input changed, or is what the changed input itself gets (a
    Parquet file cut short is no longer whole Parquet, a gzip stream cut short does not decompress: a
    plan that meets it refuses it so)."""
    cut = change == "truncate"
    cut_short = cut and data.suffix == ".parquet" and "not a whole Parquet file" in line
    cut_stream = cut and data.suffix in (".gz", ".bz2") and "cannot decompress the file" in line
    return "changed" in line or cut_short or cut_stream


def convert_argv(
    data: Path | str | Mixture, work: Path, out: Path, slicing: Sequence[str] = (), layout: str = "reference"
) -> list[str]:
    """A mixture is sliced as ``slicing`` says (by default the mixture's own size); one dataset, by rows,
    in one of :data:`LAYOUTS`."""
    flags, amount = LAYOUTS[layout]
    if isinstance(data, Mixture):
        mixer = data.mixer_list()
    else:
        mixer, slicing = [str(data), amount], ("--slice_rows", str(SLICE_ROWS), *flags)
    return [
        str(COMMAND), "convert", "--dataset_mixer_list", *mixer,
        "--tokenizer_name_or_path", str(ROOT / "examples" / "tokenizer"), "--chat_template_name", "olmo",
        "--max_seq_length", "256", "--work_dir", str(work), "--output_dir", str(out),
        *slicing, "--runner", "process", "--workers", "2",
    ]  # fmt: skip


def deployment_params(data: Path, work: Path, out: Path) -> dict[str, Any]:
    """What `convert_argv` runs, as the flow's parameters (the same strings, so the same bytes)."""
    return {
        "mixer": {
            "datasets": [{"path": str(data), "amount": "1.0"}],
            "tokenizer": {"name_or_path": str(ROOT / "examples" / "tokenizer"), "chat_template": "olmo"},
            "max_seq_length": 256,
            "output": {"path": str(out)},
        },
        "run": {"work_dir": str(work), "slice_rows": SLICE_ROWS, "runner": "process", "workers": 2},
    }


def local_env(prefect_home: Path, tmp: Path) -> dict[str, str]:
    """No configured Prefect API (the command starts its temporary one), a Prefect home of the soak's,
    and a TMPDIR of the trial's (what killed processes leave there is counted, then removed with it)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "PREFECT_API_URL",
            "PREFECT_API_AUTH_STRING",
            "TOKENIZE_MIXER_WORKER_START",
            PROCESSES_FROM_ENV,
        )
    }
    tmp.mkdir(exist_ok=True)
    env.update(PREFECT_HOME=str(prefect_home), PREFECT_SERVER_ANALYTICS_ENABLED="false", TMPDIR=str(tmp))
    return env


def stop_handling_begun(pid: int) -> bool:
    """Whether the command's first line has run in ``pid``: its stop signals held back
    (``tokenize_mixer.command``) or caught by its handlers. Before that a Ctrl-C meets Python's own start
    (a KeyboardInterrupt from inside an import: exit 1 or 130 and Python's traceback; docs/stopping.md)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    masks = dict(line.split(":\t", 1) for line in status.splitlines() if line.startswith("Sig"))
    blocked, caught = (int(masks.get(name, "0"), 16) for name in ("SigBlk", "SigCgt"))
    return bool(blocked & (1 << (signal.SIGINT - 1)) or caught & (1 << (signal.SIGTERM - 1)))


def manifests(work: Path) -> int:
    return len(list(work.glob("slices/*/*/manifest.json")))


def published(out: Path) -> bool:
    return (out / "run_report.json").is_file()


def staging(out: Path) -> bool:
    """Whether the output's staging directory exists (the run is writing the output; not the probe of
    the output's file system that a run makes as it starts)."""
    with contextlib.suppress(OSError):
        return any(
            p.name.startswith(f".{out.name}.tmp-") and not p.name.startswith(f".{out.name}.tmp-probe-")
            for p in out.parent.iterdir()
        )
    return False


class Stack:
    """infra/local_up.sh's server, process work pool, worker and deployments, started once per soak."""

    POOL = "tokenize-mixer-soak"

    def __init__(self, reaper: Reaper, root: Path) -> None:
        from sftmix.planning.roots import ENV as ALLOWED_ROOTS
        from tests.ports import free_port

        self.reaper = reaper
        self.home = root / "prefect-stack"
        self.home.mkdir()
        self.port = free_port()
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("PREFECT_")
            and k not in ("TOKENIZE_MIXER_AUTH_STRING", "TOKENIZE_MIXER_WORKER_START", ALLOWED_ROOTS)
        }
        env.update(
            PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
            PREFECT_HOME=str(self.home),
            TOKENIZE_MIXER_PORT=str(self.port),
            TOKENIZE_MIXER_POOL=self.POOL,
            PREFECT_WORKER_QUERY_SECONDS="1",
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            TMPDIR=str(root / "stack-tmp"),
        )
        (root / "stack-tmp").mkdir()
        self.env = env
        self.sessions: set[int] = set()
        self.worker: subprocess.Popen[bytes] | None = None
        self.up_seconds = 0.0

    def start(self) -> None:
        began = time.monotonic()
        try:
            up = subprocess.run(
                ["bash", "infra/local_up.sh"],
                cwd=ROOT,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=300,
            )
        finally:
            self._own()
        if up.returncode != 0:
            raise RuntimeError(
                f"infra/local_up.sh failed ({up.returncode}):\n{(up.stdout + up.stderr)[-TAIL:]}"
            )
        self.env["PREFECT_API_URL"] = f"http://127.0.0.1:{self.port}/api"
        self.env["PREFECT_API_AUTH_STRING"] = (self.home / "auth-string").read_text().strip()
        self.up_seconds = time.monotonic() - began

    def _own(self) -> None:
        """The server's and the worker's sessions are the soak's own long-lived processes."""
        table = processes()
        for name in ("server", "worker"):
            with contextlib.suppress(OSError, ValueError):
                pid = int((self.home / f"{name}.pid").read_text())
                if pid in table:
                    self.sessions.add(table[pid].sid)

    def worker_pid(self) -> int:
        return int((self.home / "worker.pid").read_text())

    def ensure_worker(self) -> None:
        """A live worker (a trial that failed half-way may have left it killed)."""
        with contextlib.suppress(OSError, ValueError):
            if alive(self.worker_pid()):
                return
        self.restart_worker()

    def restart_worker(self) -> None:
        """A new `prefect worker` in a session of its own, recorded where local_down.sh stops it."""
        with contextlib.suppress(OSError, ValueError):
            self.sessions.discard(self.worker_pid())
        if self.worker is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.worker.wait(5)
        log = open(self.home / "worker.log", "ab")  # noqa: SIM115 (the child holds it)
        with log:
            self.worker = self.reaper.hold(
                subprocess.Popen(
                    [str(PREFECT), "worker", "start", "--pool", self.POOL],
                    cwd=ROOT,
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                )
            )
        (self.home / "worker.pid").write_text(str(self.worker.pid))
        self.sessions.add(self.worker.pid)

    def stop(self) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run(
                ["bash", "infra/local_down.sh"], cwd=ROOT, env=self.env, timeout=60, capture_output=True
            )
        if self.worker is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.worker.wait(5)
        left = [p for p in self.reaper.others(set()) if p.sid in self.sessions]
        self.reaper.kill(left)
        self.sessions.clear()

    def api(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One authorized API call (CSRF token included), retried on 503 as Prefect's client does."""
        import httpx

        token = base64.b64encode(self.env["PREFECT_API_AUTH_STRING"].encode()).decode()
        with httpx.Client(
            base_url=self.env["PREFECT_API_URL"], headers={"Authorization": f"Basic {token}"}, timeout=15
        ) as client:
            csrf = client.get("/csrf-token", params={"client": "soak"}).json()["token"]
            client.headers.update({"Prefect-Csrf-Token": csrf, "Prefect-Csrf-Client": "soak"})
            for attempt in range(6):
                response = client.request(method, path, json=body)
                if response.status_code != 503:
                    break
                time.sleep(0.5 * 2**attempt)
            response.raise_for_status()
            return response.json()

    def flow_run(self, name: str) -> dict[str, Any]:
        runs = self.api("POST", "/flow_runs/filter", {"flow_runs": {"name": {"any_": [name]}}})
        return runs[0]


class Emulator:
    """A GCS emulator (gcp-storage-emulator, in memory) in a session of its own, for change-gcs: the
    object its trials change, and the environment that points a command's gcsfs at it."""

    def __init__(self, reaper: Reaper | None) -> None:
        from tests.ports import free_port

        port = free_port()
        self.proc = (reaper.hold if reaper is not None else _held)(
            subprocess.Popen(
                [str(Path(sys.executable).parent / "gcp-storage-emulator"), "start", "--host=127.0.0.1",
                 f"--port={port}", "--in-memory"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )  # fmt: skip
        self.session = self.proc.pid
        self.env = {
            "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # the emulator has no gRPC control plane
            "FSSPEC_GS_TOKEN": "anon",
        }
        import socket

        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("the GCS emulator did not start") from None
                time.sleep(0.2)
        from gcsfs.core import GCSFileSystem  # (not the package's default: it asks a gRPC API first)

        self.fs = GCSFileSystem(
            token="anon", endpoint_url=self.env["STORAGE_EMULATOR_HOST"], skip_instance_cache=True
        )
        self.fs.mkdir(GCS_DATA.split("/")[2])

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.session, signal.SIGKILL)
        self.proc.wait(10)


def _held(proc: subprocess.Popen[Any]) -> subprocess.Popen[Any]:
    return proc


# --------------------------------------------------------------------------------------------------
# the soak


class Soak:
    """The soak's state: its temporary root (data, expected output, a Prefect home, one directory per
    trial), the reaper, the baseline and, once a server-mode kind is drawn, the stack."""

    def __init__(self, seed: int, kinds: Sequence[str], server: bool, log: Callable[[str], None]) -> None:
        self.seed = seed
        self.kinds = [k for k in kinds if server or k not in SERVER_KINDS]
        unknown = set(self.kinds) - set(KINDS)
        if unknown or not self.kinds:
            raise ValueError(f"unknown or no kinds: {sorted(unknown)}; known: {', '.join(KINDS)}")
        self.log = log
        self.reaper = Reaper()
        self.root = Path(tempfile.mkdtemp(prefix="tokenize-mixer-soak-"))
        self.data = self.root / "chats.jsonl"
        self.parquet = self.root / "chats.parquet"  # the same rows, for change-parquet
        self.gzipped = self.root / "chats.jsonl.gz"  # the same lines, for change-gzip
        self.bzipped = self.root / "chats.jsonl.bz2"  # and in a share of its trials, as bzip2
        self.mixture = Mixture(self.root / "chats-all", self.root / "chats-half")  # for sigint-mixture
        self.parquet_mixture = Mixture(self.parquet, self.mixture.half)
        self.expected = self.root / "expected"
        self.home = self.root / "prefect-home"
        self.stack: Stack | None = None
        self.gcs: Emulator | None = None  # for change-gcs
        self.hubs: dict[str, HubEmulator] = {}  # for sigint-hub, by dataset (threads of this process)
        self.walls: dict[Path, float] = {}  # each expected output's plain run: its trials draw moments in it
        self.baseline: Baseline | None = None
        self.durations: dict[str, list[float]] = {}
        self._cancelled = ""  # the flow run a cancel trial cancelled
        self.setup: dict[str, Any] = {"rows": ROWS, "slice_rows": SLICE_ROWS}

    # -- setup

    def prepare(self) -> None:
        began = time.monotonic()
        sys.path.insert(0, str(ROOT / "examples"))
        from generate_demo_data import arithmetic

        rows = arithmetic(random.Random(11), ROWS)
        self.data.write_text(
            "".join(json.dumps({**r, "id": r["id"].ljust(ID_CHARS, ".")}) + "\n" for r in rows)
        )
        assert self.data.stat().st_size > BATCH_BYTES
        if {"change-parquet", "change-gcs", "sigint-hub", "sigint-mixture"} & set(self.kinds):
            write_parquet_copy([{**r, "id": r["id"].ljust(ID_CHARS, ".")} for r in rows], self.parquet)
        if "change-gzip" in self.kinds or "change-gcs" in self.kinds:
            self.gzipped.write_bytes(gzip.compress(self.data.read_bytes(), mtime=0))
        if "change-gzip" in self.kinds:
            self.bzipped.write_bytes(bz2.compress(self.data.read_bytes(), 1))
        if "sigint-mixture" in self.kinds:
            lines = self.data.read_text().splitlines(keepends=True)
            quarter = len(lines) // 4
            for directory, cuts in ((self.mixture.whole, (0, 2, 4)), (self.mixture.half, (0, 1, 2))):
                directory.mkdir()
                for k in range(2):
                    part = lines[cuts[k] * quarter : cuts[k + 1] * quarter]
                    (directory / f"part-{k}.jsonl").write_text("".join(part))
        self.home.mkdir()
        # the temporary API's database, created once (a first run's slow API start is not the timeline)
        subprocess.run(
            [str(PREFECT), "server", "database", "upgrade", "-y"],
            env=local_env(self.home, self.root / "tmp"),
            capture_output=True,
            timeout=300,
            check=True,
        )
        self.baseline = self._baseline()
        if "sigint-hub" in self.kinds:
            repos = {
                HUB_DATASET: write_hub_copy(self.parquet, self.root / "hub-repo"),
                HUB_JSON_DATASET: write_hub_json_copy(self.data, self.root / "hub-json-repo"),
                HUB_GZIP_DATASET: write_hub_json_copy(self.data, self.root / "hub-gzip-repo", gzipped=True),
                HUB_DECLARED_DATASET: write_hub_json_copy(
                    self.data, self.root / "hub-declared-repo", card=DECLARED_CARD
                ),
                HUB_LOADED_DATASET: write_hub_json_copy(
                    self.data, self.root / "hub-loaded-repo", card=LOADED_CARD
                ),
            }
            for dataset, repo in repos.items():
                self.hubs[dataset] = HubEmulator(repo, dataset, HUB_RATE)
                self.hubs[dataset].__enter__()
        if "change-gcs" in self.kinds:  # (after the baseline, which counts every process left as its)
            self.gcs = Emulator(self.reaper)
            self.gcs.fs.put_file(str(self.data), GCS_DATA)
            self.gcs.fs.put_file(str(self.parquet), GCS_PARQUET)
            self.gcs.fs.put_file(str(self.gzipped), GCS_GZIP)
        self.setup.update(
            baseline_wall=round(self.baseline.wall, 2),
            output_bytes=self.baseline.output_bytes,
            api_at=round(self.baseline.api_at, 2),
            workers_at=round(self.baseline.workers_at, 2),
            beginning_at=round(self.baseline.beginning_at, 2),
            manifest_at=round(self.baseline.manifest_at, 2),
            published_at=round(self.baseline.published_at, 2),
            tail_at=round(self.baseline.tail_at, 2),  # (the orchestration lags the last slice by seconds)
            up_to_date_wall=round(self.baseline.up_to_date_wall, 2),
            force_wall=round(self.baseline.force_wall, 2),
            setup_seconds=round(time.monotonic() - began, 1),
        )
        self.log(
            f"soak seed {self.seed}: baseline {self.baseline.wall:.1f} s (API seen {self.baseline.api_at:.1f} s, "
            f"workers {self.baseline.workers_at:.1f} s, flow run {self.baseline.beginning_at:.1f} s, "
            f"tail {self.baseline.tail_at:.1f} s, published {self.baseline.published_at:.1f} s; reruns: up to date "
            f"{self.baseline.up_to_date_wall:.1f} s, --force {self.baseline.force_wall:.1f} s), "
            f"{self.baseline.output_bytes} bytes of output"
        )

    def _baseline(self) -> Baseline:
        work = self.root / "work-baseline"
        env = local_env(self.home, self.root / "tmp")
        cmd = Command(self.reaper, convert_argv(self.data, work, self.expected), env, self.root)
        seen: dict[str, float] = {}
        deadline = cmd.started + 600
        while cmd.running() and time.monotonic() < deadline:
            now = time.monotonic() - cmd.started
            if "api" not in seen and api_server_of(cmd.pid):
                seen["api"] = now
            if "workers" not in seen and workers_of(cmd.pid):
                seen["workers"] = now
            if "manifest" not in seen and manifests(work):
                seen["manifest"] = now
            if "tail" not in seen and staging(self.expected):
                seen["tail"] = now
            if "published" not in seen and published(self.expected):
                seen["published"] = now
            time.sleep(0.05)
        if cmd.running():
            cmd.kill_group()
        cmd.finish()
        wall = (cmd.ended or time.monotonic()) - cmd.started
        if cmd.code != 0 or not published(self.expected):
            raise RuntimeError(f"the baseline run failed (exit {cmd.code}):\n{cmd.err.text()[-TAIL:]}")
        left = self.reaper.gone(set())
        if left:
            self.reaper.kill(left)
            raise RuntimeError("the baseline run left processes behind:\n" + "\n".join(evidence(left)))
        # the reruns a sigterm-rerun trial stops: up to date, then --force (the same bytes, published again)
        reruns = []
        for extra in ([], ["--force"]):
            rerun = Command(self.reaper, convert_argv(self.data, work, self.expected) + extra, env, self.root)
            if not rerun.wait(rerun.started + 600) or rerun.code != 0:
                rerun.kill_group()
                raise RuntimeError(f"the baseline's rerun {extra} failed:\n{rerun.err.text()[-TAIL:]}")
            rerun.finish()
            reruns.append((rerun.ended or time.monotonic()) - rerun.started)
        shutil.rmtree(work, ignore_errors=True)
        lines = [(t - cmd.started, line) for t, line in cmd.err.lines]
        beginning = next((t for t, line in lines if "Beginning flow run" in line), wall)
        return Baseline(
            wall=wall,
            output_bytes=len(cmd.out.data) + len(cmd.err.data),
            lines=lines,
            api_at=seen.get("api", 0.0),
            workers_at=seen.get("workers", beginning),
            beginning_at=beginning,
            manifest_at=seen.get("manifest", beginning),
            published_at=seen.get("published", wall),
            tail_at=seen.get("tail", wall),
            up_to_date_wall=reruns[0],
            force_wall=reruns[1],
        )

    def close(self) -> None:
        try:
            for hub in self.hubs.values():
                hub.__exit__(None, None, None)
            if self.gcs is not None:
                self.gcs.stop()
            if self.stack is not None:
                self.stack.stop()
        finally:
            left = self.reaper.gone(set(), within=2)
            if left:
                self.log("soak: killing what is left at the end:\n" + "\n".join(evidence(left)))
                self.reaper.kill(left)
            self.reaper.close()
            shutil.rmtree(self.root, ignore_errors=True)

    # -- drawing

    def estimate(self, kind: str) -> float:
        """Seconds a trial of ``kind`` is expected to take (what is left of a time budget must hold it)."""
        assert self.baseline is not None
        seen = self.durations.get(kind)
        if seen:
            return sum(seen) / len(seen)
        if kind in SERVER_KINDS:
            return 2 * self.baseline.wall + 15 + (0 if self.stack else 35)
        return (3 if kind in RERUN_KINDS else 2) * self.baseline.wall + 8

    def draw(self, index: int, kind: str) -> tuple[random.Random, str]:
        """The trial's own generator (seed and index give the same draws whatever ran before)."""
        rng = random.Random(f"{self.seed}/{index}/{kind}")
        start = "n/a" if kind == "kill-prefect-worker" else rng.choice(["forked", "spawned"])
        # half the trials write their output with worker processes, as outputs from 64 Mi tokens are
        # (a generator of its own: the draws above and after are those of older soaks)
        if start != "n/a" and random.Random(f"{self.seed}/{index}/{kind}/tail").random() < 0.5:
            start += TAIL_IN_PROCESSES
        return rng, start

    def draw_layout(self, rec: TrialRecord) -> str:
        """The trial's layout (:data:`LAYOUTS`; a generator of its own: the other draws are those of older
        soaks)."""
        if rec.kind not in LAYOUT_KINDS:
            return "reference"
        rng = random.Random(f"{self.seed}/{rec.index}/{rec.kind}/layout")
        return "reference" if rng.random() < 0.5 else rng.choice([k for k in LAYOUTS if k != "reference"])

    def _layout_expected(self, layout: str, env: dict[str, str], tdir: Path) -> Path:
        """The generated dataset's output in ``layout``, made once by a plain run."""
        expected = self.root / f"expected-layout-{layout}"
        if not expected.exists():
            started = time.monotonic()
            argv = convert_argv(self.data, tdir / "layout-work", expected, layout=layout)
            run = subprocess.run(argv, env=env, cwd=tdir, capture_output=True, timeout=300)
            if run.returncode != 0:
                raise RuntimeError(f"the {layout} layout's run failed:\n{run.stderr.decode()[-TAIL:]}")
            self.walls[expected] = time.monotonic() - started
        return expected

    def early_or_any(self, rng: random.Random, wall: float | None = None) -> float:
        """A moment in a run of ``wall`` seconds (the baseline's where none is given), one draw in five in
        its first half second."""
        assert self.baseline is not None
        wall = self.baseline.wall if wall is None else wall
        return rng.uniform(0, 0.5) if rng.random() < 0.2 else rng.uniform(0, wall)

    # -- trials

    def trial(self, index: int, kind: str) -> TrialRecord:
        rng, start = self.draw(index, kind)
        rec = TrialRecord(index=index, kind=kind, start=start, fault="", expected=EXPECTED_CODE[kind])
        tdir = self.root / f"trial-{index:03d}"
        tdir.mkdir()
        began = time.monotonic()
        try:
            if kind in SERVER_KINDS and self.stack is None:
                self.log("soak: starting the local Prefect stack (infra/local_up.sh)")
                self.stack = Stack(self.reaper, self.root)
                try:
                    self.stack.start()
                except Exception:
                    self.kinds = [k for k in self.kinds if k not in SERVER_KINDS]  # no more server trials
                    self.stack.stop()
                    self.stack = None
                    raise
                self.setup["stack_up_seconds"] = round(self.stack.up_seconds, 1)
            if kind == "kill-prefect-worker":
                self._worker_trial(rec, rng, tdir)
            else:
                self._command_trial(rec, rng, tdir)
        except Exception:
            rec.problem("error", traceback.format_exc()[-TAIL:])
        finally:
            left = self.reaper.others(self.owned())
            if left:
                rec.problem("leftover", "after the trial:\n" + "\n".join(evidence(left)))
                self.reaper.kill(left)
            shutil.rmtree(tdir, ignore_errors=True)
        rec.seconds = round(time.monotonic() - began, 2)
        rec.verdict = next((p for p in PROBLEMS if p in rec.problems), "pass")
        self.durations.setdefault(kind, []).append(rec.seconds)
        return rec

    def owned(self) -> set[int]:
        owned = set(self.stack.sessions) if self.stack is not None else set()
        return owned | ({self.gcs.session} if self.gcs is not None else set())

    def _env(self, rec: TrialRecord, tmp: Path, hub: str = HUB_DATASET) -> dict[str, str]:
        if rec.kind == "cancel":
            assert self.stack is not None
            tmp.mkdir(exist_ok=True)
            env = {**self.stack.env, "TMPDIR": str(tmp)}
        else:
            env = local_env(self.home, tmp)
        if rec.kind == "change-gcs":
            assert self.gcs is not None
            env.update(self.gcs.env)
        if rec.kind == "sigint-hub":  # an empty hub cache of its own: the files download during the run
            env.update(HF_ENDPOINT=self.hubs[hub].endpoint, HF_HOME=str(tmp.parent / "hf-home"))
            env.pop("HF_HUB_OFFLINE", None)
        if rec.start.startswith("spawned"):
            env["TOKENIZE_MIXER_WORKER_START"] = "spawn"
        if rec.start.endswith(TAIL_IN_PROCESSES):
            env[PROCESSES_FROM_ENV] = "1"
        return env

    def _command_trial(self, rec: TrialRecord, rng: random.Random, tdir: Path) -> None:
        """`tokenize-mixer convert` with one fault (every kind but kill-prefect-worker), then the rerun."""
        assert self.baseline is not None
        if rec.kind in CHANGE_KINDS:
            self._change_trial(rec, rng, tdir)
            return
        base = self.baseline
        work, out = tdir / "work", tdir / "out"
        data: Path | str | Mixture = {"sigint-mixture": self.mixture}.get(rec.kind, self.data)
        if rec.kind == "sigint-hub":
            data = rng.choice(list(HUB_KINDS))
            for hub in self.hubs.values():
                hub.flaky.clear()  # (what an earlier trial's stop left)
        slicing = rng.choice(MIXTURE_SLICINGS) if rec.kind == "sigint-mixture" else ()
        layout = self.draw_layout(rec)
        argv = convert_argv(data, work, out, slicing, layout)
        env = self._env(rec, tdir / "tmp", str(data))
        expected = None if layout == "reference" else self._layout_expected(layout, env, tdir)
        if rec.kind == "sigint-hub":  # (its statistics name the dataset; made with a cache of its own)
            expected = self._version_expected(data, "", {**env, "HF_HOME": str(self.root / "hf-home")}, tdir)
            rec.fault = f"{HUB_KINDS[str(data)]}, "
            if rng.random() < HUB_BUSY:
                busy = rng.choice([f for f in self.hubs[str(data)].files() if f.startswith("data/")])
                self.hubs[str(data)].flaky[busy] = 1
                rec.fault += f"the hub too busy once for {Path(busy).name}, "
            if data == HUB_DATASET and rng.random() < 0.5:  # each row group decoded once, spilled
                env[settings.PARQUET_STREAMED_BYTES.name] = str(PARQUET_STREAMED_BYTES)
                rec.fault += "row groups spilled, "
        elif rec.kind == "sigint-mixture":  # (made sliced by the mixture's size, whatever the trial's)
            rec.fault = f"{' '.join(slicing) or 'sliced by the mixture'}, "
            if rng.random() < MIXTURE_PARQUET:
                data = self.parquet_mixture
                argv = convert_argv(data, work, out, slicing)
                env[settings.PARQUET_STREAMED_BYTES.name] = str(PARQUET_STREAMED_BYTES)
                rec.fault += "the first dataset Parquet, row groups spilled, "
            expected = self._version_expected(data, "", env, tdir)
        kind = rec.kind
        fault_at: float | None = None
        published_id: str | None = None
        if kind in RERUN_KINDS:  # the output is published first; the fault meets a rerun of it
            first = Command(self.reaper, argv, env, tdir)
            if not first.wait(first.started + RERUN_TIMEOUT) or first.code != 0 or not published(out):
                first.kill_group()
                self._settle(rec, first, "the first run")
                rec.problem("error", f"the first run failed (exit {first.code}):\n{first.err.text()[-TAIL:]}")
                return
            self._settle(rec, first, "the first run")
            published_id = output_id(out)
            if rng.random() < 0.5:
                argv = [*argv, "--force"]
        if kind in PIPE_KINDS:
            code_file = tdir / "code"
            if kind == "pipe-grep":
                pattern = self._pattern(rng)
                reader = ["grep", "-m1", "-F", "-e", pattern]
                rec.fault = f"grep -m1 {pattern!r}"
                at = base.first(pattern)
                rec.fault += f" (baseline {at:.1f} s)" if at is not None else ""
            else:
                nbytes = rng.randint(1, base.output_bytes)
                reader = ["head", "-c", str(nbytes)]
                rec.fault = f"head -c {nbytes}"
            script = (
                f'"$@" 2>&1 | {shlex.join(reader)}; echo "${{PIPESTATUS[0]}}" > {shlex.quote(str(code_file))}'
            )
            cmd = Command(self.reaper, ["bash", "-c", script, "_", *argv], env, tdir)
            if kind == "pipe-grep":
                done = cmd.out.wait(lambda: b"\n" in cmd.out.data, HANG_AFTER + 2 * base.wall)
            else:
                done = cmd.out.wait(lambda: len(cmd.out.data) >= nbytes, HANG_AFTER + 2 * base.wall)
            if done:
                fault_at = cmd.out.arrived(cmd.out.data.index(b"\n") + 1 if kind == "pipe-grep" else nbytes)
        else:
            cmd = Command(self.reaper, argv, env, tdir)
            wall = base.wall if expected is None else self.walls.get(expected, base.wall)
            fault_at = self._inject(rec, rng, cmd, out, wall)
        if layout != "reference":
            rec.fault = f"layout {layout}, {rec.fault}"
        self._judge_stop(rec, cmd, fault_at, out, tdir)
        if kind in RERUN_KINDS:
            self._judge_published_kept(rec, out, published_id, forced="--force" in argv, expected=expected)
            argv = [a for a in argv if a != "--force"]
        if kind in PIPE_KINDS:
            rec.expected = rec.expected if rec.landed else 0
            rec.code = None
            if "hang" not in rec.problems:  # the command's own status, as the pipeline saw it
                try:
                    rec.code = int((tdir / "code").read_text().strip())
                except (OSError, ValueError) as e:
                    rec.problem("error", f"no exit status from the pipeline: {e!r}")
                self._judge_code(rec)
        offline_first = random.Random(f"{self.seed}/{rec.index}/offline").random() < 0.5
        if (
            rec.kind == "sigint-hub"
            and offline_first
            and self._offline_rerun(rec, argv, env, out, tdir, expected)
        ):
            return  # (the output is judged: what an online rerun would find is up to date)
        self._rerun_command(rec, argv, env, work, out, tdir, expected=expected)

    def _offline_rerun(
        self,
        rec: TrialRecord,
        argv: list[str],
        env: dict[str, str],
        out: Path,
        tdir: Path,
        expected: Path | None,
    ) -> bool:
        """sigint-hub, half its trials: the stopped run's rerun first with ``HF_HUB_OFFLINE`` (a cluster's
        compute node, after an online run on its login node was stopped). It gives the hub version's bytes,
        or one error and nothing published (a file the stopped run did not download, or no plan got as far
        as keeping the dataset's files): never fewer rows. True when it published the output."""
        cmd = Command(self.reaper, argv, {**env, "HF_HUB_OFFLINE": "1"}, tdir)
        exited = cmd.wait(cmd.started + RERUN_TIMEOUT)
        if not exited:
            cmd.kill_group()
        self._settle(rec, cmd, "the offline rerun")
        stderr = cmd.err.text()
        errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
        if not exited:
            rec.problem("rerun", f"the offline rerun ran {RERUN_TIMEOUT:.0f} s:\n{stderr[-TAIL:]}")
        elif cmd.code == 0:
            result = compare(out, expected or self.expected)
            rec.fault += "; the offline rerun published"
            if not result.matches:
                rec.problem("rerun", f"the offline rerun's bytes differ:\n{result.render()[-TAIL:]}")
            return True
        elif cmd.code != 2 or len(errors) != 1 or "Traceback" in stderr or published(out):
            rec.problem(
                "rerun", f"the offline rerun exited {cmd.code}, published {published(out)}:\n{stderr[-TAIL:]}"
            )
        else:
            rec.fault += "; the offline rerun refused: " + errors[0][:160]
        return False

    def _pattern(self, rng: random.Random) -> str:
        """A line the baseline printed: a slice's progress line ("[k/") or one of the markers."""
        assert self.baseline is not None
        totals = [int(m.group(1)) for _, line in self.baseline.lines if (m := PROGRESS.search(line))]
        if totals and rng.random() < 0.5:
            return f"[{rng.randint(1, max(totals))}/"
        present = [m for m in MARKERS if self.baseline.first(m) is not None]
        return rng.choice(present)

    def _inject(
        self, rec: TrialRecord, rng: random.Random, cmd: Command, out: Path, wall: float
    ) -> float | None:
        """The fault of a signal / kill / cancel kind, at its drawn moment (in a run of ``wall`` seconds,
        as long as its input's plain run took): when it landed, or None."""
        assert self.baseline is not None
        base = self.baseline
        kind = rec.kind
        if kind in (
            "sigint-group",
            "sigterm",
            "sighup-group",
            "sigterm-tail",
            "sigterm-rerun",
            *SIGINT_TO_GROUP,
        ):
            forced = "--force" in cmd.argv
            if kind == "sigterm-tail" or forced:  # while the output is assembled, checked and published
                delay = rng.uniform(0, base.published_at - base.tail_at + 0.1)
                rec.fault = "--force, " if forced else ""
                rec.fault += f"{kind} {delay:.2f} s after the staging directory appeared"
                appeared = cmd.wait_for(lambda: staging(out), HANG_AFTER + 2 * base.wall)
                if not appeared or not cmd.sleep_until(time.monotonic() + delay):
                    return None
                rec.fault += f" (at {time.monotonic() - cmd.started:.2f} s)"
            else:
                if kind == "sigterm-rerun":
                    moment = rng.uniform(0, base.up_to_date_wall)
                    rec.fault = "up to date, "
                elif kind == "sigint-hub" and rng.random() < 0.6:  # while its files download
                    moment = rng.uniform(0, HUB_WINDOW)
                else:
                    moment = self.early_or_any(rng, wall)
                rec.fault += f"{kind} at {moment:.2f} s"
                if not cmd.sleep_until(cmd.started + moment):
                    return None
            sig = {"sighup-group": signal.SIGHUP, "sigint-group": signal.SIGINT}.get(kind, signal.SIGTERM)
            sig = signal.SIGINT if kind in SIGINT_TO_GROUP else sig
            if not stop_handling_begun(cmd.pid):
                rec.before_our_code = True
                rec.fault += " (before the command's first line: Python's own start)"
            fault_at = time.monotonic()
            if not kind.endswith("-group") and kind not in SIGINT_TO_GROUP:
                os.kill(cmd.pid, sig)
            else:
                os.killpg(cmd.pid, sig)
            return fault_at
        if kind == "kill-worker":
            moment = rng.uniform(base.workers_at, base.wall)
            rec.fault = f"SIGKILL a worker at {moment:.2f} s"
            if not cmd.sleep_until(cmd.started + moment):
                return None
            while cmd.running():
                found = workers_of(cmd.pid)
                if found:
                    victim = rng.choice(sorted(found))
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(victim, signal.SIGKILL)
                        rec.fault += f" (pid {victim} of {len(found)})"
                        return time.monotonic()
                time.sleep(0.01)
            return None
        if kind == "kill-api-early":
            gap = max(0.0, base.beginning_at - base.api_at)
            delay = 0.0 if rng.random() < 0.4 else rng.uniform(0, 0.8 * gap)
            rec.fault = f"SIGKILL the API server {delay:.2f} s after it exists"
            server = self._api_server(cmd, cmd.started + HANG_AFTER)
            if server is None or not cmd.sleep_until(time.monotonic() + delay):
                return None
            early = cmd.err.first("Beginning flow run") is None
            rec.fault += "" if early else " (after 'Beginning flow run': it answered already)"
            return self._kill(server)
        if kind == "kill-api-late":
            moment = rng.uniform(base.beginning_at, base.wall)
            rec.fault = f"SIGKILL the API server at {moment:.2f} s, after 'Beginning flow run'"
            if not cmd.err.wait(lambda: cmd.err.first("Beginning flow run") is not None, HANG_AFTER):
                return None
            if not cmd.sleep_until(cmd.started + moment):
                return None
            server = self._api_server(cmd, time.monotonic() + 1)
            return None if server is None else self._kill(server)
        if kind == "cancel":
            assert self.stack is not None
            delay = rng.uniform(0, max(0.5, base.wall - base.beginning_at))
            rec.fault = f"prefect flow-run cancel {delay:.2f} s after 'Beginning flow run'"
            if not cmd.err.wait(lambda: cmd.err.first("Beginning flow run") is not None, HANG_AFTER):
                return None
            line = next(x for _, x in cmd.err.lines if "Beginning flow run" in x)
            flow_run = self.stack.flow_run(line.split("'")[1])
            rec.detail += f"flow run {flow_run['id']}\n"
            if not cmd.sleep_until(time.monotonic() + delay):
                return None
            cancel = subprocess.run(
                [str(PREFECT), "flow-run", "cancel", flow_run["id"]],
                env=self.stack.env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            if cancel.returncode != 0:
                rec.fault += f" (refused: {cancel.stdout.strip()[-200:]})"
                return None
            self._cancelled = flow_run["id"]
            return time.monotonic()
        raise ValueError(kind)

    def _api_server(self, cmd: Command, deadline: float) -> int | None:
        while cmd.running() and time.monotonic() < deadline:
            found = api_server_of(cmd.pid)
            if found:
                return found[0]
            time.sleep(0.003)
        return None

    @staticmethod
    def _kill(pid: int) -> float | None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None
        return time.monotonic()

    def _judge_stop(
        self, rec: TrialRecord, cmd: Command, fault_at: float | None, out: Path, tdir: Path
    ) -> None:
        """The stopped command: its exit, code, one line, no processes left, no staging directories."""
        assert self.baseline is not None
        landed = fault_at is not None and (cmd.ended is None or cmd.ended > fault_at)
        rec.landed = landed
        if landed:
            assert fault_at is not None
            rec.moment = round(fault_at - cmd.started, 3)
            limit = HANG_AFTER + (2 * self.baseline.wall if rec.kind == "kill-worker" else 0)
            deadline = fault_at + limit
        else:
            deadline = cmd.started + 3 * self.baseline.wall + HANG_AFTER
        exited = cmd.wait(deadline)
        if not exited:
            procs = [cmd.pid, *[p.pid for p in descendants(cmd.pid)]]
            table = processes()
            rec.problem(
                "hang",
                f"no exit {deadline - (fault_at or cmd.started):.0f} s after the fault:\n"
                + "\n".join(evidence(table[p] for p in procs if p in table))
                + f"\nstderr:\n{cmd.err.text()[-TAIL:]}\noutput:\n{cmd.out.text()[-TAIL:]}",
            )
            cmd.kill_group()
        # every process of the command gone within 5 s of its exit (checked before its pipes are
        # drained: a process left behind may hold them open)
        self._settle(rec, cmd, "the stopped run")
        if exited and landed:
            assert fault_at is not None and cmd.ended is not None
            rec.elapsed = round(cmd.ended - fault_at, 3)
            if rec.kind != "kill-worker" and rec.elapsed > STOP_WITHIN:
                rec.problem("slow", f"exit {rec.elapsed:.1f} s after the fault")
        rec.code = cmd.code if exited else None  # after a hang: our SIGKILL's
        rec.published = published(out)
        if rec.before_our_code:
            if (rec.published and rec.kind not in RERUN_KINDS) or rec.code not in (rec.expected, 1, None):
                rec.problem("code", f"exit {rec.code}, published {rec.published}, at Python's own start")
        elif rec.kind not in PIPE_KINDS:
            self._judge_code(rec)
            if exited and rec.code not in (0, None):
                stderr = cmd.err.text()
                errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
                if len(errors) != 1 or "Traceback" in stderr:
                    rec.problem(
                        "stderr",
                        f"{len(errors)} 'error: ' line(s), Traceback {'Traceback' in stderr}:\n{stderr[-TAIL:]}",
                    )
            if rec.kind == "cancel" and rec.landed and rec.code == 4 and self.stack is not None:
                state = self.stack.api("GET", f"/flow_runs/{self._cancelled}")["state"]["type"]
                if state != "CANCELLED":
                    rec.problem("code", f"the flow run ended {state}, not CANCELLED")
        if rec.problems and "stderr" not in rec.problems and rec.kind not in PIPE_KINDS:
            rec.detail += f"stderr:\n{cmd.err.text()[-TAIL:]}\n"
        elif rec.kind in PIPE_KINDS:
            rec.detail += f"the reader got:\n{cmd.out.text()[-500:]}\n"
        self._judge_staging(rec, out, "the stopped run")
        with contextlib.suppress(OSError):
            rec.tmp_left = sorted(os.listdir(tdir / "tmp"))
        if private := [name for name in rec.tmp_left if name.startswith(PRIVATE_DIR_PREFIX)]:
            rec.problem("leftover", f"the temporary API's private directory after the stopped run: {private}")

    def _judge_code(self, rec: TrialRecord) -> None:
        """The exit code against the stop table: a fault after the publish (or none at all) is exit 0
        with the output; a stop code with an output, or exit 0 without one, is wrong."""
        expected = rec.expected if rec.landed else 0
        rec.expected = expected
        if rec.code is None:
            return  # a hang, already counted
        if rec.kind in RERUN_KINDS:  # published before the fault: the code alone says how it ended
            if rec.code not in (0, expected):
                rec.problem("code", f"exit {rec.code}, expected {expected} (or 0: the rerun ended first)")
            return
        if rec.published and rec.code != 0:
            rec.problem("code", f"exit {rec.code} with a published output")
        elif not rec.published and rec.code == 0:
            rec.problem("code", "exit 0 without a published output")
        elif not rec.published and rec.code != expected:
            rec.problem("code", f"exit {rec.code}, expected {expected}")

    def _judge_published_kept(
        self,
        rec: TrialRecord,
        out: Path,
        published_id: str | None,
        forced: bool,
        expected: Path | None = None,
    ) -> None:
        """A stopped rerun of a published output leaves it whole (the same bytes: ``expected``, the trial's
        layout's), and one found up to date leaves it untouched (the same output, not rewritten)."""
        if not published(out):
            rec.problem("code", "the published output is gone after the stopped rerun")
            return
        result = compare(out, expected or self.expected)
        if not result.matches:
            rec.problem("rerun", f"the stopped rerun changed the published bytes:\n{result.render()[-TAIL:]}")
        elif not forced and output_id(out) != published_id:
            rec.problem("rerun", "a rerun of an up-to-date output replaced it")

    @staticmethod
    def _judge_staging(rec: TrialRecord, out: Path, when: str) -> None:
        left = sorted(
            p.name
            for p in out.parent.iterdir()
            if p.name.startswith(f".{out.name}.tmp-") or p.name.startswith(f".{out.name}.old-")
        )
        if left:
            rec.problem("staging", f"after {when}: {left}")

    def _change_trial(self, rec: TrialRecord, rng: random.Random, tdir: Path) -> None:
        """The data changed at a drawn moment: the run either reads one version of it whole (exit 0, that
        version's bytes) or says the file changed (exit 2, one line, nothing published), never an output
        of two versions; then, the data restored, the rerun makes the expected output. (The soak's own
        data file, JSON Lines or its Parquet copy, is changed and restored: its path is in the output's
        statistics. Trials run one at a time.)"""
        assert self.baseline is not None
        data: Path | str = {
            "change-parquet": self.parquet, "change-gzip": self.gzipped, "change-gcs": GCS_DATA
        }.get(rec.kind, self.data)  # fmt: skip
        if rec.kind == "change-gcs":
            data = rng.choice((GCS_DATA, GCS_PARQUET, GCS_GZIP))
        elif rec.kind == "change-gzip" and rng.random() < CHANGE_BZIP2:
            data = self.bzipped  # (sized from its first blocks: its slices begin as its copy is written)
        original = tdir / f"original{Path(data).suffix}"
        shutil.copyfile(self._local_copy(data), original)
        work, out = tdir / "work", tdir / "out"
        argv, env = convert_argv(data, work, out), self._env(rec, tdir / "tmp")
        expected = self.expected if data == self.data else self._version_expected(data, "", env, tdir)
        change, moment = rng.choice(CHANGES), self.early_or_any(rng)
        rec.fault = f"{change} the input at {moment:.2f} s"
        if data in (GCS_PARQUET, GCS_GZIP):
            rec.fault += ", a Parquet object" if data == GCS_PARQUET else ", a gzipped object"
        if data == self.bzipped:
            rec.fault += ", bzip2"
        if Path(data).suffix == ".parquet" and rng.random() < 0.5:  # its row groups read batch by batch
            env[settings.PARQUET_STREAMED_BYTES.name] = str(PARQUET_STREAMED_BYTES)
            rec.fault += ", row groups read by batch, spilled"
            if rec.kind == "change-parquet" and rng.random() < DAMAGE_SPILL:
                rec.fault = rec.fault.replace(f"{change} the input", "damage the spills", 1)
                change = "damage"
        try:
            cmd = Command(self.reaper, argv, env, tdir)
            if cmd.sleep_until(cmd.started + moment):
                if change == "damage":
                    rec.landed = damage_spills(work) > 0
                else:
                    self._change(change, data, tdir)
                    rec.landed = True
                rec.moment = round(time.monotonic() - cmd.started, 3)
            exited = cmd.wait(cmd.started + 3 * self.baseline.wall + HANG_AFTER)
            if not exited:
                rec.problem("hang", f"no exit:\n{cmd.err.text()[-TAIL:]}")
                cmd.kill_group()
            self._settle(rec, cmd, "the run")
        finally:
            self._restore(original, data)  # restored: the rerun makes the expected output
        rec.code, rec.published = (cmd.code if exited else None), published(out)
        stderr = cmd.err.text()
        if change == "damage":  # (the input as it was: its bytes, whatever the spills hold)
            rec.expected = 0
            if rec.code != 0 or not rec.published:
                rec.problem(
                    "code", f"exit {rec.code}, published {rec.published}, spills damaged {rec.landed}"
                )
            elif not compare(out, expected).matches:
                rec.problem("mixed", "the output is not the data's bytes after its spills were damaged")
        elif rec.code == 0:
            rec.expected = 0
            if not rec.published:
                rec.problem("code", "exit 0 without a published output")
            elif not compare(out, expected).matches and not (
                rec.landed and compare(out, self._version_expected(data, change, env, tdir)).matches
            ):
                rec.problem("mixed", "the output is the bytes of neither version of the data")
        elif rec.code is not None:
            errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
            if rec.code != 2 or rec.published or not rec.landed:
                rec.problem("code", f"exit {rec.code}, published {rec.published}, changed {rec.landed}")
            elif len(errors) != 1 or not said_changed(errors[0], Path(data), change) or "Traceback" in stderr:
                rec.problem("stderr", f"{len(errors)} 'error: ' line(s), not one saying the file changed")
        if rec.problems:
            rec.detail += f"stderr:\n{stderr[-TAIL:]}\n"
        self._judge_staging(rec, out, "the run")
        if rec.published:
            shutil.rmtree(out)  # (the other version's, or the expected one: made again)
        self._rerun_command(rec, argv, env, work, out, tdir, reuse=False, expected=expected)

    def _change(self, change: str, data: Path | str, tdir: Path) -> None:
        """One of :data:`CHANGES` to ``data``: a file, or change-gcs's object (replaced by the file's copy
        as the change leaves it)."""
        if isinstance(data, Path):
            change_data(change, data, tdir)
            return
        assert self.gcs is not None
        changed = tdir / f"changed{Path(data).suffix}"
        shutil.copyfile(self._local_copy(data), changed)
        change_data(change, changed, tdir)
        self.gcs.fs.put_file(str(changed), data)

    def _local_copy(self, data: Path | str) -> Path:
        """The soak's own file of ``data``'s rows: ``data`` itself, or the file a gs:// object was put from."""
        return {GCS_DATA: self.data, GCS_PARQUET: self.parquet, GCS_GZIP: self.gzipped}.get(
            str(data), Path(data)
        )

    def _restore(self, original: Path, data: Path | str) -> None:
        if isinstance(data, Path):
            shutil.copyfile(original, data)
        else:
            assert self.gcs is not None
            self.gcs.fs.put_file(str(original), data)

    def _version_expected(
        self, data: Path | str | Mixture, change: str, env: dict[str, str], tdir: Path
    ) -> Path:
        """The output of ``data`` as ``change`` leaves it (``""``: unchanged), made once by a plain run."""
        if isinstance(data, Mixture):
            name = "-mixture" + data.whole.suffix.replace(".", "-")
        else:
            name = {
                GCS_DATA: "gcs",
                GCS_PARQUET: "gcs",
                GCS_GZIP: "gcs",
                HUB_DATASET: "hub",
                HUB_JSON_DATASET: "hub-jsonl",
                HUB_GZIP_DATASET: "hub-jsonl-gz",
                HUB_DECLARED_DATASET: "hub-declared",
                HUB_LOADED_DATASET: "hub-loaded",
            }.get(str(data), "")
            name += Path(data).suffix.replace(".", "-")
        expected = self.root / f"expected{name}-{change or 'unchanged'}"
        if not expected.exists():
            try:
                if change:
                    assert not isinstance(data, Mixture)
                    original = tdir / f"original{Path(data).suffix}"
                    self._change(change, data, tdir)
                started = time.monotonic()
                run = subprocess.run(
                    convert_argv(data, tdir / "version-work", expected),
                    env=env,
                    cwd=tdir,
                    capture_output=True,
                    timeout=300,
                )
            finally:
                if change:
                    self._restore(original, data)
            if run.returncode != 0:
                raise RuntimeError(f"the {change} version's run failed:\n{run.stderr.decode()[-TAIL:]}")
            self.walls[expected] = time.monotonic() - started
        return expected

    def _rerun_command(
        self,
        rec: TrialRecord,
        argv: list[str],
        env: dict[str, str],
        work: Path,
        out: Path,
        tdir: Path,
        reuse: bool = True,
        expected: Path | None = None,
    ) -> None:
        finished = manifests(work)
        rec.finished_before_rerun = finished
        published_id = output_id(out)
        cmd = Command(self.reaper, argv, env, tdir)
        exited = cmd.wait(cmd.started + RERUN_TIMEOUT)
        if not exited:
            cmd.kill_group()
        self._settle(rec, cmd, "the rerun")
        if not exited:
            rec.problem("rerun", f"the rerun ran {RERUN_TIMEOUT:.0f} s:\n{cmd.err.text()[-TAIL:]}")
            return
        rec.rerun_seconds = round((cmd.ended or time.monotonic()) - cmd.started, 2)
        if cmd.code != 0:
            rec.problem("rerun", f"the rerun exited {cmd.code}:\n{cmd.err.text()[-TAIL:]}")
            return
        self._judge_rerun_output(rec, work, out, finished if reuse else 0, "", published_id, expected)

    def _settle(self, rec: TrialRecord, cmd: Command, what: str) -> None:
        """After ``cmd`` ended: every other process gone within 5 s of its exit, then its pipes drained."""
        ended = cmd.ended or time.monotonic()
        left = self.reaper.gone(self.owned(), within=max(0.0, ended + GONE_WITHIN - time.monotonic()))
        if left:
            rec.problem("leftover", f"after {what}:\n" + "\n".join(evidence(left)))
            self.reaper.kill(left)
        if semaphores_left := left_in_shm(set(cmd.semaphores)):
            rec.problem("leftover", f"named semaphores of {what} left in /dev/shm: {semaphores_left}")
        cmd.finish()

    def _judge_rerun_output(
        self,
        rec: TrialRecord,
        work: Path,
        out: Path,
        finished: int,
        log: str,
        published_id: str | None,
        expected: Path | None = None,
    ) -> None:
        result = compare(out, expected or self.expected)
        if not result.matches:
            rec.problem("rerun", f"the rerun's bytes differ:\n{result.render()[-TAIL:]}\n{log[-TAIL:]}")
            return
        if rec.published and output_id(out) == published_id:  # the rerun found it up to date: no rewrite
            self._judge_staging(rec, out, "the rerun")
            return
        report = json.loads((out / "run_report.json").read_text())
        rec.reused = report["slices_reused"]
        if report["slices_reused"] < finished - report.get("slices_rechecked", 0):
            rec.problem(
                "rerun",
                f"{finished} slices were checkpointed before the rerun, it reused {report['slices_reused']} "
                f"(rechecked {report.get('slices_rechecked')})",
            )
        self._judge_staging(rec, out, "the rerun")

    # -- server mode: a deployment run whose `prefect worker` is killed

    def _deployment_run(self, params: dict[str, Any]) -> Command:
        assert self.stack is not None
        argv = [
            str(PREFECT), "deployment", "run", "tokenize-mixer/demo", "--watch", "--watch-interval", "1",
            "--params", json.dumps(params),
        ]  # fmt: skip
        return Command(self.reaper, argv, self.stack.env, ROOT)

    def _worker_trial(self, rec: TrialRecord, rng: random.Random, tdir: Path) -> None:
        """kill -9 of `prefect worker` while slices run: the flow run ends Crashed, its process and pool
        end within 10 s, nothing is published; with a new worker, a deployment run gives the bytes."""
        assert self.stack is not None and self.baseline is not None
        base = self.baseline
        work, out = tdir / "work", tdir / "out"
        params = deployment_params(self.data, work, out)
        delay = rng.uniform(0, max(0.5, 0.8 * (base.wall - base.manifest_at)))
        rec.fault = f"SIGKILL `prefect worker` {delay:.2f} s after the first slice"
        self.stack.ensure_worker()
        watch = self._deployment_run(params)
        deadline = watch.started + HANG_AFTER + 3 * base.wall
        while watch.running() and not manifests(work) and time.monotonic() < deadline:
            time.sleep(0.05)
        fault_at: float | None = None
        killed_at = 0.0  # wall clock, to compare with the output's
        flow_procs: list[int] = []
        held: set[int] = set()  # the flow run's named semaphores
        if watch.running() and watch.sleep_until(time.monotonic() + delay):
            worker = self.stack.worker_pid()
            flow_procs = children(worker)
            flow_procs += [p.pid for f in flow_procs for p in descendants(f)]
            held = set().union(*(semaphores(p) for p in flow_procs))
            if flow_procs and not published(out):
                killed_at = time.time()
                os.kill(worker, signal.SIGKILL)
                fault_at = time.monotonic()
                self.stack.sessions.discard(worker)
                if self.stack.worker is not None and self.stack.worker.pid == worker:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self.stack.worker.wait(5)
        rec.landed = fault_at is not None
        if fault_at is None:
            rec.fault += " (never landed: the run ended first)"
        else:
            rec.moment = round(fault_at - watch.started, 3)
            # the flow run's process and its pool must end within 10 s
            gone_by = fault_at + HANG_AFTER
            while any(alive(p) for p in flow_procs) and time.monotonic() < gone_by:
                self.reaper.reap()
                time.sleep(0.05)
            ended = time.monotonic()
            still = [p for p in flow_procs if alive(p)]
            if still:
                table = processes()
                rec.problem(
                    "hang",
                    "the flow-run process or its pool outlived the worker by 60 s:\n"
                    + "\n".join(evidence(table[p] for p in still if p in table)),
                )
            else:
                rec.elapsed = round(ended - fault_at, 3)
                if rec.elapsed > STOP_WITHIN:
                    rec.problem(
                        "slow", f"the flow-run process and its pool ended {rec.elapsed:.1f} s after the kill"
                    )
                if semaphores_left := left_in_shm(held):
                    rec.problem(
                        "leftover", f"the flow run's named semaphores left in /dev/shm: {semaphores_left}"
                    )
        if not watch.wait((fault_at or watch.started) + HANG_AFTER + (0 if fault_at else 3 * base.wall)):
            rec.problem(
                "hang", f"`prefect deployment run --watch` did not return:\n{watch.out.text()[-TAIL:]}"
            )
            watch.kill_group()
        self._settle(rec, watch, "the crashed flow run")
        rec.code = watch.code
        rec.published = published(out)
        text = watch.out.text() + watch.err.text()
        if rec.landed:
            if rec.published:
                after = os.stat(out).st_ctime - killed_at
                if after > PUBLISHING_AT_THE_KILL or "Completed" not in text:
                    rec.problem(
                        "code",
                        f"a flow run whose worker was killed published its output {after:.3f} s after the kill",
                    )
                else:
                    rec.fault += f" (the run was publishing: published {after:.3f} s after it)"
            elif "Crashed" not in text:
                rec.problem("code", f"the flow run did not end Crashed:\n{text[-TAIL:]}")
        elif not rec.published:
            rec.problem("code", f"no fault landed and nothing was published:\n{text[-TAIL:]}")
        if rec.problems:
            rec.detail += f"`prefect deployment run --watch` said:\n{text[-TAIL:]}\n"
        self._judge_staging(rec, out, "the crashed flow run")
        self.stack.ensure_worker()
        finished = manifests(work)
        rec.finished_before_rerun = finished
        published_id = output_id(out)
        rerun = self._deployment_run(params)
        exited = rerun.wait(rerun.started + RERUN_TIMEOUT)
        if not exited:
            rerun.kill_group()
        self._settle(rec, rerun, "the rerun")
        if not exited:
            rec.problem("rerun", f"the rerun ran {RERUN_TIMEOUT:.0f} s:\n{rerun.out.text()[-TAIL:]}")
            return
        rec.rerun_seconds = round((rerun.ended or time.monotonic()) - rerun.started, 2)
        log = rerun.out.text() + rerun.err.text()
        if rerun.code != 0:
            rec.problem("rerun", f"the rerun's deployment run exited {rerun.code}:\n{log[-TAIL:]}")
            return
        self._judge_rerun_output(rec, work, out, finished, log, published_id)


def deal(kinds: Sequence[str], rng: random.Random) -> list[str]:
    """One deck: every kind once, shuffled, a server-mode kind first when there is one (the stack's
    start is paid up front, and even a soak of a few minutes runs a trial against a real server)."""
    deck = list(kinds)
    rng.shuffle(deck)
    lead = next((k for k in deck if k in SERVER_KINDS), None)
    return deck if lead is None else [lead, *[k for k in deck if k != lead]]


def run_soak(
    trials: int | None = None,
    seconds: float | None = None,
    seed: int = 0,
    kinds: Sequence[str] = KINDS,
    server: bool = True,
    log: Callable[[str], None] = print,
) -> SoakResult:
    """Run ``trials`` trials, or trials for ``seconds`` after the setup (whichever the caller gives; both:
    whichever ends first). Kinds are dealt from decks shuffled with ``seed`` (``deal``), so every kind
    comes up once before any comes up twice; each trial draws its moment and start method from (seed,
    index, kind)."""
    if trials is None and seconds is None:
        raise ValueError("give trials, seconds or both")
    # Trials run as a terminal's foreground job: SIGINT not ignored (a shell ignores it for the
    # background job this may be; a Ctrl-C drawn before the command's first line was then lost).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    soak = Soak(seed, kinds, server, log)
    result = SoakResult(seed=seed, kinds=soak.kinds, setup=soak.setup)
    deck_rng = random.Random(seed)
    deck: list[str] = []
    previous = _stop_on_signals()
    try:
        try:
            soak.prepare()
        except Exception:
            result.aborted = "setup failed:\n" + traceback.format_exc()[-TAIL:]
            log(f"soak seed {seed}: setup failed\n{result.aborted}")
            return result
        began = time.monotonic()
        index = 0
        try:
            while trials is None or index < trials:
                if not deck:
                    if not soak.kinds:
                        break
                    deck = deal(soak.kinds, deck_rng)
                kind = deck.pop(0)
                if kind not in soak.kinds:  # the stack did not start
                    continue
                if (
                    seconds is not None
                    and result.records
                    and time.monotonic() - began + soak.estimate(kind) > seconds
                ):
                    break
                record = soak.trial(index, kind)
                result.records.append(record)
                exit_s = "-" if record.elapsed is None else f"{record.elapsed:.1f} s"
                log(
                    f"[{index}] {kind} ({record.start}; {record.fault}) -> exit {record.code} "
                    f"(expected {record.expected}) after {exit_s}, "
                    f"published {record.published}: {record.verdict.upper()} ({record.seconds:.0f} s)"
                )
                if record.verdict != "pass":
                    log(record.detail[-TAIL:])
                index += 1
        except SoakStopped as stop:  # the trials so far are still a result
            result.aborted = f"{stop} after {len(result.records)} trial(s)"
            log(f"soak seed {seed}: {result.aborted}")
        result.setup["trial_seconds"] = round(time.monotonic() - began, 1)
    finally:
        try:
            soak.close()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return result


class SoakStopped(BaseException):
    """SIGTERM or SIGHUP to the harness: unwound like Ctrl-C, so that its cleanup still runs."""


def _stop_on_signals() -> dict[int, Any]:
    """SIGTERM / SIGHUP (a CI timeout, a closed terminal) raise in the main thread instead of ending the
    harness where it stands, which would leave a trial's processes and the stack running."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def stop(signum: int, _frame: object) -> None:
        raise SoakStopped(f"the soak was stopped by {signal.Signals(signum).name}")

    return {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}


def default_seed() -> int:
    """TOKENIZE_MIXER_SOAK_SEED, else a fresh random seed (printed by the callers, to replay a failure)."""
    env = os.environ.get("TOKENIZE_MIXER_SOAK_SEED")
    return int(env) if env else random.SystemRandom().randrange(1, 10**6)


def kinds_arg(text: str | None) -> list[str]:
    return list(KINDS) if not text else [k.strip() for k in text.split(",") if k.strip()]
