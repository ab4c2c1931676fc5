"""The output's parts written by window or by slice, on threads or worker processes (``sftmix.output.part_writing``):
what the page cache is asked, and a worker that dies while writing."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from sftmix.output.part_writing import cached_share, write_slice


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
    import sftmix.assembly.assemble
    from sftmix.output.digest import output_digests
    from tests.test_check import chat, run

    rows = [chat(f"question {i}?", f"answer {i}.") for i in range(60)]
    (tmp_path / "a").mkdir()
    first = run(tmp_path / "a", rows, "out", slice_rows=8, shuffle_seed=3)
    monkeypatch.setattr(sftmix.assembly.assemble, "ASSEMBLE_BY", "slice")
    monkeypatch.setattr(sftmix.assembly.assemble, "ASSEMBLE_THREADS", 2)
    monkeypatch.setattr(sftmix.assembly.assemble, "PROCESSES_FROM_TOKENS", 1)
    monkeypatch.setattr(sftmix.assembly.assemble, "write_slice", write_slice_or_die_once)
    monkeypatch.setenv(DIE_MARKER, str(tmp_path / "died"))
    (tmp_path / "b").mkdir()
    again = run(tmp_path / "b", rows, "out", slice_rows=8, shuffle_seed=3)
    assert (tmp_path / "died").exists()  # a worker did die
    differ = {k for k, v in output_digests(again).items() if output_digests(first)[k] != v}
    assert differ == {"dataset_statistics.json"}  # which names the dataset file: another path here


@pytest.mark.full  # (the quick loop: tests/tiers.py)
def test_a_dataset_of_more_slices_than_open_files_allowed_is_assembled(prefect_api, tmp_path):
    """A live memory map holds a file descriptor: the tail maps one slice's row records at a time, so a
    dataset of 300 slices is assembled by a process that may open 60 more files (1,024 is a common limit;
    a 4 GB dataset has as many 4 MiB slices). Same bytes as the run's own."""
    import resource

    from sftmix.assembly.assemble import assemble
    from sftmix.config.config import MixerConfig
    from sftmix.config.run_options import RunOptions
    from sftmix.output.digest import output_digests
    from sftmix.planning.plan import build_plan
    from sftmix.tokenizing.slices import read_manifest
    from tests.test_check import EXAMPLES, chat, run

    rows = [chat(f"question {i}?", f"answer {i}.") for i in range(300)]
    out = run(tmp_path, rows, "out", slice_rows=1, shuffle_seed=5)
    mixer = MixerConfig.model_validate(
        {
            "datasets": [{"path": str(tmp_path / "out.jsonl"), "amount": "1.0"}],
            "tokenizer": {"name_or_path": str(EXAMPLES / "tokenizer"), "chat_template": "olmo"},
            "output": {"path": str(out)},
            "shuffle_seed": 5,
        }
    )
    plan = build_plan(mixer, RunOptions(work_dir=str(tmp_path / "work"), runner="thread", slice_rows=1))
    manifests = [read_manifest(plan.context.output.work_dir, s.key) for s in plan.slices]
    assert len(manifests) == 300 and all(m is not None for m in manifests)
    staging = tmp_path / "again"
    staging.mkdir()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    open_now = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + 60, hard))
    try:
        assemble(plan, manifests, staging, tmp_path / "documents.npy")  # type: ignore[arg-type]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    mine, theirs = output_digests(staging), output_digests(out)
    assert {k for k in theirs if k.startswith(("token_ids", "labels_mask"))} <= set(mine)
    assert all(mine[k] == v for k, v in theirs.items() if k.startswith(("token_ids", "labels_mask")))


def test_a_reader_waits_for_what_it_reads_and_stops_with_the_writers():
    """``WrittenParts``: a reader waiting for tokens of a part goes on only once they are written (or
    every part is), and raises once the writing stops, even after every part was written."""
    import threading

    import pytest

    from sftmix.output.part_writing import WritingStopped, WrittenParts

    written = WrittenParts()
    through: list[int] = []
    reader = threading.Thread(target=lambda: (written.wait(1, 100), through.append(100)))
    reader.start()
    written.advance(0, 500)  # another part
    written.advance(1, 99)
    reader.join(0.2)
    assert reader.is_alive() and not through
    written.advance(1, 100)
    reader.join(5)
    assert through == [100]
    written.wait(1, 50)  # (behind the writers: at once)
    written.complete()
    written.wait(7)  # every part is written
    written.stop()
    with pytest.raises(WritingStopped):
        written.wait(0, 1)


def test_the_check_that_follows_the_writers_finds_what_a_check_after_them_finds(
    prefect_api, tmp_path, monkeypatch
):
    """The run checks each chunk of the parts as soon as the windows before it are written: in small
    windows and chunks, on threads and on worker processes, its findings, counts and digests are those of
    the check of the finished output, which are the run's own."""
    import functools

    import sftmix.assembly.assemble
    import sftmix.check.parts
    from sftmix.assembly.assemble import assemble
    from sftmix.check.findings import Recorded, check_output
    from sftmix.config.config import MixerConfig
    from sftmix.config.run_options import RunOptions
    from sftmix.output.digest import output_digests
    from sftmix.planning.plan import build_plan
    from sftmix.tokenizing.slices import read_manifest
    from tests.test_check import EXAMPLES, chat, run

    rows = [chat(f"question {i}?", f"answer {i} " + "word " * (i % 40)) for i in range(120)]
    rows[7] = chat("q <|im_start|> again?", "trained <|im_start|> mid-answer")  # a finding with examples
    out = run(tmp_path, rows, "out", slice_rows=16, shuffle_seed=9)
    mixer = MixerConfig.model_validate(
        {
            "datasets": [{"path": str(tmp_path / "out.jsonl"), "amount": "1.0"}],
            "tokenizer": {"name_or_path": str(EXAMPLES / "tokenizer"), "chat_template": "olmo"},
            "output": {"path": str(out)},
            "shuffle_seed": 9,
        }
    )
    plan = build_plan(mixer, RunOptions(work_dir=str(tmp_path / "work"), runner="thread", slice_rows=16))
    manifests = [read_manifest(plan.context.output.work_dir, s.key) for s in plan.slices]
    monkeypatch.setattr(sftmix.assembly.assemble, "ASSEMBLE_BY", "window")
    monkeypatch.setattr(sftmix.assembly.assemble, "WINDOW", 97)
    monkeypatch.setattr(sftmix.check.parts, "CHUNK", 61)
    after = check_output(out, 4096, recorded=Recorded(token_dtype=plan.context.output.token_dtype))
    assert after.findings  # the literal special token, trained mid-answer
    for processes_from in (1 << 40, 1):  # threads, then worker processes
        monkeypatch.setattr(sftmix.assembly.assemble, "PROCESSES_FROM_TOKENS", processes_from)
        staging = tmp_path / f"staging-{processes_from}"
        staging.mkdir()
        follow = functools.partial(
            check_output, staging, 4096, recorded=Recorded(token_dtype=plan.context.output.token_dtype)
        )
        result = assemble(plan, manifests, staging, tmp_path / "documents.npy", follow)  # type: ignore[arg-type]
        checked = result.checked
        assert checked is not None
        assert (checked.documents, checked.tokens, checked.trainable_tokens) == (
            after.documents,
            after.tokens,
            after.trainable_tokens,
        )
        assert [(f.kind, f.what, f.count) for f in checked.findings] == [
            (f.kind, f.what, f.count) for f in after.findings
        ]
        mine = output_digests(staging)
        assert checked.digests == mine
        parts = {k: v for k, v in output_digests(out).items() if k.startswith(("token_ids", "labels_mask"))}
        assert parts and all(mine[k] == v for k, v in parts.items())


def _cached_pages(path: Path) -> np.ndarray:
    """Which of the file's pages are in the page cache (``mincore`` on a mapping never touched: asking
    leaves the cache as it was; a read with ``RWF_NOWAIT`` starts a readahead that a fast disk may
    finish before the read looks, so a page just dropped could read as kept)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size, page = path.stat().st_size, mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            resident = (ctypes.c_ubyte * ((size + page - 1) // page))()
            assert libc.mincore(address, size, resident) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)
    return np.frombuffer(resident, np.uint8) & 1 == 1


def test_what_is_durable_and_read_leaves_the_page_cache_and_nothing_else(tmp_path):
    """``SyncBehind`` with the ``WrittenParts`` a reader follows: behind each sync, the pages the reader has read
    leave the page cache; the pages it has not read yet stay (it reads them next, not from the disk)."""
    import pytest

    from sftmix.output.olmo_format import MASK_PART, TOKENS_PART, PartLayout, PartSet
    from sftmix.output.part_writing import SyncBehind, WrittenParts

    tokens_name, mask_name = TOKENS_PART.format(0), MASK_PART.format(0)

    if not hasattr(os, "posix_fadvise") or not sys.platform.startswith("linux"):
        pytest.skip("the page cache cannot be asked here")
    probe = tmp_path / "probe"
    probe.write_bytes(b"x" * 8192)
    fd = os.open(probe, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if _cached_pages(probe).any():
        pytest.skip("this file system keeps its pages (tmpfs): nothing can leave the page cache")
    mib = 1 << 20  # tokens of uint32: 4 MiB of ids, 1 MiB of mask a step
    parts = PartSet(tmp_path, PartLayout.by_count(8 * mib, 8 * mib), np.dtype(np.uint32))
    written = WrittenParts()
    for step in range(8):
        lo = step * mib
        parts.write(lo, np.full(mib, step, np.uint32), np.ones(mib, np.uint8))
        written.advance(0, lo + mib)
        written.read(0, min(lo + mib, 3 * mib))  # the reader stops at token 3 Mi
        sync = SyncBehind(parts.files, every=1, written=written, itemsize=4)
        sync.wrote([0], 5 * mib)
        sync.close()  # (each sync ends before the next write: the test's order is the writers' own)
    parts.close()
    for name, width in ((tokens_name, 4), (mask_name, 1)):
        cached, read_end = _cached_pages(tmp_path / name), 3 * mib * width // mmap.PAGESIZE
        assert not cached[:read_end].any() and cached[read_end:].all(), (
            name,
            np.flatnonzero(cached[:read_end]),
        )
    assert np.array_equal(np.fromfile(tmp_path / tokens_name, np.uint32)[::mib], np.arange(8))


def test_over_length_edits_land_the_same_by_window_as_over_the_whole_output():
    """``Edits.within`` (a window's share, found by search) applied window by window gives what applying
    every edit to the whole output gives."""
    from sftmix.output.part_writing import Edits

    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 40, size=300)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    terminated, unmasked = rng.random(300) < 0.2, rng.random(300) < 0.2
    edits = Edits(9, ends[terminated] - 1, np.stack([starts[unmasked], ends[unmasked]], axis=1))
    tokens, mask = np.zeros(int(ends[-1]), np.int64), np.ones(int(ends[-1]), np.uint8)
    edits.apply(tokens, mask)
    for window in (1, 7, 64, 1000):
        t, m = np.zeros_like(tokens), np.ones_like(mask)
        for lo in range(0, tokens.shape[0], window):
            hi = min(lo + window, tokens.shape[0])
            edits.within(lo, hi).apply(t[lo:hi], m[lo:hi])
        assert np.array_equal(t, tokens) and np.array_equal(m, mask), window
