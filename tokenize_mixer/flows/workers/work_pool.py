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
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.deployments import run_deployment
from prefect.states import Cancelling, State

from sftmix.assembly.outcome import SliceOutcome
from sftmix.config.run_options import RunOptions
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
    ctx = plan.context
    if ctx.output.remote_work_dir is None:
        raise ConfigError("runner work_pool needs a work_dir on gs:// (its batches run on other machines)")
    push_worker_tokenizer(ctx)
    started = time.perf_counter()
    batches = _BatchRuns(plan, run)
    todo = run_order(batches.not_done())
    for k in range(0, len(todo), run.batch_slices):
        batches.submit(todo[k : k + run.batch_slices])
    batches.logger.info(
        "%d slices (%d already done) in %d batch run(s) of %s",
        len(plan.slices),
        len(batches.cached),
        len(batches.pending),
        run.slice_deployment,
    )
    batches.follow()
    done, cached = batches.done, batches.cached
    problems = verify_slices(
        ctx.output.work_dir,
        [(done[s.index], s.index in cached) for s in plan.slices],
        ctx.output.remote_work_dir,
    )
    stale = [f"{s.describe()}: {p}" for s, p in zip(plan.slices, problems, strict=True) if p is not None]
    if stale:
        raise SliceFailuresError(f"{len(stale)} finished slice(s) do not verify, first {stale[0]}; rerun")
    return SliceOutcome.of(
        [done[s.index] for s in plan.slices],
        [s.index in cached for s in plan.slices],
        time.perf_counter() - started,
    )


class _BatchRuns:
    """The run's batches of slices as runs of the slice deployment: submitted, followed to their end, a
    batch lost (Crashed, Cancelled not by us) submitted again, and cancelled with us."""

    def __init__(self, plan: Plan, run: RunOptions) -> None:
        self.plan, self.run, self.ctx = plan, run, plan.context
        self.logger = get_run_logger()
        self.done: dict[int, SliceManifest] = {}
        self.cached: set[int] = set()
        self.losses: Counter[int] = Counter()
        self.pending: dict = {}  # flow run id -> its slices
        ctx = self.ctx.model_dump(mode="json")
        self.parameters = {"ctx": ctx, "workers": 0, "reuse": not run.force_recache}

    def not_done(self) -> list[SliceSpec]:
        """The slices no earlier run finished (those it did are done, from their manifests)."""
        todo = []
        for s in self.plan.slices:
            m = None if self.run.force_recache else self._manifest(s)
            if m is not None and unrecorded_over_length(self.ctx, m) is None:
                self.done[s.index] = m
                self.cached.add(s.index)
            else:
                todo.append(s)
        return todo

    def _manifest(self, s: SliceSpec) -> SliceManifest | None:
        return read_manifest(self.ctx.output.work_dir, s.key, self.ctx.output.remote_work_dir)

    def submit(self, batch: list[SliceSpec]) -> None:
        flow_run = run_deployment(
            self.run.slice_deployment,
            parameters={**self.parameters, "slices": [s.model_dump(mode="json") for s in batch]},
            timeout=0,
        )
        self.pending[flow_run.id] = batch  # type: ignore[union-attr]  # called from sync code: the FlowRun itself

    def follow(self) -> None:
        """Until every batch has ended; our batch runs are cancelled where we stop first."""
        watch = StopCheck()
        with get_client(sync_client=True) as client:
            try:
                while self.pending:
                    time.sleep(1)
                    watch.check()
                    for run_id in list(self.pending):
                        state = client.read_flow_run(run_id).state
                        if state is not None and state.is_final():
                            self._ended(self.pending.pop(run_id), state)
            except BaseException:
                self._cancel(client)
                raise

    def _ended(self, batch: list[SliceSpec], state: State) -> None:
        """A batch run's end: its finished slices are done; the others fail the run (a batch that Failed,
        or a slice lost ``MAX_LOSSES`` times), or are submitted again."""
        for s in batch:
            if (m := self._manifest(s)) is not None:
                self.done[s.index] = m
        missing = [s for s in batch if s.index not in self.done]
        if not missing:
            self.logger.info("batch of %d slice(s) done (%s)", len(batch), state.name)
            return
        if state.is_failed():
            raise SliceFailuresError(
                f"a batch of {len(batch)} slices failed ({state.message}); finished slices are "
                "checkpointed and a rerun recomputes only the others"
            )
        for s in missing:
            self.losses[s.index] += 1
        lost = [s for s in missing if self.losses[s.index] >= MAX_LOSSES]
        if lost:
            raise SliceFailuresError(
                f"slice {lost[0].describe()} was lost with its batch run {MAX_LOSSES} times "
                f"(last: {state.name}: {state.message})"
            )
        self.logger.warning(
            "a batch run ended %s (%s): its %d unfinished slice(s) are submitted again",
            state.name,
            state.message,
            len(missing),
        )
        self.submit(missing)

    def _cancel(self, client: SyncPrefectClient) -> None:
        for run_id in self.pending:  # our children stop with us
            try:
                client.set_flow_run_state(
                    run_id, Cancelling(message="the tokenize-mixer run stopped"), force=True
                )
            except Exception as exc:  # the run is stopping anyway
                self.logger.warning("could not cancel batch run %s: %s", run_id, exc)
