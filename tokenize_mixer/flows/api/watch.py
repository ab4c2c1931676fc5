"""Noticing, while slices run, that the run should stop: a cancel from the UI or `prefect flow-run
cancel` (the flow-run state turns CANCELLING), or a Prefect API that stopped answering.

A flow started by our CLI has no runner process that would kill it on a cancel, so the flow looks
itself, every couple of seconds, between slice completions.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.context import FlowRunContext

from sftmix.runtime.stopping import EXIT_API_LOST, EXIT_CANCELLED, RunStopped, look_for_stop, record_stop

logger = logging.getLogger(__name__)


class StopCheck:
    """Raises :class:`RunStopped` from :meth:`check` once the run is stopped, cancelled or the API is lost
    (asked every few seconds at most, unless forced)."""

    def __init__(self, every_seconds: float = 2.0, api_grace_seconds: float = 3.0) -> None:
        ctx = FlowRunContext.get()
        self.flow_run_id = ctx.flow_run.id if ctx is not None and ctx.flow_run is not None else None
        self.every = every_seconds
        self.grace = api_grace_seconds
        self._last_check = 0.0
        self._api_ok_at = time.monotonic()
        self._api_failing = False

    def seconds_to_next_look(self) -> float:
        """How long a waiting caller may sleep before calling :meth:`check` again: every few seconds, or,
        once the API failed to answer, just past the end of its grace period (not a whole interval later)."""
        if not self._api_failing:
            return self.every
        return max(0.05, min(self.every, self._api_ok_at + self.grace + 0.05 - time.monotonic()))

    def check(self, force: bool = False) -> None:
        # recorded by a thread that noticed it, or noticed now (sftmix.runtime.stopping)
        stop = look_for_stop()
        if stop is not None:
            raise stop
        now = time.monotonic()
        grace_over = self._api_failing and now - self._api_ok_at > self.grace
        if self.flow_run_id is None or (not force and not grace_over and now - self._last_check < self.every):
            return
        self._last_check = now
        try:
            with quick_client() as client:  # a look, not a vigil
                state = client.read_flow_run(self.flow_run_id).state
        except Exception as exc:  # the API is down or unreachable: a grace period, then stop
            self._api_failing = True
            if now - self._api_ok_at > self.grace:
                _no_more_retries()
                raise record_stop(
                    RunStopped(
                        f"stopped: the Prefect API stopped answering ({type(exc).__name__}: {exc})",
                        EXIT_API_LOST,
                    )
                ) from None
            return
        self._api_ok_at, self._api_failing = now, False
        if state is not None and (state.is_cancelling() or state.is_cancelled()):
            raise record_stop(RunStopped("cancelled through the Prefect API", EXIT_CANCELLED))


@contextlib.contextmanager
def no_retries() -> Iterator[None]:
    """Prefect's client retries a refused connection five times with backoff (a minute); the settings
    object is shared with the engine's context (a context variable set here would not reach it), so
    it is changed in place."""
    from prefect.settings import get_current_settings

    client_settings = get_current_settings().client
    before = client_settings.max_retries
    object.__setattr__(client_settings, "max_retries", 0)
    try:
        yield
    finally:
        object.__setattr__(client_settings, "max_retries", before)


@contextlib.contextmanager
def quick_client() -> Iterator[SyncPrefectClient]:
    """A client that asks once: no request retries (:func:`no_retries`) and no connection retries
    either (Prefect sets its connection pool to retry a refused connect 3 times with backoff, 3.5 s a
    request; set back to none here the way Prefect sets it, each attribute looked for first)."""
    with no_retries(), get_client(sync_client=True) as client:
        transport_for_url = getattr(getattr(client, "_client", None), "_transport_for_url", None)
        if callable(transport_for_url):
            pool = getattr(transport_for_url(client.api_url), "_pool", None)
            if pool is not None and hasattr(pool, "_retries"):
                pool._retries = 0
        yield client


def _no_more_retries() -> None:
    """From here on Prefect's client gives up at once: reporting the crash to an API that is gone
    would otherwise retry with backoff for minutes. Left in place on purpose: the run is ending."""
    from prefect.settings import get_current_settings

    object.__setattr__(get_current_settings().client, "max_retries", 0)


def report_crashed(flow_run_id: str, stop: RunStopped) -> None:
    """Mark a flow run Crashed with the stop's reason, for a process about to end without the engine
    doing it (no retries: the API may be gone too)."""
    from prefect.states import Crashed

    _no_more_retries()
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Crashed(message=stop.reason), force=True)
