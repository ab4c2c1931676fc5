"""Where the flow's Prefect API lives when the user has no server.

With no ``PREFECT_API_URL``, Prefect would start a temporary API server in this process *and in every
spawned worker*. We start one temporary server up front and point this process and the workers at it
(workers inherit the environment), so a run pays the start-up once.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator


def _warm_imports() -> None:
    import datasets  # noqa: F401
    import transformers  # noqa: F401


@contextlib.contextmanager
def prefect_api(prepare: Callable[[], None] | None = None) -> Iterator[str]:
    """Yield the API URL in use: the configured server, or a temporary one for this command.

    ``prepare`` runs while the temporary server starts (work that fills caches the run uses next)."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.settings import PREFECT_API_URL, temporary_settings

    configured = PREFECT_API_URL.value()
    if configured:
        yield configured
        return
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    # Prefect's default 20 s is too short on a busy machine; a slow start is not a reason to fail.
    timeout = int(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120"))
    starting = threading.Thread(target=server.start, kwargs={"timeout": timeout}, daemon=True)
    starting.start()
    _warm_imports()  # the heavy imports of the run overlap the server's start-up
    if prepare is not None:
        prepare()
    starting.join()
    if not server.running:
        raise RuntimeError("the temporary Prefect API server did not start")
    os.environ["PREFECT_API_URL"] = server.api_url
    try:
        with temporary_settings({PREFECT_API_URL: server.api_url}):
            yield server.api_url
    finally:
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=10)  # send the last log lines while the server still listens
        os.environ.pop("PREFECT_API_URL", None)
        server.stop()
