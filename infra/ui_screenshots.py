"""Drive the Prefect UI in headless Chromium as a user does: screenshots, and a Custom run submitted.

    export PREFECT_API_URL=http://127.0.0.1:4200/api PREFECT_API_AUTH_STRING="$(cat .prefect/auth-string)"
    python infra/ui_screenshots.py docs/ui                    # the pages of the latest run, and the form
    python infra/ui_screenshots.py out/ui --submit-demo --amount 1=0.25 \
        --output-dir /tmp/demo-out --work-dir /tmp/demo-work  # change the form, click Submit

Needs Debian's chromium (apt-get install chromium). Writes form.png (the demo deployment's Custom run
form, whole), run.png (the run's page) and one PNG per artifact of that run (progress, per-dataset
table, markdown report), from the UI the server opens by default (Prefect 3.9: its V2 UI). With an auth
string (infra/local_up.sh sets one) it logs in as a user does: the UI keeps the password in the
browser's local storage, so Chromium is driven over the DevTools protocol to put it there first.

``--submit-demo`` fills the demo's Custom run form (an amount, by dataset index; the output and work
directories), checks that the form speaks in words (no Python type names), clicks Submit (again when
the form sent nothing) and prints the new flow run's id; exit status 1 when the form shows a type name
or the run was not created, with what the page said and sent after the click.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

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


def log_in(page: DevTools, base: str, auth: str | None) -> None:
    """What the UI's login form stores: the password, base64-encoded, sent as HTTP basic auth."""
    page.navigate(f"{base}/")
    if auth is not None:
        page.evaluate(f"localStorage.setItem('prefect-password', btoa({json.dumps(auth)}))")


def capture(page: DevTools, url: str | None, path: Path, whole: bool = False) -> None:
    """A screenshot of ``url`` (the page as it is when None); ``whole``: its full height, not the window."""
    if url is not None:
        page.navigate(url)
    if page.evaluate("document.querySelector('input[type=password]') !== null"):
        raise SystemExit(f"the UI still asks for a password at {url}: is PREFECT_API_AUTH_STRING right?")
    if whole:  # the tallest scrolling element decides: the UI scrolls inside its own panes
        height = page.evaluate("Math.max(...[...document.querySelectorAll('*')].map(e => e.scrollHeight))")
        page.call(
            "Emulation.setDeviceMetricsOverride",
            width=1400,
            height=int(height or 1100) + 60,
            deviceScaleFactor=1,
            mobile=False,
        )
        time.sleep(2)
    try:
        path.write_bytes(base64.b64decode(page.call("Page.captureScreenshot", format="png")["data"]))
    finally:
        if whole:
            page.call("Emulation.clearDeviceMetricsOverride")


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


#: Installed in each page before its own scripts: what the page did after a click, for the log when a
#: Submit creates no run (the buttons clicked, the requests sent and their statuses, the page's errors).
RECORDER = """(() => {
  const log = window.__tokenizeMixer = {clicks: [], requests: [], errors: []};
  document.addEventListener('click', e => {
    const b = e.target.closest && e.target.closest('button');
    log.clicks.push(b ? b.innerText.trim() : e.target.tagName);
  }, true);
  const fetch0 = window.fetch;
  window.fetch = async (...args) => {
    const req = args[0];
    const entry = {
      method: (args[1] && args[1].method) || (req && req.method) || 'GET',
      url: typeof req === 'string' ? req : String(req.url || req), status: 'pending',
    };
    log.requests.push(entry);
    try { const r = await fetch0(...args); entry.status = r.status; return r; }
    catch (err) { entry.status = 'failed: ' + err; throw err; }
  };
  const open0 = XMLHttpRequest.prototype.open;
  XMLHttpRequest.prototype.open = function (method, url, ...rest) {
    const entry = {method, url: String(url), status: 'pending'};
    log.requests.push(entry);
    this.addEventListener('loadend', () => { entry.status = this.status || 'failed'; });
    return open0.call(this, method, url, ...rest);
  };
  const error0 = console.error;
  console.error = (...a) => { log.errors.push(a.map(String).join(' ').slice(0, 500)); error0(...a); };
  window.addEventListener('error', e => log.errors.push(String(e.message)));
  window.addEventListener('unhandledrejection', e => log.errors.push('unhandled: ' + String(e.reason)));
})()"""


def recorded(page: DevTools, since: dict[str, int] | None = None) -> dict[str, list]:
    """What :data:`RECORDER` saw (since an earlier call's counts)."""
    log = page.evaluate("window.__tokenizeMixer || null") or {"clicks": [], "requests": [], "errors": []}
    return {k: v[(since or {}).get(k, 0) :] for k, v in log.items()}


#: The form's fields in page order, and the label of one without " (Optional)" (the V2 form labels its
#: inputs with <label for=...>).
FIELDS = "[...document.querySelectorAll('textarea, input')].filter(e => e.id)"
LABEL = """(e => {
  const label = document.querySelector(`label[for="${e.id}"]`);
  return label ? label.innerText.replace(/ \\(Optional\\)$/, '') : '';
})"""
FIELDS_JS = f"{FIELDS}.map({LABEL})"


def wait_for(page: DevTools, condition: str, what: str, timeout: float = 90) -> None:
    """Until the JavaScript ``condition`` holds (a busy machine renders slowly)."""
    deadline = time.monotonic() + timeout
    while not page.evaluate(condition):
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} did not appear within {timeout:.0f} s")
        time.sleep(0.5)


def type_into(page: DevTools, label: str, index: int, value: str) -> None:
    """Select the text of the ``index``-th field labelled ``label`` and type ``value`` over it."""
    found = page.evaluate(
        f"""(() => {{
  const fields = {FIELDS}.filter(e => {LABEL}(e) === {json.dumps(label)});
  const field = fields[{index}];
  if (!field) return false;
  field.scrollIntoView({{block: 'center'}});
  field.focus();
  field.select();
  return true;
}})()"""
    )
    if not found:
        labels = page.evaluate(FIELDS_JS)
        raise SystemExit(f"no field {label!r} number {index} in the form; its fields: {labels}")
    page.call("Input.insertText", text=value)
    time.sleep(0.3)


def click_button(page: DevTools, text: str) -> None:
    """A real mouse click (press and release) in the middle of the button that reads ``text``, once the
    page has scrolled it into view and nothing else is drawn over that point."""
    locate = f"""(() => {{
  const b = [...document.querySelectorAll('button')].filter(b => b.innerText.trim() === {json.dumps(text)}).pop();
  if (!b) return null;
  b.scrollIntoView({{block: 'center', behavior: 'instant'}});
  const r = b.getBoundingClientRect();
  const x = r.x + r.width / 2, y = r.y + r.height / 2;
  const hit = document.elementFromPoint(x, y);
  return [x, y, hit !== null && b.contains(hit)];
}})()"""
    deadline = time.monotonic() + 30
    while True:
        box = page.evaluate(locate)
        if box is None:
            raise SystemExit(f"no {text!r} button on the page")
        if box[2]:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"the {text!r} button stays covered or out of view")
        time.sleep(0.5)
    for kind in ("mousePressed", "mouseReleased"):
        page.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)


#: Clicks on Submit at most, and seconds for each to make the page ask for the run.
SUBMIT_CLICKS, SUBMIT_SECONDS = 3, 15.0


#: What the V2 form sends on Submit: the parameters to check, then the run to create.
SUBMIT_REQUESTS = ("/ui/schemas/validate", "/create_flow_run")


def submit_requests(seen: dict[str, list]) -> list[dict]:
    """The requests among those :func:`recorded` saw that a Submit sends."""
    return [r for r in seen["requests"] if any(path in r["url"] for path in SUBMIT_REQUESTS)]


def submit(page: DevTools) -> dict[str, int]:
    """Click Submit as a person does: again when nothing happened (the form sent nothing within
    :data:`SUBMIT_SECONDS`: on a busy machine a click has missed, twice in CI), never once it has sent
    something (a second run could follow). What :func:`recorded` held before the first click."""
    since = {k: len(v) for k, v in recorded(page).items()}
    for attempt in range(1, SUBMIT_CLICKS + 1):
        click_button(page, "Submit")
        deadline = time.monotonic() + SUBMIT_SECONDS
        while time.monotonic() < deadline:
            if submit_requests(recorded(page, since)):
                return since
            time.sleep(0.5)
        seen = recorded(page, since)
        sys.stderr.write(
            f"click {attempt} on Submit: the form sent nothing within {SUBMIT_SECONDS:.0f} s "
            f"(clicks seen {seen['clicks']}, requests {[r['url'] for r in seen['requests']][-5:]})\n"
        )
    return since


#: Clicks on Submit again after the server answered 503: Prefect's SQLite server refuses a run whose
#: transaction met another writer's commit ("database is locked", retryable, nothing created), which the
#: UI shows as "Unknown error while creating flow run"; its Python client retries, the page does not.
BUSY_RESUBMITS = 3


def refused_as_busy(seen: dict[str, list]) -> bool:
    """Whether the last run that Submit asked for was answered 503 (nothing was created)."""
    created = [r for r in seen["requests"] if "/create_flow_run" in r["url"]]
    return bool(created) and created[-1]["status"] == 503


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


def submit_demo(out: Path, amounts: dict[int, str], output_dir: str, work_dir: str) -> str:
    """Fill the demo deployment's Custom run form and click Submit; the new flow run's id."""
    ui = PREFECT_API_URL.value().removesuffix("/api")
    base = ui_base(ui)
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("tokenize-mixer/demo")
        runs_filter = DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
        before = {r.id for r in client.read_flow_runs(deployment_filter=runs_filter)}
    with devtools(find_browser()) as page:
        page.call("Page.enable")  # (without it, the script below is not run)
        page.call("Page.addScriptToEvaluateOnNewDocument", source=RECORDER)
        log_in(page, base, auth_string())
        page.navigate(f"{base}/deployments/deployment/{deployment.id}/run")
        wait_for(page, f"{FIELDS_JS}.includes('Work directory')", "the Custom run form")
        capture(page, None, out / "form.png", whole=True)
        shown = python_in_form(page.evaluate("document.body.innerText"))
        if shown:
            raise SystemExit(f"the Custom run form shows Python type names: {shown}")
        for index, amount in sorted(amounts.items()):
            type_into(page, "Amount", index, amount)
        type_into(page, "Output directory", 0, output_dir)
        if work_dir:
            type_into(page, "Work directory", 0, work_dir)
        since = submit(page)
        deadline = time.monotonic() + 120
        resubmits = 0
        with get_client(sync_client=True) as client:
            while True:
                new = [r for r in client.read_flow_runs(deployment_filter=runs_filter) if r.id not in before]
                if new:
                    return str(new[0].id)
                if refused_as_busy(recorded(page, since)) and resubmits < BUSY_RESUBMITS:
                    resubmits += 1
                    sys.stderr.write(
                        "Submit was answered 503 (Prefect's SQLite database was busy; no run was created): "
                        f"clicking Submit again ({resubmits} of {BUSY_RESUBMITS}), as a person would\n"
                    )
                    time.sleep(1.0)
                    since = submit(page)
                    continue
                if time.monotonic() > deadline:  # what the page says and did, for the log
                    capture(page, None, out / "after-submit.png", whole=True)
                    seen = recorded(page, since)
                    text = str(page.evaluate("document.body.innerText"))
                    (out / "after-submit.txt").write_text(
                        f"{text}\n\nafter the click:\n{json.dumps(seen, indent=1)}\n"
                    )
                    asked = submit_requests(seen)
                    raise SystemExit(
                        "no flow run was created within 120 s of clicking Submit; after the click: clicks "
                        f"{seen['clicks']}, Submit's requests {asked}, {len(seen['requests']) - len(asked)} "
                        f"other requests, page errors {seen['errors']} (all of it: {out / 'after-submit.txt'})"
                    )
                time.sleep(0.5)


def main(out: str) -> list[Path]:
    browser = find_browser()
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
    auth = auth_string()
    if auth is None and base == ui:
        for url, path, _ in shots:
            screenshot(browser, url, path)
    else:
        with devtools(browser) as page:
            log_in(page, base, auth)
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
