"""How the command's worker processes start: forked from a server that imported their modules once.

Spawned workers are fresh interpreters that each import Prefect, datasets and transformers again:
about 1 CPU-second each on a 2-core VM, and on the lent 16-core machine 16 of them starting at once
took 6-8 s before their first slice. A fork server imports them once and forks each worker ready.

Only for a process that is one run of the command (``tokenize-mixer``): the server keeps the
environment and the modules of its start, which a later run in a longer-lived process (the tests, a
notebook) may not share; those keep Prefect's spawned workers. No Prefect import here: the command
starts the server before it imports Prefect's task machinery.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
from typing import TYPE_CHECKING

from sftmix.runtime import settings
from sftmix.runtime.parallel import available_cpus
from sftmix.runtime.processes import start_resource_tracker, stop_signals_blocked

if TYPE_CHECKING:
    from sftmix.config.config import MixerConfig
    from sftmix.config.run_options import RunOptions

#: What the fork server imports for its workers: what a worker needs before its first slice.
WORKER_PRELOAD = ["tokenize_mixer.flows.workers.worker_preload"]

#: Below this much local input a run is not expected to use worker processes (``flows.workers.pool``'s
#: ``SMALL_JOB_ROWS``), so the command does not start their server ahead of the plan.
SMALL_INPUT_BYTES = 4 << 20

#: Fewer workers than this are spawned even in the command. One worker gains nothing from a server.
#: With the server importing only what workers use, 2 workers on 2 cores were faster forked: 1x ShareGPT,
#: alternating, 25.7-27.8 s (9 runs, mean 26.7) against 26.2-31.3 s spawned (mean 28.0). Before, when
#: the server also imported transformers and datasets, they were 1-4% slower forked.
MIN_FORKED_WORKERS = 2

_start_method = "spawn"


def start_method(workers: int) -> str:
    """How a pool of ``workers`` processes starts them here: ``spawn`` unless the command chose to fork
    them and there are enough of them."""
    return _start_method if workers >= MIN_FORKED_WORKERS else "spawn"


#: Set to ``spawn`` to start workers as Prefect does (to compare, or should forking ever misbehave).
START_METHOD_ENV = settings.WORKER_START.name


def fork_workers_from_server() -> None:
    """In the command's own process: from now on, worker processes are forked from the fork server."""
    global _start_method
    if settings.WORKER_START.get() == "spawn":
        return
    if "forkserver" in multiprocessing.get_all_start_methods():
        multiprocessing.get_context("forkserver").set_forkserver_preload(WORKER_PRELOAD)
        _start_method = "forkserver"


def start_worker_server(mixer: MixerConfig, run: RunOptions) -> None:
    """Start the workers' fork server now where the run is likely to use worker processes, so that its
    imports overlap the API's start and the planning instead of following them. A guess made before the
    plan: a wrong one costs one idle process's imports, or the overlap (the pool starts it anyway)."""
    if run.runner not in ("auto", "process") or start_method(run.workers or available_cpus()) != "forkserver":
        return
    paths = [d.path for d in mixer.datasets]
    local = all(os.path.isfile(p) for p in paths)
    if run.runner == "auto" and local and sum(os.path.getsize(p) for p in paths) < SMALL_INPUT_BYTES:
        return
    if not local:  # a hub or remote dataset that workers may read through datasets
        multiprocessing.get_context("forkserver").set_forkserver_preload([*WORKER_PRELOAD, "datasets"])
    # The server needs multiprocessing's resource tracker: started first, in a block of its own, so that
    # the server's block holds for the server's whole start.
    start_resource_tracker()
    with stop_signals_blocked():  # the server, and each worker it forks, is born deaf to Ctrl-C
        multiprocessing.forkserver.ensure_running()
