"""``run.runner: work_pool``: the slices go out in batches, each a run of the ``tokenize-slices``
deployment, to whichever machines' Prefect workers serve its work pool.

Why deployment runs and not Prefect task workers: a flow run started by a worker is watched (a worker
that dies takes the run down with it: the run ends Crashed in seconds, see ``sftmix.runtime.stopping``), it
scales with the pool's infrastructure (processes, Kubernetes jobs), and it is visible in the UI as a
child of this run. A background task run whose task worker dies stays Running for good.

The remote work directory is the only thing shared: a batch that ends Crashed or Cancelled (not by us)
has its unfinished slices submitted again; a slice lost that way ``MAX_LOSSES`` times fails the run,
named. A batch that Failed did so on bad data or configuration, which another try would not change.
"""

from __future__ import annotations

import time
from collections import Counter

from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.states import Cancelling

from sftmix.assembly.outcome import SliceOutcome
from sftmix.config.config import RunOptions
from sftmix.errors import ConfigError, SliceFailuresError
from sftmix.planning.plan import Plan
from sftmix.tokenizing.slices import (
    SliceManifest,
    SliceSpec,
    push_worker_tokenizer,
    read_manifest,
    unrecorded_over_length,
    verify_slices,
)
from tokenize_mixer.flows.api.watch import StopCheck
from tokenize_mixer.flows.workers.pool import run_order

#: A slice whose batch ended Crashed this many times fails the run.
MAX_LOSSES = 3


def run_on_work_pool(plan: Plan, run: RunOptions) -> SliceOutcome:
    logger = get_run_logger()
    ctx = plan.context
    if ctx.remote_work_dir is None:
        raise ConfigError("runner work_pool needs a work_dir on gs:// (its batches run on other machines)")
    push_worker_tokenizer(ctx)
    started = time.perf_counter()
    done: dict[int, SliceManifest] = {}
    cached: set[int] = set()
    todo: list[SliceSpec] = []
    for s in plan.slices:
        m = None if run.force_recache else read_manifest(ctx.work_dir, s.key, ctx.remote_work_dir)
        if m is not None and unrecorded_over_length(ctx, m) is None:
            done[s.index] = m
            cached.add(s.index)
        else:
            todo.append(s)
    losses: Counter[int] = Counter()
    pending: dict = {}  # flow run id -> its slices
    parameters = {"ctx": ctx.model_dump(mode="json"), "workers": 0, "reuse": not run.force_recache}

    def submit(batch: list[SliceSpec]) -> None:
        flow_run = run_deployment(
            run.slice_deployment,
            parameters={**parameters, "slices": [s.model_dump(mode="json") for s in batch]},
            timeout=0,
        )
        pending[flow_run.id] = batch  # type: ignore[union-attr]  # called from sync code: the FlowRun itself

    todo = run_order(todo)
    for k in range(0, len(todo), run.batch_slices):
        submit(todo[k : k + run.batch_slices])
    logger.info(
        "%d slices (%d already done) in %d batch run(s) of %s",
        len(plan.slices),
        len(cached),
        len(pending),
        run.slice_deployment,
    )
    watch = StopCheck()
    with get_client(sync_client=True) as client:
        try:
            while pending:
                time.sleep(1)
                watch.check()
                for run_id in list(pending):
                    state = client.read_flow_run(run_id).state
                    if state is None or not state.is_final():
                        continue
                    batch = pending.pop(run_id)
                    for s in batch:
                        m = read_manifest(ctx.work_dir, s.key, ctx.remote_work_dir)
                        if m is not None:
                            done[s.index] = m
                    missing = [s for s in batch if s.index not in done]
                    if not missing:
                        logger.info("batch of %d slice(s) done (%s)", len(batch), state.name)
                        continue
                    if state.is_failed():
                        raise SliceFailuresError(
                            f"a batch of {len(batch)} slices failed ({state.message}); finished slices are "
                            "checkpointed and a rerun recomputes only the others"
                        )
                    for s in missing:
                        losses[s.index] += 1
                    lost = [s for s in missing if losses[s.index] >= MAX_LOSSES]
                    if lost:
                        raise SliceFailuresError(
                            f"slice {lost[0].describe()} was lost with its batch run {MAX_LOSSES} times "
                            f"(last: {state.name}: {state.message})"
                        )
                    logger.warning(
                        "a batch run ended %s (%s): its %d unfinished slice(s) are submitted again",
                        state.name,
                        state.message,
                        len(missing),
                    )
                    submit(missing)
        except BaseException:
            for run_id in pending:  # our children stop with us
                try:
                    client.set_flow_run_state(
                        run_id, Cancelling(message="the tokenize-mixer run stopped"), force=True
                    )
                except Exception as exc:  # the run is stopping anyway
                    logger.warning("could not cancel batch run %s: %s", run_id, exc)
            raise
    problems = verify_slices(
        ctx.work_dir, [(done[s.index], s.index in cached) for s in plan.slices], ctx.remote_work_dir
    )
    stale = [f"{s.describe()}: {p}" for s, p in zip(plan.slices, problems, strict=True) if p is not None]
    if stale:
        raise SliceFailuresError(f"{len(stale)} finished slice(s) do not verify, first {stale[0]}; rerun")
    return SliceOutcome.of(
        [done[s.index] for s in plan.slices],
        [s.index in cached for s in plan.slices],
        time.perf_counter() - started,
    )
