from __future__ import annotations

import atexit
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sftmix.runtime import settings as product_settings
from tests import tiers

#: Variables the suite itself reads (``.ci/run`` sets the first; the soak's seed is chosen by a person).
SUITE_OWN = ("TOKENIZE_MIXER_BROWSER_TEST", "TOKENIZE_MIXER_SOAK_SEED")

#: Prefixes of what the libraries we run read from the environment: Prefect's settings (its API, its
#: profile), the Hugging Face hub's, datasets' and transformers' (offline modes, caches, endpoints, tokens).
LIBRARY_PREFIXES = ("PREFECT_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "DATASETS_")

#: Single variables the product or its libraries read: telemetry opt-out, the GCS client's.
LIBRARY_VARIABLES = ("DO_NOT_TRACK", "STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS")


def scrub_environment(profiles: Path) -> None:
    """The suite's environment is its own, whatever the caller's shell exports (a cluster's
    ``HF_HUB_OFFLINE=1``, a configured Prefect server, a ``TOKENIZE_MIXER_WORK_DIR``): every product setting
    (``sftmix.runtime.settings``) and every library variable is cleared, then the suite's choices set; Prefect
    reads an empty profiles file (its default profile), not the caller's. Done before any test module
    imports a library that reads its variables once; the processes tests start inherit it."""
    ours = {s.name for s in product_settings.ALL}
    for name in list(os.environ):
        library = name.startswith(LIBRARY_PREFIXES) or name in LIBRARY_VARIABLES
        if (name in ours or library or name.startswith("TOKENIZE_MIXER_")) and name not in SUITE_OWN:
            del os.environ[name]
    profiles.parent.mkdir(parents=True, exist_ok=True)
    profiles.write_text("")
    os.environ["PREFECT_PROFILES_PATH"] = str(profiles)
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    # gcsfs reads this once, when first imported (the test modules' collection imports it). Its default picks a
    # class that asks, before each call on a bucket, the gRPC control plane the GCS emulator lacks, and retries
    # it: in a cold-cache run each call took seconds to a minute (test_gcs's first test ran 10 minutes and on).
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"


_scrubbed = Path(tempfile.mkdtemp(prefix="tokenize-mixer-tests-"))
atexit.register(shutil.rmtree, _scrubbed, ignore_errors=True)
scrub_environment(_scrubbed / "profiles.toml")
# (after the scrub: these import libraries that read the environment once)
from tests.sharegpt import ensure_golden_sample  # noqa: E402
from tests.tokenizer_fixtures import GOLDEN, ensure_dolma2  # noqa: E402

# The commands the tests start get the signal dispositions of a terminal's foreground job, whatever
# started the tests (a shell's background job ignores SIGINT; nohup ignores SIGHUP, which the command
# then leaves ignored): the stop tests send both.
signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        help="every tier, as .ci/run runs it (without it: the quick loop, no test marked slow or full)",
    )


def pytest_configure(config: pytest.Config) -> None:
    tiers.FULL = bool(config.getoption("--full"))
    if not tiers.FULL:  # the loop's properties draw the same examples each run (tests/tiers.py)
        from hypothesis import settings

        settings.register_profile("loop", derandomize=True)
        settings.load_profile("loop")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The smoke tier's tests are marked ``smoke``; the quick loop leaves tests marked slow or full out,
    unless tests are named (files, ids) or chosen by ``-m``: then they run whatever their marks. The
    longest modules run first (``tiers.LONGEST_FIRST``), each module's tests in their order."""
    items.sort(key=lambda item: tiers.started_first(item.nodeid.split("::", 1)[0]))
    for item in items:
        if any(item.nodeid == s or item.nodeid.startswith(s + "::") for s in tiers.SMOKE):
            item.add_marker(pytest.mark.smoke)
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
