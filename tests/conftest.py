from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.sharegpt import ensure_golden_sample
from tests.tokenizer_fixtures import GOLDEN, ensure_dolma2

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


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
