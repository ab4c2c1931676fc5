"""The last resort: in a process that ends with its run (the command), a recorded stop ends the process
in bounded time, even if a thread is wedged and the stop never reaches the place that would end the run.
"""

from __future__ import annotations

import threading
import time

from sftmix.runtime.stopping import exit_now, first_stop, stop_recorded

_watchdog_armed = False


def arm_watchdog(seconds: float = 7.0) -> None:
    """In a process that ends with its run (the command): once a stop is recorded, the process ends
    within ``seconds`` (plus a bounded clean-up) with the stop's exit code, even if a thread is wedged
    and the stop never reaches the place that would end the run. A thread that dies or waits for ever
    can freeze a run that was told to stop; this cannot. (Its thread starts now: starting one from a
    signal handler could wait on a lock the interrupted code holds.)"""
    global _watchdog_armed
    if _watchdog_armed:
        return
    _watchdog_armed = True

    def watch() -> None:
        stop_recorded.wait()
        time.sleep(seconds)
        stop = first_stop()
        if stop is not None:
            exit_now(stop, forced=True)

    threading.Thread(target=watch, name="stop-watchdog", daemon=True).start()
