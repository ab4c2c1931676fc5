"""Plan the mixer (opens every dataset's metadata; no tokenizing)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from sftmix.config.config import MixerConfig
from sftmix.config.run_options import RunOptions
from sftmix.planning.plan import Plan, build_plan
from sftmix.runtime import settings
from tokenize_mixer.tasks import fail_cleanly

#: The plan the command made while the API started, for the flow run it starts next in this process.
_handed: dict[str, Plan] = {}


def _plan_key(mixer: MixerConfig, run: RunOptions) -> str:
    return mixer.model_dump_json() + run.model_dump_json()


def hand_to_flow(mixer: MixerConfig, run: RunOptions, plan: Plan | None) -> None:
    """Give the flow run the command starts next the plan made ahead of it (``None``: forget it), so the
    plan is made once per command and what it found is said once."""
    _handed.clear()
    if plan is not None:
        _handed[_plan_key(mixer, run)] = plan


@task(name="plan", cache_policy=NO_CACHE, persist_result=False)
@fail_cleanly
def plan_mixer(mixer: MixerConfig, run: RunOptions) -> Plan:
    handed = _handed.pop(_plan_key(mixer, run), None)
    _handed.clear()
    if handed is not None:
        handed.made_ahead = True
        return handed
    with core_lines_in_run_logs():
        return build_plan(mixer, run)


class _ToRunLogs(logging.Handler):
    """A line of the core, said again by the task run's logger (with the logger it came from)."""

    def __init__(self, run_logger: Any) -> None:
        super().__init__(logging.INFO)
        self.run_logger = run_logger

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.run_logger.log(record.levelno, "%s: %s", record.name, record.getMessage())
        except Exception:  # (a line that cannot be said is not a reason to fail the plan)
            self.handleError(record)


@contextlib.contextmanager
def core_lines_in_run_logs() -> Iterator[None]:
    """The core's lines while the plan runs (the encoder it chose, how far a hub dataset's downloads
    are, which may take minutes) in the run's logs, where no console of the command shows them: a flow
    run a Prefect worker runs (a deployment, the UI). The command's console shows them itself."""
    if settings.CONSOLE.get():
        yield
        return
    core = logging.getLogger("sftmix")
    handler, level, propagate = _ToRunLogs(get_run_logger()), core.level, core.propagate
    core.addHandler(handler)
    core.propagate = False  # (said once: the run's logger has the worker's console too)
    if core.getEffectiveLevel() > logging.INFO:
        core.setLevel(logging.INFO)
    try:
        yield
    finally:
        core.removeHandler(handler)
        core.setLevel(level)
        core.propagate = propagate
