"""The loop users live in: a real `prefect server` on 127.0.0.1, a process work pool, a worker, the
deployments from deployments/prefect.yaml, and `prefect deployment run` (started by infra/local_up.sh)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from sftmix.output.report import RunReport
from sftmix.planning.roots import ENV as ALLOWED_ROOTS
from tests.ports import free_port

ROOT = Path(__file__).parent.parent
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PREFECT_") and k not in ("TOKENIZE_MIXER_AUTH_STRING", ALLOWED_ROOTS)
    }
    env.update(
        PATH=f"{BIN}{os.pathsep}{env['PATH']}",
        PREFECT_HOME=str(home),
        TOKENIZE_MIXER_PORT=str(port),
        TOKENIZE_MIXER_POOL="tokenize-mixer-test",
        PREFECT_WORKER_QUERY_SECONDS="1",
    )
    up = subprocess.run(
        ["bash", "infra/local_up.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        auth_file = home / "auth-string"
        assert stat.S_IMODE(auth_file.stat().st_mode) == 0o600
        assert f'export PREFECT_API_AUTH_STRING="$(cat {auth_file})"' in up.stdout
        env["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
        env["PREFECT_API_AUTH_STRING"] = auth_file.read_text().strip()  # what a user exports
        yield env
    finally:
        subprocess.run(["bash", "infra/local_down.sh"], cwd=ROOT, env=env, timeout=60)


def deployment_run(env: dict, name: str, params: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            str(BIN / "prefect"),
            "deployment",
            "run",
            f"tokenize-mixer/{name}",
            "--watch",
            "--watch-interval",
            "1",
            "--params",
            json.dumps(params),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_api_refuses_requests_without_the_auth_string(server):
    api = server["PREFECT_API_URL"]
    assert httpx.get(f"{api}/health").status_code == 200  # unauthenticated probes stay open (Prefect's rule)
    assert httpx.get(f"{api}/deployments/name/tokenize-mixer/demo").status_code == 401
    assert (
        httpx.get(f"{api}/deployments/name/tokenize-mixer/demo", auth=("admin", "wrong")).status_code == 401
    )
    assert httpx.get(f"{api}/csrf-token", params={"client": "x"}).status_code == 401
    assert httpx.post(f"{api}/flow_runs/filter", json={}).status_code in (401, 403)
    with authed(server) as client:  # the right auth string, and a CSRF token (what Prefect's client does)
        assert client.post("/flow_runs/filter", json={}).status_code == 200
        no_csrf = httpx.post(f"{api}/flow_runs/filter", json={}, headers=auth_header(server))
        assert no_csrf.status_code == 403 and "CSRF" in no_csrf.text


def test_a_web_page_on_another_origin_cannot_start_a_run(server, tmp_path):
    """What a page on http://evil.example could send from the user's browser: the auth string is not a
    cookie, so the browser has none to attach; the CSRF token cannot be fetched without it."""
    api = server["PREFECT_API_URL"]
    own = api.removesuffix("/api")
    with authed(server) as client:
        deployment = client.get("/deployments/name/tokenize-mixer/demo").json()["id"]
        runs_before = client.post("/flow_runs/count", json={}).json()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    params = demo_params(tmp_path)
    params["mixer"]["output"] = {"path": str(victim), "overwrite": True}
    url = f"{api}/deployments/{deployment}/create_flow_run"
    evil = {"Origin": "http://evil.example"}
    body = json.dumps({"parameters": params})
    for content_type in ("text/plain", "application/json"):  # a "simple" request needs no preflight
        r = httpx.post(url, content=body, headers={**evil, "Content-Type": content_type})
        assert r.status_code in (401, 403), r.text
        assert r.headers.get("access-control-allow-origin") is None
    forged = {**evil, "Prefect-Csrf-Token": "guess", "Prefect-Csrf-Client": "guess"}
    assert httpx.post(url, content=body, headers=forged).status_code in (401, 403)
    # the browser's preflight for a JSON / authorized request: evil.example is not allowed, the UI is
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,authorization",
    }
    r = httpx.options(url, headers={**evil, **preflight})
    assert r.status_code >= 400 and r.headers.get("access-control-allow-origin") is None
    r = httpx.options(url, headers={"Origin": own, **preflight})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == own
    with authed(server) as client:
        r = client.get(f"/deployments/{deployment}", headers=evil)  # even an authorized answer is not shared
        assert r.status_code == 200 and r.headers.get("access-control-allow-origin") is None
        assert client.post("/flow_runs/count", json={}).json() == runs_before
    assert [p.name for p in victim.iterdir()] == ["precious.txt"]


def auth_header(env: dict) -> dict[str, str]:
    """HTTP basic auth with the auth string, as Prefect's client sends PREFECT_API_AUTH_STRING."""
    return {"Authorization": "Basic " + base64.b64encode(env["PREFECT_API_AUTH_STRING"].encode()).decode()}


class _RetryUnavailable(httpx.HTTPTransport):
    """Retries a 503, as Prefect's own client does: the server answers 503 for the errors it calls
    retryable (a busy SQLite database under a loaded machine), seen once failing a CI run."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        import time

        for attempt in range(6):
            response = super().handle_request(request)
            if response.status_code != 503 or attempt == 5:
                return response
            response.close()
            time.sleep(0.5 * 2**attempt)
        raise AssertionError("unreachable")


@contextlib.contextmanager
def authed(env: dict) -> Iterator[httpx.Client]:
    """An httpx client with the auth string and a CSRF token (what Prefect's own client does)."""
    with httpx.Client(
        base_url=env["PREFECT_API_URL"], headers=auth_header(env), transport=_RetryUnavailable()
    ) as client:
        csrf = client.get("/csrf-token", params={"client": "tests"}).json()["token"]
        client.headers.update({"Prefect-Csrf-Token": csrf, "Prefect-Csrf-Client": "tests"})
        yield client


def demo_params(tmp: Path, data: Path = Path("examples/data")) -> dict:
    """The demo mixer (dataset paths as typed, relative to the checkout the worker runs in)."""
    return {
        "mixer": {
            "datasets": [
                {"path": str(data / "general.jsonl"), "amount": "3.0"},
                {"path": str(data / "arithmetic.jsonl"), "amount": "0.5"},
                {"path": str(data / "conversions.jsonl"), "amount": "100"},
            ],
            "tokenizer": {"name_or_path": "examples/tokenizer", "chat_template": "olmo"},
            "max_seq_length": 512,
            "output": {"path": str(tmp / "out")},
        },
        "run": {"work_dir": str(tmp / "work"), "slice_rows": 40},
    }


def run_states(env: dict, flow_run_name: str) -> tuple[str, dict[str, int]]:
    """The flow run's state message, and its slice task runs counted by state name."""
    code = (
        "import collections, json, sys\n"
        "from prefect.client.orchestration import get_client\n"
        "from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, TaskRunFilter, TaskRunFilterName\n"
        "with get_client(sync_client=True) as c:\n"
        "    fr = c.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[sys.argv[1]])))[0]\n"
        "    trs = c.read_task_runs(flow_run_filter=FlowRunFilter(id={'any_': [fr.id]}),\n"
        "                           task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_='tokenize ')))\n"
        "    print(json.dumps([fr.state.message, collections.Counter(t.state.name for t in trs)]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, flow_run_name], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    message, counts = json.loads(out.stdout)
    return message or "", counts


def assert_demo_bytes(out: Path) -> None:
    """``tokenize-mixer compare`` of ``out`` against the demo's published digests."""
    compare = subprocess.run(
        [str(BIN / "tokenize-mixer"), "compare", str(out), str(ROOT / "examples" / "demo.digests.json")],
        capture_output=True,
        text=True,
    )
    assert compare.returncode == 0, compare.stdout + compare.stderr


def flow_run_name(output: str) -> str:
    for line in output.splitlines():
        if line.startswith("Created flow run '"):
            return line.strip().split("'")[1]
    raise AssertionError(output)


def test_demo_deployment_runs_to_completion_with_the_expected_digests(server, tmp_path):
    proc = deployment_run(server, "demo", demo_params(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_demo_bytes(tmp_path / "out")
    report = json.loads((tmp_path / "out" / "run_report.json").read_text())
    assert report["slices_computed"] == report["slices_total"]
    # --watch shows the flow run's logs (streamed out: infra/local_up.sh) until its final state, and the
    # run's summary lines before it (each cut where the console wraps it)
    said = RunReport.model_validate(report).render().splitlines()
    for line in (next(x for x in said if x.startswith(kind)) for kind in ("rows ", "documents ")):
        assert line[:40] in proc.stdout.split("prefect.flow-run.Completed")[0], proc.stdout[-3000:]


def test_a_changed_mixer_into_the_same_output_is_refused_in_one_line_before_any_slice(server, tmp_path):
    """The UI's way to lose hours, closed: the same output with one amount changed fails right after
    the plan, its state message the one line that says why, no traceback in its logs, no slice run."""
    first = deployment_run(server, "demo", demo_params(tmp_path))
    assert first.returncode == 0, first.stdout[-3000:]
    params = demo_params(tmp_path)
    params["mixer"]["datasets"][1]["amount"] = "0.25"
    refused = deployment_run(server, "demo", params)
    assert refused.returncode != 0
    name = flow_run_name(refused.stdout)
    message, tasks = run_states(server, name)
    assert "holds shards made with other settings or data" in message, message
    assert "mixer.datasets[1].amount: 0.5 -> 0.25" in message and "\n" not in message, message
    assert tasks == {}  # no slice was tokenized
    with authed(server) as client:
        run = client.post("/flow_runs/filter", json={"flow_runs": {"name": {"any_": [name]}}}).json()[0]
        logs = client.post("/logs/filter", json={"logs": {"flow_run_id": {"any_": [run["id"]]}}}).json()
    assert run["state"]["type"] == "FAILED"
    assert logs and not [entry["message"] for entry in logs if "Traceback" in entry["message"]]


def test_fail_then_fix_recomputes_only_the_failed_slices_batch(server, tmp_path):
    """The fixed file is read by batch (sftmix.sources.jsonl): the slices of the fixed row's 10 MiB batch, here all
    6 of the small arithmetic.jsonl, are computed again; the other datasets' 4 are reused."""
    data = tmp_path / "data"
    shutil.copytree(ROOT / "examples" / "data", data)
    rows = (data / "arithmetic.jsonl").read_text(encoding="utf-8").splitlines()
    good = rows[60]
    broken = json.loads(good)
    broken["messages"][0]["role"] = None  # loads fine, fails validation in its slice
    rows[60] = json.dumps(broken)
    (data / "arithmetic.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    params = demo_params(tmp_path, data)
    params["mixer"]["datasets"][1]["amount"] = "1.0"  # fixed row ranges: rows 40-79 are one slice

    failed = deployment_run(server, "demo", params)
    assert failed.returncode != 0
    message, states = run_states(server, flow_run_name(failed.stdout))
    assert "1 of 10 slices failed" in message
    assert (
        "arithmetic.jsonl rows 40-79" in message
        and "row 60 (0-based; line 61 of the file): message 0 has no 'role' string" in message
    )
    assert states == {"Failed": 1, "Completed": 9}

    rows[60] = good
    (data / "arithmetic.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    fixed = deployment_run(server, "demo", params)
    assert fixed.returncode == 0, fixed.stdout[-3000:]
    report = json.loads((tmp_path / "out" / "run_report.json").read_text())
    assert (report["slices_computed"], report["slices_reused"], report["slices_total"]) == (6, 4, 10)
    _, states = run_states(server, flow_run_name(fixed.stdout))
    assert states == {"Completed": 6}  # the 4 finished slices are reused with no task run each


def needs_chromium() -> None:
    """Skipped where Chromium is missing, except where CI asks for it (.ci/run installs it)."""
    if shutil.which("chromium") is None:
        if os.environ.get("TOKENIZE_MIXER_BROWSER_TEST") == "required":
            pytest.fail("TOKENIZE_MIXER_BROWSER_TEST=required but chromium is not installed")
        pytest.skip("needs Debian's chromium (apt-get install chromium; .ci/run installs it)")


def wait_for_flow_run(env: dict, flow_run_id: str, timeout: float = 300) -> dict:
    import time

    deadline = time.monotonic() + timeout
    with authed(env) as client:
        while True:
            run = client.get(f"/flow_runs/{flow_run_id}").json()
            if run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                return run
            assert time.monotonic() < deadline, run["state"]
            time.sleep(1)


def test_a_person_changes_an_amount_in_the_custom_run_form_and_submits_it(server, tmp_path):
    """Headless Chromium logs in with the auth string, opens the demo's Custom run form (the UI Prefect
    opens by default), finds no Python type name on it, types a new amount for the second dataset and
    the output and work directories, and clicks Submit. The run it creates writes the bytes that the
    config file with that amount writes on the command line; then the run's pages and artifacts render."""
    needs_chromium()
    out, work = tmp_path / "ui-out", tmp_path / "ui-work"
    submitted = subprocess.run(
        [
            sys.executable,
            str(ROOT / "infra" / "ui_screenshots.py"),
            str(tmp_path / "ui"),
            "--submit-demo",
            "--amount",
            "1=0.25",
            "--output-dir",
            str(out),
            "--work-dir",
            str(work),
        ],
        env=server,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    run = wait_for_flow_run(server, submitted.stdout.strip().splitlines()[-1])
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert run["parameters"]["mixer"]["datasets"][1]["amount"] == "0.25"
    report = json.loads((out / "run_report.json").read_text())
    assert [d["selected"] for d in report["per_dataset"]][1] == 60  # a quarter of 240 rows

    # the same mixer from a config file on the command line writes the same bytes
    config = yaml.safe_load((ROOT / "examples" / "mixer.yaml").read_text())
    config["mixer"]["datasets"][1]["amount"] = 0.25
    (tmp_path / "mixer.yaml").write_text(yaml.safe_dump(config))
    cli_env = {k: v for k, v in server.items() if not k.startswith("PREFECT_API")}
    cli = subprocess.run(
        [
            str(BIN / "tokenize-mixer"),
            "run",
            str(tmp_path / "mixer.yaml"),
            "--output_dir",
            str(tmp_path / "cli"),
        ],
        cwd=ROOT,
        env={**cli_env, "TOKENIZE_MIXER_WORK_DIR": str(tmp_path / "cli-work")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    compare = subprocess.run(
        [str(BIN / "tokenize-mixer"), "compare", str(out), str(tmp_path / "cli")],
        capture_output=True,
        text=True,
    )
    shards = [line for line in compare.stdout.splitlines() if ".npy" in line or ".csv.gz" in line]
    assert shards and all(line.startswith("OK") for line in shards), compare.stdout
    statistics = [json.loads((d / "dataset_statistics.json").read_text()) for d in (out, tmp_path / "cli")]
    for s in statistics:  # what differs: where and when each output was written
        s.pop("output_directory"), s.pop("timestamp")
    assert statistics[0] == statistics[1]

    shots = subprocess.run(
        [sys.executable, str(ROOT / "infra" / "ui_screenshots.py"), str(tmp_path / "ui")],
        env=server,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert shots.returncode == 0, shots.stderr
    names = {p.name for p in (tmp_path / "ui").iterdir()}
    assert {
        "form.png",
        "run.png",
        "tokenize-mixer-progress.png",
        "tokenize-mixer-datasets.png",
        "tokenize-mixer-report.png",
    } <= names
    assert all((tmp_path / "ui" / n).stat().st_size > 20_000 for n in names)  # rendered pages, not blank


def test_a_killed_worker_ends_the_flow_run_and_a_rerun_resumes(server, tmp_path):
    """kill -9 of `prefect worker start` mid-run: the flow-run process and its pool end within
    seconds, the run ends Crashed on the server (`--watch` returns), nothing is published; with a
    worker back, the same run reuses every finished slice."""
    import random
    import signal
    import time

    sys.path.insert(0, str(ROOT / "examples"))
    from generate_demo_data import arithmetic

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in arithmetic(random.Random(3), 60_000)))
    params = {
        "mixer": {
            "datasets": [{"path": str(data), "amount": "1.0"}],
            "tokenizer": {"name_or_path": "examples/tokenizer", "chat_template": "olmo"},
            "max_seq_length": 256,
            "output": {"path": str(tmp_path / "out")},
        },
        "run": {"work_dir": str(tmp_path / "work"), "slice_rows": 500, "runner": "process", "workers": 2},
    }
    args = [
        str(BIN / "prefect"),
        "deployment",
        "run",
        "tokenize-mixer/demo",
        "--watch",
        "--watch-interval",
        "1",
    ]
    watch = subprocess.Popen(
        [*args, "--params", json.dumps(params)],
        cwd=ROOT,
        env=server,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    home = Path(server["PREFECT_HOME"])
    worker = int((home / "worker.pid").read_text())
    deadline = time.monotonic() + 240
    while len(list((tmp_path / "work").glob("slices/*/*/manifest.json"))) < 3:
        assert time.monotonic() < deadline and watch.poll() is None, "no slice finished"
        time.sleep(0.2)
    flow_run_proc = subprocess.run(
        ["pgrep", "-P", str(worker)], capture_output=True, text=True
    ).stdout.split()
    assert flow_run_proc, "the worker runs no flow"
    pool = subprocess.run(["pgrep", "-P", flow_run_proc[0]], capture_output=True, text=True).stdout.split()
    os.kill(worker, signal.SIGKILL)
    killed = time.monotonic()
    out, _ = watch.communicate(timeout=120)
    assert time.monotonic() - killed < 30, out[-3000:]
    assert "Crashed" in out, out[-3000:]
    gone_by = time.monotonic() + 10
    while any(Path(f"/proc/{p}").exists() for p in [*flow_run_proc, *pool]) and time.monotonic() < gone_by:
        time.sleep(0.2)
    assert not any(Path(f"/proc/{p}").exists() for p in [*flow_run_proc, *pool])
    assert not (tmp_path / "out").exists()
    finished = len(list((tmp_path / "work").glob("slices/*/*/manifest.json")))

    restarted = subprocess.Popen(
        ["setsid", str(BIN / "prefect"), "worker", "start", "--pool", server["TOKENIZE_MIXER_POOL"]],
        cwd=ROOT,
        env=server,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    (home / "worker.pid").write_text(str(restarted.pid))  # local_down.sh stops it
    proc = deployment_run(server, "demo", params)
    assert proc.returncode == 0, proc.stdout[-3000:]
    report = json.loads((tmp_path / "out" / "run_report.json").read_text())
    assert report["slices_reused"] >= finished - report["slices_rechecked"]


def test_the_demo_submitted_as_the_ui_sends_it_writes_the_demos_bytes(server, tmp_path):
    """The UI form shows the deployment's stored parameters and posts them back as JSON, where 3.0 and
    3 are one number: amounts are text in the schema and in the deployment, so "3.0" stays an upsampling."""
    import time

    with authed(server) as client:
        deployment = client.get("/deployments/name/tokenize-mixer/demo").json()
        amount_schema = deployment["parameter_openapi_schema"]["definitions"]["DatasetEntry"]["properties"][
            "amount"
        ]
        assert amount_schema["type"] == "string"
        params = deployment["parameters"]
        assert [d["amount"] for d in params["mixer"]["datasets"]] == ["3.0", "0.5", "100"]
        # what the form sends, through a browser's JSON (only the output and work dir moved into tmp_path)
        params = json.loads(json.dumps(params))
        params["mixer"]["output"]["path"] = str(tmp_path / "out")
        params["run"] = {**params.get("run", {}), "work_dir": str(tmp_path / "work")}
        run = client.post(f"/deployments/{deployment['id']}/create_flow_run", json={"parameters": params})
        assert run.status_code == 201, run.text
        deadline = time.monotonic() + 300
        while True:
            state = client.get(f"/flow_runs/{run.json()['id']}").json()["state"]
            if state["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                break
            assert time.monotonic() < deadline, state
            time.sleep(1)
    assert state["type"] == "COMPLETED", state
    assert_demo_bytes(tmp_path / "out")
