"""The command forks its workers from a server that imported their modules once (flows.workers.worker_start);
the bytes are those of Prefect's spawned workers, and the server is gone with the command."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sftmix.output.digest import compare
from tests.cli_runs import cli_env, convert_command
from tokenize_mixer.flows.workers.worker_start import MIN_FORKED_WORKERS, START_METHOD_ENV

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from generate_demo_data import arithmetic  # noqa: E402

pytestmark = pytest.mark.slow

FORKED = "workers forked from a preloaded server"


def _convert(data: Path, root: Path, workers: int = 4, **env: str) -> subprocess.CompletedProcess:
    cmd = convert_command(
        data, root / "work", root / "out", 500, "--runner", "process", "--workers", str(workers)
    )
    done = subprocess.run(cmd, env={**cli_env(), **env}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_forked_workers_write_the_bytes_of_spawned_ones(tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in arithmetic(random.Random(5), 8_000)))
    forked = _convert(data, tmp_path / "forked")
    assert FORKED in forked.stderr
    spawned = _convert(data, tmp_path / "spawned", **{START_METHOD_ENV: "spawn"})
    assert FORKED not in spawned.stderr and "(ProcessPool)" in spawned.stderr
    few = _convert(data, tmp_path / "few", workers=MIN_FORKED_WORKERS - 1)  # spawned: too few to pay
    assert FORKED not in few.stderr and "(ProcessPool)" in few.stderr
    for other in ("spawned", "few"):
        result = compare(tmp_path / "forked" / "out", tmp_path / other / "out")
        assert result.matches, result.render()
    assert "Warning" not in forked.stderr.replace("WARNING", "")  # e.g. runpy's, from each worker


def test_the_fork_server_ends_with_the_command(tmp_path):
    """Its workers and the server itself: nothing of the run is left once the command has exited."""
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in arithmetic(random.Random(6), 3_000)))
    marker = f"tm-fork-{tmp_path.name}"
    _convert(data, tmp_path, TM_TEST_MARKER=marker)
    deadline = time.monotonic() + 5  # it ends when it reads the end of the command's pipe
    while ours := _processes_with(marker, "multiprocessing.forkserver"):
        assert time.monotonic() < deadline, ours
        time.sleep(0.1)


def _processes_with(marker: str, running: str) -> list[int]:
    left = subprocess.run(["pgrep", "-f", running], capture_output=True, text=True).stdout
    return [int(p) for p in left.split() if marker in _environ(int(p))]


def _environ(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/environ").read_text(errors="replace")
    except OSError:
        return ""


def test_the_fork_server_imports_what_workers_use_and_no_more():
    """transformers, datasets and pandas would cost the server seconds of CPU that a worker reading the
    plan's Arrow and tokenizer files never uses; Prefect's collections (prefect-dask: all of Dask) each
    worker would import at its first task."""
    probe = (
        "import sys, tokenize_mixer.flows.workers.worker_preload; "
        "print(sorted(m for m in ('transformers', 'datasets', 'pandas', 'torch', 'prefect_dask') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[-2] == "['prefect_dask']"
