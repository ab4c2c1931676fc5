"""Progress a person can watch at any scale.

One board per process (:data:`BOARD`) counts the run's finished slices by their place in the plan,
whoever finished them: the head start while the Prefect API starts, then the flow's fan-out. So a slice
is counted once, as it finishes, not when the flow gets round to it. From the board:

- the flow logs one summary line every :func:`line_seconds` (the UI's logs, a Prefect worker's console,
  a log file) instead of a line per slice (those are debug lines), and keeps the UI's progress artifact
  in step;
- the command shows a live bar on a terminal, and elsewhere prints the same summary line itself (it
  sees the head start's slices before a flow run exists); the flow's lines stay off its console.

The rate is over the last :data:`WINDOW` seconds of slices computed (reused ones are done but cost no
time), and the time left is the input bytes still to do over the bytes per second of that window.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sftmix.runtime import settings
from sftmix.runtime.read_progress import duration_text

if TYPE_CHECKING:
    from sftmix.tokenizing.slices import SliceSpec

logger = logging.getLogger(__name__)

#: Seconds of computed slices the rate and the time left are measured over.
WINDOW = 30.0

#: ``extra=`` of the flow's periodic progress lines: the command's console leaves them out (it shows its
#: own bar or lines, which also count the head start's slices).
PROGRESS_LOG = {"tokenize_mixer_progress": True}


def is_progress_record(record: logging.LogRecord) -> bool:
    return bool(getattr(record, "tokenize_mixer_progress", False))


def line_seconds() -> float:
    """Seconds between two summary lines (``TOKENIZE_MIXER_PROGRESS_SECONDS``, default 10)."""
    return settings.progress_seconds()


def _count(n: float) -> str:
    for size, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f}"


@dataclass(frozen=True)
class ProgressFacts:
    """What the board knows at one moment."""

    done: int
    total: int
    reused: int
    failed: int
    rows: int
    tokens: int
    bytes_done: int
    bytes_total: int
    elapsed: float
    tokens_per_second: float  # over the last WINDOW seconds of computed slices
    rows_per_second: float
    seconds_left: float | None  # None until a computed slice gives a rate

    @property
    def fraction(self) -> float:
        if self.bytes_total > 0:
            return min(1.0, self.bytes_done / self.bytes_total)
        return self.done / max(self.total, 1)

    def counts(self) -> str:
        return f"{self.done:,}/{self.total:,} slices ({self.reused:,} reused, {self.failed:,} failed)"

    def rate(self) -> str:
        if not self.tokens_per_second:
            return f"no slice computed in the last {WINDOW:.0f} s" if self.done > self.reused else "starting"
        return f"{_count(self.tokens_per_second)} tokens/s, {_count(self.rows_per_second)} rows/s"

    def left(self) -> str:
        if self.done >= self.total:
            return "tokenizing done"
        return (
            "time left unknown yet"
            if self.seconds_left is None
            else f"about {duration_text(self.seconds_left)} left"
        )

    def short(self) -> str:
        """For the terminal's bar, beside its percentage: '30/81 slices, 2 reused, 6.0 k tok/s, 4 s left'."""
        parts = [f"{self.done:,}/{self.total:,} slices", f"{self.reused:,} reused"]
        if self.failed:
            parts.append(f"{self.failed:,} failed")
        if self.tokens_per_second:
            parts.append(f"{_count(self.tokens_per_second)} tok/s")
        if self.done >= self.total:
            parts.append("assembling")
        elif self.seconds_left is not None:
            parts.append(f"{duration_text(self.seconds_left)} left")
        return ", ".join(parts)

    def line(self) -> str:
        """The summary line: 'progress 340/1,105 slices (12 reused, 0 failed), 31% of the input, ...'."""
        rate = self.rate() + (f" (last {WINDOW:.0f} s)" if self.tokens_per_second else "")
        return (
            f"progress {self.counts()}, {100 * self.fraction:.0f}% of the input, {rate}, {self.left()}, "
            f"{duration_text(self.elapsed)} in"
        )


Listener = Callable[[ProgressFacts], None]


class Board:
    """The run's finished slices, counted once each, with the recent rate."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []
        self._reset({})

    def _reset(self, plan: dict[int, tuple[str, int]], work_dir: str | None = None) -> None:
        self.plan = plan  # index -> (key, estimated input bytes)
        self.seen: set[int] = set()
        self.reused = self.failed = self.rows = self.tokens = self.bytes_done = 0
        self.started = time.monotonic()
        self.started_at = time.time()
        self.recent: deque[tuple[float, int, int, int]] = deque()  # (when, bytes, tokens, rows) computed
        self.partial: dict[int, float] = {}  # running slices' input bytes done, as their workers note them
        self.computed = 0  # input bytes of the slices computed (not reused) so far
        self.samples: deque[tuple[float, float]] = deque()  # (when, bytes computed, running slices' too)
        self.work_dir = work_dir
        self.generation = getattr(self, "generation", 0) + 1
        self._watching = 0  # the generation whose manifest watcher runs

    @property
    def active(self) -> bool:
        return bool(self.plan)

    def begin(self, specs: Iterable[SliceSpec], keep: bool = False, work_dir: str | None = None) -> None:
        """Count these slices from now on; with ``keep`` (the flow taking over the head start's pool),
        the same slices keep what was counted. With a local ``work_dir``, a thread also looks for their
        manifests every second: a slice is counted when its worker writes it, not when the orchestrator
        hands its result back (seconds, up to a minute, later on a busy machine)."""
        specs = list(specs)
        plan = {s.index: (s.key, s.est_bytes) for s in specs}
        with self._lock:
            if not keep or plan != self.plan:
                self._reset(plan, work_dir)
            if work_dir is not None and self._watching != self.generation:
                # also when the flow keeps the head start's count: the head start had no watcher
                self.work_dir, self._watching = work_dir, self.generation
                watcher = threading.Thread(
                    target=self._watch,
                    args=(self.generation, specs),
                    name="progress-manifests",
                    daemon=True,
                )
                watcher.start()
        self._tell()

    def stop_watching(self) -> None:
        """The fan-out ended (done, failed or stopped): its manifest watcher ends too."""
        with self._lock:
            self.generation += 1

    def _watch(self, generation: int, specs: list[SliceSpec]) -> None:
        from sftmix.tokenizing.slices import read_manifest, read_progress, slice_dir

        todo = {s.index: s for s in specs}
        earlier: dict[int, tuple[int, int]] = {}  # index -> (inode, mtime) of an earlier run's manifest
        while todo and self.generation == generation:
            for index in [i for i in todo if i in self.seen]:
                del todo[index]
            for index, spec in list(todo.items()):
                if self.generation != generation:
                    return
                root = slice_dir(self.work_dir or "", spec.key)
                try:
                    st = (root / "manifest.json").stat()
                except OSError:
                    if (share := read_progress(root, self.started_at)) is not None:
                        self._running(spec, share)
                    continue
                if earlier.get(index) == (st.st_ino, st.st_mtime_ns):
                    continue
                m = read_manifest(self.work_dir or "", spec.key)
                if m is None:
                    continue
                if m.timing.finished_at < self.started_at:
                    # an earlier run's: the flow counts it if it reuses the slice; a slice it computes
                    # again is counted when its new manifest replaces this one
                    earlier[index] = (st.st_ino, st.st_mtime_ns)
                    continue
                self.finished(spec, m.rows, m.tokens, reused=False)
                del todo[index]
            self._sample()
            time.sleep(1.0)

    def _running(self, spec: SliceSpec, share: float) -> None:
        """A running slice's worker has done ``share`` of its rows: the bar and the time left move before it
        ends (a slice of a large file runs for minutes)."""
        with self._lock:
            if self.plan.get(spec.index, (None,))[0] == spec.key and spec.index not in self.seen:
                self.partial[spec.index] = share * spec.est_bytes

    def _sample(self) -> None:
        """The bytes done now, running slices' shares with them: what the time left is measured from."""
        with self._lock:
            now = time.monotonic()
            self.samples.append((now, self.computed + sum(self.partial.values())))
            while self.samples and self.samples[0][0] < now - WINDOW:
                self.samples.popleft()
        self._tell()

    def finished(self, spec: SliceSpec, rows: int, tokens: int, reused: bool) -> None:
        with self._lock:
            if self.plan.get(spec.index, (None,))[0] != spec.key or spec.index in self.seen:
                return
            self.seen.add(spec.index)
            self.partial.pop(spec.index, None)
            self.rows += rows
            self.tokens += tokens
            self.bytes_done += spec.est_bytes
            if reused:
                self.reused += 1
            else:
                self.computed += spec.est_bytes
                self.recent.append((time.monotonic(), spec.est_bytes, tokens, rows))
        self._tell()

    def failed_slice(self, spec: SliceSpec) -> None:
        with self._lock:
            if spec.index in self.seen or spec.index not in self.plan:
                return
            self.seen.add(spec.index)
            self.partial.pop(spec.index, None)
            self.failed += 1
        self._tell()

    def facts(self) -> ProgressFacts:
        now = time.monotonic()
        with self._lock:
            while self.recent and self.recent[0][0] < now - WINDOW:
                self.recent.popleft()
            span = max(min(WINDOW, now - self.started), 1e-3)
            nbytes = sum(r[1] for r in self.recent) / span
            tokens = sum(r[2] for r in self.recent) / span
            rows = sum(r[3] for r in self.recent) / span
            bytes_total = sum(b for _, b in self.plan.values())
            done = self.bytes_done + int(sum(self.partial.values()))
            if len(self.samples) >= 2 and self.samples[-1][0] - self.samples[0][0] >= 2.0:
                (t0, b0), (t1, b1) = self.samples[0], self.samples[-1]
                if b1 > b0:  # the running slices' notes with the ended ones: a rate before any has ended
                    nbytes = (b1 - b0) / (t1 - t0)
            left = (bytes_total - done) / nbytes if nbytes > 0 else None
            return ProgressFacts(
                done=len(self.seen),
                total=len(self.plan),
                reused=self.reused,
                failed=self.failed,
                rows=self.rows,
                tokens=self.tokens,
                bytes_done=done,
                bytes_total=bytes_total,
                elapsed=now - self.started,
                tokens_per_second=tokens,
                rows_per_second=rows,
                seconds_left=left,
            )

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    def _tell(self) -> None:
        if not self._listeners:
            return
        facts = self.facts()
        for listener in list(self._listeners):
            with contextlib.suppress(Exception):  # a view: never a reason to fail a slice
                listener(facts)


BOARD = Board()

#: Seconds without progress-artifact updates after one failed.
ARTIFACT_PAUSE_SECONDS = 30.0


class SliceProgress:
    """The flow's side: counts its slices on the board, logs a summary line every few seconds and keeps
    the UI's progress artifact in step (at most every ``every_seconds``)."""

    def __init__(
        self,
        specs: list[SliceSpec],
        every_seconds: float = 2.0,
        keep: bool = False,
        work_dir: str | None = None,
    ) -> None:
        from prefect.artifacts import create_progress_artifact

        from tokenize_mixer.flows.api.watch import no_retries

        self.total = len(specs)
        BOARD.begin(specs, keep, work_dir)
        self.every = every_seconds
        self._last_artifact = self._last_line = time.monotonic()
        self._said_complete = self._artifact_complete = False
        self.artifact = None
        self._artifact_paused_until = 0.0
        # progress in the UI is a view: never a reason to fail, nor to wait (Prefect's client retries a
        # refused connection for minutes; an API lost meanwhile is the run's watch's to notice)
        with contextlib.suppress(Exception), no_retries():
            self.artifact = create_progress_artifact(
                progress=0.0, key="tokenize-mixer-progress", description=f"Slices tokenized (of {self.total})"
            )

    def advance(self, spec: SliceSpec, rows: int, tokens: int, reused: bool = False) -> None:
        BOARD.finished(spec, rows, tokens, reused)
        self.tick()

    def reused(self, finished: list[tuple[SliceSpec, int, int]]) -> None:
        """Slices an earlier run finished, as ``(spec, rows, tokens)``: counted together, with one look at
        the artifact and the log (one each per slice, thousands of API calls on a resumed run)."""
        for spec, rows, tokens in finished:
            BOARD.finished(spec, rows, tokens, reused=True)
        self.tick()

    def failed(self, spec: SliceSpec) -> None:
        BOARD.failed_slice(spec)
        self.tick()

    def tick(self) -> None:
        """Called as slices finish and whenever the fan-out wakes (every couple of seconds)."""
        from prefect import get_run_logger

        now = time.monotonic()
        facts = BOARD.facts()
        complete = facts.done >= facts.total
        # complete: said once (with every slice's manifest on disk the board is complete from the start of
        # a rerun, and an update per finished slice was an API call each)
        if now - self._last_artifact >= self.every or (complete and not self._artifact_complete):
            self._last_artifact, self._artifact_complete = now, complete
            self._update_artifact(
                progress=100.0 * facts.done / max(facts.total, 1),
                description=f"{facts.counts()}; {facts.rate()}; {facts.left()}",
            )
        if self._said_complete:
            return
        if now - self._last_line >= line_seconds() or complete:
            self._last_line, self._said_complete = now, complete
            get_run_logger().info(facts.line(), extra=PROGRESS_LOG)

    def _update_artifact(self, **fields: object) -> None:
        if self.artifact is None or time.monotonic() < self._artifact_paused_until:
            return
        from prefect.artifacts import update_progress_artifact

        from tokenize_mixer.flows.api.watch import no_retries

        try:
            with no_retries():  # an API that does not answer at once: skip this update, not wait
                update_progress_artifact(self.artifact, **fields)  # type: ignore[arg-type]  # a sync call's UUID; progress, description
        except Exception as exc:  # the API may be gone; the run's own watch decides what that means
            # not asked again for a while: each try at an API that refuses costs seconds of connect
            # retries, which the watch (looking every couple of seconds) would wait behind
            self._artifact_paused_until = time.monotonic() + ARTIFACT_PAUSE_SECONDS
            logger.warning("could not update the progress artifact: %s: %s", type(exc).__name__, exc)
