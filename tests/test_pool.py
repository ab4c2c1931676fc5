"""The flow's process pool (flows.workers.pool) with real worker processes."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import pytest

from tokenize_mixer.flows.workers.pool import WorkerCallInterrupted, pool_stalled, process_pool

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_broken_pool_ends_at_once_with_its_other_workers_killed():
    """A worker killed outright breaks the pool; the others ignore the SIGTERM Python sends them (as
    every worker does: tasks.tokenize.init_worker), so leaving the pool must kill them, not wait for
    their work to end."""
    pool = process_pool(2)
    with pool:
        busy = [pool._executor.submit(time.sleep, 600) for _ in range(2)]
        deadline = time.monotonic() + 120
        while len(pool._executor._processes) < 2 or any(
            not p.is_alive() for p in pool._executor._processes.values()
        ):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(2)  # both workers have taken their call
        victim, other = list(pool._executor._processes.values())
        os.kill(victim.pid, signal.SIGKILL)
        for fut in busy:
            with pytest.raises(BrokenProcessPool):
                fut.result(timeout=60)
        assert pool.broken()
        since = time.monotonic()
    assert time.monotonic() - since < 30
    other.join(5)
    assert other.exitcode == -signal.SIGKILL


POISONED_QUEUE = """
import os, signal, time
from concurrent.futures import wait
from tokenize_mixer.flows.workers.pool import WorkerCallInterrupted, pool_stalled, process_pool

pool = process_pool(2)
with pool:
    busy = [pool._executor.submit(time.sleep, 600) for _ in range(2)]
    while len(pool._executor._processes) < 2:
        time.sleep(0.1)
    time.sleep(2)
    # what a worker killed while writing a log line to Prefect's queue leaves: its lock, held for ever
    pool._subprocess_message_queue._wlock.acquire()
    os.kill(next(iter(pool._executor._processes.values())).pid, signal.SIGKILL)
    wait(busy, timeout=60)
print("left the pool", flush=True)
"""


@pytest.mark.slow
def test_a_worker_killed_holding_the_log_queue_lock_does_not_hang_the_exit():
    done = subprocess.run(
        [sys.executable, "-c", POISONED_QUEUE], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "left the pool" in done.stdout


@pytest.mark.slow
def test_a_base_exception_in_a_worker_is_that_calls_failure_and_the_pool_goes_on():
    """``SystemExit`` in a worker (what ``rich`` raises on a closed pipe, Prefect on an abort) comes back
    as an ordinary exception: carried back as it was, it ended the pool's management thread."""
    pool = process_pool(2)
    with pool:
        failed = pool._executor.submit(sys.exit, 1)
        assert isinstance(failed.exception(timeout=120), WorkerCallInterrupted)
        assert "SystemExit" in str(failed.exception())
        assert pool._executor.submit(os.getpid).result(timeout=60) > 0
        assert not pool_stalled(pool) and not pool.broken()


def _end_this_thread(future) -> None:
    raise SystemExit(1)  # as a re-raised outcome did, in the pool's management thread


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_the_collector_hands_back_the_slices_of_a_pool_whose_management_thread_ended(prefect_api):
    """Threads die without a word: the collector looks at every wake-up, and the pool's unfinished slices
    go to a new pool (here: come back as lost) instead of being waited for for ever."""
    from prefect import flow

    from sftmix.tokenizing.slices import SliceSpec
    from tokenize_mixer.flows.api.watch import StopCheck
    from tokenize_mixer.flows.fanout import _collect, _Slices

    specs = [
        SliceSpec(
            key=f"k{i}", index=i, dataset_index=0, dataset="d", split="train", row_start=i, row_end=i + 1
        )
        for i in range(2)
    ]

    @flow
    def collect_from_a_stalled_pool() -> tuple[list[str], int, bool]:
        pool = process_pool(1)
        with pool:
            trigger = pool._executor.submit(time.sleep, 1)
            trigger.add_done_callback(_end_this_thread)
            stuck = pool._executor.submit(time.sleep, 600)
            pending = {stuck: specs[0], trigger: specs[1]}
            state = _Slices(specs)
            lost: list = []
            _collect(pending, queue.SimpleQueue(), state, StopCheck(every_seconds=0.5), lost, {}, None, pool)
            stalled = pool.broken()
        return [s.key for s in lost], state.stalls, stalled

    since = time.monotonic()
    lost, stalls, stalled = collect_from_a_stalled_pool()
    assert sorted(lost) == ["k0", "k1"] and stalls == 1 and stalled
    assert time.monotonic() - since < 60


def _task_settings() -> tuple[int, bool]:
    import prefect.task_runners
    from prefect.settings import get_current_settings

    settled = getattr(prefect.task_runners._run_task_with_hydrated_context, "settled", False)
    return get_current_settings().client.max_retries, settled


@pytest.mark.slow
def test_each_task_in_a_worker_runs_with_the_settings_of_its_submission(prefect_api):
    """A worker validates the flow's settings once, not per task run (``flows.workers.pool._settle_settings``),
    and still gives every task the settings it was submitted with, when they change between tasks."""
    from prefect import flow, task
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    settings_of = task(_task_settings)

    @flow(task_runner=process_pool(2))
    def submit_under_two_settings() -> list[tuple[int, bool]]:
        futures = []
        for retries in (7, 7, 7, 9, 9, 7):
            with temporary_settings({PREFECT_CLIENT_MAX_RETRIES: retries}):
                futures.append(settings_of.submit())
            futures[-1].wait()  # in turn, so one worker sees the settings change
        return [f.result() for f in futures]

    seen = submit_under_two_settings()
    assert [retries for retries, _ in seen] == [7, 7, 7, 9, 9, 7]
    assert all(settled for _, settled in seen)  # each worker settles before its first call
