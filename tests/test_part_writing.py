"""The output's parts written by window or by slice, on threads or worker processes (``sftmix.part_writing``):
what the page cache is asked, and a worker that dies while writing."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from sftmix.part_writing import cached_share, write_slice


def _npy(path: Path, data: np.ndarray) -> None:
    np.save(path, data)


def test_the_page_cache_is_asked_and_a_missing_file_is_not_an_answer(tmp_path):
    tokens = tmp_path / "tokens.npy"
    _npy(tokens, np.arange(100_000, dtype=np.uint32))
    with open(tokens, "rb") as fh:
        fh.read()  # now in the page cache
    share = cached_share([str(tokens)] * 4, [0, 4096, 40_000, 399_000])
    if share is not None:  # None where the kernel cannot say (no RWF_NOWAIT)
        assert share == 1.0
    assert cached_share([str(tmp_path / "gone.npy")], [0]) in (0.0, None)


#: A file that, while it does not exist, makes the next job kill the worker process it runs in.
DIE_MARKER = "TOKENIZE_MIXER_TEST_DIE_ONCE"


def write_slice_or_die_once(job) -> None:  # type: ignore[no-untyped-def]
    """``write_slice``, except that the first call of a run (in a worker process) kills its process."""
    marker = Path(os.environ[DIE_MARKER])
    if not marker.exists():
        marker.touch()
        os._exit(9)
    write_slice(job)


def test_a_worker_that_dies_while_writing_leaves_the_same_bytes(prefect_api, tmp_path, monkeypatch):
    """The OOM killer ends a worker process mid-write: the parts are written again on threads (a job
    writes the same bytes at the same places however often it runs) and the output is the same."""
    import sftmix.assemble
    from sftmix.digest import output_digests
    from tests.test_check import chat, run

    rows = [chat(f"question {i}?", f"answer {i}.") for i in range(60)]
    (tmp_path / "a").mkdir()
    first = run(tmp_path / "a", rows, "out", slice_rows=8, shuffle_seed=3)
    monkeypatch.setattr(sftmix.assemble, "ASSEMBLE_BY", "slice")
    monkeypatch.setattr(sftmix.assemble, "ASSEMBLE_THREADS", 2)
    monkeypatch.setattr(sftmix.assemble, "PROCESSES_FROM_TOKENS", 1)
    monkeypatch.setattr(sftmix.assemble, "write_slice", write_slice_or_die_once)
    monkeypatch.setenv(DIE_MARKER, str(tmp_path / "died"))
    (tmp_path / "b").mkdir()
    again = run(tmp_path / "b", rows, "out", slice_rows=8, shuffle_seed=3)
    assert (tmp_path / "died").exists()  # a worker did die
    differ = {k for k, v in output_digests(again).items() if output_digests(first)[k] != v}
    assert differ == {"dataset_statistics.json"}  # which names the dataset file: another path here
