"""Fan-out across machines: a Dask cluster started as separate processes, each worker with its own
home, caches, temporary and work directories, sharing nothing with the flow but the work directory on
gs:// (the GCS emulator) and the sources there. One worker is killed mid-run; the bytes must equal a
local run's, its slices must be done by the other, and a rerun must reuse every slice."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from sftmix.config.config import MixerConfig
from sftmix.config.run_options import RunOptions
from sftmix.output.digest import output_digests
from tests.cli_runs import left_in_shm, machine_env, semaphores
from tests.ports import free_port
from tests.soak import processes
from tests.test_gcs import gcs, parts  # noqa: F401 (the emulator fixture)
from tokenize_mixer.flows.tokenize_mixer import tokenize_mixer

pytestmark = pytest.mark.slow

DASK = Path(sys.executable).parent / "dask"


def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while True:
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"dask scheduler did not start (exit {proc.poll()})")
        time.sleep(0.2)


def _machine_env(root: Path) -> dict[str, str]:
    """Another machine: PATH, the bucket and the API in common, nothing of the flow's directories."""
    keep = (
        "PATH",
        "STORAGE_EMULATOR_HOST",
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
        "FSSPEC_GS_TOKEN",
        "PREFECT_API_URL",
    )
    return machine_env(root, {k: os.environ[k] for k in keep if k in os.environ})


@pytest.fixture
def dask_cluster(tmp_path, gcs, prefect_api):  # noqa: F811
    """A scheduler and two single-threaded workers, each in its own session and 'machine'."""
    port = free_port()
    procs: list[subprocess.Popen] = []
    sched_root = tmp_path / "scheduler"
    scheduler = subprocess.Popen(
        [str(DASK), "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
        env=_machine_env(sched_root), cwd=sched_root, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    procs.append(scheduler)
    workers = {}
    try:
        _wait_port(port, scheduler)
        for name in ("a", "b"):
            root = tmp_path / f"machine-{name}"
            log = open(root.with_suffix(".log"), "wb")  # noqa: SIM115 (closed with the process)
            root.mkdir()
            workers[name] = subprocess.Popen(
                [str(DASK), "worker", f"tcp://127.0.0.1:{port}", "--nthreads", "1", "--nworkers", "1",
                 "--no-dashboard", "--local-directory", str(root / "dask"), "--name", name],
                env=_machine_env(root), cwd=root, start_new_session=True, stdout=log, stderr=log,
            )  # fmt: skip
            procs.append(workers[name])
        from distributed import Client

        with Client(f"tcp://127.0.0.1:{port}", timeout=60) as client:
            client.wait_for_workers(2, timeout=120)
        yield f"tcp://127.0.0.1:{port}", workers
    finally:
        for p in procs:
            _kill_machine(p.pid)
            p.wait()


#: The named semaphores of the machines' processes killed so far (by inode): unlinked at the end.
_KILLED_SEMAPHORES: set[int] = set()


def _kill_machine(pgid: int) -> None:
    """SIGKILL a machine's process group, as a crash would. Its semaphores (its multiprocessing resource
    tracker dies with it, which would unlink them) are noted first, and unlinked once the test's
    machines are gone: on a real machine /dev/shm goes with it. (Each machine runs in a session of its
    own, so its session is its process group.)"""
    for proc in processes().values():
        if proc.sid == pgid:
            _KILLED_SEMAPHORES.update(semaphores(proc.pid))
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


@pytest.fixture(autouse=True)
def _crashed_machines_leave_no_semaphores():
    yield
    for name in left_in_shm(_KILLED_SEMAPHORES):
        with contextlib.suppress(OSError):
            (Path("/dev/shm") / name).unlink()
    _KILLED_SEMAPHORES.clear()


def _mixer(data: str, output: str) -> MixerConfig:
    return MixerConfig.model_validate(
        {
            "datasets": [{"path": data, "amount": "1.0"}],
            "tokenizer": {"name_or_path": str(Path(__file__).parent / "golden" / "tokenizers" / "dolma2")},
            "max_seq_length": 1024,
            "output": {"path": output},
        }
    )


def test_dask_workers_sharing_only_a_gcs_work_dir_survive_a_killed_worker(
    golden_dir,
    gcs,  # noqa: F811 (the fixture imported above)
    dask_cluster,
    tmp_path,
    monkeypatch,  # noqa: F811
):
    address, workers = dask_cluster
    run_id = uuid.uuid4().hex[:8]
    local_data = golden_dir / "data" / "sharegpt_mt150.jsonl"
    data, work = f"gs://src/{run_id}/chats.jsonl", f"gs://work/{run_id}"
    gcs.put_file(str(local_data), data)

    monkeypatch.setenv("TOKENIZE_MIXER_WORK_DIR", str(tmp_path / "local-run"))
    tokenize_mixer(
        mixer=_mixer(str(local_data), str(tmp_path / "local-out")),
        run=RunOptions(work_dir=str(tmp_path / "local-work"), slice_rows=8, runner="thread"),
    )
    expected = parts(output_digests(tmp_path / "local-out"))

    # Kill machine a (its nanny and worker) once it has finished a slice of its own: the rest of its
    # work, and what it held, must be done by machine b.
    killed = threading.Event()

    def kill_a_mid_run() -> None:
        deadline = time.time() + 120
        while time.time() < deadline and not killed.is_set():
            if list((tmp_path / "machine-a" / "work").glob("mirrors/*/slices/*/*/manifest.json")):
                _kill_machine(workers["a"].pid)
                killed.set()
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_a_mid_run, daemon=True)
    killer.start()
    monkeypatch.setenv("TOKENIZE_MIXER_WORK_DIR", str(tmp_path / "flow-machine"))
    run = RunOptions(work_dir=work, slice_rows=8, runner="dask", dask_address=address)
    first = tokenize_mixer(mixer=_mixer(data, str(tmp_path / "out")), run=run)
    killer.join(timeout=1)
    assert killed.is_set(), "machine a never finished a slice"
    n = first["slices_total"]
    assert first["slices_computed"] == n > 4
    assert parts(output_digests(tmp_path / "out")) == expected

    done_by = {
        name: len(list((tmp_path / f"machine-{name}" / "work").glob("mirrors/*/slices/*/*/manifest.json")))
        for name in ("a", "b")
    }
    print("slices done by machine", done_by, "of", n)
    assert done_by["a"] >= 1 and done_by["b"] >= 1 and done_by["a"] + done_by["b"] >= n, done_by
    assert len(gcs.glob(f"{work}/slices/*/*/manifest.json")) == n

    # A rerun from another flow machine, with machine a gone for good: every slice is reused from gs://.
    shutil.rmtree(tmp_path / "out")
    monkeypatch.setenv("TOKENIZE_MIXER_WORK_DIR", str(tmp_path / "flow-machine-2"))
    second = tokenize_mixer(mixer=_mixer(data, str(tmp_path / "out")), run=run)
    assert (second["slices_reused"], second["slices_computed"]) == (n, 0)
    assert parts(output_digests(tmp_path / "out")) == expected
