"""What one Prefect task run costs, apart from its work: CPU of the worker, the flow process and the API.

    python bench/task_overhead.py                 # 200 empty task runs on 2 workers
    python bench/task_overhead.py --tasks 500 --workers 4

Runs empty task runs (a persisted JSON result each, like a slice's manifest) on the flow's own
process pool (``flows.workers.pool.ProcessPool``, warm workers) under the command's temporary Prefect API,
and prints the CPU each process spent per task run, measured from ``/proc`` around the batch. From
that, the dispatch ceiling: how many task runs per second one core of the API server, and the flow
process, can carry. A run whose slices take *s* seconds on *W* workers needs *W / s* task runs per
second; above a ceiling, workers wait on the orchestrator instead of tokenizing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _cpu(process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def measure(tasks: int, workers: int) -> dict:
    import psutil
    from prefect import flow, task

    from tokenize_mixer.flows.workers.pool import process_pool

    @task(persist_result=True, result_serializer="json", cache_policy=None)
    def empty(i: int) -> dict:
        return {"i": i}

    out: dict = {}

    @flow(name="task-overhead")
    def batch() -> None:
        me = psutil.Process()
        with process_pool(workers) as pool:
            for fut in [pool.submit(empty, parameters={"i": -1}) for _ in range(workers)]:
                fut.result()  # workers started and warm
            children = me.children()
            pool_workers = [c for c in children if "spawn_main" in " ".join(c.cmdline())]
            server = [c for c in children if "uvicorn" in " ".join(c.cmdline())]
            before = [_cpu(me), sum(map(_cpu, pool_workers)), sum(map(_cpu, server))]
            started = time.perf_counter()
            for fut in [pool.submit(empty, parameters={"i": i}) for i in range(tasks)]:
                fut.result()
            wall = time.perf_counter() - started
            time.sleep(2.0)  # the server records the last states from events
            after = [_cpu(me), sum(map(_cpu, pool_workers)), sum(map(_cpu, server))]
        flow_ms, worker_ms, server_ms = ((a - b) * 1000 / tasks for a, b in zip(after, before, strict=True))
        out.update(
            tasks=tasks,
            workers=workers,
            wall_seconds=round(wall, 2),
            worker_ms_per_task=round(worker_ms, 1),
            flow_ms_per_task=round(flow_ms, 1),
            server_ms_per_task=round(server_ms, 1) if server else None,
        )

    batch()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=200)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    os.environ.pop("PREFECT_API_URL", None)  # the command's own temporary API, as a user gets it
    from tokenize_mixer.flows.api.runtime import prefect_api

    with prefect_api():
        r = measure(args.tasks, args.workers)
    print(
        f"{r['tasks']} empty task runs on {r['workers']} workers in {r['wall_seconds']} s; CPU per task run: "
        f"worker {r['worker_ms_per_task']} ms, flow process {r['flow_ms_per_task']} ms, "
        f"API server {r['server_ms_per_task']} ms (its 2 s of idling after the batch included)"
    )
    if r["server_ms_per_task"]:
        print(
            f"dispatch ceiling: one core of the API server carries {1000 / r['server_ms_per_task']:.0f} task "
            f"runs/s, the flow process {1000 / r['flow_ms_per_task']:.0f}/s; W workers on slices of s seconds "
            "need W/s"
        )


if __name__ == "__main__":
    main()
