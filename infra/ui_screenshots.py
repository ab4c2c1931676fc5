"""Screenshot what a user sees in the Prefect UI for the latest tokenize-mixer run (a documented check).

    PREFECT_API_URL=http://127.0.0.1:4200/api PREFECT_API_AUTH_STRING="$(cat .prefect/auth-string)" \
        python infra/ui_screenshots.py out/ui

Needs Debian's chromium (apt-get install chromium). Writes run.png (the run's task graph and logs) and
one PNG per artifact of that run (progress, per-dataset table, markdown report). With an auth string
(infra/local_up.sh sets one) it logs in as a user does: the UI keeps the password in the browser's local
storage, so Chromium is driven over the DevTools protocol to put it there before the screenshots.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter
from prefect.client.schemas.sorting import FlowRunSort
from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL

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
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        subprocess.run(
            [browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={target}", url],
            check=True,
            capture_output=True,
            timeout=120,
        )


#: Seconds a page gets to fetch its data and render before the screenshot (DevTools path).
SETTLE_SECONDS = 10.0


class DevTools:
    """A minimal Chrome DevTools protocol session on one page (commands answered in order)."""

    def __init__(self, ws_url: str) -> None:
        from websockets.sync.client import connect

        self.ws = connect(ws_url, max_size=None, open_timeout=30)
        self.ids = itertools.count(1)

    def call(self, method: str, **params: object) -> dict:
        call_id = next(self.ids)
        self.ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=120))
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        time.sleep(SETTLE_SECONDS)

    def evaluate(self, expression: str) -> object:
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")


@contextlib.contextmanager
def devtools(browser: str) -> Iterator[DevTools]:
    flags = [f for f in CHROMIUM_FLAGS if not f.startswith("--virtual-time-budget")]
    # Chromium's helper processes may still write into the profile as it is removed: a leftover
    # file in a temporary directory is no reason to fail the screenshots.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        proc = subprocess.Popen(
            [browser, *flags, f"--user-data-dir={profile}", "--remote-debugging-port=0", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            port_file = Path(profile) / "DevToolsActivePort"
            deadline = time.monotonic() + 60
            while not (port_file.exists() and port_file.read_text().strip()):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("chromium did not open its DevTools port")
                time.sleep(0.2)
            port = int(port_file.read_text().split()[0])
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30) as resp:
                targets = json.loads(resp.read())
            session = DevTools(next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page"))
            try:
                yield session
            finally:
                session.ws.close()
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def screenshots_logged_in(browser: str, ui: str, auth: str, shots: list[tuple[str, Path]]) -> None:
    """Log in to the UI with the auth string (as its password form does), then screenshot each page."""
    with devtools(browser) as page:
        page.navigate(f"{ui}/")
        # what the UI's login form stores: the password, base64-encoded, sent as HTTP basic auth
        page.evaluate(f"localStorage.setItem('prefect-password', btoa({json.dumps(auth)}))")
        for url, path in shots:
            page.navigate(url)
            if page.evaluate("document.querySelector('input[type=password]') !== null"):
                raise SystemExit(
                    f"the UI still asks for a password at {url}: is PREFECT_API_AUTH_STRING right?"
                )
            path.write_bytes(base64.b64decode(page.call("Page.captureScreenshot", format="png")["data"]))


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
    auth = PREFECT_API_AUTH_STRING.value()
    if auth is not None:
        secret = auth.get_secret_value() if hasattr(auth, "get_secret_value") else str(auth)
        screenshots_logged_in(browser, ui, secret, shots)
    else:
        for url, path in shots:
            screenshot(browser, url, path)
    return [p for _, p in shots]


if __name__ == "__main__":
    for p in main(sys.argv[1] if len(sys.argv) > 1 else "out/ui"):
        sys.stdout.write(f"{p}\n")
