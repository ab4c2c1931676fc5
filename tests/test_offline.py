"""A run on local files reaches nothing outside this machine: on a cluster whose outbound traffic is
dropped, every attempt would cost a timeout (the datasets library's download-count request did: 3 s
plus the name lookup, per load)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sftmix.config.config import MixerConfig
from sftmix.config.run_options import RunOptions
from sftmix.planning.plan import build_plan, prepare_plan
from sftmix.tokenizing.slices import tokenize_slice

ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = {"127.0.0.1", "::1", "localhost"}


@pytest.fixture
def no_outside_network(monkeypatch):
    attempts: list[str] = []
    real_getaddrinfo, real_connect = socket.getaddrinfo, socket.socket.connect

    def getaddrinfo(host, *args, **kwargs):
        if host not in LOOPBACK:
            attempts.append(f"name lookup of {host}")
            raise socket.gaierror(f"no network in this test ({host})")
        return real_getaddrinfo(host, *args, **kwargs)

    def connect(self, address):
        if isinstance(address, tuple) and address[0] not in LOOPBACK:
            attempts.append(f"connect to {address}")
            raise OSError(f"no network in this test ({address})")
        return real_connect(self, address)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", connect)
    return attempts


def test_local_files_are_planned_and_tokenized_without_the_network(
    golden_dir, tmp_path, monkeypatch, no_outside_network
):
    monkeypatch.chdir(golden_dir)
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    mixer = MixerConfig.model_validate(
        {
            "datasets": [
                {"path": "data/chat_multi.jsonl", "amount": "1.0"},
                {"path": "data/chat_single.parquet", "amount": "1.0"},
            ],
            "tokenizer": {"name_or_path": "tokenizers/dolma2", "chat_template": "olmo"},
            "max_seq_length": 512,
            "output": {"path": str(tmp_path / "out")},
        }
    )
    run = RunOptions(work_dir=str(tmp_path / "work"))
    prepare_plan(mixer, run)
    plan = build_plan(mixer, run)
    for spec in plan.slices:
        tokenize_slice(spec, plan.context)
    assert no_outside_network == []


def test_loading_a_tokenizer_never_imports_pytorch(golden_dir, tmp_path):
    """Where PyTorch is installed, transformers would import it (seconds, on a GPU machine) to load a
    tokenizer. An installed 'torch' whose import fails shows that it is never imported."""
    fake = tmp_path / "site"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text('raise ImportError("PyTorch was imported")\n')
    (fake / "torch-2.9.0.dist-info").mkdir()
    (fake / "torch-2.9.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torch\nVersion: 2.9.0\n"
    )
    code = (
        "import sys\n"
        "from sftmix.tokenizing.tokenizer import TokenizerKey, load_hf_tokenizer\n"
        f"tok = load_hf_tokenizer(TokenizerKey.of({str(golden_dir / 'tokenizers' / 'dolma2')!r}, None))\n"
        "assert tok.backend_tokenizer is not None\n"
        "print('torch' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
