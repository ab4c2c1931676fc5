"""Slices tokenized while the Prefect API starts (``flows.workers.head_start``): the flow takes over the same
pool, every slice is still a task run with its persisted result, nothing is tokenized twice, and the
bytes are those of a run without a head start."""

from __future__ import annotations

import bisect
import dataclasses
import json
import os
import random
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest

from sftmix.config.config import DatasetEntry, MixerConfig, OutputSpec, TokenizerSpec
from sftmix.config.run_options import RunOptions
from sftmix.errors import DatasetError
from sftmix.output.digest import compare
from sftmix.planning.plan import build_plan
from sftmix.sources import jsonl
from sftmix.sources.jsonl import JsonlSource
from sftmix.sources.jsonl import batches as jsonl_batches
from sftmix.sources.jsonl import scanning as jsonl_scanning
from tokenize_mixer.flows.tokenize_mixer import tokenize_mixer
from tokenize_mixer.flows.workers import head_start

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "examples"))
from generate_demo_data import arithmetic  # noqa: E402


def _mixer(data: Path, out: Path) -> MixerConfig:
    return MixerConfig(
        datasets=[DatasetEntry(path=str(data), amount=1.0)],
        tokenizer=TokenizerSpec(name_or_path=str(ROOT / "examples" / "tokenizer"), chat_template="olmo"),
        max_seq_length=256,
        output=OutputSpec(path=str(out)),
    )


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("head") / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in arithmetic(random.Random(5), 12_000)))
    return path


def _run(work: Path) -> RunOptions:
    return RunOptions(work_dir=str(work), slice_rows=400, runner="process", workers=2)  # 30 slices


def _alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return False


@pytest.mark.full  # (the quick loop: tests/tiers.py)
def test_the_flow_takes_over_the_head_start_and_counts_its_slices_as_computed(prefect_api, chats, tmp_path):
    mixer, run = _mixer(chats, tmp_path / "out"), _run(tmp_path / "work")
    with head_start.head_start_scope():
        head_start.begin_head_start(mixer, run)
        head = head_start._pending
        assert head is not None
        deadline = time.monotonic() + 120
        while sum(f.done() for f in head.futures.values()) < 3:  # the API "starts" meanwhile
            assert time.monotonic() < deadline
            time.sleep(0.05)
        report = tokenize_mixer(mixer=mixer, run=run)
        assert head_start._pending is None  # the flow took it
    assert report["slices_computed"] == report["slices_total"] == 30
    assert report["slices_reused"] == 0
    # every slice is a task run whose result Prefect persisted, the head start's ones included
    assert len(list((tmp_path / "work" / "prefect-results").iterdir())) == 30
    manifests = [json.loads(p.read_text()) for p in (tmp_path / "work").glob("slices/*/*/manifest.json")]
    assert len(manifests) == 30  # and each was tokenized once: one checkpoint per slice, none redone
    assert min(m["started_at"] for m in manifests) >= head.started_at

    plain = _mixer(chats, tmp_path / "plain")
    tokenize_mixer(
        mixer=plain, run=RunOptions(work_dir=str(tmp_path / "w2"), slice_rows=400, runner="thread")
    )
    result = compare(tmp_path / "out", tmp_path / "plain")
    assert result.matches, result.render()

    again = tokenize_mixer(mixer=_mixer(chats, tmp_path / "again"), run=run)
    assert again["slices_reused"] == 30


def test_a_head_start_that_does_not_match_the_flows_plan_is_discarded(chats, tmp_path):
    mixer, run = _mixer(chats, tmp_path / "out"), _run(tmp_path / "work")
    with head_start.head_start_scope():
        head_start.begin_head_start(mixer, run)
        head = head_start._pending
        assert head is not None
        pids = list(head.pool._executor._processes)
        plan = build_plan(mixer, run)
        shorter = dataclasses.replace(plan.context.masking, max_seq_length=128)
        other = plan.context.model_copy(update={"masking": shorter})
        assert head_start.take_head_start(plan.slices, other, run) is None
        assert head_start._pending is None
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, "a head-start worker outlived its discard"
        time.sleep(0.1)


def test_a_head_start_the_flow_never_takes_is_closed_with_the_command(chats, tmp_path):
    mixer, run = _mixer(chats, tmp_path / "out"), _run(tmp_path / "work")
    with pytest.raises(KeyboardInterrupt), head_start.head_start_scope():
        head_start.begin_head_start(mixer, run)
        head = head_start._pending
        assert head is not None
        pids = list(head.pool._executor._processes)
        raise KeyboardInterrupt  # e.g. Ctrl-C while the API starts
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, "a head-start worker outlived the command"
        time.sleep(0.1)


def test_no_head_start_where_the_flow_would_not_use_a_local_process_pool(chats, tmp_path):
    mixer = _mixer(chats, tmp_path / "out")
    for run in (
        RunOptions(work_dir=str(tmp_path / "w1"), slice_rows=400, runner="thread"),
        RunOptions(work_dir=str(tmp_path / "w2"), slice_rows=400, runner="process", force_recache=True),
        RunOptions(work_dir=str(tmp_path / "w3"), slice_rows=400, runner="auto", disable_cache=True),
        RunOptions(work_dir=str(tmp_path / "w4"), slice_rows=400, runner="auto", workers=1),
    ):
        with head_start.head_start_scope():
            head_start.begin_head_start(mixer, run)
            assert head_start._pending is None, run


@pytest.fixture(scope="module")
def large(tmp_path_factory) -> Path:
    """Chats in three of the reader's batches (each row carries an unrendered 3 KB id)."""
    path = tmp_path_factory.mktemp("large") / "large.jsonl"
    rows = arithmetic(random.Random(9), 7_600)
    with open(path, "w", encoding="utf-8") as fh:
        for k, row in enumerate(rows):
            fh.write(json.dumps({**row, "id": f"{k:05d}-" + "x" * 3000}) + "\n")
    assert path.stat().st_size > 2 * jsonl_batches.BATCH_BYTES
    return path


def _read_whole(path: Path) -> bool:
    return any(stamp[0] == str(path) for stamp in jsonl_scanning._SCANS)


@pytest.mark.parametrize("slice_rows", [None, 1000])
def test_a_large_files_slices_are_cut_while_the_plan_reads_it(large, tmp_path, slice_rows):
    jsonl_scanning._SCANS.clear()
    mixer, run = (
        _mixer(large, tmp_path / "out"),
        RunOptions(work_dir=str(tmp_path / "w"), slice_rows=slice_rows),
    )
    early: list[tuple[str, int, bool]] = []
    plan = build_plan(mixer, run, lambda spec, ctx: early.append((spec.key, spec.index, _read_whole(large))))
    assert [(key, index) for key, index, _ in early] == [(s.key, s.index) for s in plan.slices]
    batches = jsonl.scan(str(large)).batches
    firsts = [b.first_row for b in batches]
    for s in plan.slices:  # none across batches
        assert bisect.bisect_right(firsts, s.row_start) == bisect.bisect_right(firsts, s.row_end - 1)
    if slice_rows:
        assert len(plan.slices) == sum(-(-b.rows // slice_rows) for b in batches)
    else:  # (a small mixture's batches are cut finer: two slices a worker, sftmix.planning.slice_sizes.slice_bytes_for)
        assert len(plan.slices) >= max(len(batches), 2 * 2)
    assert not early[0][2]  # the first slice was handed over before the file was read whole
    assert plan.datasets[0].n_rows == 7_600
    # the same plan from the scan made before, and as a plan that is not handed its slices early
    again: list[str] = []
    replayed = build_plan(mixer, run, lambda spec, ctx: again.append(spec.key))
    assert replayed.model_dump(exclude={"inputs", "seconds"}) == plan.model_dump(
        exclude={"inputs", "seconds"}
    )
    assert again == [s.key for s in plan.slices]
    assert build_plan(mixer, run).model_dump(exclude={"inputs", "seconds"}) == plan.model_dump(
        exclude={"inputs", "seconds"}
    )


def _gzipped(plain: Path, packed: Path) -> Path:
    import gzip

    with gzip.open(packed, "wb", compresslevel=1) as fh:
        fh.write(plain.read_bytes())
    return packed


def _packed(plain: Path, packed: Path) -> Path:
    """``plain`` compressed as ``packed``'s suffix says (gzip, bzip2 or xz)."""
    import bz2
    import lzma

    if packed.suffix == ".gz":
        return _gzipped(plain, packed)
    data = plain.read_bytes()
    packed.write_bytes(bz2.compress(data, 1) if packed.suffix == ".bz2" else lzma.compress(data, preset=1))
    return packed


def _held_copy(monkeypatch) -> threading.Event:
    """Decompressions made 1 MiB at a time, each held once its copy holds more than a batch and a
    bit, until the event is set."""
    from sftmix.sources import copies as sources
    from sftmix.sources.growing import GrowingFile

    held, grew = threading.Event(), GrowingFile.grew

    def holding(self, nbytes: int) -> None:
        grew(self, nbytes)
        if self._written > jsonl_batches.BATCH_BYTES + (2 << 20):
            assert held.wait(120), "the copy was held and no slice was handed on"

    monkeypatch.setattr(sources, "_DECOMPRESS_BLOCK", 1 << 20)
    monkeypatch.setattr(GrowingFile, "grew", holding)
    return held


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz"])
def test_a_large_compressed_files_slices_start_while_its_copy_is_written(
    large, tmp_path, monkeypatch, suffix
):
    """A single large .jsonl.gz (.bz2, .xz): its decompressed copy is scanned, and its first slice's rows
    read, while the copy is still being written (held here), not once it is whole (its size, which
    sizes the slices, told from its gzip trailer, or from its first blocks); the plan is the plain
    file's."""
    from sftmix.runtime.storage import TMP_MARK
    from sftmix.tokenizing.slices import rows_of

    jsonl_scanning._SCANS.clear()
    packed = _packed(large, tmp_path / f"large.jsonl{suffix}")
    held = _held_copy(monkeypatch)
    work = tmp_path / "w"
    seen: list[tuple[bool, object]] = []

    def handed(spec, ctx) -> None:
        if not held.is_set():
            assert isinstance(spec.source, JsonlSource)
            made = Path(spec.source.path).exists()
            seen.append((made, rows_of(spec, str(work / "datasets-cache"), [spec.row_start])[0]))
            held.set()

    plan = build_plan(_mixer(packed, tmp_path / "out"), RunOptions(work_dir=str(work)), handed)
    first_row = json.loads(large.read_text().split("\n", 1)[0])
    assert seen and seen[0][0] is False  # handed on, and read, before the copy was whole
    assert seen[0][1]["messages"] == first_row["messages"]
    plain = build_plan(_mixer(large, tmp_path / "out"), RunOptions(work_dir=str(tmp_path / "w2")))
    assert [s.key for s in plan.slices] == [s.key for s in plain.slices] and len(plan.slices) >= 3
    assert plan.datasets[0].fingerprint == plain.datasets[0].fingerprint
    assert plan.datasets[0].n_rows == 7_600 and plan.slices[0].dataset == str(packed)
    copies = [p for p in (work / "datasets-cache").rglob("*") if p.is_file()]
    assert [p.read_bytes() == large.read_bytes() for p in copies] == [True]  # no temp file left
    assert not any(TMP_MARK in p.name for p in copies)


def test_a_compressed_file_that_ends_short_while_its_slices_begin_is_one_clear_error(
    large, tmp_path, monkeypatch
):
    """Cut short: the slices begun from its copy's first batches do not hide the error; it names the
    file, and no copy or temp file is left."""
    packed = _gzipped(large, tmp_path / "large.jsonl.gz")
    packed.write_bytes(packed.read_bytes()[: packed.stat().st_size * 2 // 3])
    held = _held_copy(monkeypatch)
    early: list[str] = []

    def handed(spec, ctx) -> None:
        early.append(spec.key)
        held.set()

    with pytest.raises(DatasetError, match="cannot decompress the file") as refused:
        build_plan(_mixer(packed, tmp_path / "out"), RunOptions(work_dir=str(tmp_path / "w")), handed)
    assert early and str(packed) in str(refused.value)
    assert not [p for p in (tmp_path / "w" / "datasets-cache").rglob("*") if p.is_file()]


def test_a_compressed_file_that_changes_while_its_copy_is_written_is_one_clear_error(
    large, tmp_path, monkeypatch
):
    """Appended to (a second gzip member) after its first slice began from its copy: the plan refuses it,
    naming the file, and keeps no copy of either version."""
    import gzip

    packed = _gzipped(large, tmp_path / "large.jsonl.gz")
    held = _held_copy(monkeypatch)
    early: list[str] = []

    def handed(spec, ctx) -> None:
        if not early:
            with open(packed, "ab") as fh:
                fh.write(gzip.compress(b'{"messages": []}\n'))
            held.set()
        early.append(spec.key)

    with pytest.raises(DatasetError, match="changed while it was decompressed") as refused:
        build_plan(_mixer(packed, tmp_path / "out"), RunOptions(work_dir=str(tmp_path / "w")), handed)
    assert early and str(packed) in str(refused.value)
    assert not [p for p in (tmp_path / "w" / "datasets-cache").rglob("*") if p.is_file()]


def test_a_compressed_file_counted_first_is_counted_as_its_copy_is_written(large, tmp_path):
    """At a fraction below 1 a compressed file is counted before any slice is cut, its copy scanned as it
    is written (one pass, not a copy then a read): the plain file's count, selection and slices."""
    jsonl_scanning._SCANS.clear()
    packed = _gzipped(large, tmp_path / "large.jsonl.gz")

    def counted_first(data: Path, work: str):
        mixer, early = _mixer(data, tmp_path / "out"), []
        mixer.datasets[0].amount = 0.5
        plan = build_plan(mixer, RunOptions(work_dir=str(tmp_path / work)), lambda s, c: early.append(s))
        assert not early and plan.datasets[0].target == 3_800
        return plan

    plans = [counted_first(packed, "w"), counted_first(large, "w2")]
    assert [s.key for s in plans[0].slices] == [s.key for s in plans[1].slices]
    assert plans[0].datasets[0].fingerprint == plans[1].datasets[0].fingerprint


def test_a_fraction_below_one_is_counted_before_any_slice_is_cut(large, tmp_path):
    jsonl_scanning._SCANS.clear()
    mixer = _mixer(large, tmp_path / "out")
    mixer.datasets[0].amount = 0.5  # which rows it selects follows from the count
    early: list[str] = []
    plan = build_plan(
        mixer, RunOptions(work_dir=str(tmp_path / "w")), lambda spec, ctx: early.append(spec.key)
    )
    assert not early and plan.datasets[0].target == 3_800


@pytest.mark.full  # (the loop has the plain head start taken over by the flow)
def test_slices_begun_while_the_plan_reads_a_large_file_are_the_flows(prefect_api, large, tmp_path):
    jsonl_scanning._SCANS.clear()
    mixer = _mixer(large, tmp_path / "out")
    run = RunOptions(work_dir=str(tmp_path / "work"), slice_rows=1000, runner="process", workers=2)
    with head_start.head_start_scope():
        plan = head_start.plan_ahead(mixer, run, head_start.early_start(run))
        head = head_start._pending
        assert plan is not None and head is not None  # begun by the plan itself
        head_start.begin_head_start(mixer, run, plan)
        assert head_start._pending is head and head.keys == {s.key for s in plan.slices}
        report = tokenize_mixer(mixer=mixer, run=run)
        assert head_start._pending is None  # the flow took it
    assert report["slices_computed"] == report["slices_total"] == len(plan.slices)
    manifests = list((tmp_path / "work").glob("slices/*/*/manifest.json"))
    assert len(manifests) == len(plan.slices)  # each slice tokenized once
    plain = _mixer(large, tmp_path / "plain")
    tokenize_mixer(mixer=plain, run=RunOptions(work_dir=str(tmp_path / "w2"), runner="thread"))
    result = compare(tmp_path / "out", tmp_path / "plain")
    assert result.matches, result.render()


def test_larger_slices_hold_whole_batches_and_share_keys_with_a_counted_plan(large, tmp_path):
    """``slice_bytes`` of several batches (fewer task runs on many cores): whole batches per slice, the
    same slices whether they are cut as the file is read (1.0) or after a count (a row count above it)."""
    run = RunOptions(work_dir=str(tmp_path / "w"), slice_bytes=2 * jsonl_batches.BATCH_BYTES)
    streamed, counted = _mixer(large, tmp_path / "a"), _mixer(large, tmp_path / "b")
    counted.datasets[0].amount = 10_000  # every row (more than the file has), known from the count
    early: list[str] = []
    plan = build_plan(streamed, run, lambda spec, ctx: early.append(spec.key))
    assert [len(s.source.batches) for s in plan.slices] == [2, 1]
    assert early == [s.key for s in plan.slices]
    assert [s.key for s in build_plan(counted, run).slices] == early


def test_left_to_the_tool_a_larger_dataset_has_larger_slices(large, tmp_path, monkeypatch):
    """Bytes per slice left empty grow with the mixture's size, in tiers (fewer task runs for the one
    Prefect API core at 100 GB): the same slices as asking for that tier, whether cut as the file is read
    or after a count. Here at most 2 slices a mixture, so this ~25 MiB file gets the 16 MiB tier."""
    from sftmix.planning import slice_sizes as planning

    two = RunOptions(workers=2)
    assert [planning.slice_bytes_for(two, n << 20) for n in (1, 12, 17, 2048, 2049, 10_000, 10**6)] == [
        256 << 10,  # a small mixture is cut finer, down to 256 KiB, until each worker has two slices
        2 << 20,
        4 << 20,
        4 << 20,
        8 << 20,
        32 << 20,
        64 << 20,
    ]
    assert planning.slice_bytes_for(RunOptions(workers=64), 200 << 20) == 1 << 20
    assert planning.slice_bytes_for(RunOptions(slice_bytes=123), 10**12) == 123
    monkeypatch.setattr(planning, "AUTO_SLICES", 2)
    monkeypatch.setattr(planning, "SLICES_PER_WORKER", 0)  # (the tiers alone)
    assert 16 << 20 < large.stat().st_size <= 32 << 20  # above 2 x 8 MiB, within 2 x 16 MiB
    streamed, counted = _mixer(large, tmp_path / "a"), _mixer(large, tmp_path / "b")
    counted.datasets[0].amount = 10_000
    early: list[str] = []
    plan = build_plan(
        streamed, RunOptions(work_dir=str(tmp_path / "w")), lambda spec, ctx: early.append(spec.key)
    )
    assert [len(s.source.batches) for s in plan.slices] == [2, 1]
    asked = RunOptions(work_dir=str(tmp_path / "w2"), slice_bytes=16 << 20)
    assert [s.key for s in build_plan(streamed, asked).slices] == early
    assert [s.key for s in build_plan(counted, RunOptions(work_dir=str(tmp_path / "w3"))).slices] == early


@pytest.mark.parametrize("amount", [1.0, 0.5])
def test_left_to_the_tool_the_slices_follow_the_whole_mixtures_size(large, tmp_path, monkeypatch, amount):
    """Two datasets get the slices one dataset of their total size gets, not each its own (20 datasets of
    1 GB were up to ~4,800 task runs, minutes of dispatch on 64 cores): whether a file is cut as it is read
    (1.0) or counted first (0.5), the same slices as asking for the mixture's tier. Here at most 2 slices
    a mixture: one ~25 MiB file alone gets the 16 MiB tier (2 batches), the two together 32 MiB (3)."""
    from sftmix.planning import slice_sizes as planning

    monkeypatch.setattr(planning, "AUTO_SLICES", 2)
    monkeypatch.setattr(planning, "SLICES_PER_WORKER", 0)  # (the tiers alone)
    other = tmp_path / "other.jsonl"
    shutil.copyfile(large, other)
    alone = build_plan(_mixer(large, tmp_path / "a"), RunOptions(work_dir=str(tmp_path / "w1")))
    assert [len(s.source.batches) for s in alone.slices] == [2, 1]
    both = _mixer(large, tmp_path / "b")
    both.datasets[0].amount = amount
    both.datasets.append(DatasetEntry(path=str(other), amount=1.0))
    plan = build_plan(both, RunOptions(work_dir=str(tmp_path / "w2")))
    assert [(s.dataset_index, len(s.source.batches)) for s in plan.slices] == [(0, 3), (1, 3)]
    asked = build_plan(both, RunOptions(work_dir=str(tmp_path / "w3"), slice_bytes=32 << 20))
    assert [s.key for s in asked.slices] == [s.key for s in plan.slices]


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _append(path: Path) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(arithmetic(random.Random(1), 1)[0]) + "\n")


def _replace(path: Path) -> None:
    """Another file of the same size and mtime, renamed over it."""
    data = bytearray(path.read_bytes())
    data[jsonl_batches.BATCH_BYTES + 100 : jsonl_batches.BATCH_BYTES + 101] = (
        b"7" if data[jsonl_batches.BATCH_BYTES + 100] != ord("7") else b"8"
    )
    other = path.with_name("other.jsonl")
    other.write_bytes(bytes(data))
    st = path.stat()
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, path)


@pytest.mark.parametrize("change", [_truncate, _append, _replace])
def test_a_file_that_changes_while_its_slices_begin_is_one_clear_error(large, tmp_path, change):
    """Changed while the plan reads it (at its first slice): the plan refuses it, naming the file."""
    path = tmp_path / "large.jsonl"
    shutil.copyfile(large, path)
    mixer = _mixer(path, tmp_path / "out")
    first: list[str] = []

    def early(spec, ctx) -> None:
        if not first:
            first.append(spec.key)
            change(path)

    with pytest.raises(DatasetError, match="changed") as refused:
        build_plan(mixer, RunOptions(work_dir=str(tmp_path / "w")), early)
    assert first and str(path) in str(refused.value)


def test_an_upsampling_the_machine_cannot_assemble_is_refused_before_any_slice_begins(
    large, tmp_path, monkeypatch
):
    from sftmix.planning import plan as plan_module

    monkeypatch.setattr(plan_module, "memory_limit", lambda: 2 << 30)  # a 2 GiB machine
    mixer = _mixer(large, tmp_path / "out")
    mixer.datasets[0].amount = 100_000.0  # 760 M rows: more than it can assemble
    early: list[str] = []
    with pytest.raises(DatasetError, match="more than this machine"):
        build_plan(mixer, RunOptions(work_dir=str(tmp_path / "w")), lambda spec, ctx: early.append(spec.key))
    assert not early  # estimated from the first batch: counted first, refused before any work


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz"])
def test_a_compressed_files_copy_size_is_told_without_the_copy(large, tmp_path, monkeypatch, suffix):
    """Exact where the file tells it (a gzip trailer below 4 GiB; a whole file within the sample), else
    within a few percent from its first blocks; never by making the copy."""
    import random

    from sftmix.sources import copies as sources

    def made() -> int:
        raise AssertionError("the copy was made to tell its size")

    monkeypatch.setattr(sources, "_SIZE_SAMPLE", 1 << 20)
    plain = tmp_path / "varied.jsonl"  # (packs less well than ``large``: more than the sample)
    rng = random.Random(3)
    words = ["".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(2, 12))) for _ in range(5000)]
    with open(plain, "w", encoding="utf-8") as fh:
        for _ in range(15_000):
            fh.write(json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(5, 200)))}) + "\n")
    packed = _packed(plain, tmp_path / f"varied.jsonl{suffix}")
    assert packed.stat().st_size > sources._SIZE_SAMPLE
    told = sources.copy_size(str(packed), made)
    if suffix == ".gz":
        assert told == plain.stat().st_size
    else:
        assert told != plain.stat().st_size and abs(told / plain.stat().st_size - 1) < 0.05
    assert sources.copy_size(str(_packed(large, tmp_path / f"large.jsonl{suffix}")), made) == (
        large.stat().st_size
    )  # (within the sample, or a gzip trailer)
    if suffix != ".gz":
        damaged = tmp_path / f"damaged.jsonl{suffix}"
        damaged.write_bytes(b"not what the suffix says" * 100)
        assert sources.copy_size(str(damaged), lambda: -1) == -1  # (the copy meets it, and says so)
