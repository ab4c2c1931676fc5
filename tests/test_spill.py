"""A large Parquet row group decoded once by the plan for all its slices (sftmix.sources.parquet.spill): the rows its
slices read are the file's, its slices are handed on once all it decoded is confirmed, and a slice
without it reads the file itself."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sftmix.config.config import DatasetEntry
from sftmix.config.run_options import RunOptions
from sftmix.errors import DatasetError
from sftmix.sources import parquet
from sftmix.sources.parquet import decoding as parquet_decoding
from sftmix.sources.parquet import ranges as parquet_ranges
from sftmix.sources.parquet import row_groups as parquet_row_groups
from sftmix.sources.parquet import spill
from tests.test_parquet import _datasets_rows, _mixer, _rows


@pytest.fixture
def streamed(monkeypatch):
    """Row groups of more than 16 KiB read batch by batch (spilled where cut into several slices), in
    batches of a few rows."""
    monkeypatch.setenv("TOKENIZE_MIXER_PARQUET_STREAMED_BYTES", str(16 << 10))
    monkeypatch.setattr(parquet_row_groups, "_STREAM_BATCH_BYTES", 4096)
    parquet.release()
    yield
    parquet.release()


def _one_group(tmp_path: Path, n: int = 600) -> Path:
    path = tmp_path / "chats.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(n)), path, row_group_size=n)
    return path


def _spill(layout: parquet.ParquetLayout, cache: Path, tables=None) -> spill.Spill:
    group = layout.row_groups[0]
    return spill.spill_group(
        group.path,
        group.index,
        group.rows,
        str(cache),
        f"test-{cache}",
        tables or (lambda: parquet.decoded_tables(layout, group)),
    )


def test_rows_read_from_a_spill_are_the_files(tmp_path, streamed):
    path = _one_group(tmp_path)
    expected = _datasets_rows(path, tmp_path / "cache")
    layout = parquet.scan(str(path))
    assert layout is not None and len(layout.row_groups) == 1
    group = layout.row_groups[0]
    made = _spill(layout, tmp_path / "spills")
    made.wait()
    assert len(made.rows(0, group.rows).batches) > 10  # (many batches: slices read a few each)
    for lo, hi in ((0, 600), (0, 1), (123, 377), (599, 600)):
        found = made.rows(lo, hi)
        assert found is not None
        source = layout.source([group], [found])
        assert parquet.read_rows(source, list(range(lo, hi))) == expected[lo:hi]
        parquet.confirm()
    subset = [5, 9, 300, 301, 598]  # (a fraction's rows, in order)
    assert parquet.read_rows(layout.source([group], [made.rows(5, 599)]), subset) == [
        expected[i] for i in subset
    ]
    parquet.release()


def test_a_landed_spill_is_reused_and_a_missing_one_read_from_the_file(tmp_path, streamed):
    path = _one_group(tmp_path)
    expected = _datasets_rows(path, tmp_path / "cache")
    layout = parquet.scan(str(path))
    assert layout is not None
    made = _spill(layout, tmp_path / "spills")
    made.wait()
    spill.forget_spills()

    def never():
        raise AssertionError("decoded again")

    again = _spill(layout, tmp_path / "spills", never)
    again.wait()
    assert again.rows(0, 600) == made.rows(0, 600)
    found = again.rows(200, 400)
    Path(found.path).unlink()  # (a user's clean-up: the slice reads the Parquet file instead)
    source = layout.source(list(layout.row_groups), [found])
    assert parquet.read_rows(source, list(range(200, 400))) == expected[200:400]
    parquet.confirm()
    parquet.release()
    spill.forget_spills()


def test_a_damaged_spill_is_read_from_the_file_instead_and_made_again(tmp_path, streamed, caplog):
    """A spill batch whose bytes are not what the plan wrote (a damaged disk) is our cache gone bad: the
    slice reads the row group from the Parquet file, says so, and the next plan writes the spill again."""
    path = _one_group(tmp_path)
    expected = _datasets_rows(path, tmp_path / "cache")
    layout = parquet.scan(str(path))
    assert layout is not None
    made = _spill(layout, tmp_path / "spills")
    made.wait()
    found = made.rows(0, 600)
    batch = found.batches[3]
    with open(found.path, "r+b") as fh:
        fh.seek(batch.end - 20)
        fh.write(b"\0" * 8)
    source = layout.source(list(layout.row_groups), [found])
    with caplog.at_level("WARNING", logger="sftmix.sources.parquet.spill"):
        assert parquet.read_rows(source, list(range(600))) == expected
    parquet.confirm()
    parquet.release()
    assert "is not what the plan wrote (a damaged disk?)" in caplog.text
    assert not Path(found.path).with_suffix(".json").exists()  # (its index: no plan reuses it)
    spill.forget_spills()
    again = _spill(layout, tmp_path / "spills")  # (written again, not reused)
    again.wait()
    assert again.rows(0, 600) == found
    assert parquet.read_rows(layout.source(list(layout.row_groups), [again.rows(0, 600)]), [0, 599]) == [
        expected[0],
        expected[599],
    ]
    parquet.release()
    spill.forget_spills()


def test_a_spills_rows_are_handed_on_as_they_are_written(tmp_path, streamed):
    """Each batch is written once all read to decode it is known to be the plan's version, so a slice
    reads it at once and none waits for the rest; a writer that fails later (the file changed) leaves
    nothing behind, and what it handed on before stays right."""
    path = _one_group(tmp_path)
    expected = _datasets_rows(path, tmp_path / "cache")
    layout = parquet.scan(str(path))
    assert layout is not None
    group = layout.row_groups[0]

    for ending in ("lands", "fails"):
        go_on = threading.Event()

        def tables(go_on=go_on, ending=ending):
            for k, table in enumerate(parquet.decoded_tables(layout, group)):
                if k == 3:
                    go_on.wait(30)
                    if ending == "fails":
                        raise DatasetError(str(path), "the file changed since the run was planned (test)")
                yield table

        made = _spill(layout, tmp_path / f"spills-{ending}", tables)
        found = made.rows(0, 10)
        assert found is not None and found.temp  # (handed on while it is written)
        assert parquet.read_rows(layout.source([group], [found]), list(range(10))) == expected[:10]
        parquet.confirm()
        parquet.release()
        assert made.rows(0, 600, wait=False) is None  # (the rest not yet written)
        go_on.set()
        if ending == "lands":
            made.wait()
            assert not made.rows(0, 600).temp
        else:
            with pytest.raises(DatasetError, match="changed since the run was planned"):
                made.rows(0, 600)
            assert not list((tmp_path / "spills-fails").rglob("*.arrows*"))  # (its temp file removed)
    spill.forget_spills()


def test_a_file_that_changes_while_it_is_spilled_gives_no_batch_of_the_change(
    tmp_path, streamed, monkeypatch
):
    """The plan hashed each column chunk in blocks: a batch decoded from a block that is not the plan's
    is never given to the spill; the change is said as a change."""
    monkeypatch.setattr(parquet_ranges, "_MIN_CHECKED_BLOCK", 1024)
    monkeypatch.setattr(parquet_decoding, "_STREAM_BUFFER", 512)
    path = tmp_path / "chats.parquet"
    pq.write_table(
        pa.Table.from_pylist(_rows(600)), path, compression="none", use_dictionary=False, data_page_size=512
    )
    expected = _datasets_rows(path, tmp_path / "cache")
    layout = parquet.scan(str(path))
    assert layout is not None
    group = layout.row_groups[0]
    tables = parquet.decoded_tables(layout, group)
    given = [next(tables)]
    raw = bytearray(path.read_bytes())
    at = raw.rindex(b"answer 300.")  # (mid-file: the last batch waits for the whole check anyway)
    raw[at : at + 6] = b"ANSWER"
    with open(path, "r+b") as fh:  # (in place: the same size and inode)
        fh.write(bytes(raw))
    with pytest.raises(DatasetError, match="chats.parquet.*changed since the run was planned"):
        for table in tables:
            given.append(table)
    rows = [r for t in given for r in t.to_pylist()]
    assert len(given) > 1 and rows == expected[: len(rows)]  # (every batch given is the plan's version)


def test_the_plan_cuts_a_large_row_group_into_many_slices_of_one_spill(tmp_path, streamed):
    from sftmix.planning.plan import build_plan

    path = _one_group(tmp_path, 2000)
    run = RunOptions(work_dir=str(tmp_path / "work"), slice_bytes=64 << 10)
    plan = build_plan(_mixer(path, tmp_path / "out"), run)
    assert len(plan.slices) > 8  # (was at most 4: each slice decoded the row group up to its rows)
    spills = {s.source.spilled[0].path for s in plan.slices}
    assert len(spills) == 1 and all(len(s.source.spilled) == 1 for s in plan.slices)
    index = json.loads(Path(next(iter(spills))).with_suffix(".json").read_text())
    assert sum(b["rows"] for b in index["batches"]) == 2000
    again = build_plan(_mixer(path, tmp_path / "out"), run)
    assert [s.key for s in again.slices] == [s.key for s in plan.slices]
    unspilled = build_plan(_mixer(path, tmp_path / "out"), run.model_copy(update={"slice_bytes": 8 << 20}))
    assert len(unspilled.slices) == 1 and not unspilled.slices[0].source.spilled


def test_the_datasets_after_a_spilled_one_are_cut_while_it_is_spilled(tmp_path, streamed, monkeypatch):
    """The plan does not wait for a dataset's spill before it cuts the next dataset: the later slices
    are handed on while the spill is held, the spill's own as its rows are written, and the plan is
    the same, in mixer order."""
    from sftmix.planning.plan import build_plan

    first = _one_group(tmp_path, 2000)
    second = tmp_path / "more.parquet"  # (row groups of a slice or less: none spilled)
    pq.write_table(pa.Table.from_pylist(_rows(400, seed=1)), second, row_group_size=50)
    mixer = _mixer(first, tmp_path / "out").model_copy(
        update={"datasets": [DatasetEntry(path=str(first)), DatasetEntry(path=str(second))]}
    )
    run = RunOptions(work_dir=str(tmp_path / "work"), slice_bytes=64 << 10)
    later_cut, decoded = threading.Event(), parquet.decoded_tables

    def held(layout, group):
        for k, table in enumerate(decoded(layout, group)):
            if k == 2:
                later_cut.wait(20)
            yield table

    handed: list[tuple[int, int]] = []

    def early(spec, ctx) -> None:
        handed.append((spec.dataset_index, spec.index))
        if spec.dataset_index == 1:
            later_cut.set()

    monkeypatch.setattr(parquet, "decoded_tables", held)
    plan = build_plan(mixer, run, early)
    assert later_cut.is_set()
    monkeypatch.setattr(parquet, "decoded_tables", decoded)
    firsts = [k for k, (d, _) in enumerate(handed) if d == 1]
    assert firsts and firsts[0] < len(handed) - 1 and handed[-1][0] == 0  # (the spill's last slices last)
    assert sorted(handed) == [(s.dataset_index, s.index) for s in plan.slices]
    assert [s.index for s in plan.slices] == list(range(len(plan.slices)))
    assert [s.dataset_index for s in plan.slices] == sorted(s.dataset_index for s in plan.slices)
    assert [d.slices for d in plan.datasets] == [
        [s.index for s in plan.slices if s.dataset_index == d] for d in (0, 1)
    ]
    spill.forget_spills()
    again = build_plan(mixer, run.model_copy(update={"work_dir": str(tmp_path / "work-again")}))
    assert [s.key for s in again.slices] == [s.key for s in plan.slices]


def test_a_spill_that_fails_while_a_later_dataset_is_cut_is_its_own_datasets_error(
    tmp_path, streamed, monkeypatch
):
    from sftmix.planning.plan import build_plan

    first = _one_group(tmp_path, 2000)
    second = tmp_path / "more.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(400, seed=1)), second, row_group_size=50)
    mixer = _mixer(first, tmp_path / "out").model_copy(
        update={"datasets": [DatasetEntry(path=str(first)), DatasetEntry(path=str(second))]}
    )
    later_cut, decoded = threading.Event(), parquet.decoded_tables

    def failing(layout, group):
        for k, table in enumerate(decoded(layout, group)):
            if k == 2:
                later_cut.wait(20)
                raise DatasetError(str(first), "the file changed since the run was planned (test)")
            yield table

    def early(spec, ctx) -> None:
        if spec.dataset_index == 1:
            later_cut.set()

    monkeypatch.setattr(parquet, "decoded_tables", failing)
    run = RunOptions(work_dir=str(tmp_path / "work"), slice_bytes=64 << 10)
    with pytest.raises(DatasetError, match="changed since the run was planned") as refused:
        build_plan(mixer, run, early)
    assert refused.value.dataset == str(first)
    spill.forget_spills()


@pytest.mark.slow
def test_shards_from_a_spilled_row_group_are_those_of_datasets(prefect_api, tmp_path, monkeypatch, streamed):
    from tokenize_mixer.flows.tokenize_mixer import tokenize_mixer

    path = _one_group(tmp_path, 1500)
    for amount in (1.0, 0.5):

        def convert(name: str, amount: float = amount) -> dict:
            run = RunOptions(work_dir=str(tmp_path / f"work-{name}"), slice_bytes=64 << 10, runner="process")
            return tokenize_mixer(mixer=_mixer(path, tmp_path / name, amount), run=run)

        ours = convert(f"spilled-{amount}")
        assert ours["slices_total"] > parquet.MAX_PIECES_PER_ROW_GROUP
        monkeypatch.setenv("TOKENIZE_MIXER_PARQUET_READER", "datasets")
        assert convert(f"datasets-{amount}")["digests"] == ours["digests"]
        monkeypatch.delenv("TOKENIZE_MIXER_PARQUET_READER")


def test_a_spill_that_cannot_be_written_is_named_with_its_place(tmp_path, streamed):
    """A spill's own failure (here a file where its directory goes; a full disk alike) says where it
    was written, not that the Parquet file cannot be read."""
    path = _one_group(tmp_path)
    layout = parquet.scan(str(path))
    assert layout is not None
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "spilled").write_text("not a directory")
    made = _spill(layout, cache)
    with pytest.raises(DatasetError, match=r"row group 0 cannot be spilled to .*spilled.*NotADirectoryError"):
        made.rows(0, 600)
    assert (cache / "spilled").read_text() == "not a directory"
    spill.forget_spills()
