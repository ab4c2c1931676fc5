"""The fan-out: one task per slice, its manifest persisted as the Prefect result under its content key."""

from __future__ import annotations

import atexit
import hashlib
import os
from pathlib import Path
from typing import Any

from prefect import Task, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import TaskRun
from prefect.context import TaskRunContext
from prefect.filesystems import RemoteFileSystem
from prefect.states import State

from sftmix.errors import MixerError
from sftmix.runtime.console import configure_worker_console
from sftmix.runtime.pipes import silence_closed_pipes
from sftmix.runtime.processes import follow_parent, ignore_stop_signals
from sftmix.runtime.storage import join_url
from sftmix.tokenizing.slices import SliceSpec, TokenizeContext, tokenize_slice
from tokenize_mixer.tasks import fail_cleanly


def slice_cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    """The slice's content key: same inputs, same key, whatever the run."""
    return f"tokenize-mixer-slice-{parameters['spec'].key}"


def retry_transient(task: Task, task_run: TaskRun, state: State) -> bool:
    """Retry I/O hiccups, not bad data: a MixerError fails the same way every time."""
    try:
        state.result()
    except MixerError:
        return False
    except Exception:
        return True
    return False


@task(
    name="tokenize_slice",
    cache_key_fn=slice_cache_key,
    persist_result=True,
    result_serializer="json",
    retries=2,
    retry_delay_seconds=2,
    retry_condition_fn=retry_transient,
    task_run_name="tokenize {spec.dataset} [{spec.row_start}:{spec.row_end}]",
)
@fail_cleanly
def tokenize_slice_task(spec: SliceSpec, ctx: TokenizeContext, reuse: bool = True) -> dict:
    return tokenize_slice(spec, ctx, reuse=reuse).model_dump()


def tokenize_ahead(spec: SliceSpec, ctx: TokenizeContext) -> dict:
    """A slice tokenized before its task run exists (``flows.workers.head_start``): the task's own work, whose
    checkpoint the task run then finds."""
    return tokenize_slice(spec, ctx, reuse=True).model_dump()


def slice_task_for(ctx: TokenizeContext, refresh: bool = False, cache: bool = True) -> Task:
    """The slice task with its result records stored in the run's work directory, local or remote
    (``cache=False``: no record is read or written)."""
    if not cache:
        return tokenize_slice_task.with_options(cache_policy=NO_CACHE, persist_result=False)
    storage: Path | RemoteFileSystem = Path(ctx.output.work_dir) / "prefect-results"
    if ctx.output.remote_work_dir is not None:
        storage = remote_result_storage(join_url(ctx.output.remote_work_dir, "prefect-results"))
    return tokenize_slice_task.with_options(result_storage=storage, refresh_cache=refresh)


def remote_result_storage(url: str) -> RemoteFileSystem:
    """A saved file-system block for ``url`` (Prefect wants task result storage persisted
    server-side); one block per location, saved again each run so it always matches."""
    block = RemoteFileSystem(basepath=url)
    block.save(f"tokenize-mixer-results-{hashlib.sha256(url.encode()).hexdigest()[:16]}", overwrite=True)
    return block


def init_worker() -> None:
    """Each worker process tokenizes on one thread; the processes use the cores."""
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    ignore_stop_signals()  # the run stops its workers itself
    silence_closed_pipes()  # and notices a closed output pipe itself
    follow_parent()  # and none outlives a run killed outright
    configure_worker_console()  # the command's terminal: as quiet as the command
    atexit.register(_end_without_teardown)


def _end_without_teardown() -> None:
    """A worker that exits has sent its last result, and multiprocessing has flushed its queues and
    streams before the interpreter's exit begins: the teardown of every module it imported (Prefect,
    tokenizers) is 0.5 s that the pool's shutdown at the end of the run waits for (measured), not
    work. Registered last, this at-exit function runs first."""
    os._exit(0)
