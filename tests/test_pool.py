"""The flow's process pool (flows.pool) with real worker processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import pytest

from flows.pool import process_pool

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
from flows.pool import process_pool

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
