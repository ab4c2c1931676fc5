"""The ``tokenize-mixer`` flow: plan -> tokenize_slice per slice -> assemble -> validate -> publish."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.states import Cancelled, Failed, State
from pydantic import Field

from sftmix.assembly.outcome import SliceOutcome, check_for, run_report
from sftmix.assembly.up_to_date import remember_inputs, up_to_date
from sftmix.check.findings import BROKEN, CHANGES_TRAINING, CheckReport
from sftmix.check.report_page import REPORT_PNG, write_report
from sftmix.config.config import MixerConfig
from sftmix.config.run_options import RunOptions
from sftmix.errors import CheckFailedError, MixerError
from sftmix.output.digest import RUN_REPORT
from sftmix.output.output_dir import check_output_free, paths_to_protect, refuse_different_output
from sftmix.output.publish import staging_dir
from sftmix.output.report import COMMAND_CLOCK, RunReport
from sftmix.planning.free_space import refuse_short_disk
from sftmix.planning.plan import Plan
from sftmix.planning.roots import check_allowed_roots
from sftmix.runtime.console import SUMMARY_LOG
from sftmix.runtime.stopping import EXIT_CANCELLED, RunStopped, first_stop, follow_supervisor, our_sigterm
from sftmix.runtime.storage import atomic_write_bytes, is_remote, remove_tree
from sftmix.tokenizing.templates import template_drift
from sftmix.tokenizing.tokenizer_facts import tokenizer_facts
from tokenize_mixer.flows.api.watch import StopCheck, no_retries, report_crashed
from tokenize_mixer.flows.artifacts import publish_artifacts, report_markdown
from tokenize_mixer.flows.fanout import run_slice_specs
from tokenize_mixer.flows.workers.worker_start import fork_workers_from_server, start_worker_server
from tokenize_mixer.tasks.assemble import assemble_output
from tokenize_mixer.tasks.plan import plan_mixer
from tokenize_mixer.tasks.publish import publish_output
from tokenize_mixer.tasks.validate import validate_output


def run_slices(plan: Plan, run: RunOptions) -> SliceOutcome:
    """The plan's slices, on this run's pool or, for ``runner: work_pool``, as batch runs elsewhere."""
    if run.runner == "work_pool":
        from tokenize_mixer.flows.workers.work_pool import run_on_work_pool

        return run_on_work_pool(plan, run)
    return run_slice_specs(plan.slices, plan.context, run)


def _documents_path(plan: Plan) -> Path:
    ident = json.dumps([plan.mixer.model_dump(), [s.key for s in plan.slices]], sort_keys=True)
    return (
        Path(plan.context.output.work_dir)
        / "runs"
        / f"{hashlib.sha256(ident.encode()).hexdigest()[:24]}.documents.npy"
    )


#: The form's headings of the flow's two parameters (Prefect titles them with their names).
MIXER_FORM = Field(
    json_schema_extra={"title": "Mixer", "description": "What to tokenize and where to write the shards."}
)
RUN_FORM = Field(
    default=RunOptions(),
    json_schema_extra={
        "title": "Run options",
        "description": "How the run goes; the defaults suit most runs.",
        "default": {},  # each option shows its own default, not a copy of all of them
    },
)


@flow(name="tokenize-mixer", validate_parameters=True)
def tokenize_mixer(mixer: MixerConfig = MIXER_FORM, run: RunOptions = RUN_FORM) -> dict | State:
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
        # one flow run a process, as the command's: its workers forked ready, not spawned to import again
        fork_workers_from_server()
        start_worker_server(mixer, run)
    try:
        try:
            with our_sigterm():
                done = _tokenize_mixer(mixer, run)
            if flow_run_id:
                _send_logs_now()
            return done
        except Exception:
            if (stop := first_stop()) is not None:  # what a library made of the stop raised into it (a
                raise stop from None  # pydantic serializer wraps it in an error of its own): the stop
            raise
    except MixerError as exc:
        return Failed(message=str(exc), data=exc)
    except RunStopped as exc:
        if exc.exit_code == EXIT_CANCELLED:  # the run ends Cancelled, not Crashed; nothing was published
            return Cancelled(message=f"{exc.reason}; finished slices are checkpointed, nothing was published")
        raise


def _send_logs_now() -> None:
    """The run's last log lines (its summary) sent to the API before its final state: ``prefect deployment
    run --watch`` stops at that state, before log lines still queued behind it."""
    from prefect.logging.handlers import APILogWorker

    try:
        APILogWorker.drain_all(timeout=5)
    except Exception as exc:  # (the logs go at the process's end anyway)
        logging.getLogger(__name__).debug("could not send the logs now: %s: %s", type(exc).__name__, exc)


def _call(task: Any, *args: Any) -> Any:
    """Run a task in-line; a user error it reports as a Failed state is raised here."""
    return task(*args, return_state=True).result()


def _tokenize_mixer(mixer: MixerConfig, run: RunOptions) -> dict:
    logger = get_run_logger()
    started = time.perf_counter()
    check_allowed_roots(mixer, run)  # before anything touches a path (check_output_free creates dirs)
    seen_id = check_output_free(mixer.output.path, paths_to_protect(mixer, run))
    if (done := up_to_date(mixer, run)) is not None:  # the inputs' stamps say so: no plan needed
        return _nothing_to_do(done, started)
    plan = _call(plan_mixer, mixer, run)
    for line in plan.summary(warnings=False).splitlines():  # (its warnings were said as it found them)
        logger.info(line)
    refuse_different_output(mixer.output.path, mixer.output.overwrite, plan.recipe())
    if (done := up_to_date(mixer, run, plan.recipe())) is not None:
        remember_inputs(mixer.output.path, plan.recipe(), plan.inputs)
        return _nothing_to_do(done, started)
    refuse_short_disk(plan)
    plan_seconds = round(time.perf_counter() - started, 3)
    documents = _documents_path(plan)
    scratch = None
    if run.disable_cache:  # slices still go through files, in a scratch directory removed below
        scratch = Path(plan.context.output.work_dir) / "scratch" / uuid.uuid4().hex
        output = plan.context.output.model_copy(update={"work_dir": str(scratch), "remote_work_dir": None})
        plan.context = plan.context.model_copy(update={"output": output})
    try:
        outcome = run_slices(plan, run)
        with staging_dir(mixer.output.path, plan.context.output.work_dir) as staging:
            report, result = _assemble_and_publish(
                plan, run, outcome, staging, documents, started, seen_id, plan_seconds
            )
    finally:
        if scratch is not None:
            remove_tree(scratch)
    try:  # the output is published: the UI's view of it is no reason to fail the run now, nor to wait
        with no_retries():
            publish_artifacts(report, result.statistics)
    except Exception as exc:
        logger.warning("could not attach the report artifacts: %s: %s", type(exc).__name__, exc)
    for line in report.render().splitlines():
        logger.info(line, extra=SUMMARY_LOG)
    return report.model_dump()


def _nothing_to_do(report: RunReport, started: float) -> dict:
    """The run's end when the output already holds its shards: the published report, said again."""
    timings = report.timings
    timings.wall_seconds = timings.plan_seconds = round(time.perf_counter() - started, 3)
    if COMMAND_CLOCK.started is not None:
        timings.command_seconds = round(time.time() - COMMAND_CLOCK.started, 3)
    try:
        with no_retries():
            create_markdown_artifact(
                markdown=report_markdown(report), key="tokenize-mixer-report", description="Run report"
            )
    except Exception as exc:
        get_run_logger().warning("could not attach the report artifact: %s: %s", type(exc).__name__, exc)
    for line in report.render().splitlines():
        get_run_logger().info(line, extra=SUMMARY_LOG)
    return report.model_dump()


def _assemble_and_publish(
    plan: Plan,
    run: RunOptions,
    outcome: SliceOutcome,
    staging: Path,
    documents: Path,
    started: float,
    seen_id: str | None,
    plan_seconds: float = 0.0,
) -> tuple[RunReport, Any]:
    mixer = plan.mixer
    tail_started = time.perf_counter()
    drift = template_drift(
        plan.context.template.text,
        plan.template_source,
        tokenizer_facts(plan.context.tokenizer.key()).chat_template,
    )
    check = check_for(plan, run, staging, documents, outcome, drift)
    result = _call(assemble_output, plan, outcome.manifests, staging, documents, check)
    assembled = min(time.perf_counter(), tail_started + result.written_seconds)
    checked = result.checked
    digests, validation = _call(validate_output, staging, run.reference, checked.digests if checked else None)
    report = run_report(plan, outcome, result, digests, validation, plan_seconds)
    report.findings.template_drift = drift
    timings = report.timings
    timings.assemble_seconds = round(assembled - tail_started, 3)
    timings.verify_seconds = round(time.perf_counter() - assembled, 3)
    if checked is not None:
        _report_findings(report, checked, run)
    timings.wall_seconds = round(time.perf_counter() - started, 3)
    if COMMAND_CLOCK.started is not None:  # started by our CLI: the whole command, start-up included
        timings.command_seconds = round(time.time() - COMMAND_CLOCK.started, 3)
        began = [
            m.timing.started_at for m in outcome.manifests if m.timing.started_at >= COMMAND_CLOCK.started
        ]
        timings.first_slice_seconds = round(min(began) - COMMAND_CLOCK.started, 3) if began else None
    timings.time = report.time_line()  # the JSON's times in words (start-up, planning, tokenizing, ...)
    report.publish = "pending"  # publish stamps its outcome into the staged copy before it shows
    atomic_write_bytes(staging / RUN_REPORT, report.model_dump_json(indent=2).encode("utf-8"))
    StopCheck().check(force=True)  # a run cancelled while it assembled does not publish
    had_report = not is_remote(mixer.output.path) and (Path(mixer.output.path) / REPORT_PNG).exists()
    report.publish = _call(
        publish_output,
        staging,
        mixer.output.path,
        mixer.output.overwrite,
        seen_id,
        plan.recipe(),
        plan.inputs,
    )
    if had_report and not (Path(mixer.output.path) / REPORT_PNG).exists():
        try:  # a report the user made of the replaced output is made again for the new one
            write_report(mixer.output.path)
            get_run_logger().info("report.png and report.md rewritten for the new output")
        except Exception as exc:
            get_run_logger().warning("could not rewrite report.png: %s: %s", type(exc).__name__, exc)
    return report, result


def _report_findings(report: RunReport, checked: CheckReport, run: RunOptions) -> None:
    """The check's findings into the report and the run's log; under ``run.check: strict`` one that breaks
    the output or changes training fails the run, nothing published."""
    found = report.findings
    found.check_notes = checked.notes()
    findings = checked.findings
    found.check_findings = [asdict(f) for f in findings]
    found.training = [*found.training, *checked.summary_lines()]  # (after the run's own: span losses)
    log = get_run_logger()
    for f in findings:  # what follows from the user's settings is information, not a warning
        level = {BROKEN: logging.ERROR, CHANGES_TRAINING: logging.WARNING}.get(f.severity, logging.INFO)
        log.log(level, "check %s", f.console_line())
    serious = checked.serious
    if serious and run.check == "strict":
        raise CheckFailedError(
            f"run.check is strict and the output has {len(serious)} finding(s) that "
            f"{'break it' if serious[0].severity == BROKEN else 'change training'}: "
            + "; ".join(f.line() for f in serious)
            + ". Nothing was published; with --check report (run.check: report) it is, and "
            "`tokenize-mixer check OUTPUT` lists the same findings",
            exit_code=checked.exit_code,
        )
