from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import tiers
from tests.sharegpt import ensure_golden_sample
from tests.tokenizer_fixtures import GOLDEN, ensure_dolma2

# The commands the tests start get the signal dispositions of a terminal's foreground job, whatever
# started the tests (a shell's background job ignores SIGINT; nohup ignores SIGHUP, which the command
# then leaves ignored): the stop tests send both.
signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        help="every tier, as .ci/run runs it (without it: the quick loop, no test marked slow or full)",
    )


def pytest_configure(config: pytest.Config) -> None:
    tiers.FULL = bool(config.getoption("--full"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The quick loop leaves tests marked slow or full out, unless tests are named (files, ids) or chosen
    by ``-m``: then they run whatever their marks."""
    if tiers.FULL or config.getoption("-m") or config.option.file_or_dir:
        return
    left = [item for item in items if any(item.get_closest_marker(m) for m in tiers.FULL_ONLY)]
    if left:
        config.hook.pytest_deselected(items=left)
        out = set(left)
        items[:] = [item for item in items if item not in out]


@pytest.fixture(autouse=True, scope="module")
def _prefect_workers_drained() -> Iterator[None]:
    """After each module, the event and log workers a flow run started in this process are drained:
    the events worker's websocket pings draw from the global ``random`` (``websockets``' keepalive)
    while a later module's Hypothesis test draws, which Hypothesis reports as a strategy using it."""
    yield
    if "prefect.events.worker" in sys.modules:
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        for worker in (EventsWorker, APILogWorker):
            worker.drain_all(timeout=30, at_exit=False)


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    ensure_dolma2()
    ensure_golden_sample()
    return GOLDEN


@pytest.fixture(scope="session")
def prefect_api():
    """One real (temporary) Prefect API server for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        from prefect.settings import PREFECT_API_URL

        os.environ["PREFECT_API_URL"] = PREFECT_API_URL.value()  # spawned workers find the same server
        yield PREFECT_API_URL.value()
        os.environ.pop("PREFECT_API_URL", None)
