"""The temporary Prefect API of a command run with no server: ours, or Prefect's own when ours fails."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    """
    import sys, httpx
    import flows.runtime as runtime

    if sys.argv[1] == "broken":  # a Prefect whose server no longer starts the way we launch it
        import subprocess

        real_launch = runtime.TemporaryServer.launch

        def launch(self):  # it exits by itself with an error (a server killed stops the run instead)
            real_launch(self)
            self.process.kill()
            self.process.wait()
            self.process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])

        runtime.TemporaryServer.launch = launch

    if sys.argv[1] == "profile":  # the API a Prefect profile names, found after the early launch
        import logging, os, subprocess

        logging.basicConfig(level=logging.INFO)

        with runtime.prefect_api(launch_first=True) as url:
            children = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True)
            assert children.stdout.split() == [], children.stdout  # the temporary server is stopped
        print("OK", url)
        sys.exit(0)

    prepared = []
    with runtime.prefect_api(prepare=lambda: prepared.append(1), launch_first=sys.argv[1] == "first") as url:
        assert httpx.get(url + "/health").status_code == 200
        from prefect import flow

        @flow
        def hello() -> int:
            return 7

        assert hello() == 7
    assert prepared == [1]
    print("OK", url)
    """
)


def run(mode: str, **extra_env: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra_env)
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_temporary_api_serves_a_flow():
    proc = run("ok")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OK http://127.0.0.1:" in proc.stdout


def test_a_server_that_does_not_start_falls_back_to_prefects_own():
    proc = run("broken")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "starting it the way Prefect does" in proc.stderr


def test_the_command_launches_its_server_before_importing_prefect_and_it_serves_a_flow():
    """``launch_first``: no settings handed over (the server reads the same profile and environment)."""
    proc = run("first")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OK http://127.0.0.1:" in proc.stdout


def test_an_api_named_by_a_profile_is_used_and_the_early_server_stopped(tmp_path):
    profiles = tmp_path / "profiles.toml"
    profiles.write_text('active = "remote"\n[profiles.remote]\nPREFECT_API_URL = "http://127.0.0.1:9/api"\n')
    proc = run("profile", PREFECT_PROFILES_PATH=str(profiles))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OK http://127.0.0.1:9/api" in proc.stdout
    assert "the Prefect profile names an API" in proc.stderr
