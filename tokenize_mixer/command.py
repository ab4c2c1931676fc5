"""The ``tokenize-mixer`` command's first step, before anything heavy is imported: from here on a stop (a
Ctrl-C, a SIGTERM, a closed pipe) at any moment ends the command with its one line and exit code, never
a traceback from inside an import, and a recorded stop ends it within seconds even if a thread is
wedged (:func:`sftmix.runtime.stopping.arm_watchdog`).
"""

from __future__ import annotations

import signal
import time

STARTED = time.time()
# Held back until the handlers are in place (a signal meanwhile is delivered to them then).
signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))

import sys  # noqa: E402

from sftmix.runtime.pipes import guard_std_streams  # noqa: E402 (the clock starts first)
from sftmix.runtime.processes import STOP_SIGNALS  # noqa: E402
from sftmix.runtime.stopping import (  # noqa: E402
    RUN_STOP_NOTE,
    RunStopped,
    exit_now,
    install_signal_handlers,
    set_stop_note,
)
from sftmix.runtime.watchdog import arm_watchdog  # noqa: E402


def entry() -> None:
    import os

    if not os.environ.get("PREFECT_API_URL"):
        # A command without a configured API runs on a temporary one whose analytics are off
        # (tokenize_mixer/flows/api/runtime.py); Prefect's client would still greet a first interactive run with a notice
        # that usage data is collected. Not so here: a user's own server keeps the user's settings.
        os.environ.setdefault("DO_NOT_TRACK", "1")
    guard_std_streams()
    install_signal_handlers()
    arm_watchdog()
    if sys.argv[1:2] in (["convert"], ["run"]):
        set_stop_note(RUN_STOP_NOTE)
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        from tokenize_mixer import cli
    except RunStopped as stop:
        exit_now(stop)
    cli.entry(started=STARTED)


if __name__ == "__main__":
    entry()
