"""Drive the Prefect UI in headless Chromium as a user does: screenshots, and a Custom run submitted.

    export PREFECT_API_URL=http://127.0.0.1:4200/api PREFECT_API_AUTH_STRING="$(cat .prefect/auth-string)"
    python infra/ui_screenshots.py docs/ui                    # the pages of the latest run, and the form
    python infra/ui_screenshots.py out/ui --submit-demo --amount 1=0.25 \
        --output-dir /tmp/demo-out --work-dir /tmp/demo-work  # change the form, click Submit

Playwright for Python drives Debian's chromium (apt-get install chromium) through ``executable_path``: no
browser download. It waits for what it acts on as a person does (a field to be there, a button to be
visible and not covered). Writes form.png (the demo deployment's Custom run form, whole), run.png (the
run's page) and one PNG per artifact of that run (progress, per-dataset table, markdown report), from the
UI the server opens by default (Prefect 3.9: its V2 UI). With an auth string (infra/local_up.sh sets one)
it logs in as a user does, typing it into the UI's password field.

``--submit-demo`` fills the demo's Custom run form (an amount, by dataset index; the output and work
directories), checks that the form speaks in words (no Python type names; the output directory required,
path fields that say they are read on the worker), clicks Submit and prints the new flow run's id. Submit is
clicked again only when the server answered 503 (Prefect's SQLite server, busy, created nothing: see
infra/README.md). Exit status 1 when the form is wrong or the run was not created, with what the page said.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    DeploymentFilter,
    DeploymentFilterId,
    FlowRunFilter,
)
from prefect.client.schemas.sorting import FlowRunSort
from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL

#: Chromium's flags: no sandbox (containers), no GPU, nothing fetched from outside.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
VIEWPORT = {"width": 1400, "height": 1100}
#: Milliseconds Playwright waits for a page, a field or a button (a busy machine renders slowly).
WAIT_MS = 90_000


def find_browser() -> str:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("chromium not found (apt-get install chromium)")
    return browser


def auth_string() -> str | None:
    auth = PREFECT_API_AUTH_STRING.value()
    if auth is None:
        return None
    return auth.get_secret_value() if hasattr(auth, "get_secret_value") else str(auth)


def ui_base(ui: str) -> str:
    """The UI the server opens by default (Prefect 3.9 serves its V2 UI under /v2 and the old one at /)."""
    try:
        with urllib.request.urlopen(f"{ui}/ui-settings", timeout=30) as resp:
            settings = json.loads(resp.read())
    except (OSError, ValueError):
        return ui
    if settings.get("default_ui") == "v2" and settings.get("v2_base_url"):
        return ui + settings["v2_base_url"].rstrip("/")
    return ui


@contextlib.contextmanager
def browser_page() -> Iterator[Any]:
    """A page of headless Debian chromium, driven by Playwright."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=find_browser(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_context(viewport=VIEWPORT).new_page()
            page.set_default_timeout(WAIT_MS)
            yield page
        finally:
            browser.close()


def log_in(page: Any, base: str, auth: str | None) -> None:
    """Open the UI and, where it asks for a password, type the auth string and press Enter."""
    page.goto(f"{base}/")
    if auth is None:
        return
    password = page.locator("input[type=password]")
    password.wait_for()
    password.fill(auth)
    password.press("Enter")
    password.wait_for(state="detached")


def settle(page: Any) -> None:
    """Until the page has fetched its data (no request for half a second) and drawn it."""
    page.wait_for_load_state("networkidle")
    page.wait_for_timeout(1000)


def capture(page: Any, url: str | None, path: Path, whole: bool = False) -> None:
    """A screenshot of ``url`` (the page as it is when None); ``whole``: its full height, not the window."""
    if url is not None:
        page.goto(url)
        settle(page)
    if page.locator("input[type=password]").count():
        raise SystemExit(f"the UI still asks for a password at {url}: is PREFECT_API_AUTH_STRING right?")
    if whole:  # the tallest scrolling element decides: the UI scrolls inside its own panes
        height = page.evaluate("Math.max(...[...document.querySelectorAll('*')].map(e => e.scrollHeight))")
        page.set_viewport_size({"width": VIEWPORT["width"], "height": int(height or 1100) + 60})
        page.wait_for_timeout(1000)
    try:
        page.screenshot(path=str(path))
    finally:
        page.set_viewport_size(VIEWPORT)


#: What a form must not show a person: type buttons, "Property is type", model class names.
PYTHON_IN_FORM = re.compile(
    r"^(str|int|float|bool|None|NoneType|list|dict)$"
    r"|\b(str|int|float|bool|list|dict|None)\s*\|"
    r"|Property is type"
    r"|\b[A-Z][a-z]+(Spec|Entry|Options|Config)\b",
    re.MULTILINE,
)


def python_in_form(text: str) -> list[str]:
    return sorted({m.group(0) for m in PYTHON_IN_FORM.finditer(text)})


def field(page: Any, label: str, index: int = 0) -> Any:
    """The ``index``-th field labelled ``label`` (the V2 form adds " (Optional)" to optional ones)."""
    return page.get_by_label(re.compile(rf"^{re.escape(label)}( \(Optional\))?$")).nth(index)


def form_problems(page: Any) -> list[str]:
    """What a person filling the Custom run form would trip over: Python type names, an output directory
    not marked as required, path fields that do not say they are read on the worker."""
    problems = (
        [f"shows Python type names: {', '.join(shown)}"]
        if (shown := python_in_form(page.inner_text("body")))
        else []
    )
    labels = page.locator("label").all_inner_texts()
    if "Output directory (Optional)" in labels or "Output directory" not in labels:
        problems.append("the output directory is not marked as required")
    if "give an absolute one" not in page.inner_text("body"):
        problems.append("no help says that paths are read on the worker")
    return problems


#: Clicks on Submit at most: again only after a 503 (nothing created, see the module docstring).
SUBMIT_CLICKS = 3


def submit(page: Any) -> list[int]:
    """Click Submit as a person does, and again when the server answered 503; the statuses of the
    requests that asked for the run."""
    statuses: list[int] = []
    for attempt in range(1, SUBMIT_CLICKS + 1):
        with page.expect_response(lambda r: "/create_flow_run" in r.url) as answer:
            page.get_by_role("button", name="Submit", exact=True).click()
        statuses.append(answer.value.status)
        if answer.value.status != 503:
            return statuses
        sys.stderr.write(
            "Submit was answered 503 (Prefect's SQLite database was busy; no run was created): "
            f"clicking Submit again ({attempt} of {SUBMIT_CLICKS - 1}), as a person would\n"
        )
        page.wait_for_timeout(1000)
    return statuses


def submit_demo(out: Path, amounts: dict[int, str], output_dir: str, work_dir: str) -> str:
    """Fill the demo deployment's Custom run form and click Submit; the new flow run's id."""
    ui = PREFECT_API_URL.value().removesuffix("/api")
    base = ui_base(ui)
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("tokenize-mixer/demo")
        runs_filter = DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
        before = {r.id for r in client.read_flow_runs(deployment_filter=runs_filter)}
    with browser_page() as page:
        log_in(page, base, auth_string())
        page.goto(f"{base}/deployments/deployment/{deployment.id}/run")
        field(page, "Work directory").wait_for()
        settle(page)
        capture(page, None, out / "form.png", whole=True)
        if problems := form_problems(page):
            raise SystemExit(f"the Custom run form: {'; '.join(problems)}")
        for index, amount in sorted(amounts.items()):
            field(page, "Amount", index).fill(amount)
        field(page, "Output directory").fill(output_dir)
        if work_dir:
            field(page, "Work directory").fill(work_dir)
        statuses = submit(page)
        deadline = time.monotonic() + 120
        with get_client(sync_client=True) as client:
            while True:
                new = [r for r in client.read_flow_runs(deployment_filter=runs_filter) if r.id not in before]
                if new:
                    return str(new[0].id)
                if time.monotonic() > deadline:  # what the page says, for the log
                    capture(page, None, out / "after-submit.png", whole=True)
                    text = page.inner_text("body")
                    (out / "after-submit.txt").write_text(text)
                    raise SystemExit(
                        f"no flow run was created within 120 s of clicking Submit (answered {statuses}); the "
                        f"page: {text[-500:]!r} (all of it: {out / 'after-submit.txt'})"
                    )
                time.sleep(0.5)


def main(out: str) -> list[Path]:
    ui = PREFECT_API_URL.value().removesuffix("/api")
    base = ui_base(ui)
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    with get_client(sync_client=True) as client:
        run = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=None), sort=FlowRunSort.START_TIME_DESC, limit=1
        )[0]
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]))
        )
        try:
            demo = client.read_deployment_by_name("tokenize-mixer/demo")
        except Exception:  # no demo deployment on this server: no form to show
            demo = None
    shots = [(f"{base}/runs/flow-run/{run.id}", target / "run.png", False)]
    shots += [
        (f"{base}/artifacts/artifact/{a.id}", target / f"{a.key or a.id}.png", False) for a in artifacts
    ]
    if demo is not None:
        shots.append((f"{base}/deployments/deployment/{demo.id}/run", target / "form.png", True))
    with browser_page() as page:
        log_in(page, base, auth_string())
        for url, path, whole in shots:
            capture(page, url, path, whole=whole)
    return [p for _, p, _ in shots]


def _amount(text: str) -> tuple[int, str]:
    index, _, value = text.partition("=")
    return int(index), value


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", nargs="?", default="out/ui")
    parser.add_argument(
        "--submit-demo", action="store_true", help="fill and submit the demo's Custom run form"
    )
    parser.add_argument(
        "--amount", type=_amount, action="append", default=[], help="INDEX=AMOUNT, e.g. 1=0.25"
    )
    parser.add_argument("--output-dir", default="out/demo-ui")
    parser.add_argument("--work-dir", default="")
    args = parser.parse_args()
    if args.submit_demo:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        sys.stdout.write(
            submit_demo(Path(args.out), dict(args.amount), args.output_dir, args.work_dir) + "\n"
        )
    else:
        for p in main(args.out):
            sys.stdout.write(f"{p}\n")
