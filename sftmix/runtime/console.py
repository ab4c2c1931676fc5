"""What the command's console shows: without ``--verbose``, none of Prefect's per-task chatter, in the
command's own process and in the worker processes it starts (their console is the same terminal)."""

from __future__ import annotations

import logging

from sftmix.runtime import settings
from sftmix.runtime.redaction import add_secrets_from_environment

LINE_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
TIME_FORMAT = "%H:%M:%S"

#: Set by the command for the worker processes it starts: ``quiet`` or ``verbose``. Unset (a Prefect
#: worker's flow run) or verbose, a worker's console stays as Prefect set it up.
CONSOLE_ENV = settings.CONSOLE.name


#: ``extra=`` of the flow's log lines that repeat what the command prints on stdout (the run's summary):
#: the Prefect UI has only the log, so the flow logs them; the command's console leaves them out.
SUMMARY_LOG = {"tokenize_mixer_summary": True}


def is_summary_record(record: logging.LogRecord) -> bool:
    """A log record made with ``extra=SUMMARY_LOG``."""
    return bool(getattr(record, "tokenize_mixer_summary", False))


class QuietConsole(logging.Filter):
    """What the console leaves out without ``--verbose``: the run's summary and progress lines as the flow
    logs them for the Prefect UI (stdout has the summary, the command's bar or lines the progress), Prefect's "Finished in state ..." per task and flow run (a failure is
    the command's one ``error:`` line, or its traceback) and its workers' "Still processing items" as
    they flush at exit."""

    def filter(self, record: logging.LogRecord) -> bool:
        if is_summary_record(record) or getattr(record, "tokenize_mixer_progress", False):
            return False  # (the command prints the summary itself, and its own progress)
        msg = str(record.msg)
        if record.name in ("prefect.task_runs", "prefect.flow_runs") and msg.startswith("Finished in state"):
            return False
        return not msg.startswith("Still processing items")


def configure_command_console(verbose: bool) -> None:
    """The command's logging: our line format on stderr, quiet unless ``verbose`` (on our console
    handler only: a caller's own handlers are left as they are), and the same for its workers; no
    secret of the environment in any line (``sftmix.runtime.redaction``)."""
    add_secrets_from_environment()
    before = list(logging.getLogger().handlers)
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, format=LINE_FORMAT, datefmt=TIME_FORMAT
    )
    if not verbose:
        for handler in logging.getLogger().handlers:
            if handler not in before:
                handler.addFilter(QuietConsole())
    settings.CONSOLE.put("verbose" if verbose else "quiet")


def configure_worker_console() -> None:
    """In a worker process of the command: its console is as quiet as the command's. Prefect set up the
    worker's logging when it was imported (its console handler on the root logger, where the task's
    "Finished in state ..." arrives, in Prefect's format, which names the task run); its API handlers
    are left alone."""
    add_secrets_from_environment()
    if settings.CONSOLE.get() == "quiet":
        for handler in logging.getLogger().handlers:
            handler.addFilter(QuietConsole())
