"""The demo end to end, cold against in a warm runner (sftmix/warm.py), side by side in one run.

    python bench/warm_start.py --runs 5

A first cold command (with TOKENIZE_MIXER_WARM_SECONDS set, as a terminal would) leaves a runner; then
cold (TOKENIZE_MIXER_WARM_SECONDS=0) and warm commands alternate, each computing the demo from scratch in
a fresh work and output directory. Prints each pair's wall seconds and ratio, their medians, and whether
the warm and cold outputs are the same bytes. Everything lives in a temporary directory (its own Prefect
home and runner directory); the runner is stopped at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sftmix.digest import compare  # noqa: E402
from sftmix.warm import WARM_SECONDS_ENV  # noqa: E402

TOOL = Path(sys.executable).parent / "tokenize-mixer"


def demo(env: dict[str, str], root: Path, name: str) -> tuple[float, str, Path]:
    out = root / f"out-{name}"
    began = time.monotonic()
    done = subprocess.run(
        [str(TOOL), "run", "examples/mixer.yaml", "--work_dir", str(root / f"work-{name}"), "--output_dir", str(out)],
        env=env, cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    wall = time.monotonic() - began
    if done.returncode != 0:
        raise SystemExit(f"{name} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return wall, done.stderr, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tm-warm-bench-"))
    runners = root / "run"
    runners.mkdir(mode=0o700)
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING")},
        "XDG_RUNTIME_DIR": str(runners),
        "PREFECT_HOME": str(root / "prefect"),
        WARM_SECONDS_ENV: "600",
    }
    cold_env = {**env, WARM_SECONDS_ENV: "0"}
    try:
        first, _, _ = demo(env, root, "first")
        directory = runners / f"tokenize-mixer-{os.getuid()}"
        began = time.monotonic()
        while not list(directory.glob("*.sock")):
            if time.monotonic() - began > 180:
                raise SystemExit("no warm runner within 180 s of the first command")
            time.sleep(0.1)
        print(
            f"first command (a new Prefect database): {first:.2f} s; runner ready {time.monotonic() - began:.1f} s later"
        )
        pairs = []
        for i in range(args.runs):
            cold, cold_err, cold_out = demo(cold_env, root, f"cold{i}")
            warm, warm_err, warm_out = demo(env, root, f"warm{i}")
            assert "in the warm runner" in warm_err and "in the warm runner" not in cold_err
            same = compare(warm_out, cold_out).matches
            pairs.append((cold, warm))
            print(
                f"pair {i}: cold {cold:.2f} s, warm {warm:.2f} s, cold/warm {cold / warm:.2f}x, same bytes {same}"
            )
        colds, warms = [c for c, _ in pairs], [w for _, w in pairs]
        print(
            f"median: cold {statistics.median(colds):.2f} s, warm {statistics.median(warms):.2f} s "
            f"(min {min(warms):.2f}, max {max(warms):.2f}), "
            f"cold/warm {statistics.median(c / w for c, w in pairs):.2f}x"
        )
    finally:
        for state in (runners / f"tokenize-mixer-{os.getuid()}").glob("*.json"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                os.kill(json.loads(state.read_text())["pid"], signal.SIGTERM)
        time.sleep(2)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
