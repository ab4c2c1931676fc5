"""Tokenizing while the temporary Prefect API starts, so its seconds of start-up are not idle cores.

A command without a Prefect server starts one (``flows.api.runtime``); until it answers, no flow or task
run can exist. The plan does not need it: once the plan is known, the head start opens the run's
process pool and gives its workers the slices the flow would run last. When the flow reaches its
fan-out it takes over that same pool (:func:`take_head_start`): slices the head start finished are
checkpoints on disk, so their task runs find them and return at once; a slice still being tokenized
gets its task run when it ends; queued ones are cancelled and run as ordinary tasks. So every slice is
still a Prefect task run with its result persisted, nothing is tokenized twice, and the run counts the
head start's slices as computed by this command (they finished after it began).

With a configured server, the flow run's own start (about a second) is the head start's. Only the
plain case gets one: a local work directory, process pool, neither ``force_recache`` nor
``disable_cache``. Anything unexpected (an error planning, a broken pool, a plan the flow sees
differently) discards it: the flow then runs as it would without one, and the slices the head start
finished are reused as checkpoints.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the command enters head_start_scope before the API starts
    from sftmix.config.config import MixerConfig
    from sftmix.config.run_options import RunOptions
    from sftmix.planning.plan import Plan
    from sftmix.planning.slicing import EarlySlice
    from sftmix.tokenizing.slices import SliceSpec, TokenizeContext

logger = logging.getLogger(__name__)


class HeadStart:
    """A running process pool with slices of the plan submitted to it: the flow's last ones, or a large
    file's first ones while the plan still reads the rest (:func:`early_start`)."""

    def __init__(self, ctx: TokenizeContext, workers: int) -> None:
        from tokenize_mixer.flows.workers.pool import process_pool

        self.started_at = time.time()
        self.ctx = ctx
        self.workers = workers
        self.keys: set[str] = set()
        self.specs: dict[str, SliceSpec] = {}
        self.futures: dict[str, Future] = {}
        self.pool = process_pool(workers)
        global _pending
        with _lock:  # known before any worker starts: a stop from here on closes it (head_start_scope)
            stale, _pending = _pending, self
        if stale is not None:
            stale.close()
        self.pool.__enter__()

    def submit(self, specs: Iterable[SliceSpec]) -> None:
        from tokenize_mixer.tasks.tokenize import tokenize_ahead

        executor = self.pool._executor
        assert executor is not None
        for s in specs:
            if s.key in self.keys:
                continue
            self.keys.add(s.key)
            self.specs[s.key] = s
            self.futures[s.key] = fut = executor.submit(tokenize_ahead, s, self.ctx)
            fut.add_done_callback(functools.partial(_count_finished, s))

    def count(self, plan: list[SliceSpec]) -> None:
        """The command's bar counts the plan's slices from now on, these included as they finish (and
        those that finished before the plan was whole)."""
        from tokenize_mixer.flows.progress import BOARD

        BOARD.begin(plan)
        for key, fut in list(self.futures.items()):
            if fut.done():
                _count_finished(self.specs[key], fut)

    def broken(self) -> bool:
        return self.pool.broken()

    def claim(self) -> dict[str, Future]:
        """Stop here: slices not begun are cancelled (the flow runs them); returns the others by key,
        finished or still being tokenized."""
        for fut in self.futures.values():
            fut.cancel()
        return {key: fut for key, fut in self.futures.items() if not fut.cancelled()}

    def close(self) -> None:
        """Kill the workers: what they were tokenizing is unfinished, and a rerun recomputes it."""
        self.pool.kill_workers()
        with contextlib.suppress(Exception):
            self.pool.__exit__(RuntimeError, RuntimeError("head start discarded"), None)


def _count_finished(spec: SliceSpec, fut: Future) -> None:
    from tokenize_mixer.flows.progress import BOARD

    if not fut.cancelled() and fut.exception() is None:
        manifest = fut.result()
        BOARD.finished(spec, manifest["rows"], manifest["tokens"], reused=False)


_lock = threading.Lock()
_pending: HeadStart | None = None


def _applies(run: RunOptions) -> bool:
    """Runs that use a local process pool the plain way (the work directory is checked on the plan)."""
    return run.runner in ("auto", "process") and not (run.force_recache or run.disable_cache)


def _take_pending() -> HeadStart | None:
    global _pending
    with _lock:
        head, _pending = _pending, None
    return head


def plan_ahead(mixer: MixerConfig, run: RunOptions, early: EarlySlice | None = None) -> Plan | None:
    """The flow's plan and its output and disk checks, made while the API starts. A user's error (a
    :class:`~sftmix.errors.MixerError`: a dataset that cannot be opened, an output that holds other
    shards, a disk too small) is raised, so that the command refuses before a flow run exists; any other error is left to
    the flow's own plan, which meets it and reports it properly (``None``)."""
    from sftmix.errors import MixerError
    from sftmix.output.output_dir import refuse_different_output
    from sftmix.planning.free_space import refuse_short_disk
    from sftmix.planning.plan import build_plan

    try:
        plan = build_plan(mixer, run, early)
        refuse_different_output(mixer.output.path, mixer.output.overwrite, plan.recipe())
        refuse_short_disk(plan)
    except MixerError:
        raise
    except Exception as exc:
        logger.debug("no plan ahead of the flow: %s: %s", type(exc).__name__, exc)
        return None
    return plan


def begin_head_start(mixer: MixerConfig, run: RunOptions, plan: Plan | None = None) -> None:
    """Start tokenizing ``plan`` (by default, a plan made here), where the flow would use a local process
    pool; without a plan (planning failed, errors included) there is no head start, and errors are left
    to the flow's own plan."""
    if not _applies(run):
        return
    from tokenize_mixer.flows.workers.pool import pool_size, run_order, slices_to_compute

    if plan is None:
        try:
            plan = plan_ahead(mixer, run)
        except Exception as exc:
            logger.debug("no head start: planning failed (%s: %s)", type(exc).__name__, exc)
            return
    if plan is None:
        return
    ctx = plan.context
    if ctx.output.remote_work_dir is not None:
        return
    todo = slices_to_compute(plan.slices, ctx, run)
    head = _pending
    if head is None or head.ctx != ctx:  # (none began while the plan read a large file)
        workers, processes = pool_size(todo, run)
        if not todo or not processes:
            return
        head = HeadStart(ctx, workers)  # registers itself as the pending head start
    head.count(plan.slices)
    # From the end of the flow's order: the flow submits from the front, so the two meet last.
    head.submit(reversed(run_order(todo)))


def early_start(run: RunOptions) -> EarlySlice | None:
    """What the plan hands the slices it cuts while it still reads a large file: they begin on a head
    start's pool at once (``None`` where the flow would not use a local process pool)."""
    if not _applies(run):
        return None
    from sftmix.runtime.parallel import available_cpus
    from sftmix.tokenizing.slices import read_manifest

    workers = run.workers or available_cpus()
    if not (run.runner == "process" or workers > 1):
        return None

    def begin(spec: SliceSpec, ctx: TokenizeContext) -> None:
        if ctx.output.remote_work_dir is not None or read_manifest(ctx.output.work_dir, spec.key) is not None:
            return
        head = _pending
        if head is None:
            head = HeadStart(ctx, workers)
        elif head.ctx != ctx:
            return
        head.submit([spec])

    return begin


def take_head_start(specs: list[SliceSpec], ctx: TokenizeContext, run: RunOptions) -> HeadStart | None:
    """The head start begun for exactly these slices, now the flow's; ``None`` (and any other discarded)
    otherwise."""
    head = _take_pending()
    if head is None:
        return None
    if head.broken():
        logger.warning(
            "a worker process of the start-up pool died (killed, or out of memory): that pool is closed, "
            "its finished slices are reused and the others run on a new pool"
        )
    elif head.ctx == ctx and head.keys <= {s.key for s in specs} and _applies(run):
        return head
    else:
        logger.info("the slices tokenized during start-up do not match this run's plan: discarded")
    head.close()
    return None


@contextlib.contextmanager
def head_start_scope() -> Iterator[None]:
    """Around a command: a head start the flow never took (it failed or stopped first) is closed."""
    try:
        yield
    finally:
        head = _take_pending()
        if head is not None:
            head.close()
