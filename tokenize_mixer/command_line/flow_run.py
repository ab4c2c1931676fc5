"""A run of the flow from the command: the checks before any Prefect API starts, the plan made once
(before the API or while it starts), the API, the head start and the progress, and the run's end said;
``--tokenizer_config_only``'s tokenizer alone.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

from sftmix.config.config import MixerConfig
from sftmix.config.run_options import RunOptions
from sftmix.errors import ConfigError
from sftmix.output.report import COMMAND_CLOCK, RunReport
from sftmix.runtime.stopping import (
    EXIT_CANCELLED,
    RunStopped,
    record_stop,
)
from tokenize_mixer.command_line.progress_display import progress_bar

logger = logging.getLogger("sftmix")

#: Set by ``tokenize_mixer.cli.entry``: this process ends with the run.
one_run_per_process = False


def write_tokenizer_only(mixer: MixerConfig) -> int:
    """--tokenizer_config_only: OUTPUT_DIR/tokenizer/ (the tokenizer with the chat template the run would
    use) and nothing else, as the reference writes it; an existing tokenizer/ is never replaced."""
    from sftmix.planning.plan import resolve_tokenizer
    from sftmix.runtime.storage import is_remote, writer_tag
    from sftmix.tokenizing.tokenizer_facts import write_tokenizer_dir

    if is_remote(mixer.output.path):
        raise ConfigError("--tokenizer_config_only writes to a local --output_dir only")
    target = Path(mixer.output.path) / "tokenizer"
    if target.exists():
        raise ConfigError(f"{target} already exists; remove it or choose another --output_dir")
    key, _, template = resolve_tokenizer(mixer.tokenizer)
    staging = target.with_name(f".tokenizer.tmp-{writer_tag()}")
    write_tokenizer_dir(key, template.text, staging)
    staging.rename(target)
    logger.info(
        "wrote %s (chat template %s); no data was converted (--tokenizer_config_only)",
        target,
        template.source,
    )
    return 0


def run_flow(mixer: MixerConfig, run: RunOptions) -> int:
    from sftmix.assembly.up_to_date import UpToDate, may_be_up_to_date, up_to_date
    from tokenize_mixer.flows.api.runtime import prefect_api, remove_abandoned_private_dirs

    remove_abandoned_private_dirs()  # (a command killed outright could not remove its own)
    _check_before_any_api(mixer, run)
    if (done := up_to_date(mixer, run)) is not None:  # no API, no plan: the inputs' stamps say so
        return _say_up_to_date(done)

    from tokenize_mixer.flows.workers.head_start import head_start_scope
    from tokenize_mixer.tasks.plan import hand_to_flow

    planning = _Planning(mixer, run)
    if one_run_per_process:
        from tokenize_mixer.flows.workers.worker_start import fork_workers_from_server, start_worker_server

        fork_workers_from_server()
        start_worker_server(mixer, run)
    try:
        # An output that only the plan can find up to date: planned before any API is launched.
        first = planning.plan_and_check if may_be_up_to_date(mixer, run) else None
        api = prefect_api(planning.prepare, launch_first=one_run_per_process, before_launch=first)
        with head_start_scope(), api, progress_bar():
            # Imported here, not above: with a temporary API server, the import overlaps its start-up.
            from tokenize_mixer.flows.tokenize_mixer import tokenize_mixer

            state = tokenize_mixer(mixer=mixer, run=run, return_state=True)
    except UpToDate as found:
        return _say_up_to_date(found.report)
    finally:
        hand_to_flow(mixer, run, None)
    return _say_flow_run_end(state)


def _check_before_any_api(mixer: MixerConfig, run: RunOptions) -> None:
    """The flow checks these again; here they fail fast, before a Prefect API starts."""
    from sftmix.output.output_dir import check_output_free, paths_to_protect, refuse_different_settings
    from sftmix.planning.plan import check_inputs
    from sftmix.planning.recipe import mixer_recipe
    from sftmix.planning.roots import check_allowed_roots
    from sftmix.tokenizing.slices import SLICE_FORMAT_VERSION

    check_allowed_roots(mixer, run)
    check_output_free(mixer.output.path, paths_to_protect(mixer, run))
    check_inputs(mixer, run)
    refuse_different_settings(
        mixer.output.path, mixer.output.overwrite, mixer_recipe(mixer), SLICE_FORMAT_VERSION
    )


class _Planning:
    """The plan of a run, made once: before any API where only the plan can find the output up to
    date, else while the API starts (:func:`prefect_api`'s ``before_launch`` and ``prepare``)."""

    def __init__(self, mixer: MixerConfig, run: RunOptions) -> None:
        self.mixer, self.run = mixer, run
        self.planned: list[Any] = []

    def plan_and_check(self, early: Any = None) -> None:
        """The plan, whose user errors end the command before a flow run exists, and whether it finds
        the output up to date (then no flow run either). ``early``: what the slices of a large file
        are handed while the plan still reads it."""
        from sftmix.assembly.up_to_date import UpToDate, remember_inputs, up_to_date
        from sftmix.planning.plan import prepare_plan
        from tokenize_mixer.flows.workers.head_start import plan_ahead
        from tokenize_mixer.tasks.plan import hand_to_flow

        mixer, run = self.mixer, self.run
        prepare_plan(mixer, run)
        plan = plan_ahead(mixer, run, early)
        if plan is not None and (done := up_to_date(mixer, run, plan.recipe())) is not None:
            remember_inputs(mixer.output.path, plan.recipe(), plan.inputs)
            raise UpToDate(done)  # no API (or it stops); no flow run
        self.planned.append(plan)
        hand_to_flow(mixer, run, plan)

    def prepare(self) -> None:
        """While the API starts: the plan (unless made before), then the head start where it applies:
        tokenizing begins while the API is still starting."""
        from tokenize_mixer.flows.workers.head_start import begin_head_start, early_start

        if not self.planned:
            self.plan_and_check(early_start(self.run))
        if self.planned[0] is not None:
            begin_head_start(self.mixer, self.run, self.planned[0])


def _say_flow_run_end(state: Any) -> int:
    """The flow run's end: a cancel through the API stops the command, a failure is raised, and a
    finished run's report is printed."""
    if state.is_cancelled() or state.is_cancelling():
        raise record_stop(RunStopped("cancelled through the Prefect API", EXIT_CANCELLED))
    result = state.result(raise_on_failure=False)
    if isinstance(result, BaseException):
        raise result
    report = RunReport.model_validate(result)
    sys.stdout.write(report.render() + "\n")
    return 0


def _say_up_to_date(report: RunReport) -> int:
    """The command's end when the output already holds its shards: its report, said again."""
    timings, now = report.timings, time.time()
    timings.wall_seconds = timings.plan_seconds = round(now - (COMMAND_CLOCK.started or now), 3)
    timings.command_seconds = timings.wall_seconds
    sys.stdout.write(report.render() + "\n")
    return 0
