"""Prefect-native fan-out across machines (run.runner: work_pool): batches of slices as runs of the
tokenize-slices deployment, served by two Prefect workers started as separate 'machines' (own home,
caches, temporary and work directories), sharing nothing with the parent run but the Prefect server
and the work directory on gs:// (the GCS emulator). One worker is SIGKILLed mid-run: its batch run
ends Crashed, its unfinished slices are done by the other machine, the bytes equal a local run's, and
a rerun reuses every slice."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml

from sftmix.output.digest import output_digests
from tests.cli_runs import machine_env
from tests.test_deployment import BIN, ROOT, server  # noqa: F401 (the real server fixture)
from tests.test_gcs import gcs, parts  # noqa: F401 (the emulator fixture)

pytestmark = pytest.mark.slow

GCS_ENV = ("STORAGE_EMULATOR_HOST", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "FSSPEC_GS_TOKEN")


def _machine(server_env: dict, root: Path) -> dict:
    """Another machine's environment: the API and the bucket, and directories of its own."""
    return machine_env(root, {**server_env, **{k: os.environ[k] for k in GCS_ENV if k in os.environ}})


def _slices_done_by(root: Path) -> int:
    return len(list((root / "work").glob("mirrors/*/slices/*/*/manifest.json")))


def test_batches_on_two_machines_survive_a_killed_worker(server, gcs, golden_dir, tmp_path):  # noqa: F811
    # only our two machines serve the pool: the worker infra/local_up.sh started is stopped
    home = Path(server["PREFECT_HOME"])
    with contextlib.suppress(ProcessLookupError):
        os.killpg(int((home / "worker.pid").read_text()), signal.SIGKILL)
    workers = {}
    for name in ("a", "b"):
        root = tmp_path / f"machine-{name}"
        log = open(tmp_path / f"machine-{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        workers[name] = subprocess.Popen(
            # --limit 1: one batch at a time per machine, each on all of its cores
            [str(BIN / "prefect"), "worker", "start", "--pool", server["TOKENIZE_MIXER_POOL"], "--name", name,
             "--limit", "1"],
            cwd=ROOT, env=_machine(server, root), stdout=log, stderr=log, start_new_session=True,
        )  # fmt: skip
    try:
        run_id = uuid.uuid4().hex[:8]
        local = golden_dir / "data" / "sharegpt_mt150.jsonl"
        data, work = f"gs://src/{run_id}/chats.jsonl", f"gs://work/{run_id}"
        gcs.put_file(str(local), data)

        def config(path: str, output: Path, run: dict) -> Path:
            cfg = tmp_path / f"{output.name}.yaml"
            mixer = {
                "datasets": [{"path": path, "amount": "1.0"}],
                "tokenizer": {"name_or_path": str(golden_dir / "tokenizers" / "dolma2")},
                "max_seq_length": 1024,
                "output": {"path": str(output)},
            }
            cfg.write_text(yaml.safe_dump({"mixer": mixer, "run": run}))
            return cfg

        def tokenize(cfg: Path, machine: Path, **popen) -> subprocess.Popen:
            return subprocess.Popen(
                [str(BIN / "tokenize-mixer"), "run", str(cfg)], cwd=ROOT, env=_machine(server, machine),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen,
            )  # fmt: skip

        baseline = config(
            str(local), tmp_path / "local-out", {"work_dir": str(tmp_path / "lw"), "slice_rows": 8}
        )
        proc = tokenize(baseline, tmp_path / "local-machine")
        assert proc.wait(timeout=300) == 0, proc.communicate()[0][-3000:]
        expected = parts(output_digests(tmp_path / "local-out"))

        pooled = {"work_dir": work, "slice_rows": 8, "runner": "work_pool", "batch_slices": 6}
        parent = tokenize(config(data, tmp_path / "out", pooled), tmp_path / "flow-machine")
        deadline = time.monotonic() + 300
        while _slices_done_by(tmp_path / "machine-a") < 1:
            if parent.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"machine a never finished a slice:\n{parent.communicate()[0][-5000:]}")
            time.sleep(0.05)
        os.kill(workers["a"].pid, signal.SIGKILL)  # the worker; its flow run follows it out (Crashed)
        out = parent.communicate(timeout=300)[0]
        assert parent.returncode == 0, out[-4000:]
        assert "submitted again" in out, out[-4000:]
        report = json.loads((tmp_path / "out" / "run_report.json").read_text())
        n = report["slices_total"]
        assert report["slices_computed"] == n > 6
        assert parts(output_digests(tmp_path / "out")) == expected
        done_by = {name: _slices_done_by(tmp_path / f"machine-{name}") for name in ("a", "b")}
        assert done_by["a"] >= 1 and done_by["b"] >= 1 and done_by["a"] + done_by["b"] >= n, done_by

        again = tokenize(config(data, tmp_path / "out2", pooled), tmp_path / "flow-machine-2")
        out = again.communicate(timeout=300)[0]
        assert again.returncode == 0, out[-4000:]
        report = json.loads((tmp_path / "out2" / "run_report.json").read_text())
        assert (report["slices_reused"], report["slices_computed"]) == (n, 0)
        assert parts(output_digests(tmp_path / "out2")) == expected
    finally:
        for proc in workers.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
