"""Input layouts (messages, messages_key, Alpaca, ShareGPT), sliced splits and a hub-layout directory,
read through the real ``datasets`` loaders: the same chat gives the same tokens whatever its layout."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sftmix.config.config import DatasetEntry, MixerConfig, OutputSpec, TokenizerSpec
from sftmix.config.run_options import RunOptions
from sftmix.errors import BadRowError, DatasetError
from sftmix.planning.plan import build_plan
from sftmix.tokenizing.slices import load_slice_arrays, tokenize_slice

TINY = Path(__file__).parent / "golden" / "tokenizers" / "tiny"

CHATS = [
    ("Name a colour.", "", "Blue.", None),
    ("Add the numbers.", "2 and 3", "5", "You are terse."),
    ("Translate to French.", "cat", "chat", None),
    ("Say hi.", "", "Hi!", "Be kind."),
]


def as_messages(instruction: str, extra: str, output: str, system: str | None) -> list[dict]:
    user = f"{instruction}\n\n{extra}" if extra else instruction
    msgs = [{"role": "system", "content": system}] if system else []
    return [*msgs, {"role": "user", "content": user}, {"role": "assistant", "content": output}]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def tokenize(tmp_path: Path, entry: DatasetEntry) -> tuple[np.ndarray, np.ndarray, int]:
    mixer = MixerConfig(
        datasets=[entry],
        tokenizer=TokenizerSpec(name_or_path=str(TINY), chat_template="tulu"),
        max_seq_length=128,
        output=OutputSpec(path=str(tmp_path / "out")),
    )
    plan = build_plan(mixer, RunOptions(work_dir=str(tmp_path / "work")))
    manifests = [tokenize_slice(s, plan.context) for s in plan.slices]
    arrays = [load_slice_arrays(plan.context.output.work_dir, m) for m in manifests]
    tokens = np.concatenate([np.asarray(a[0]) for a in arrays])
    mask = np.concatenate([np.asarray(a[1]) for a in arrays])
    return tokens, mask, sum(m.rows for m in manifests)


@pytest.fixture
def expected(tmp_path):
    rows = [{"messages": as_messages(*c)} for c in CHATS]
    return tokenize(tmp_path / "m", DatasetEntry(path=write_jsonl(tmp_path / "messages.jsonl", rows)))


def same(a, b) -> bool:
    return a[2] == b[2] and np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_alpaca_rows_give_the_tokens_of_the_same_messages(tmp_path, expected):
    rows = [
        {"instruction": i, "input": x, "output": o, **({"system": s} if s else {"system": None})}
        for i, x, o, s in CHATS
    ]
    path = write_jsonl(tmp_path / "alpaca.jsonl", rows)
    assert same(tokenize(tmp_path / "a", DatasetEntry(path=path)), expected)  # detected
    assert same(tokenize(tmp_path / "b", DatasetEntry(path=path, format="alpaca")), expected)


def test_sharegpt_rows_give_the_tokens_of_the_same_messages(tmp_path, expected):
    speakers = {"system": "system", "user": "human", "assistant": "gpt"}
    rows = [
        {"conversations": [{"from": speakers[m["role"]], "value": m["content"]} for m in as_messages(*c)]}
        for c in CHATS
    ]
    path = write_jsonl(tmp_path / "sharegpt.jsonl", rows)
    assert same(tokenize(tmp_path / "s", DatasetEntry(path=path)), expected)

    rows[2]["conversations"][0]["from"] = "narrator"
    bad = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(
        BadRowError,
        match=r"bad\.jsonl', row 2 \(0-based; line 3 of the file\): turn 0 has an unknown speaker 'narrator'",
    ):
        tokenize(tmp_path / "bad", DatasetEntry(path=bad))


def test_messages_under_another_column_name(tmp_path, expected):
    rows = [{"chat": as_messages(*c), "id": n} for n, c in enumerate(CHATS)]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    assert same(tokenize(tmp_path / "k", DatasetEntry(path=path, messages_key="chat")), expected)
    with pytest.raises(DatasetError, match=r"no 'messages' column \(columns: chat, id\).*messages_key"):
        tokenize(tmp_path / "k2", DatasetEntry(path=path))
    with pytest.raises(DatasetError, match="format alpaca needs 'instruction' and 'output'"):
        tokenize(tmp_path / "k3", DatasetEntry(path=path, format="alpaca"))


def test_sliced_splits_as_datasets_writes_them(tmp_path):
    rows = [{"messages": as_messages(f"question {n}", "", f"answer {n}", None)} for n in range(20)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    assert tokenize(tmp_path / "a", DatasetEntry(path=path, split="train[:5]"))[2] == 5
    assert tokenize(tmp_path / "b", DatasetEntry(path=path, split="train[25%:75%]"))[2] == 10
    whole = tokenize(tmp_path / "c", DatasetEntry(path=path))
    tail = tokenize(tmp_path / "d", DatasetEntry(path=path, split="train[10:]"))
    head = tokenize(tmp_path / "e", DatasetEntry(path=path, split="train[:10]"))
    assert np.array_equal(np.concatenate([head[0], tail[0]]), whole[0])
    with pytest.raises(DatasetError, match="only the 'train' split"):
        tokenize(tmp_path / "f", DatasetEntry(path=path, split="test[:5]"))


def test_a_directory_laid_out_as_on_the_hub(tmp_path, expected):
    """A hub dataset goes through ``datasets.load_dataset(name, split=..., revision=...)``; here the
    same call on a local directory with the hub's layout (no network)."""
    repo = tmp_path / "org--sft-mixture"
    (repo / "data").mkdir(parents=True)
    table = pa.Table.from_pylist([{"messages": as_messages(*c)} for c in CHATS])
    pq.write_table(table.slice(0, 2), repo / "data" / "train-00000-of-00002.parquet")
    pq.write_table(table.slice(2), repo / "data" / "train-00001-of-00002.parquet")
    (repo / "README.md").write_text("---\nlicense: odc-by\n---\n# a mixture\n")
    got = tokenize(tmp_path / "h", DatasetEntry(path=str(repo), split="train"))
    assert same(got, expected)
    with pytest.raises(DatasetError, match="cannot load split 'validation'"):
        tokenize(tmp_path / "h2", DatasetEntry(path=str(repo), split="validation"))


#: Every golden data file: real chats in JSON Lines and parquet.
GOLDEN_DATA = sorted(
    str(p)
    for p in (Path(__file__).parent / "golden" / "data").iterdir()
    if p.suffix in {".jsonl", ".parquet"}
)


@pytest.mark.parametrize(
    "path",
    GOLDEN_DATA
    + sorted(str(p) for p in (Path(__file__).parent.parent / "examples" / "data").glob("*.jsonl")),
)
def test_workers_read_the_rows_datasets_would_give(tmp_path, path):
    """Workers read rows straight from the memory-mapped Arrow cache (no ``datasets`` import): the same
    Python objects as ``datasets`` gives, in any order asked."""
    from sftmix.sources.whole.arrow import arrow_cache_files, open_dataset, read_rows

    cache = str(tmp_path / "cache")
    files = arrow_cache_files(path, "train", None, cache)
    assert files, "plain JSON/parquet data should take the fast path"
    n = len(open_dataset(path, "train", None, cache))
    every = list(range(n))
    picked = every[::3][::-1]
    assert read_rows(path, "train", None, cache, every, files) == read_rows(path, "train", None, cache, every)
    assert read_rows(path, "train", None, cache, picked, files) == read_rows(
        path, "train", None, cache, picked
    )


def test_a_field_whose_type_changes_between_rows_is_a_clear_error(tmp_path):
    """JSON is loaded as the reference's datasets 4 loads it (datasets 5 would wrap such a field in a
    JSON-typed column and render different bytes): a type change between rows is an error naming it."""
    from sftmix.errors import DatasetError
    from sftmix.sources.whole.arrow import arrow_cache_files

    path = write_jsonl(
        tmp_path / "mixed.jsonl", [{"messages": [{"role": "user", "content": "x"}]}, {"messages": {"a": 1}}]
    )
    with pytest.raises(DatasetError, match=r"mixed.jsonl.*Column\(/messages\) changed from array to object"):
        arrow_cache_files(path, "train", None, str(tmp_path / "cache"))


@pytest.mark.parametrize("path", GOLDEN_DATA)
def test_planning_hashes_the_rows_datasets_gives_through_a_map_it_closes(tmp_path, path, monkeypatch):
    """Slice fingerprints read through the split's own Arrow files (a map closed every few hundred MiB,
    so planning a large file keeps resident memory flat) hash exactly the bytes the ``datasets`` path
    hashes: every checkpoint key stays what it was."""
    from sftmix.sources.whole import arrow as sources
    from sftmix.sources.whole.arrow import RowsFingerprinter, arrow_cache_files, open_dataset

    cache = str(tmp_path / "cache")
    files = arrow_cache_files(path, "train", None, cache)
    n = len(open_dataset(path, "train", None, cache))
    windows = [(0, n, None), (1, max(2, n // 2), None), (0, n, list(range(0, n, 3))[::-1])]
    via_datasets = RowsFingerprinter(path, "train", None, cache, None)
    monkeypatch.setattr(sources, "HASH_REMAP_BYTES", 1)  # remap after every window
    via_files = RowsFingerprinter(path, "train", None, cache, files)
    for window in windows:
        assert via_files(*window) == via_datasets(*window)
    assert via_files._files is not None, "the files' schema should match the dataset's"
    assert via_files._table is None, "the map should be closed once the window's bytes are read"
