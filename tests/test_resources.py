"""A full disk (a small tmpfs) and an unwritable output: a one-line error, finished checkpoints kept,
nothing half-published. Needs root to mount (CI runs as root); skipped otherwise, with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from sftmix.output.digest import compare
from sftmix.runtime import settings

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "examples"))
from generate_demo_data import arithmetic  # noqa: E402

pytestmark = pytest.mark.slow


def _mount(path: Path, options: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")


@pytest.fixture
def mounts():
    mounted: list[Path] = []

    def mount(path: Path, options: str) -> Path:
        _mount(path, options)
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def convert(data: Path, work: Path, out: Path, disk_check: str = "on") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env[settings.DISK_CHECK.name] = disk_check
    return subprocess.run(
        [
            sys.executable, "-m", "tokenize_mixer.cli", "convert", "--dataset_mixer_list", str(data), "1.0",
            "--tokenizer_name_or_path", str(ROOT / "examples" / "tokenizer"), "--chat_template_name", "olmo",
            "--max_seq_length", "256", "--work_dir", str(work), "--output_dir", str(out),
            "--slice_rows", "500",
        ],
        env=env, capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    """4,000 rows: about 600k tokens, 1.2 MB of uint16 ids plus 0.6 MB of mask in the output."""
    import random

    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in arithmetic(random.Random(3), 4000)))
    return path


def one_line_error(done: subprocess.CompletedProcess, *needles: str) -> str:
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_full_output_disk_keeps_checkpoints_and_publishes_nothing(tmp_path, mounts, chats):
    """Refused before work, with the numbers; with the check off (an estimate can be low), the disk fills
    while the output is written: the slices stay checkpointed and nothing is published."""
    work = tmp_path / "work"
    small = mounts(tmp_path / "small", "size=1m")  # the shards need ~1.8 MB
    out = small / "out"
    refused = one_line_error(convert(chats, work, out), "not enough free disk", "~1.8 MB of output staged in")
    print(refused)
    assert not work.exists() or not list(work.glob("slices/*/*/manifest.json"))  # before any slice
    line = one_line_error(convert(chats, work, out, "off"), "No space left on device", str(small))
    print(line)
    assert list(small.iterdir()) == []  # no output, no staging left behind
    finished = len(list(work.glob("slices/*/*/manifest.json")))
    assert finished == 8  # every slice is checkpointed: the work was not lost

    roomy = tmp_path / "roomy" / "out"
    done = convert(chats, work, roomy)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((roomy / "run_report.json").read_text())
    assert (report["slices_reused"], report["slices_computed"]) == (8, 0)


def test_full_work_disk_fails_cleanly_then_resumes(tmp_path, mounts, chats):
    work = mounts(tmp_path / "work", "size=1200k")  # room for some slices, not all
    out = tmp_path / "out"
    refused = one_line_error(convert(chats, work, out), "not enough free disk", "of 8 slices to tokenize in")
    print(refused)
    assert not list(work.glob("slices/*/*/manifest.json"))  # refused before any slice
    line = one_line_error(
        convert(chats, work, out, "off"), "No space left on device", "cannot write the checkpoint"
    )
    print(line)
    assert not out.exists()
    finished = len(list(work.glob("slices/*/*/manifest.json")))
    assert 0 < finished < 8
    subprocess.run(["mount", "-o", "remount,size=64m", str(work)], check=True)  # the user frees space
    done = convert(chats, work, out)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "run_report.json").read_text())
    assert report["slices_reused"] + report["slices_rechecked"] >= finished
    assert report["slices_reused"] + report["slices_computed"] == 8
    expected = tmp_path / "expected"
    assert convert(chats, tmp_path / "work2", expected).returncode == 0
    assert compare(out, expected).matches
    assert not [p for p in work.rglob("*") if ".tmp-" in p.name]  # no half-written checkpoint files


def test_unwritable_output_is_refused_before_any_work(tmp_path, mounts, chats):
    locked = mounts(tmp_path / "locked", "size=1m,ro")
    work = tmp_path / "work"
    line = one_line_error(
        convert(chats, work, locked / f"out-{uuid.uuid4().hex[:6]}"),
        "is not writable",
        "Read-only file system",
    )
    print(line)
    assert not list(work.glob("slices/*/*/manifest.json"))  # refused before tokenizing anything
