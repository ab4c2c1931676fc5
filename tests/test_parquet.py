"""Local Parquet read by row group (sftmix.sources.parquet) gives exactly the rows datasets' Parquet builder gives,
for several writers; a file that changes after the plan, or is not whole Parquet, is one clear error; the
plan cuts slices at row groups and an edit recomputes only its row group's slices; the shards are the
same as through datasets and as from the same chats in JSON Lines (issue 41 item 3)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sftmix.config.config import DatasetEntry, MixerConfig, OutputSpec, TokenizerSpec
from sftmix.config.run_options import RunOptions
from sftmix.errors import DatasetError
from sftmix.sources import parquet
from sftmix.sources.parquet import ParquetSource
from sftmix.sources.parquet import counting as parquet_counting
from sftmix.sources.parquet import decoding as parquet_decoding
from sftmix.sources.parquet import ranges as parquet_ranges
from sftmix.sources.parquet import row_groups as parquet_row_groups

EXAMPLES = Path(__file__).parent.parent / "examples"


def _chat(rng: random.Random, i: int) -> dict:
    words = ["alpha", "beta", "gamma", "delta", "ümlaut", "日本語", "emoji 🙂", ""]
    turns = []
    for t in range(rng.randint(1, 3)):
        turns.append({"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(0, 30)))})
        turns.append({"role": "assistant", "content": f"answer {i}.{t} " + rng.choice(words)})
    row: dict = {"messages": turns, "id": f"row-{i}", "score": rng.random() if i % 5 else None}
    return row


def _rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [_chat(rng, i) for i in range(n)]


def _datasets_rows(path: Path, cache: Path) -> list[dict]:
    datasets.disable_progress_bars()
    return list(datasets.load_dataset("parquet", data_files=str(path), split="train", cache_dir=str(cache)))


@pytest.fixture
def by_batch(monkeypatch):
    """Every row group read batch by batch, a few rows and a few hundred bytes at a time, as only a large
    one is (:data:`sftmix.sources.parquet.row_groups.STREAMED_BYTES`)."""
    monkeypatch.setenv("TOKENIZE_MIXER_PARQUET_STREAMED_BYTES", "-1")
    monkeypatch.setattr(parquet_row_groups, "_STREAM_BATCH_BYTES", 4096)
    monkeypatch.setattr(parquet_decoding, "_STREAM_BUFFER", 512)
    parquet.release()
    yield
    parquet.release()


def _our_rows(path: Path, order: list[int] | None = None) -> list[dict]:
    layout = parquet.scan(str(path))
    assert layout is not None
    if order is not None:
        return parquet.read_rows(layout.source(list(layout.row_groups)), order)
    rows: list[dict] = []
    for group in layout.row_groups:  # as slices read them: each its own row group
        rows += parquet.read_rows(
            layout.source([group]), list(range(group.first_row, group.first_row + group.rows))
        )
    return rows


def _write_with(writer: str, rows: list[dict], path: Path) -> None:
    table = pa.Table.from_pylist(rows)
    if writer == "pyarrow":
        pq.write_table(table, path, row_group_size=70)
    elif writer == "large-strings-zstd-page-index":
        large = pa.schema(
            [
                pa.field(
                    "messages",
                    pa.large_list(pa.struct([("role", pa.large_string()), ("content", pa.large_string())])),
                ),
                pa.field("id", pa.large_string()),
                pa.field("score", pa.float64()),
            ]
        )
        pq.write_table(table.cast(large), path, row_group_size=90, compression="zstd", write_page_index=True)
    elif writer == "plain-encoding":
        pq.write_table(table, path, row_group_size=55, use_dictionary=False, compression="none")
    elif writer == "datasets":
        datasets.Dataset.from_list(rows).to_parquet(str(path), batch_size=64)
    else:
        raise AssertionError(writer)


@pytest.mark.parametrize("read", ["whole", "by batch"])
@pytest.mark.parametrize("writer", ["pyarrow", "large-strings-zstd-page-index", "plain-encoding", "datasets"])
def test_rows_are_datasets_rows_for_every_writer(tmp_path, writer, read, request):
    if read == "by batch":
        request.getfixturevalue("by_batch")
    rows = _rows(400)
    path = tmp_path / f"{writer}.parquet"
    _write_with(writer, rows, path)
    assert parquet.applies(str(path), "train")
    layout = parquet.scan(str(path))
    assert layout is not None and layout.n_rows == 400 and len(layout.row_groups) > 1
    expected = _datasets_rows(path, tmp_path / "cache")
    assert _our_rows(path) == expected
    order = list(range(0, 400, 7))[::-1] + [3, 3, 250]
    assert _our_rows(path, order) == [expected[i] for i in order]
    parquet.confirm()  # (what was read by batch is the version the plan read)


@pytest.mark.parametrize("read", ["whole", "by batch"])
def test_a_file_that_changes_after_the_plan_is_one_clear_error(tmp_path, read, request):
    if read == "by batch":
        request.getfixturevalue("by_batch")
    rows = _rows(300)
    path = tmp_path / "chats.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=100)
    layout = parquet.scan(str(path))
    assert layout is not None
    source = layout.source(list(layout.row_groups))

    rows[150]["messages"][0]["content"] = "edited"  # rewritten in place
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=100)
    parquet.release()
    with pytest.raises(DatasetError, match="changed since the run was planned"):
        parquet.read_rows(source, [0, 1])

    renamed = tmp_path / "other.parquet"  # replaced by a rename: another file of the same name
    pq.write_table(pa.Table.from_pylist(_rows(300, seed=9)), renamed, row_group_size=100)
    renamed.replace(path)
    with pytest.raises(DatasetError, match="changed since the run was planned"):
        parquet.read_rows(source, [299])

    path.write_bytes(path.read_bytes()[:1000])  # truncated
    with pytest.raises(DatasetError, match="changed since the run was planned"):
        parquet.read_rows(source, [0])
    path.unlink()
    with pytest.raises(DatasetError, match="changed since the run was planned"):
        parquet.read_rows(source, [0])


def test_a_file_that_changes_while_a_row_group_is_read_by_batch_is_one_clear_error(tmp_path, by_batch):
    """A row group read batch by batch (a large one) is read from the file as it is decoded: what was
    decoded is checked against the plan's bytes before the slice's checkpoint (``confirm``), and a
    change mid-read is said as a change, never handed on as rows of another version."""
    rows = _rows(300)
    path = tmp_path / "chats.parquet"

    def write(rows: list[dict]) -> None:
        table = pa.Table.from_pylist(rows)
        pq.write_table(table, path, compression="none", use_dictionary=False, data_page_size=512)

    write(rows)
    expected = _datasets_rows(path, tmp_path / "cache")
    layout = parquet.scan(str(path))
    assert layout is not None and len(layout.row_groups) == 1
    source = layout.source(list(layout.row_groups))
    assert parquet.read_rows(source, list(range(300))) == expected
    parquet.confirm()

    for change in ("edited in place", "truncated"):
        write(rows)
        parquet.release()
        assert parquet.read_rows(source, list(range(10))) == expected[:10]
        raw = bytearray(path.read_bytes())
        if change == "edited in place":  # the same size and inode: only the bytes tell
            at = raw.rindex(b"answer 299.")
            raw[at : at + 6] = b"ANSWER"
            with open(path, "r+b") as fh:
                fh.write(bytes(raw))
        else:
            with open(path, "r+b") as fh:
                fh.truncate(len(raw) // 2)
        with pytest.raises(DatasetError, match="chats.parquet.*changed since the run was planned"):
            got = parquet.read_rows(source, list(range(10, 300)))
            assert "ANSWER" in json.dumps(got)  # decoded from the edit: only confirm can tell
            parquet.confirm()


def test_a_row_group_read_by_batch_is_read_once_by_a_slice(tmp_path, by_batch, monkeypatch):
    """Its column chunks' hashes come with the plan's hash of the row group, so a slice reads its bytes
    once, as they are decoded (checked before its checkpoint), not once more first to hash them."""
    path = tmp_path / "chats.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(300)), path, row_group_size=300)
    expected = _datasets_rows(path, tmp_path / "cache")
    layout = parquet.scan(str(path))
    assert layout is not None
    group = layout.row_groups[0]
    assert len(group.chunk_sha256) == len(group.chunks) > 1
    passes: list[int] = []
    hash_group = parquet_ranges.hash_group
    monkeypatch.setattr(parquet_ranges, "hash_group", lambda *a: passes.append(1) or hash_group(*a))
    for read, counted in ((group, []), (group.model_copy(update={"chunk_sha256": ()}), [1])):
        assert parquet.read_rows(layout.source([read]), list(range(300))) == expected
        parquet.confirm()
        parquet.release()
        assert passes == counted


@pytest.mark.slow
def test_a_large_row_group_is_read_holding_about_a_batch(tmp_path):
    """A row group of more than :data:`~sftmix.sources.parquet.row_groups.STREAMED_BYTES` (pyarrow writes up to 1Mi rows a
    row group): the reader holds about one batch of it, not the whole."""
    rng = random.Random(5)
    text = "".join(rng.choice("abcdefghij klmnopqrstuvwxyz") for _ in range(1 << 16))
    n = 80_000
    messages = [
        [
            {"role": "user", "content": text[i % 997 : i % 997 + 1000]},
            {"role": "assistant", "content": str(i)},
        ]
        for i in range(n)
    ]
    path = tmp_path / "large.parquet"
    pq.write_table(pa.table({"messages": messages}), path, row_group_size=n, use_dictionary=False)
    del messages
    layout = parquet.scan(str(path))
    assert layout is not None and len(layout.row_groups) == 1
    group = layout.row_groups[0]
    assert group.nbytes > parquet.streamed_bytes()
    parquet.release()
    held_before = pa.total_allocated_bytes()  # (what earlier tests in this process still hold)
    source, peak = layout.source([group]), 0
    for start in range(0, n, 256):
        got = parquet.read_rows(source, list(range(start, min(n, start + 256))))
        assert got[0]["messages"][1]["content"] == str(start)
        peak = max(peak, pa.total_allocated_bytes() - held_before)
    parquet.confirm()
    parquet.release()
    assert peak < group.nbytes // 3, (peak, group.nbytes)


@pytest.mark.parametrize("read", ["whole", "by batch"])
def test_a_damaged_row_group_is_one_clear_error(tmp_path, read, request):
    """Bytes damaged before the plan reads them: the plan's hash is of the damage, and the decode fails
    naming the file and the row group, not deep inside pyarrow."""
    path = tmp_path / "chats.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(300)), path, row_group_size=100, compression="zstd")
    layout = parquet.scan(str(path))
    assert layout is not None
    group = layout.row_groups[1]
    raw = bytearray(path.read_bytes())
    for k in range(group.offset + 8, group.end - 8):
        raw[k] ^= 0x5A
    path.write_bytes(bytes(raw))
    damaged = parquet.scan(str(path))
    assert damaged is not None  # the first row group still decodes
    if read == "by batch":
        request.getfixturevalue("by_batch")
    with pytest.raises(DatasetError, match=r"chats.parquet.*row group 1 cannot be read"):
        parquet.read_rows(damaged.source(list(damaged.row_groups)), [150])


def test_a_file_that_is_not_whole_parquet_is_refused_in_words(tmp_path):
    path = tmp_path / "cut.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(50)), path)
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(DatasetError, match="not a whole Parquet file"):
        parquet.scan(str(path))
    text = tmp_path / "text.parquet"
    text.write_text("messages,id\n" * 20)
    with pytest.raises(DatasetError, match="not a whole Parquet file"):
        parquet.scan(str(text))


def test_what_only_datasets_reads_goes_through_it(tmp_path, monkeypatch):
    path = tmp_path / "chats.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(10)), path)
    assert parquet.applies(str(path), "train")
    assert not parquet.applies(str(path), "train[:5]")  # a sliced split
    assert not parquet.applies(str(tmp_path / "chats.jsonl"), "train")
    none = tmp_path / "none.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(1)).slice(0, 0), none)
    assert parquet.scan(str(none)) is None  # no rows: datasets' path says so
    images = tmp_path / "images.parquet"
    features = datasets.Features({"messages": datasets.Value("string"), "image": datasets.Image()})
    datasets.Dataset.from_dict({"messages": ["x"], "image": [None]}, features=features).to_parquet(
        str(images)
    )
    assert parquet.scan(str(images)) is None  # a feature that decodes
    monkeypatch.setenv("TOKENIZE_MIXER_PARQUET_READER", "datasets")
    assert not parquet.applies(str(path), "train")


def _mixer(path: Path, out: Path, amount: float | int = 1.0) -> MixerConfig:
    return MixerConfig(
        datasets=[DatasetEntry(path=str(path), amount=amount)],
        tokenizer=TokenizerSpec(name_or_path=str(EXAMPLES / "tokenizer"), chat_template="olmo"),
        max_seq_length=256,
        output=OutputSpec(path=str(out)),
    )


def test_the_plan_cuts_at_row_groups_and_an_edit_changes_only_its_row_groups_keys(tmp_path):
    from sftmix.planning.plan import build_plan

    rows = _rows(600)
    path = tmp_path / "chats.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=200)
    largest = max(g.nbytes for g in parquet.scan(str(path)).row_groups)  # type: ignore[union-attr]
    run = RunOptions(work_dir=str(tmp_path / "work"), slice_bytes=largest)  # one slice per row group

    def plan(amount: float | int = 1.0):
        return build_plan(_mixer(path, tmp_path / "out", amount), run)

    whole = plan()
    assert whole.datasets[0].fingerprint.startswith(parquet.FINGERPRINT_PREFIX)
    assert [(s.row_start, s.row_end) for s in whole.slices] == [(0, 200), (200, 400), (400, 600)]
    assert all(isinstance(s.source, ParquetSource) and len(s.source.row_groups) == 1 for s in whole.slices)
    assert all(getattr(s.source, "arrow_files", None) is None for s in whole.slices)
    for amount, selected, tokenized in ((0.5, 300, 300), (250, 250, 250), (2.0, 1200, 600)):
        got = plan(amount)  # (an upsampled row is tokenized once)
        assert got.datasets[0].target == selected
        assert sum(len(s.rows or range(s.row_start, s.row_end)) for s in got.slices) == tokenized
    rows[450]["messages"][0]["content"] = "edited"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=200)
    edited = plan()
    assert [a.key == b.key for a, b in zip(whole.slices, edited.slices, strict=True)] == [True, True, False]
    few = build_plan(_mixer(path, tmp_path / "out"), RunOptions(work_dir=str(tmp_path / "work")))
    assert len(few.slices) == 1  # the default slice_bytes holds all three row groups


def test_a_row_group_is_cut_into_a_few_slices_or_spilled_into_many():
    """A row group of several slices' size is cut into at most a few (each decodes it up to its rows);
    one read batch by batch is decoded once by the plan (spilled), so it is cut into slices of the
    run's size (a batch's at least), as many as it makes."""
    group = parquet.RowGroup(
        path="f.parquet",
        index=0,
        offset=4,
        end=100,
        first_row=0,
        rows=1000,
        nbytes=parquet.STREAMED_BYTES,
        sha256="",
        meta_sha256="",
    )
    assert not parquet.spilled(group)
    layout = parquet.ParquetLayout((), "", "", (group,))
    cuts = parquet.slice_cuts(layout, None, 4 << 20)
    assert len(cuts) == parquet.MAX_PIECES_PER_ROW_GROUP
    assert [c[:2] for c in cuts] == [(0, 250), (250, 500), (500, 750), (750, 1000)]
    two = (
        group.model_copy(update={"nbytes": 8 << 20}),
        group.model_copy(update={"index": 1, "first_row": 1000}),
    )
    layout = parquet.ParquetLayout((), "", "", two)
    assert parquet.slice_cuts(layout, None, 4 << 20) == [
        (0, 1000, None),
        *[(a + 1000, b + 1000, None) for a, b, _ in cuts],
    ]
    large = group.model_copy(update={"nbytes": 100 << 20})
    assert parquet.spilled(large)
    cuts = parquet.slice_cuts(parquet.ParquetLayout((), "", "", (large,)), None, 4 << 20)
    assert len(cuts) == 13 and cuts[0][:2] == (0, 77) and cuts[-1][:2] == (924, 1000)  # (8 MiB batches)
    cuts = parquet.slice_cuts(parquet.ParquetLayout((), "", "", (large,)), None, 10 << 20)
    assert len(cuts) == 10 and cuts[0][:2] == (0, 100)
    unspilled = parquet.slice_cuts(parquet.ParquetLayout((), "", "", (large,)), None, 4 << 20, spill=False)
    assert len(unspilled) == parquet.MAX_PIECES_PER_ROW_GROUP  # (a remote work directory's slices)


@pytest.mark.slow
def test_shards_are_those_of_datasets_and_of_the_same_chats_as_json_lines(prefect_api, tmp_path, monkeypatch):
    from tokenize_mixer.flows.tokenize_mixer import tokenize_mixer

    lines = [json.loads(line) for line in (EXAMPLES / "data" / "arithmetic.jsonl").read_text().splitlines()]
    path = tmp_path / "chats.parquet"
    pq.write_table(pa.Table.from_pylist(lines), path, row_group_size=37)
    as_jsonl = tmp_path / "chats.jsonl"
    as_jsonl.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in lines), encoding="utf-8")

    def convert(data: Path, name: str, amount: float | int) -> dict:
        run = RunOptions(work_dir=str(tmp_path / f"work-{name}"), slice_bytes=4096, runner="thread")
        return tokenize_mixer(mixer=_mixer(data, tmp_path / name, amount), run=run)

    for amount in (1.0, 0.5, 2.0):
        ours = convert(path, f"ours-{amount}", amount)
        assert ours["slices_total"] > 1
        shards = {
            k: v for k, v in ours["digests"].items() if k != "dataset_statistics.json"
        }  # (names the file)
        assert shards and convert(as_jsonl, f"jsonl-{amount}", amount)["digests"].items() >= shards.items()
        monkeypatch.setenv("TOKENIZE_MIXER_PARQUET_READER", "datasets")
        assert convert(path, f"datasets-{amount}", amount)["digests"] == ours["digests"]
        monkeypatch.delenv("TOKENIZE_MIXER_PARQUET_READER")
        monkeypatch.setenv("TOKENIZE_MIXER_PARQUET_STREAMED_BYTES", "64")  # every row group read by batch
        assert convert(path, f"by-batch-{amount}", amount)["digests"] == ours["digests"]
        monkeypatch.delenv("TOKENIZE_MIXER_PARQUET_STREAMED_BYTES")


def _hub_layout(root: Path, rows: list[dict], card: str = "---\nlicense: odc-by\n---\n# a mixture\n") -> Path:
    """A directory laid out as a dataset on the hub: two train files (several row groups), one test file."""
    repo = root / "org--mixture"
    (repo / "data").mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    half = len(rows) // 2
    pq.write_table(table.slice(0, half), repo / "data" / "train-00000-of-00002.parquet", row_group_size=60)
    pq.write_table(table.slice(half), repo / "data" / "train-00001-of-00002.parquet", row_group_size=60)
    pq.write_table(table.slice(0, 7), repo / "data" / "test-00000-of-00001.parquet")
    (repo / "README.md").write_text(card)
    return repo


def _hub_rows(repo: Path, split: str, cache: Path) -> list[dict]:
    from sftmix.sources.data_files import parquet_data_files

    found = parquet_data_files(str(repo), split, None, str(cache))
    assert found is not None
    layout = parquet.scan_files(found.paths, found.declared)
    assert layout is not None
    return parquet.read_rows(layout.source(list(layout.row_groups)), list(range(layout.n_rows)))


def _load(repo: Path, split: str, cache: Path) -> list[dict]:
    datasets.disable_progress_bars()
    return list(datasets.load_dataset(str(repo), split=split, cache_dir=str(cache)))


def test_a_hub_datasets_parquet_files_are_read_by_row_group_in_datasets_order(tmp_path):
    """The files a hub dataset's split names (here a directory with the hub's layout: no network), in
    the order datasets reads them, give its rows; what datasets must read itself is left to it."""
    from sftmix.sources.data_files import parquet_data_files

    rows = _rows(300)
    repo = _hub_layout(tmp_path, rows)
    cache = tmp_path / "cache"
    found = parquet_data_files(str(repo), "train", None, str(cache))
    assert found is not None and [Path(p).name for p in found.paths] == [
        "train-00000-of-00002.parquet",
        "train-00001-of-00002.parquet",
    ]
    assert _hub_rows(repo, "train", cache) == _load(repo, "train", cache)
    assert _hub_rows(repo, "test", cache) == _load(repo, "test", cache)
    assert parquet_data_files(str(repo), "train[:10]", None, str(cache)) is None  # a sliced split
    assert parquet_data_files(str(repo), "validation", None, str(cache)) is None  # datasets says why
    other = repo / "data" / "train-00001-of-00002.parquet"  # files of two schemas: datasets casts them
    pq.write_table(pa.Table.from_pylist([{**r, "score": str(r["score"])} for r in rows[150:]]), other)
    found = parquet_data_files(str(repo), "train", None, str(cache))
    assert found is not None and parquet.scan_files(found.paths, found.declared) is None


def test_features_the_card_declares_are_the_ones_rows_are_cast_to(tmp_path):
    card = """---
dataset_info:
  features:
  - name: messages
    list:
    - name: role
      dtype: large_string
    - name: content
      dtype: large_string
  - name: id
    dtype: string
  - name: score
    dtype: float32
---
"""
    repo = _hub_layout(tmp_path, _rows(200), card)
    cache = tmp_path / "cache"
    ours = _hub_rows(repo, "train", cache)
    assert ours == _load(repo, "train", cache)
    assert any(r["score"] is not None and r["score"] != round(r["score"], 12) for r in ours)  # float32


def test_the_plan_reads_a_hub_layout_by_row_group(tmp_path):
    from sftmix.planning.plan import build_plan

    repo = _hub_layout(tmp_path, _rows(240))
    plan = build_plan(
        _mixer(repo, tmp_path / "out"), RunOptions(work_dir=str(tmp_path / "work"), slice_bytes=1)
    )
    assert (
        plan.datasets[0].fingerprint.startswith(parquet.FINGERPRINT_PREFIX) and plan.datasets[0].n_rows == 240
    )
    assert all(isinstance(s.source, ParquetSource) for s in plan.slices)
    assert sum(s.row_end - s.row_start for s in plan.slices) == 240
    read = {Path(g.path).name for s in plan.slices for g in s.source.row_groups}  # type: ignore[union-attr]
    assert read == {"train-00000-of-00002.parquet", "train-00001-of-00002.parquet"}


def _hashed_whole(path: Path) -> bool:
    return any(path_ == str(path) for key in parquet_counting._SCANS for path_, *_ in key[0])


@pytest.mark.parametrize("amount", [1.0, 0.5, 250, 2.0])
def test_slices_are_cut_as_their_row_groups_are_hashed_for_any_amount(tmp_path, amount):
    """The footers give every count, so whatever the amount, each slice is handed on as soon as its row
    groups are hashed (before the last one is), and they are the slices of the finished plan."""
    from sftmix.planning.plan import build_plan

    path = tmp_path / "chats.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(600)), path, row_group_size=100)
    mixer, run = (
        _mixer(path, tmp_path / "out", amount),
        RunOptions(work_dir=str(tmp_path / "w"), slice_rows=50),
    )
    parquet_counting._SCANS.clear()
    early: list[tuple[str, int, bool]] = []
    plan = build_plan(mixer, run, lambda spec, ctx: early.append((spec.key, spec.index, _hashed_whole(path))))
    assert [(key, index) for key, index, _ in early] == [(s.key, s.index) for s in plan.slices]
    assert not early[0][2]  # the first slice was handed on before every row group was hashed
    again: list[str] = []  # the same plan from the hashes made before, handed on at once
    replayed = build_plan(mixer, run, lambda spec, ctx: again.append(spec.key))
    assert replayed.model_dump(exclude={"inputs", "seconds"}) == plan.model_dump(
        exclude={"inputs", "seconds"}
    )
    assert again == [s.key for s in plan.slices]
    parquet_counting._SCANS.clear()
    assert build_plan(mixer, run).model_dump(exclude={"inputs", "seconds"}) == plan.model_dump(
        exclude={"inputs", "seconds"}
    )


def test_a_file_that_changes_while_its_row_groups_are_hashed_is_one_clear_error(tmp_path):
    from sftmix.planning.plan import build_plan

    path = tmp_path / "chats.parquet"
    rows = _rows(600)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=100)
    parquet_counting._SCANS.clear()

    def change(spec, ctx) -> None:
        if spec.index == 0:  # rewritten as the first slice is handed on
            rows[0]["id"] = "changed"
            pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=100)

    run = RunOptions(work_dir=str(tmp_path / "w"), slice_rows=50)
    with pytest.raises(DatasetError, match=r"chats.parquet.*changed"):
        build_plan(_mixer(path, tmp_path / "out"), run, change)


@pytest.mark.slow
def test_slices_begun_while_row_groups_are_hashed_are_the_flows(prefect_api, tmp_path):
    from sftmix.output.digest import compare
    from tokenize_mixer.flows.tokenize_mixer import tokenize_mixer
    from tokenize_mixer.flows.workers import head_start

    path = tmp_path / "chats.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(3000)), path, row_group_size=250)
    parquet_counting._SCANS.clear()
    mixer = _mixer(path, tmp_path / "out")
    run = RunOptions(work_dir=str(tmp_path / "work"), slice_rows=250, runner="process", workers=2)
    with head_start.head_start_scope():
        plan = head_start.plan_ahead(mixer, run, head_start.early_start(run))
        assert plan is not None and head_start._pending is not None  # begun by the plan itself
        head_start.begin_head_start(mixer, run, plan)
        report = tokenize_mixer(mixer=mixer, run=run)
        assert head_start._pending is None  # the flow took it
    assert report["slices_computed"] == report["slices_total"] == len(plan.slices) == 12
    assert len(list((tmp_path / "work").glob("slices/*/*/manifest.json"))) == 12  # each tokenized once
    tokenize_mixer(
        mixer=_mixer(path, tmp_path / "plain"), run=RunOptions(work_dir=str(tmp_path / "w2"), runner="thread")
    )
    assert compare(tmp_path / "out", tmp_path / "plain").matches
