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

from sftmix.digest import compare

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "examples"))
from generate_demo_data import arithmetic  # noqa: E402

pytestmark = pytest.mark.slow


def command(data: Path, work: Path, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "sftmix.cli", "convert", "--dataset_mixer_list", str(data), "1.0",
        "--tokenizer_name_or_path", str(ROOT / "examples" / "tokenizer"), "--chat_template_name", "olmo",
        "--max_seq_length", "256", "--work_dir", str(work), "--output_dir", str(out), "--slice_rows", "600",
    ]  # fmt: skip


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    e["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    return e


def test_kill_9_anywhere_then_rerun(tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in arithmetic(random.Random(7), 12_000)))
    expected = tmp_path / "expected"
    subprocess.run(command(data, tmp_path / "work-ref", expected), env=env(), check=True, capture_output=True)

    out, work = tmp_path / "out", tmp_path / "work"
    rng = random.Random(20261125)
    for _ in range(3):  # kill points anywhere from start-up to publish
        proc = subprocess.Popen(
            command(data, work, out), env=env(), start_new_session=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(rng.uniform(9.0, 24.0))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    finished = len(list(work.glob("slices/*/*/manifest.json")))
    final = subprocess.run(command(data, work, out), env=env(), capture_output=True, text=True)
    assert final.returncode == 0, final.stderr[-3000:]
    result = compare(out, expected)
    assert result.matches, result.render()
    report = json.loads((out / "run_report.json").read_text())
    assert report["slices_reused"] >= finished - report["slices_rechecked"]  # nothing finished is redone
    assert report["slices_reused"] + report["slices_computed"] == report["slices_total"]
    leftovers = [p.name for p in out.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    assert leftovers == [], leftovers
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]
