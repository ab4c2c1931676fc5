"""The ``tokenize-mixer`` flow: plan -> tokenize_slice per slice -> assemble -> validate -> publish."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import queue
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import Cancelled, Failed
from prefect.task_runners import ThreadPoolTaskRunner

from flows.artifacts import publish_artifacts
from flows.head_start import HeadStart, take_head_start
from flows.pool import (
    pool_size,
    process_pool,
    run_order,
    runner_name,
    slices_to_compute,
    was_running,
    worker_died,
)
from flows.progress import SliceProgress
from flows.watch import StopWatch, report_crashed
from sftmix.check import check_output
from sftmix.config import MixerConfig, RunOptions
from sftmix.digest import RUN_REPORT
from sftmix.errors import CheckFailedError, MixerError, SliceFailuresError, WorkerDiedError
from sftmix.plan import Plan
from sftmix.publish import check_output_free, paths_to_protect, staging_dir
from sftmix.report import COMMAND_CLOCK, DatasetReport, RunReport
from sftmix.report_page import REPORT_PNG, write_report
from sftmix.roots import check_allowed_roots
from sftmix.slices import (
    SliceManifest,
    SliceSpec,
    TokenizeContext,
    push_worker_tokenizer,
    verify_slice,
)
from sftmix.stopping import EXIT_CANCELLED, RunStopped, follow_supervisor
from sftmix.storage import atomic_write_bytes, is_remote, remove_tree
from sftmix.templates import template_drift
from sftmix.tokenizer import TokenizerKey, own_chat_template
from tasks.assemble import assemble_output
from tasks.plan import plan_mixer
from tasks.publish import publish_output
from tasks.tokenize import slice_task_for
from tasks.validate import validate_output


@dataclass
class SliceOutcome:
    manifests: list[SliceManifest]
    computed: int
    reused: int
    rechecked: int
    seconds: float
    steady_seconds: float
    steady_tokens_per_second: float
    computed_tokens: int = 0  # tokens of the slices computed in this run (not reused)

    @classmethod
    def of(
        cls, manifests: list[SliceManifest], reused: list[bool], seconds: float, rechecked: int = 0
    ) -> SliceOutcome:
        """The outcome of ``manifests`` (in plan order), ``reused[i]`` telling the ones not computed now;
        the steady window spans the computed ones."""
        fresh = [m for m, r in zip(manifests, reused, strict=True) if not r]
        span = max((m.finished_at for m in fresh), default=0.0) - min(
            (m.started_at for m in fresh), default=0.0
        )
        return cls(
            manifests=manifests,
            computed=len(fresh),
            reused=len(manifests) - len(fresh),
            rechecked=rechecked,
            seconds=seconds,
            steady_seconds=round(max(span, 0.0), 3),
            steady_tokens_per_second=round(sum(m.tokens for m in fresh) / span, 1) if span > 0 else 0.0,
            computed_tokens=sum(m.tokens for m in fresh),
        )


RunnerFactory = Callable[[int], Any]


def _runner(specs: list[SliceSpec], ctx: TokenizeContext, run: RunOptions) -> tuple[RunnerFactory, int]:
    """A factory of task runners of N workers (so a pool broken by a dead worker can be rebuilt), and N."""
    workers, processes = pool_size(slices_to_compute(specs, ctx, run), run)
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


class _Slices:
    """What is known of each slice while the pool runs: its manifest, whether it was a cache hit, its
    failure, how many dead workers it was a casualty of."""

    def __init__(self, specs: list[SliceSpec], started_at: float | None = None) -> None:
        n = max((s.index for s in specs), default=-1) + 1  # indices are the plan's
        self.manifests: list[SliceManifest | None] = [None] * n
        self.cached = [False] * n
        self.errors: list[tuple[SliceSpec, BaseException]] = []
        self.deaths = [0] * n
        self.progress = SliceProgress(len(specs))
        self.done = 0
        # a slice whose manifest is older than this was reused, not computed by this command
        self.started_at = time.time() if started_at is None else started_at


def _run_batch(
    specs: list[SliceSpec],
    task: Any,
    runner: Any,
    ctx: Any,
    state: _Slices,
    watch: StopWatch,
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
        for s in specs:
            early = (ahead or {}).get(s.key)
            if early is not None and not early.done():
                waiting[early] = s
            else:
                pending[submit(s)] = s
        for early in waiting:
            early.add_done_callback(finished.put)
        try:
            _collect(pending, finished, state, watch, lost, waiting, submit)
        except BaseException:
            if isinstance(runner, ThreadPoolTaskRunner):  # its exit would run every queued slice first
                for fut in pending:  # (a process pool's workers are killed instead: flows.pool)
                    with contextlib.suppress(Exception):
                        fut.wrapped_future.cancel()
            raise
    return lost


def _collect(
    pending: dict,
    finished: queue.SimpleQueue,
    state: _Slices,
    watch: StopWatch,
    lost: list[SliceSpec],
    waiting: dict[Future, SliceSpec],
    submit: Callable[[SliceSpec], Any],
) -> None:
    """Take finished slices as they come: record manifests, failures, and slices lost to dead workers;
    a head-start slice that ends gets its task run (which finds its checkpoint)."""
    logger = get_run_logger()
    total = state.progress.total
    while pending or waiting:
        # Wake every couple of seconds to look for a cancel (no alarm-based timeout here: an
        # alarm would fire inside the work done for a finished slice)
        try:
            fut = finished.get(timeout=watch.every)
        except queue.Empty:
            watch.check()
            continue
        if fut in waiting:
            spec = waiting.pop(fut)
            exc = None if fut.cancelled() else fut.exception()
            if exc is not None and worker_died(exc):
                lost.append(spec)
                state.deaths[spec.index] += 1
            else:  # done, or failed: the task run reuses it, or meets the failure and reports it
                pending[submit(spec)] = spec
            continue
        spec = pending.pop(fut)
        try:
            m = SliceManifest.model_validate(fut.result())
        except Exception as exc:  # collected: finished slices stay checkpointed
            if worker_died(exc):
                lost.append(spec)
                if was_running(fut):  # queued slices were not in the dead worker's hands
                    state.deaths[spec.index] += 1
                continue
            state.errors.append((spec, exc))
            logger.error("slice %s failed: %s", spec.describe(), exc)
            continue
        state.done += 1
        state.manifests[spec.index] = m
        # reused: Prefect's cache answered, or the slice's own manifest from an earlier run did
        state.cached[spec.index] = fut.state.name == "Cached" or m.finished_at < state.started_at
        state.progress.advance(m.rows, m.tokens, spec.describe(), reused=state.cached[spec.index])
        verb = (
            "reused"
            if state.cached[spec.index]
            else f"done in {m.seconds:.1f}s ({m.tokens / max(m.seconds, 1e-9):,.0f} tok/s)"
        )
        logger.info(
            "[%d/%d] %s: %d rows, %d tokens, %s",
            state.done,
            total,
            spec.describe(),
            m.rows,
            m.tokens,
            verb,
        )
        watch.check()


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
    watch = StopWatch()
    todo = specs
    while todo:
        suspects = [s for s in todo if state.deaths[s.index] >= SUSPECT_AFTER_DEATHS]
        others = [s for s in todo if state.deaths[s.index] < SUSPECT_AFTER_DEATHS]
        todo = []
        for spec in suspects:
            if _run_batch([spec], task, make_runner(1), ctx, state, watch, reuse):
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
            lost = _run_batch(others, task, runner, ctx, state, watch, reuse, ahead)
            if lost:
                logger.warning(
                    "a worker process died (killed, or out of memory); rebuilding the pool and retrying "
                    "the %d unfinished slice(s): %s",
                    len(lost),
                    ", ".join(s.describe() for s in lost[:5]) + (" ..." if len(lost) > 5 else ""),
                )
                todo = run_order(lost)


def run_slices(plan: Plan, run: RunOptions) -> SliceOutcome:
    if run.runner == "work_pool":
        from flows.work_pool import run_on_work_pool

        return run_on_work_pool(plan, run)
    return run_slice_specs(plan.slices, plan.context, run)


def run_slice_specs(specs: list[SliceSpec], ctx: TokenizeContext, run: RunOptions) -> SliceOutcome:
    """Tokenize every slice (reusing finished ones), distrusting cached files until they verify."""
    logger = get_run_logger()
    push_worker_tokenizer(ctx)  # workers on other machines read it from the remote work directory
    head = take_head_start(specs, ctx, run)
    if head is not None:
        make_runner: RunnerFactory = process_pool
        workers = head.workers
        begun = sum(f.running() or f.done() for f in head.futures.values())
        logger.info(
            "%d slices on %d worker(s) (%s), %d begun while the Prefect API started",
            len(specs),
            workers,
            runner_name(head.pool),
            begun,
        )
    else:
        make_runner, workers = _runner(specs, ctx, run)
        logger.info("%d slices on %d worker(s) (%s)", len(specs), workers, runner_name(make_runner(workers)))
    started = time.perf_counter()
    state = _Slices(specs, started_at=head.started_at if head is not None else None)
    task = slice_task_for(ctx, refresh=run.force_recache, cache=not run.disable_cache)
    _run_all(
        run_order(specs),
        task,
        make_runner,
        workers,
        ctx,
        state,
        reuse=not run.force_recache,
        head=head,
    )
    if state.errors:
        spec, first = state.errors[0]
        n = len(specs)
        raise SliceFailuresError(
            f"{len(state.errors)} of {n} slices failed; the {n - len(state.errors)} others are "
            f"checkpointed and a rerun recomputes only the failed ones. First failure, {spec.describe()}: "
            + (str(first) if isinstance(first, MixerError) else f"{type(first).__name__}: {first}")
        ) from first
    manifests = state.manifests
    stale = []
    for spec in specs:
        m = manifests[spec.index]
        # Cached slices are distrusted until their files verify; with a remote work directory, a
        # slice computed on another machine is fetched here (its digests checked on the way).
        if not state.cached[spec.index] and ctx.remote_work_dir is None:
            continue
        problem = verify_slice(ctx.work_dir, m, ctx.remote_work_dir, hash_files=state.cached[spec.index])
        if problem is not None:
            logger.warning("cached slice %s is not trustworthy (%s): recomputing", spec.describe(), problem)
            stale.append(spec)
    if stale:
        for spec in stale:
            manifests[spec.index] = None
        _run_all(stale, slice_task_for(ctx, refresh=True), make_runner, workers, ctx, state, reuse=False)
        if state.errors:
            spec, first = state.errors[0]
            raise SliceFailuresError(
                f"recomputing untrustworthy slice {spec.describe()} failed: {first}"
            ) from first
        for spec in stale:
            state.cached[spec.index] = False
    done = [s for s in sorted(specs, key=lambda s: s.index) if manifests[s.index] is not None]
    return SliceOutcome.of(
        [manifests[s.index] for s in done],  # type: ignore[misc]
        [state.cached[s.index] for s in done],
        time.perf_counter() - started,
        rechecked=len(stale),
    )


def _documents_path(plan: Plan) -> Path:
    ident = json.dumps([plan.mixer.model_dump(), [s.key for s in plan.slices]], sort_keys=True)
    return (
        Path(plan.context.work_dir)
        / "runs"
        / f"{hashlib.sha256(ident.encode()).hexdigest()[:24]}.documents.npy"
    )


@flow(name="tokenize-mixer", validate_parameters=True)
def tokenize_mixer(mixer: MixerConfig, run: RunOptions = RunOptions()) -> dict:  # noqa: B008 (immutable use)
    """Tokenize a mixer of chat datasets into OLMo-core shards (byte-compatible with open-instruct).

    ``mixer`` is what to tokenize and where to write it; ``run`` is how (work directory, slice size,
    workers, an optional reference to validate against).
    """
    flow_run_id = os.environ.get("PREFECT__FLOW_RUN_ID")
    if flow_run_id:  # a child process of a Prefect worker (or runner)
        follow_supervisor(
            "the Prefect worker that started this flow run",
            before_exit=functools.partial(report_crashed, flow_run_id),
        )
    try:
        return _tokenize_mixer(mixer, run)
    except MixerError as exc:
        return Failed(message=str(exc), data=exc)
    except RunStopped as exc:
        if exc.exit_code == EXIT_CANCELLED:  # the run ends Cancelled, not Crashed; nothing was published
            return Cancelled(message=f"{exc.reason}; finished slices are checkpointed, nothing was published")
        raise


def _call(task: Any, *args: Any) -> Any:
    """Run a task in-line; a user error it reports as a Failed state is raised here."""
    return task(*args, return_state=True).result()


def _tokenize_mixer(mixer: MixerConfig, run: RunOptions) -> dict:
    logger = get_run_logger()
    started = time.perf_counter()
    check_allowed_roots(mixer, run)  # before anything touches a path (check_output_free creates dirs)
    seen_id = check_output_free(mixer.output.path, paths_to_protect(mixer, run))
    plan = _call(plan_mixer, mixer, run)
    for line in plan.summary().splitlines():
        logger.info(line)
    documents = _documents_path(plan)
    scratch = None
    if run.disable_cache:  # slices still go through files, in a scratch directory removed below
        scratch = Path(plan.context.work_dir) / "scratch" / uuid.uuid4().hex
        plan.context = plan.context.model_copy(update={"work_dir": str(scratch), "remote_work_dir": None})
    try:
        outcome = run_slices(plan, run)
        with staging_dir(mixer.output.path, plan.context.work_dir) as staging:
            report, result = _assemble_and_publish(plan, run, outcome, staging, documents, started, seen_id)
    finally:
        if scratch is not None:
            remove_tree(scratch)
    try:  # the output is published: the UI's view of it is no reason to fail the run now
        publish_artifacts(report, result.statistics)
    except Exception as exc:
        logger.warning("could not attach the report artifacts: %s: %s", type(exc).__name__, exc)
    for line in report.render().splitlines():
        logger.info(line)
    return report.model_dump()


def _assemble_and_publish(
    plan: Plan,
    run: RunOptions,
    outcome: SliceOutcome,
    staging: Path,
    documents: Path,
    started: float,
    seen_id: str | None,
) -> tuple[RunReport, Any]:
    mixer = plan.mixer
    result = _call(assemble_output, plan, outcome.manifests, staging, documents)
    digests, validation = _call(validate_output, staging, run.reference)
    dropped: dict[str, int] = {}
    for t in result.tallies:
        for k, v in t.dropped.items():
            dropped[k] = dropped.get(k, 0) + v
    report = RunReport(
        output_dir=mixer.output.path,
        slices_total=len(plan.slices),
        slices_computed=outcome.computed,
        slices_reused=outcome.reused,
        slices_rechecked=outcome.rechecked,
        rows_in=sum(t.selected for t in result.tallies),
        rows_kept=sum(t.kept for t in result.tallies),
        rows_dropped=dict(sorted(dropped.items())),
        datasets=[d.name for d in plan.datasets],
        per_dataset=[
            DatasetReport(name=t.name, selected=t.selected, kept=t.kept, dropped=dict(t.dropped))
            for t in result.tallies
        ],
        documents=result.documents,
        untrainable_documents=result.untrainable_documents,
        rows_kept_by_exact_spans=sum(m.kept_by_exact_spans for m in outcome.manifests),
        tokens=result.tokens,
        trainable_tokens=result.trainable_tokens,
        parts=result.parts,
        token_dtype=plan.context.token_dtype,
        wall_seconds=0.0,
        tokenize_seconds=round(outcome.seconds, 3),
        tokens_per_second=0.0,
        steady_seconds=outcome.steady_seconds,
        steady_tokens_per_second=outcome.steady_tokens_per_second,
        digests=digests,
        validation=validation,
        documents_file=result.documents_path,
        drop_examples=[
            {"dataset": m.dataset, **example} for m in outcome.manifests for example in m.drop_examples
        ][:20],
        warnings=plan.warnings,
    )
    report.template_drift = template_drift(
        plan.context.template_text,
        plan.template_source,
        own_chat_template(TokenizerKey.of(plan.context.tokenizer, plan.context.tokenizer_revision)),
    )
    if run.check != "off" and mixer.output.format == "olmo":
        checked = check_output(
            staging,
            plan.mixer.max_seq_length,
            digests=False,
            token_dtype=plan.context.token_dtype,
            template=report.template_drift,
            documents_file=result.documents_path,
            dataset_names=report.datasets,
        )
        report.check_notes = checked.notes()
        findings = checked.findings
        report.check_findings = [asdict(f) for f in findings]
        for f in findings:
            get_run_logger().warning("check [%s] %s: %d %s", f.kind, f.what, f.count, f.examples or "")
        if findings and run.check == "strict":
            raise CheckFailedError(
                f"run.check is strict and the output has {len(findings)} finding(s), first: {findings[0].what} "
                f"({findings[0].count}); nothing was published (tokenize-mixer check OUT shows them on an output)"
            )
    report.wall_seconds = round(time.perf_counter() - started, 3)
    # one throughput everywhere: tokens of the slices computed in this run over the tokenizing time
    report.tokens_per_second = (
        round(outcome.computed_tokens / outcome.seconds, 1)
        if outcome.computed_tokens and outcome.seconds > 0
        else 0.0
    )
    if COMMAND_CLOCK.started is not None:  # started by our CLI: the whole command, start-up included
        report.command_seconds = round(time.time() - COMMAND_CLOCK.started, 3)
    report.publish = "pending"  # publish stamps its outcome into the staged copy before it shows
    atomic_write_bytes(staging / RUN_REPORT, report.model_dump_json(indent=2).encode("utf-8"))
    StopWatch().check(force=True)  # a run cancelled while it assembled does not publish
    had_report = not is_remote(mixer.output.path) and (Path(mixer.output.path) / REPORT_PNG).exists()
    report.publish = _call(publish_output, staging, mixer.output.path, mixer.output.overwrite, seen_id)
    if had_report and not (Path(mixer.output.path) / REPORT_PNG).exists():
        try:  # a report the user made of the replaced output is made again for the new one
            write_report(mixer.output.path)
            get_run_logger().info("report.png and report.md rewritten for the new output")
        except Exception as exc:
            get_run_logger().warning("could not rewrite report.png: %s: %s", type(exc).__name__, exc)
    return report, result
