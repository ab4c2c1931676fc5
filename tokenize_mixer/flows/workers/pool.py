"""Prefect's process pool, made to stop at once and to survive a dead worker.

- When the run stops (a signal, a cancel, an error), the workers are killed rather than waited for:
  their slices were unfinished and a rerun recomputes them from scratch.
- A worker that dies (the OOM killer's SIGKILL) breaks a ``ProcessPoolExecutor`` and fails every
  slice in flight with ``BrokenProcessPool``; :func:`worker_died` tells those failures apart so the
  flow can rebuild the pool and retry them. The broken pool's other workers are killed.
- A pool started ahead of the flow (``flows.workers.head_start``) is handed to it already running.
- Each worker keeps one Prefect client for all its task runs (:class:`_ClientKeepingExecutor`).
- In the command, workers are forked from a server that imported their modules once
  (``flows.workers.worker_start``), not spawned as fresh interpreters that each import them.

Also here: which slices still need computing, in which order, and on how many workers.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from prefect.settings import get_current_settings
from prefect.task_runners import ProcessPoolTaskRunner

from sftmix.config.run_options import RunOptions
from sftmix.runtime.parallel import available_cpus
from sftmix.runtime.processes import start_resource_tracker, stop_signals_blocked
from sftmix.tokenizing.slices import (
    SliceManifest,
    SliceSpec,
    TokenizeContext,
    read_manifest,
    unrecorded_over_length,
)
from tokenize_mixer.flows.workers.worker_start import start_method

#: Below this many rows to tokenize, worker start-up (imports, tokenizer load) costs more than it saves.
SMALL_JOB_ROWS = 2000


def finished_slices(
    specs: list[SliceSpec], ctx: TokenizeContext, run: RunOptions
) -> dict[str, SliceManifest]:
    """The manifests of the slices with a checkpoint, by key (none when the run recomputes every slice).
    Read on threads: a remote work directory's are objects, thousands at 22 B tokens."""
    if run.force_recache or run.disable_cache or not specs:
        return {}
    with ThreadPoolExecutor(max_workers=min(32, len(specs)), thread_name_prefix="manifests") as pool:
        found = list(
            pool.map(lambda s: read_manifest(ctx.output.work_dir, s.key, ctx.output.remote_work_dir), specs)
        )
    # (a slice made before its over-length rows were recorded is made again where the run reads them)
    return {
        s.key: m
        for s, m in zip(specs, found, strict=True)
        if m is not None and unrecorded_over_length(ctx, m) is None
    }


def slices_to_compute(specs: list[SliceSpec], ctx: TokenizeContext, run: RunOptions) -> list[SliceSpec]:
    """The slices without a checkpoint on disk (the others are reused)."""
    finished = finished_slices(specs, ctx, run)
    return [s for s in specs if s.key not in finished]


def pool_size(todo: list[SliceSpec], run: RunOptions) -> tuple[int, bool]:
    """How many workers ``todo`` gets, and whether they are processes: only when there is enough work
    to pay for their start-up (otherwise one in-process worker)."""
    workers = min(run.workers or available_cpus(), max(1, len(todo)))
    rows = sum(s.row_end - s.row_start if s.rows is None else len(s.rows) for s in todo)
    if run.runner == "process" or (run.runner == "auto" and workers > 1 and rows >= SMALL_JOB_ROWS):
        return workers, True
    return workers, False


def run_order(specs: list[SliceSpec]) -> list[SliceSpec]:
    """Biggest first, so the last slices to start are the small remainders and none straggles."""
    return sorted(specs, key=lambda s: (-s.est_bytes, s.index))


Api = tuple[str | None, str | None, str | None]  # the Prefect API's URL, auth string and key

_worker_client: tuple[Api, Any] | None = None  # in a worker: the API and its entered client context


def _with_worker_client(api: Api, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """In a worker: run ``fn`` with this process's one client for ``api`` as the current client.

    Prefect otherwise makes two clients per task run (one for the flow run's context, one for the task
    engine), each loading the CA bundle and asking the server its version: 37 of the 68 ms of CPU a
    worker spends on an empty task run (measured: 100 empty tasks on 2 workers, 67.5 -> 30.6 ms each).
    Both look for a current client first, and find this one."""
    global _worker_client
    _settle_settings()
    url, auth, key = api
    if url is not None and (_worker_client is None or _worker_client[0] != api):
        from prefect.context import SyncClientContext
        from prefect.settings import (
            PREFECT_API_AUTH_STRING,
            PREFECT_API_KEY,
            PREFECT_API_URL,
            temporary_settings,
        )

        if _worker_client is not None:
            with contextlib.suppress(Exception):
                _worker_client[1].__exit__(None, None, None)
        with temporary_settings({PREFECT_API_URL: url, PREFECT_API_AUTH_STRING: auth, PREFECT_API_KEY: key}):
            context = SyncClientContext()
            context.__enter__()  # current for the rest of this process (its task runs are in this thread)
        _worker_client = (api, context)
    try:
        return fn(*args, **kwargs)
    except Exception:
        raise
    except BaseException as exc:  # SystemExit, KeyboardInterrupt: this slice's failure, nothing more
        raise WorkerCallInterrupted(f"the worker's call ended with {type(exc).__name__}: {exc}") from None


_settled: tuple[dict[str, Any], dict[str, str], Any] | None = None  # in a worker: the last task's settings


def _settle_settings() -> None:
    """In a worker, once: Prefect's task call validates the flow's whole settings again for every task
    run (``SettingsContext(**serialized)``, 20-40 ms of a worker's CPU, ~8% of a 10 MiB slice's), though
    a run's tasks all carry the same. The call goes through :func:`_settled_context` instead, which
    validates them once per distinct settings and environment. Where Prefect has no such call (another
    version), tasks run as Prefect runs them."""
    import prefect.task_runners as runners

    run = getattr(runners, "_run_task_with_hydrated_context", None)
    if run is None or getattr(run, "settled", False):
        return

    def settled(*args: Any, **kwargs: Any) -> Any:
        context = kwargs.pop("context", None)
        serialized = context.get("settings_context") if isinstance(context, dict) else None
        if not serialized:
            return run(*args, context=context, **kwargs)
        with _settled_context(serialized):
            return run(*args, context={**context, "settings_context": {}}, **kwargs)

    settled.settled = True  # type: ignore[attr-defined]  # a mark on the function object
    runners._run_task_with_hydrated_context = settled


def _settled_context(serialized: dict[str, Any]) -> Any:
    """``SettingsContext(**serialized)``, validated only when it or the environment (each task's,
    applied by Prefect before this) differs from the last task's."""
    global _settled
    from prefect.context import SettingsContext

    environment = dict(os.environ)
    if _settled is None or _settled[0] != serialized or _settled[1] != environment:
        _settled = (serialized, environment, SettingsContext(**serialized))
    known = _settled[2]
    return SettingsContext.model_construct(profile=known.profile, settings=known.settings)


class WorkerCallInterrupted(RuntimeError):
    """A worker's call ended with a ``BaseException`` (``SystemExit``: Prefect's ``exit()`` on an abort,
    ``rich`` on a closed pipe). Carried back as it is, it would be re-raised in the callbacks of the
    command's futures, which let only ``Exception`` pass: it ended the pool's management thread without
    a word, and no slice ever completed again."""


class _ClientKeepingExecutor:
    """The pool's executor, running each call through :func:`_with_worker_client` with the API the
    flow uses (unknown while the API starts: the head start's calls run without one)."""

    def __init__(self, executor: Any) -> None:
        self._inner = executor
        self.api: Api = (None, None, None)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        with stop_signals_blocked():  # a worker this starts is born deaf to Ctrl-C (init_worker)
            return self._inner.submit(_with_worker_client, self.api, fn, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class ProcessPool(ProcessPoolTaskRunner):
    def __enter__(self) -> ProcessPool:
        if self._started:  # begun ahead of the flow (flows.workers.head_start): its workers are already busy
            return self
        start_resource_tracker()  # (before the executor's first semaphore starts one that SIGHUP kills)
        super().__enter__()
        executor = self._executor
        if executor is not None:
            method = start_method(executor._max_workers)  # type: ignore[attr-defined]  # private: typeshed omits it
            if method != "spawn":  # Prefect's executor as it is, on another start method
                executor = ProcessPoolExecutor(
                    max_workers=executor._max_workers,  # type: ignore[attr-defined]  # (as above)
                    mp_context=multiprocessing.get_context(method),
                    initializer=executor._initializer,
                    initargs=executor._initargs,
                )
                self._executor.shutdown(wait=False)  # type: ignore[union-attr]  # not None: checked above; it has started no process yet
            self._executor = _ClientKeepingExecutor(executor)  # type: ignore[assignment]  # a wrapper, attributes passed on
        return self

    def submit(self, task: Any, parameters: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        if isinstance(self._executor, _ClientKeepingExecutor):  # the API of this flow run's context
            api = get_current_settings().api
            self._executor.api = (
                api.url,
                api.auth_string.get_secret_value() if api.auth_string else None,
                api.key.get_secret_value() if api.key else None,
            )
        return super().submit(task, parameters, *args, **kwargs)

    def kill_workers(self) -> None:
        processes = getattr(self._executor, "_processes", None) or {}
        for process in list(processes.values()):
            with contextlib.suppress(Exception):
                process.kill()

    def broken(self) -> bool:
        """A worker died, or the pool's management thread ended (:func:`pool_stalled`). Python then fails
        every call in flight, asks the other workers to terminate (SIGTERM, which workers ignore:
        ``init_worker``) and waits for them to end: after their current slice, whose result nobody
        takes, or never, when the dead one held the lock of a queue they must flush before they exit
        (seen: a command that hung for good after a worker was killed)."""
        return bool(getattr(self._executor, "_broken", False)) or pool_stalled(self)

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        if exc_type is not None or self.broken():
            self.kill_workers()
            if self._subprocess_message_queue is not None:
                # A worker killed while writing a log line to Prefect's queue keeps its lock for ever:
                # Prefect's last message to the queue then never leaves, and this process must not
                # wait for it at its exit.
                self._subprocess_message_queue.cancel_join_thread()
        super().__exit__(exc_type, exc_value, traceback)


def runner_name(runner: Any) -> str:
    """A task runner as the log names it: for the pool, also how its workers start."""
    name = type(runner).__name__
    if isinstance(runner, ProcessPool) and start_method(runner._max_workers) == "forkserver":
        name += ", workers forked from a preloaded server"
    return name


def process_pool(workers: int) -> ProcessPool:
    """The run's pool of ``workers`` tokenizing processes."""
    from tokenize_mixer.tasks.tokenize import init_worker

    return ProcessPool(max_workers=workers, initializer=init_worker)


def pool_stalled(runner: Any) -> bool:
    """Whether a started process pool's management thread has ended: the thread that hands back every
    result and notices dead workers. Without it no slice in flight ever completes; threads die
    without a word, so the collector asks."""
    executor = getattr(runner, "_executor", None)
    thread = getattr(executor, "_executor_manager_thread", None)
    return thread is not None and not thread.is_alive() and not getattr(executor, "_shutdown_thread", False)


def worker_died(exc: BaseException) -> bool:
    return isinstance(exc, BrokenProcessPool)


def was_running(future: Any) -> bool:
    """Whether a slice lost to a dead worker had started (a queued one only waited in line)."""
    try:
        return bool(future.state.is_running())
    except Exception:  # the state cannot be read: count it, so a culprit is never missed
        return True
