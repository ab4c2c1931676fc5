"""Checkpoints from an older version are reused only if they hold the bytes this version would write:
the slice digests of fixed inputs are pinned with ``SLICE_FORMAT_VERSION``. A change that alters slice
bytes fails here until the version is bumped (old checkpoints then miss) and the pins are updated."""

from __future__ import annotations

import pytest

from sftmix.config.config import MixerConfig
from sftmix.config.run_options import RunOptions
from sftmix.planning.plan import build_plan
from sftmix.tokenizing.slices import SLICE_FORMAT_VERSION, tokenize_slice

#: version -> case -> sha256 of the slice's (tokens.npy, mask.npy, rows.npy)
PINNED = {
    "3": {
        "olmo_chats": [
            "0f27ff6c93fbb055f33c03c5dd0cedcaf9ab84607ca91e4e9aba540ea953e8d2",
            "c358640f1d0dcb268bc5292ac45562d58f23e93f9b74f40aca77e55d0329473a",
            "fd1f43e2ff8b56a9858ac886958b36e679323cc67bdccf4afeaf4edd744f90aa",
        ],
        "tools_objects": [
            "02d48de6e524f0704aa81286956ce44919ce42257927241acb443a04712f332b",
            "602b0f93657bae970dd2fb81d4f43830f297cc6f6eb9ac8ce1a934cd5b6c2683",
            "6ca1be909336ed6236e09e1b960ee36ffa979e1c2c5383ed423bd7d43ced0602",
        ],
        "thinker_drops": [
            "2aca998e1fbfa721646bdbca9e41d7e4ae4f23ec7dcbe4da1fe47c155ed0d620",
            "4ee9975489e5bb64eb293749f3c1f87be8b294d575e2aa50d1e3a682fcd41ec6",
            "415beb14b0e7d76806ed7023cf363dfe5eafa6d8fcd2337117a7792112b04e84",
        ],
    }
}

CASES = {
    "olmo_chats": ("data/chat_multi.jsonl", "tokenizers/dolma2", "olmo"),
    "tools_objects": ("data/chat_tools_list.jsonl", "tokenizers/dolma2_tools", None),
    "thinker_drops": ("data/chat_think.jsonl", "tokenizers/dolma2", "olmo_thinker"),  # rows dropped
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_slice_bytes_are_pinned_with_the_format_version(case, golden_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(golden_dir)
    data, tokenizer, template = CASES[case]
    mixer = MixerConfig.model_validate(
        {
            "datasets": [{"path": data, "amount": "1.0"}],
            "tokenizer": {"name_or_path": tokenizer, "chat_template": template},
            "max_seq_length": 512,
            "output": {"path": str(tmp_path / "out")},
        }
    )
    plan = build_plan(mixer, RunOptions(work_dir=str(tmp_path / "work"), slice_rows=100_000))
    manifest = tokenize_slice(plan.slices[0], plan.context)
    digests = [manifest.files[name].sha256 for name in ("tokens.npy", "mask.npy", "rows.npy")]
    assert SLICE_FORMAT_VERSION in PINNED, f"pin the digests of version {SLICE_FORMAT_VERSION}: {digests}"
    assert digests == PINNED[SLICE_FORMAT_VERSION].get(case), (
        f"slice bytes changed ({case}: {digests}): bump SLICE_FORMAT_VERSION in sftmix/tokenizing/slices/manifest.py, so "
        "checkpoints of the old bytes are not reused, and pin the new digests here"
    )


def test_row_records_read_without_numpy_header_parse_are_numpy_s(tmp_path):
    """``read_npy_of`` reads a slice's row records as ``np.load`` does, for any count; a file of another
    form (another dtype, version 2 header, cut short) goes to ``np.load`` and is read or refused by it."""
    import numpy as np
    import pytest

    from sftmix.runtime.storage import read_npy_of
    from sftmix.tokenizing.slices import ROW_DTYPE

    rng = np.random.default_rng(31)
    for n in (0, 1, 7, 1500):
        rows = np.zeros(n, ROW_DTYPE)
        for name in ROW_DTYPE.names:
            rows[name] = rng.integers(-3, 1 << 40, n).astype(ROW_DTYPE[name])
        path = tmp_path / f"rows-{n}.npy"
        np.save(path, rows)
        got = read_npy_of(path, ROW_DTYPE)
        assert got.dtype == ROW_DTYPE and np.array_equal(got, np.load(path))
        assert isinstance(got.base, bytes)  # (read whole, no map held)
    other = tmp_path / "other.npy"
    np.save(other, np.arange(5, dtype=np.int64))
    assert read_npy_of(other, np.int64).tolist() == [0, 1, 2, 3, 4]
    v2 = tmp_path / "v2.npy"
    with open(v2, "wb") as fh:
        np.lib.format.write_array(fh, np.zeros(3, ROW_DTYPE), version=(2, 0))
    assert np.array_equal(read_npy_of(v2, ROW_DTYPE), np.zeros(3, ROW_DTYPE))
    cut = tmp_path / "cut.npy"
    cut.write_bytes((tmp_path / "rows-7.npy").read_bytes()[:-5])
    with pytest.raises(ValueError):
        read_npy_of(cut, ROW_DTYPE)
    cut.write_bytes(b"\x93NUMPY")  # (shorter than any header)
    with pytest.raises(ValueError):
        read_npy_of(cut, ROW_DTYPE)
