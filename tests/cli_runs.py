"""The CLI run as a user runs it, for the tests that stop or kill it and then resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sftmix.output.digest import compare

ROOT = Path(__file__).parent.parent


def convert_args(data: Path, work: Path, out: Path, *extra: str, max_seq_length: int = 256) -> list[str]:
    """The arguments of ``tokenize-mixer convert`` of ``data`` with the demo tokenizer and the olmo template."""
    return [
        "convert", "--dataset_mixer_list", str(data), "1.0",
        "--tokenizer_name_or_path", str(ROOT / "examples" / "tokenizer"), "--chat_template_name", "olmo",
        "--max_seq_length", str(max_seq_length), "--work_dir", str(work), "--output_dir", str(out), *extra,
    ]  # fmt: skip


def convert_command(data: Path, work: Path, out: Path, slice_rows: int, *extra: str) -> list[str]:
    """``tokenize-mixer convert`` of ``data`` (:func:`convert_args`), ``slice_rows`` rows a slice."""
    command = [sys.executable, "-m", "tokenize_mixer.cli"]
    return [*command, *convert_args(data, work, out, "--slice_rows", str(slice_rows), *extra)]


def semaphores(pid: int) -> set[int]:
    """The named semaphores ``pid`` has open (a worker pool's queues and locks), by inode: each is
    mapped from ``/dev/shm`` under the temporary name it was made with, so the inode, not the name,
    finds its file there. None once the process is gone."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return set()
    return {int(line.split()[4]) for line in maps if "/dev/shm/sem." in line}


def left_in_shm(inodes: set[int]) -> list[str]:
    """Those of the semaphores ``inodes`` still in ``/dev/shm``: a command that ended left them for good
    (the resource tracker that unlinks them at its end was killed with the command's other processes)."""
    left = []
    for entry in Path("/dev/shm").iterdir() if inodes else ():
        try:
            if entry.stat().st_ino in inodes:
                left.append(entry.name)
        except OSError:  # (another process's, gone meanwhile)
            continue
    return left


def cli_env(api_url: str | None = None) -> dict:
    """No configured Prefect API (the CLI starts its own) unless ``api_url`` names one."""
    e = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    if api_url is None:
        e.pop("PREFECT_API_AUTH_STRING", None)
    e["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    if api_url:
        e["PREFECT_API_URL"] = api_url
    return e


def assert_rerun_resumes(cmd: list[str], work: Path, out: Path, expected: Path) -> dict:
    """Rerun ``cmd`` after a stop or a kill: the uninterrupted bytes, every finished slice reused, no
    temporary leftovers beside the output. Returns the run report."""
    finished = len(list(work.glob("slices/*/*/manifest.json")))
    final = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True)
    assert final.returncode == 0, final.stderr[-3000:]
    result = compare(out, expected)
    assert result.matches, result.render()
    report = json.loads((out / "run_report.json").read_text())
    if "(up to date:" not in final.stdout:  # (a killed run that had published: nothing to redo)
        assert report["slices_reused"] >= finished - report["slices_rechecked"]  # nothing finished is redone
    leftovers = [p.name for p in out.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    assert leftovers == [], leftovers
    return report


def machine_env(root: Path, shared: dict[str, str]) -> dict[str, str]:
    """Another machine's environment: what it shares with the others (``shared``: PATH, the Prefect API,
    the bucket) plus a home, caches, temporary and work directories of its own under ``root``."""
    for sub in ("home", "tmp", "work", "cache"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    return {
        **shared,
        "HOME": str(root / "home"),
        "TMPDIR": str(root / "tmp"),
        "XDG_CACHE_HOME": str(root / "cache"),
        "HF_HOME": str(root / "cache" / "hf"),
        "PREFECT_HOME": str(root / "home" / ".prefect"),
        "TOKENIZE_MIXER_WORK_DIR": str(root / "work"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
