"""Kill -9 the whole process tree at random moments, rerun, and get the uninterrupted bytes."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli_runs import assert_rerun_resumes, cli_env, convert_command

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "examples"))
from generate_demo_data import arithmetic  # noqa: E402

pytestmark = pytest.mark.slow


def command(data: Path, work: Path, out: Path) -> list[str]:
    return convert_command(data, work, out, 600)


def test_kill_9_anywhere_then_rerun(tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in arithmetic(random.Random(7), 12_000)))
    expected = tmp_path / "expected"
    subprocess.run(
        command(data, tmp_path / "work-ref", expected), env=cli_env(), check=True, capture_output=True
    )

    out, work = tmp_path / "out", tmp_path / "work"
    rng = random.Random(20261125)
    for _ in range(3):  # kill points anywhere from start-up to publish
        proc = subprocess.Popen(
            command(data, work, out), env=cli_env(), start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(rng.uniform(9.0, 24.0))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    report = assert_rerun_resumes(command(data, work, out), work, out, expected)
    assert report["slices_reused"] + report["slices_computed"] == report["slices_total"]
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]
