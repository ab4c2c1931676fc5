"""The slice fan-out: one task run per slice on a pool of workers, collected as they finish.

A slice an earlier run finished gets no task run: its checkpoint is read and checked with the others
reused (a task run each cost the Prefect API ~20-40 ms: 1-2 minutes of a resumed 22 B-token run).

A worker that dies (the OOM killer) or a pool that stops answering costs only the slices it held: the
pool is rebuilt and they are retried; a slice that kills its worker by itself is named. Used by the
``tokenize-mixer`` flow and by each batch of the ``tokenize-slices`` flow (``run.runner: work_pool``).
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from prefect import get_run_logger
from prefect.task_runners import ThreadPoolTaskRunner

from sftmix.assembly.outcome import SliceOutcome
from sftmix.config.run_options import RunOptions
from sftmix.errors import MixerError, SliceFailuresError, WorkerDiedError
from sftmix.tokenizing.slices import (
    SliceManifest,
    SliceSpec,
    TokenizeContext,
    push_worker_tokenizer,
    unrecorded_over_length,
    verify_slices,
)
from tokenize_mixer.flows.api.watch import StopCheck
from tokenize_mixer.flows.progress import BOARD, SliceProgress
from tokenize_mixer.flows.workers.head_start import HeadStart, take_head_start
from tokenize_mixer.flows.workers.pool import (
    finished_slices,
    pool_size,
    pool_stalled,
    process_pool,
    run_order,
    runner_name,
    was_running,
    worker_died,
)
from tokenize_mixer.tasks.tokenize import slice_task_for

RunnerFactory = Callable[[int], Any]


def _runner(todo: list[SliceSpec], run: RunOptions) -> tuple[RunnerFactory, int]:
    """A factory of task runners of N workers (so a pool broken by a dead worker can be rebuilt), and N,
    for the slices ``todo``."""
    workers, processes = pool_size(todo, run)
    if run.runner == "dask":
        return (lambda n: _dask_runner(run, n)), workers
    if processes:
        return process_pool, workers
    return (lambda n: ThreadPoolTaskRunner(max_workers=1)), 1


def _dask_runner(run: RunOptions, workers: int):
    from prefect_dask import DaskTaskRunner

    if run.dask_address:
        return DaskTaskRunner(address=run.dask_address)
    return DaskTaskRunner(
        cluster_kwargs={
            "n_workers": workers,
            "threads_per_worker": 1,
            "processes": True,
            "env": {"RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
        }
    )


#: A slice in flight when this many workers died is retried alone, in a pool of one worker: a slice
#: that kills its worker by itself (one row needing more memory than there is) is then named.
SUSPECT_AFTER_DEATHS = 2

#: A run whose pools stop handing back results (:func:`flows.workers.pool.pool_stalled`) this many times fails.
MAX_STALLS = 3


class _Slices:
    """What is known of each slice while the pool runs: its manifest, whether it was a cache hit, its
    failure, how many dead workers it was a casualty of."""

    def __init__(
        self,
        specs: list[SliceSpec],
        started_at: float | None = None,
        head_start: bool = False,
        work_dir: str | None = None,
    ) -> None:
        n = max((s.index for s in specs), default=-1) + 1  # indices are the plan's
        self.manifests: list[SliceManifest | None] = [None] * n
        self.cached = [False] * n
        self.errors: list[tuple[SliceSpec, BaseException]] = []
        self.deaths = [0] * n
        self.stalls = 0  # pools whose management thread ended under them
        # before the progress artifact: an API lost before the fan-out counts from here, not from after
        # that artifact's own wait for it
        self.watch = StopCheck()
        # the head start's slices stay counted; a local work directory's manifests are watched
        self.progress = SliceProgress(specs, keep=head_start, work_dir=work_dir)
        self.done = 0
        # a slice whose manifest is older than this was reused, not computed by this command
        self.started_at = time.time() if started_at is None else started_at


def _run_batch(
    specs: list[SliceSpec],
    task: Any,
    runner: Any,
    ctx: Any,
    state: _Slices,
    watch: StopCheck,
    reuse: bool,
    ahead: dict[str, Future] | None = None,
) -> list[SliceSpec]:
    """Run ``specs`` on ``runner``; returns the slices lost to a dead worker (to retry). ``ahead``: the
    head start's slices, by key (their task runs are submitted once they end)."""
    lost: list[SliceSpec] = []
    with runner:
        params = {"ctx": ctx, "reuse": reuse}
        finished: queue.SimpleQueue = queue.SimpleQueue()

        def submit(spec: SliceSpec) -> Any:
            fut = runner.submit(task, parameters={"spec": spec, **params})
            fut.add_done_callback(finished.put)
            return fut

        pending: dict = {}
        waiting: dict[Future, SliceSpec] = {}  # head-start slices still being tokenized
        try:
            looked = time.monotonic()
            for s in specs:
                early = (ahead or {}).get(s.key)
                if early is not None and not early.done():
                    waiting[early] = s
                else:
                    pending[submit(s)] = s
                if time.monotonic() - looked >= 1.0:  # submitting thousands takes a while: a cancel or a
                    watch.check()  # lost API meanwhile stops the run now, not after the last submit
                    looked = time.monotonic()
            for early in waiting:
                early.add_done_callback(finished.put)
            _collect(pending, finished, state, watch, lost, waiting, submit, runner)
        except BaseException:
            if isinstance(runner, ThreadPoolTaskRunner):  # its exit would run every queued slice first
                for fut in pending:  # (a process pool's workers are killed instead: flows.workers.pool)
                    with contextlib.suppress(Exception):
                        fut.wrapped_future.cancel()
            raise
    return lost


def _collect(
    pending: dict,
    finished: queue.SimpleQueue,
    state: _Slices,
    watch: StopCheck,
    lost: list[SliceSpec],
    waiting: dict[Future, SliceSpec],
    submit: Callable[[SliceSpec], Any],
    runner: Any = None,
) -> None:
    """Take finished slices as they come: record manifests, failures, and slices lost to dead workers
    or to a pool that stopped answering; a head-start slice that ends gets its task run (which finds
    its checkpoint)."""
    logger = get_run_logger()
    total = state.progress.total
    _Collector(pending, finished, state, watch, lost, waiting, submit, runner, logger, total).run()


@dataclass
class _Collector:
    """The work of :func:`_collect`, a method per step; ``lost`` is the caller's list, extended in
    place."""

    pending: dict
    finished: queue.SimpleQueue
    state: _Slices
    watch: StopCheck
    lost: list[SliceSpec]
    waiting: dict[Future, SliceSpec]
    submit: Callable[[SliceSpec], Any]
    runner: Any
    logger: Any
    total: int

    def run(self) -> None:
        """Until every slice of the pool has ended, or the pool stopped answering."""
        while self.pending or self.waiting:
            # Wake every couple of seconds to look for a cancel and a stalled pool (no alarm-based timeout
            # here: an alarm would fire inside the work done for a finished slice)
            try:
                fut = self.finished.get(timeout=self.watch.seconds_to_next_look())
            except queue.Empty:
                self.watch.check()
                self.state.progress.tick()
                if not pool_stalled(self.runner):
                    continue
                fut = self._last_of_a_stalled_pool()
                if fut is None:
                    return
            if fut in self.waiting:
                self._head_start_ended(fut)
            else:
                self._slice_ended(fut)

    def _last_of_a_stalled_pool(self) -> Any:
        """What the pool handed back before its thread ended; else (None) its unfinished slices are
        lost, for a new pool."""
        try:
            return self.finished.get(timeout=0.2)
        except queue.Empty:
            self.state.stalls += 1
            self.logger.warning(
                "the worker pool stopped handing back results (its management thread ended); "
                "its %d unfinished slice(s) go to a new pool",
                len(self.pending) + len(self.waiting),
            )
            self.lost += [*self.pending.values(), *self.waiting.values()]
            return None

    def _head_start_ended(self, fut: Future) -> None:
        """A head-start slice ended: lost with its worker, or handed to its task run."""
        spec = self.waiting.pop(fut)
        exc = None if fut.cancelled() else fut.exception()
        if exc is not None and worker_died(exc):
            self.lost.append(spec)
            self.state.deaths[spec.index] += 1
        else:  # done, or failed: the task run reuses it, or meets the failure and reports it
            self.pending[self.submit(spec)] = spec

    def _slice_ended(self, fut: Any) -> None:
        """A slice's task run ended: its manifest recorded, or its failure, or it was lost with its
        worker."""
        spec = self.pending.pop(fut)
        try:
            m = SliceManifest.model_validate(fut.result())
        except Exception as exc:  # collected: finished slices stay checkpointed
            if worker_died(exc):
                self.lost.append(spec)
                if was_running(fut):  # queued slices were not in the dead worker's hands
                    self.state.deaths[spec.index] += 1
                return
            self.state.errors.append((spec, exc))
            self.state.progress.failed(spec)
            self.logger.error("slice %s failed: %s", spec.describe(), exc)
            return
        self._record(spec, fut, m)
        self.watch.check()

    def _record(self, spec: SliceSpec, fut: Any, m: SliceManifest) -> None:
        """A finished slice: counted, its manifest kept, and whether it was reused."""
        state = self.state
        state.done += 1
        state.manifests[spec.index] = m
        # reused: Prefect's cache answered, or the slice's own manifest from an earlier run did
        state.cached[spec.index] = fut.state.name == "Cached" or m.timing.finished_at < state.started_at
        state.progress.advance(spec, m.rows, m.tokens, reused=state.cached[spec.index])
        verb = (
            "reused"
            if state.cached[spec.index]
            else f"done in {m.timing.seconds:.1f}s ({m.tokens / max(m.timing.seconds, 1e-9):,.0f} tok/s)"
        )
        self.logger.debug(  # a line per slice is a debug line: the progress lines summarise them
            "[%d/%d] %s: %d rows, %d tokens, %s",
            state.done,
            self.total,
            spec.describe(),
            m.rows,
            m.tokens,
            verb,
        )


def _run_all(
    specs: list[SliceSpec],
    task: Any,
    make_runner: RunnerFactory,
    workers: int,
    ctx: TokenizeContext,
    state: _Slices,
    reuse: bool = True,
    head: HeadStart | None = None,
) -> None:
    """Run ``specs``, rebuilding the pool when a worker dies; a slice lost to dead workers twice runs
    alone, and one that kills its worker alone fails the run, named. The first pool is ``head``'s
    when there is one."""
    logger = get_run_logger()
    watch = state.watch
    todo = specs
    while todo:
        suspects = [s for s in todo if state.deaths[s.index] >= SUSPECT_AFTER_DEATHS]
        others = [s for s in todo if state.deaths[s.index] < SUSPECT_AFTER_DEATHS]
        todo = []
        if state.stalls >= MAX_STALLS:
            raise SliceFailuresError(
                f"the worker pool stopped handing back results {state.stalls} times; the finished slices "
                "are checkpointed and a rerun recomputes only the others"
            )
        for spec in suspects:
            deaths = state.deaths[spec.index]
            if not _run_batch([spec], task, make_runner(1), ctx, state, watch, reuse):
                continue
            if state.deaths[spec.index] == deaths:  # the pool stalled: not this slice's doing
                todo.append(spec)
                continue
            state.errors.append((spec, WorkerDiedError(
                f"slice {spec.describe()} killed the worker process tokenizing it "
                f"{state.deaths[spec.index]} times, the last time alone (out of memory? a row "
                "of it needs more than this machine has; the system log names the killer)"
            )))  # fmt: skip
        if others:
            if head is not None:
                runner, ahead, head = head.pool, head.claim(), None
            else:
                runner, ahead = make_runner(workers), None
            stalls = state.stalls
            lost = _run_batch(others, task, runner, ctx, state, watch, reuse, ahead)
            if lost:
                logger.warning(
                    "%s; rebuilding the pool and retrying the %d unfinished slice(s): %s",
                    "the pool stopped answering"
                    if state.stalls > stalls
                    else "a worker process died (killed, or out of memory)",
                    len(lost),
                    ", ".join(s.describe() for s in lost[:5]) + (" ..." if len(lost) > 5 else ""),
                )
                todo += lost
        todo = run_order(todo)


def run_slice_specs(specs: list[SliceSpec], ctx: TokenizeContext, run: RunOptions) -> SliceOutcome:
    """Tokenize every slice (reusing finished ones), distrusting cached files until they verify."""
    logger = get_run_logger()
    push_worker_tokenizer(ctx)  # workers on other machines read it from the remote work directory
    head = take_head_start(specs, ctx, run)
    if head is not None:
        make_runner: RunnerFactory = process_pool
        workers = head.workers
        _say_head_start(specs, head, logger)
    started = time.perf_counter()
    state = _Slices(
        specs,
        started_at=head.started_at if head is not None else None,
        head_start=head is not None,
        work_dir=None if ctx.output.remote_work_dir is not None or run.force_recache else ctx.output.work_dir,
    )
    # finished by an earlier run (one this command's head start finished gets its task run as it ends)
    earlier = {
        k: m for k, m in finished_slices(specs, ctx, run).items() if m.timing.finished_at < state.started_at
    }
    todo = [s for s in specs if s.key not in earlier]
    if head is None:
        make_runner, workers = _runner(todo, run)
        if todo:
            logger.info(
                "%d slices on %d worker(s) (%s)", len(todo), workers, runner_name(make_runner(workers))
            )
    _reuse_earlier(specs, earlier, state, logger)
    task = slice_task_for(ctx, refresh=run.force_recache, cache=not run.disable_cache)
    try:
        _run_all(
            run_order(todo),
            task,
            make_runner,
            workers,
            ctx,
            state,
            reuse=not run.force_recache,
            head=head,
        )
    finally:
        BOARD.stop_watching()  # (the watcher would otherwise look for slices a failed run never made)
    _raise_failures(specs, state)
    stale = _recompute_untrustworthy(specs, ctx, state, make_runner, workers, logger)
    done = [s for s in sorted(specs, key=lambda s: s.index) if state.manifests[s.index] is not None]
    return SliceOutcome.of(
        [state.manifests[s.index] for s in done],  # type: ignore[misc]  # done: those with a manifest
        [state.cached[s.index] for s in done],
        time.perf_counter() - started,
        rechecked=len(stale),
    )


def _say_head_start(specs: list[SliceSpec], head: HeadStart, logger: Any) -> None:
    """The run's pool is the head start's: its size, and how many slices it began before the flow."""
    begun = sum(f.running() or f.done() for f in head.futures.values())
    logger.info(
        "%d slices on %d worker(s) (%s), %d begun while the Prefect API started",
        len(specs),
        head.workers,
        runner_name(head.pool),
        begun,
    )


def _reuse_earlier(
    specs: list[SliceSpec], earlier: dict[str, SliceManifest], state: _Slices, logger: Any
) -> None:
    """The slices an earlier run finished count as done and reused, with no task run; their files are
    checked with the other reused ones."""
    if earlier:
        logger.info(
            "%d of the %d slices were finished by an earlier run: reused, their files checked below",
            len(earlier),
            len(specs),
        )
    reused = [(spec, m) for spec in specs if (m := earlier.get(spec.key)) is not None]
    for spec, m in reused:
        state.manifests[spec.index], state.cached[spec.index] = m, True
    state.done += len(reused)
    state.progress.reused([(spec, m.rows, m.tokens) for spec, m in reused])


def _raise_failures(specs: list[SliceSpec], state: _Slices) -> None:
    """A run with failed slices fails, naming the first; the others stay checkpointed."""
    if state.errors:
        spec, first = state.errors[0]
        n = len(specs)
        raise SliceFailuresError(
            f"{len(state.errors)} of {n} slices failed; the {n - len(state.errors)} others are "
            f"checkpointed and a rerun recomputes only the failed ones. First failure, {spec.describe()}: "
            + (str(first) if isinstance(first, MixerError) else f"{type(first).__name__}: {first}")
        ) from first


def _recompute_untrustworthy(
    specs: list[SliceSpec],
    ctx: TokenizeContext,
    state: _Slices,
    make_runner: RunnerFactory,
    workers: int,
    logger: Any,
) -> list[SliceSpec]:
    """Recompute the cached slices whose files do not verify; returns them."""
    stale = _untrustworthy(specs, ctx, state, logger)
    if stale:
        for spec in stale:
            state.manifests[spec.index] = None
        _run_all(stale, slice_task_for(ctx, refresh=True), make_runner, workers, ctx, state, reuse=False)
        if state.errors:
            spec, first = state.errors[0]
            raise SliceFailuresError(
                f"recomputing untrustworthy slice {spec.describe()} failed: {first}"
            ) from first
        for spec in stale:
            state.cached[spec.index] = False
    return stale


def _untrustworthy(
    specs: list[SliceSpec], ctx: TokenizeContext, state: _Slices, logger: Any
) -> list[SliceSpec]:
    """The cached slices whose files do not verify, each said in a warning."""
    manifests = state.manifests
    stale = []
    # Cached slices are distrusted until their files verify; with a remote work directory, a slice
    # computed on another machine is fetched here (its digests checked on the way).
    checked = [s for s in specs if state.cached[s.index] or ctx.output.remote_work_dir is not None]
    problems = verify_slices(
        ctx.output.work_dir,
        [(manifests[s.index], state.cached[s.index]) for s in checked],  # type: ignore[misc]  # none failed (raised above): each has one
        ctx.output.remote_work_dir,
    )
    for spec, problem in zip(checked, problems, strict=True):
        problem = unrecorded_over_length(ctx, manifests[spec.index]) or problem  # type: ignore[arg-type]  # (as above)
        if problem is not None:
            logger.warning("cached slice %s is not trustworthy (%s): recomputing", spec.describe(), problem)
            stale.append(spec)
    return stale
