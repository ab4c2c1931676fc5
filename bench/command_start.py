"""A command's start against Prefect's own, side by side in one run on this machine.

    python bench/command_start.py --runs 5

Timed in turn, round after round, each as a whole process from a fresh work and output directory:

- ``floor``: a trivial flow (one task) run by Prefect itself with no API configured: Prefect starts its
  own temporary server. What no command of ours can go below without a server.
- ``cold``: ``tokenize-mixer run examples/mixer.yaml`` with no API configured (its own temporary API).
- ``floor-server``: the trivial flow against an already running ``prefect server start``
  (``PREFECT_API_URL``): what no command of ours can go below with a server.
- ``server``: the demo against that server, Prefect's own answer to repeated local runs.

All share one Prefect home made for the bench (an untimed first round migrates its databases and, as
any first command on a machine does, keeps the demo tokenizer's facts in the user's cache); the server
has its own. Every demo output is compared with ``examples/demo.digests.json``. Prints each one's median
and range, ``cold - floor`` and ``server - floor-server`` per round (median).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

TRIVIAL_FLOW = """
from prefect import flow, task

@task
def one() -> int:
    return 1

@flow
def trivial() -> int:
    return one()

assert trivial() == 1
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def timed(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return seconds


def demo(scratch: Path, name: str, env: dict[str, str]) -> float:
    work, out = scratch / f"work-{name}", scratch / f"out-{name}"
    seconds = timed(
        [
            str(BIN / "tokenize-mixer"),
            "run",
            "examples/mixer.yaml",
            "--work_dir",
            str(work),
            "--output_dir",
            str(out),
        ],
        env,
    )
    same = subprocess.run(
        [str(BIN / "tokenize-mixer"), "compare", str(out), "examples/demo.digests.json"],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )  # fmt: skip
    if same.returncode != 0:
        raise SystemExit(f"{name}: the demo's output differs from examples/demo.digests.json:\n{same.stdout}")
    shutil.rmtree(work)
    shutil.rmtree(out)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="command-start-"))
    base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    base.update(
        PREFECT_HOME=str(scratch / "home"), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1"
    )
    port = free_port()
    server_env = {**base, "PREFECT_HOME": str(scratch / "server-home"), "PREFECT_UI_ENABLED": "false"}
    server = subprocess.Popen(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=server_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    with_server = {**base, "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
    runs: dict[str, list[float]] = {"floor": [], "cold": [], "floor-server": [], "server": []}
    try:
        import httpx

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/api/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        print(
            f"{os.cpu_count()} CPUs; an untimed first round (databases, bytecode, page cache) ...", flush=True
        )
        timed([sys.executable, "-c", TRIVIAL_FLOW], base)
        timed([sys.executable, "-c", TRIVIAL_FLOW], with_server)
        demo(scratch, "warm-up", base)
        demo(scratch, "warm-up-server", with_server)
        for i in range(args.runs):
            runs["floor"].append(timed([sys.executable, "-c", TRIVIAL_FLOW], base))
            runs["cold"].append(demo(scratch, f"cold{i}", base))
            runs["floor-server"].append(timed([sys.executable, "-c", TRIVIAL_FLOW], with_server))
            runs["server"].append(demo(scratch, f"server{i}", with_server))
            print(
                f"round {i + 1}: floor {runs['floor'][-1]:.2f} s, cold {runs['cold'][-1]:.2f} s, "
                f"floor-server {runs['floor-server'][-1]:.2f} s, server {runs['server'][-1]:.2f} s",
                flush=True,
            )
    finally:
        server.terminate()
        server.wait(30)
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\n{'':34}{'median':>9}{'range':>18}")
    names = {
        "floor": "Prefect's own, a trivial flow",
        "cold": "ours, the demo, no server",
        "floor-server": "Prefect's own, prefect server",
        "server": "ours, the demo, prefect server",
    }
    for key, label in names.items():
        values = runs[key]
        print(f"{label:34}{statistics.median(values):8.2f}s{min(values):9.2f}-{max(values):.2f} s")
    over = [c - f for c, f in zip(runs["cold"], runs["floor"], strict=True)]
    print(
        f"\ncold - floor, per round (median): {statistics.median(over):+.2f} s (range {min(over):+.2f} to {max(over):+.2f})"
    )
    over = [d - f for d, f in zip(runs["server"], runs["floor-server"], strict=True)]
    print(
        f"server - floor-server, per round (median): {statistics.median(over):+.2f} s "
        f"(range {min(over):+.2f} to {max(over):+.2f})"
    )
    print(f"with a server (median): {statistics.median(runs['server']):.2f} s")


if __name__ == "__main__":
    main()
