"""Screenshot what a user sees in the Prefect UI for the latest tokenize-mixer run (a documented check).

    PREFECT_API_URL=http://127.0.0.1:4200/api python infra/ui_screenshots.py out/ui

Needs Debian's chromium (apt-get install chromium). Writes run.png (the run's task graph and logs) and
one PNG per artifact of that run (progress, per-dataset table, markdown report).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter
from prefect.client.schemas.sorting import FlowRunSort
from prefect.settings import PREFECT_API_URL

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1100",
    "--virtual-time-budget=20000",
]


def screenshot(browser: str, url: str, target: Path) -> None:
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={target}", url],
            check=True,
            capture_output=True,
            timeout=120,
        )


def main(out: str) -> list[Path]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("chromium not found (apt-get install chromium)")
    ui = PREFECT_API_URL.value().removesuffix("/api")
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    with get_client(sync_client=True) as client:
        run = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=None), sort=FlowRunSort.START_TIME_DESC, limit=1
        )[0]
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]))
        )
    shots = [(f"{ui}/runs/flow-run/{run.id}", target / "run.png")]
    shots += [(f"{ui}/artifacts/artifact/{a.id}", target / f"{a.key or a.id}.png") for a in artifacts]
    for url, path in shots:
        screenshot(browser, url, path)
    return [p for _, p in shots]


if __name__ == "__main__":
    for p in main(sys.argv[1] if len(sys.argv) > 1 else "out/ui"):
        sys.stdout.write(f"{p}\n")
