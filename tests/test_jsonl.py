"""JSON Lines read by batch (sftmix.sources.jsonl) give exactly the rows datasets' JSON builder gives, on files of
several batches with the builder's quirks; what the builder refuses is refused; a file that changes
after the plan is one clear error (issue 31, items 1 and 5)."""

from __future__ import annotations

import codecs
import gzip
import json
import os
import random
import sys
from pathlib import Path

import datasets
import pytest
from datasets.packaged_modules.json.json import JsonConfig

from sftmix.errors import BadRowError, DatasetError
from sftmix.sources import jsonl
from sftmix.sources.data_files import reference_json_options
from sftmix.sources.jsonl import JsonlSource
from sftmix.sources.jsonl import batches as jsonl_batches
from sftmix.sources.jsonl import rows as jsonl_rows
from sftmix.sources.jsonl import scanning as jsonl_scanning


def _reference_rows(path: Path, cache: Path) -> list[dict]:
    datasets.disable_progress_bars()
    ds = datasets.load_dataset(
        "json", data_files=str(path), split="train", cache_dir=str(cache), **reference_json_options()
    )
    return ds.with_format("arrow")[:].to_pylist()


def _our_rows(path: Path) -> tuple[jsonl.JsonlLayout, list[dict]]:
    layout = jsonl.scan(str(path))
    assert layout is not None
    rows: list[dict] = []
    for batch in layout.batches:  # as slices read them: each its own batch
        rows += jsonl.read_rows(
            layout.source([batch]), list(range(batch.first_row, batch.first_row + batch.rows))
        )
    return layout, rows


def _chat(rng: random.Random, i: int) -> dict:
    words = ["hello", "naïve café", "日本語", "emoji 🎉", 'quote " and \\ slash', "tab\there", "2023-01-01"]
    messages = [
        {"role": "user", "content": f"{i} " + " ".join(rng.choice(words) for _ in range(rng.randint(1, 60)))},
        {"role": "assistant", "content": " ".join(rng.choice(words) for _ in range(rng.randint(1, 200)))},
    ]
    return {"id": i, "messages": messages}


def _write(path: Path, rows: list[dict | str], bom: bool = False) -> None:
    with open(path, "wb") as fh:
        if bom:
            fh.write(codecs.BOM_UTF8)
        for row in rows:
            fh.write(
                row.encode() if isinstance(row, str) else json.dumps(row, ensure_ascii=False).encode() + b"\n"
            )


def _many(rng: random.Random, nbytes: int, extra=None) -> list[dict | str]:
    rows: list[dict | str] = []
    size, i = 0, 0
    while size < nbytes:
        row = _chat(rng, i)
        if extra is not None:
            extra(rng, i, row, size)
        rows.append(row)
        size += len(json.dumps(row, ensure_ascii=False).encode()) + 1
        i += 1
    return rows


def test_the_batch_size_is_the_builders():
    assert JsonConfig.chunksize == jsonl_batches.BATCH_BYTES


@pytest.mark.slow
def test_rows_are_datasets_rows_on_a_file_of_several_batches(tmp_path):
    rng = random.Random(3)

    def extra(rng: random.Random, i: int, row: dict, size: int) -> None:
        if i < 200:  # keys only in the first batch: later batches are cast, those keys null
            row["messages"][0]["name"] = "bob"
            row["meta"] = {"source": "a", "score": 1.5}
        if rng.random() < 0.3:
            row["date"] = rng.choice(["2023-01-01", "yesterday", None])  # a timestamp-like string

    rows = _many(rng, 2 * jsonl_batches.BATCH_BYTES + (3 << 20), extra)
    for k in range(50, len(rows), 997):  # blank and whitespace lines, Windows line ends
        rows.insert(k, rng.choice(["\n", "  \n", "\r\n", " \t\r\n"]))
    rows.append('{"id": -1, "messages": [{"role": "user", "content": "no newline at the end"}]}')
    path = tmp_path / "chats.jsonl"
    _write(path, rows, bom=True)
    layout, ours = _our_rows(path)
    assert len(layout.batches) == 3
    assert ours == _reference_rows(path, tmp_path / "cache")
    assert layout.n_rows == len(ours) and layout.columns[:2] == ("id", "messages")


@pytest.mark.slow
def test_a_batch_that_ends_on_a_newline_takes_the_next_line_as_the_builder_does(tmp_path):
    rng = random.Random(5)
    rows = _many(rng, jsonl_batches.BATCH_BYTES - 4000)
    size = sum(len(json.dumps(r, ensure_ascii=False).encode()) + 1 for r in rows)  # type: ignore[arg-type]
    pad = jsonl_batches.BATCH_BYTES - size - len('{"id": 0, "pad": ""}\n')
    rows.append({"id": 0, "pad": "x" * pad})  # the batch's 10 MiB end exactly after this line's newline
    rows += _many(rng, 1 << 20)
    path = tmp_path / "edge.jsonl"
    _write(path, rows)
    assert jsonl.batch_bounds(str(path))[0][1] > jsonl_batches.BATCH_BYTES  # the following line joined it
    assert _our_rows(path)[1] == _reference_rows(path, tmp_path / "cache")


@pytest.mark.slow
def test_a_key_the_first_batch_never_saw_is_refused_as_the_reference_refuses_it(tmp_path):
    rng = random.Random(7)

    def extra(rng: random.Random, i: int, row: dict, size: int) -> None:
        if size > jsonl_batches.BATCH_BYTES + (1 << 20):
            row["messages"][1]["function_calls"] = "f()"  # tool keys only at the end

    rows = _many(rng, jsonl_batches.BATCH_BYTES + (2 << 20), extra)
    path = tmp_path / "tools.jsonl"
    _write(path, rows)
    with pytest.raises(datasets.exceptions.DatasetGenerationError):
        _reference_rows(path, tmp_path / "cache")
    layout = jsonl.scan(str(path))
    assert layout is not None
    last = layout.batches[-1]
    first_with_it = next(i for i, r in enumerate(rows) if "function_calls" in r["messages"][1])  # type: ignore[index]
    assert first_with_it >= last.first_row
    got = jsonl.read_rows(layout.source([last]), [first_with_it])[0]
    assert isinstance(got, jsonl.BadLine), got  # the slice refuses it (or skips it), naming its line
    assert got.line == first_with_it + 1
    assert (
        "key 'messages[].function_calls' is in none of the rows of the first 10 MiB the loader reads"
        in got.reason
    )


def test_rows_with_keys_the_features_lack_are_found_in_one_pass(monkeypatch):
    """A batch in which many rows have a key the features lack (a card that no longer declares every
    column, a key added after the first batch) is read in a few parses, not one search per such row
    (which took minutes for a batch): each such row is a bad line naming its key, the rest are rows."""
    rng = random.Random(31)
    rows = [_chat(rng, i) for i in range(400)]
    target = jsonl.parse_batch(b"".join(json.dumps(r).encode() + b"\n" for r in rows[:5])).schema
    marked: dict[int, str] = {}
    for i, row in enumerate(rows):
        if rng.random() < 0.6:
            if rng.random() < 0.5:
                row["source"] = rng.choice(["a", None, 3])
                marked[i] = "source"
            else:
                row["messages"][0]["name"] = "n"
                marked[i] = "messages[].name"
    data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    parses = []
    table_of = jsonl_rows._table
    monkeypatch.setattr(jsonl_rows, "_table", lambda d, t: parses.append(1) or table_of(d, t))
    table, bad = jsonl.read_batch(data, 0, target, declared=True)
    assert len(parses) <= 3, len(parses)
    assert sorted(bad) == sorted(marked) and table.num_rows == len(rows)
    assert all(f"key {marked[r]!r} is not among the features" in bad[r].reason for r in bad)
    assert bad[min(bad)].line == min(bad) + 1
    kept = table.to_pylist()
    assert all(kept[i] == rows[i] for i in range(len(rows)) if i not in marked)


def test_a_file_that_changes_after_the_plan_is_one_clear_error(tmp_path):
    path = tmp_path / "small.jsonl"
    rows = [_chat(random.Random(i), i) for i in range(50)]
    _write(path, rows)
    layout = jsonl.scan(str(path))
    assert layout is not None and layout.n_rows == 50
    rows[10]["messages"][0]["content"] = "edited"
    _write(path, rows)
    jsonl.release()
    with pytest.raises(DatasetError, match="changed since the run was planned"):
        jsonl.read_rows(layout.source(list(layout.batches)), [0, 1])
    path.write_bytes(b"")  # truncated: shorter than the plan read
    with pytest.raises(DatasetError, match="changed since the run was planned"):
        jsonl.read_rows(layout.source(list(layout.batches)), [0])


def test_what_is_not_plain_json_lines_goes_through_datasets(tmp_path):
    array = tmp_path / "array.json"
    array.write_text('[{"messages": []}]')
    lines = tmp_path / "lines.jsonl"
    lines.write_text('{"messages": []}\n')
    assert jsonl.applies(str(lines), "train")
    assert not jsonl.applies(str(array), "train")  # a JSON array: the builder reads it whole
    assert not jsonl.applies(str(lines), "train[:10]")  # a sliced split
    gz = tmp_path / "lines.jsonl.gz"
    gz.write_bytes(b"\x1f\x8b")
    assert not jsonl.applies(str(gz), "train")
    pretty = tmp_path / "pretty.json"
    pretty.write_text('{\n "messages": []\n}\n')  # one object over many lines: pyarrow cannot read it
    assert jsonl.scan(str(pretty)) is None


def test_invalid_utf8_names_its_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"a": "ok"}\n{"a": "ok"}\n{"a": "\xff"}\n')
    layout = jsonl.scan(str(path))
    assert layout is not None and layout.n_rows == 3
    (bad,) = layout.bad_lines
    assert (bad.line, bad.reason) == (3, "not valid UTF-8 (byte 31 of the file)")


@pytest.mark.slow
def test_the_plan_cuts_a_large_file_by_batch_and_an_edit_changes_only_its_batchs_keys(tmp_path):
    from sftmix.config.config import DatasetEntry, MixerConfig, OutputSpec, TokenizerSpec
    from sftmix.config.run_options import RunOptions
    from sftmix.planning.plan import build_plan

    rows = _many(random.Random(11), 2 * jsonl_batches.BATCH_BYTES + (1 << 20))
    path = tmp_path / "chats.jsonl"
    _write(path, rows)

    def plan(amount: float):
        mixer = MixerConfig(
            datasets=[DatasetEntry(path=str(path), amount=amount)],
            tokenizer=TokenizerSpec(name_or_path="examples/tokenizer", chat_template="olmo"),
            output=OutputSpec(path=str(tmp_path / "out")),
        )
        # (slices of 8 MiB: a batch each; a smaller mixture's batches are cut finer, test_small_refusals.py)
        return build_plan(mixer, RunOptions(work_dir=str(tmp_path / "work"), slice_bytes=8 << 20))

    whole, half = plan(1.0), plan(0.5)
    assert whole.datasets[0].fingerprint.startswith(jsonl.FINGERPRINT_PREFIX)
    assert [len(s.source.batches) for s in whole.slices] == [1, 1, 1]  # type: ignore[union-attr]
    assert sum(s.row_end - s.row_start for s in whole.slices) == len(rows)
    assert sum(len(s.rows or []) for s in half.slices) == len(rows) // 2 and len(half.slices) == 3
    rows[-5]["messages"][0]["content"] = "edited"  # type: ignore[index]
    _write(path, rows)
    edited = plan(1.0)
    assert [a.key == b.key for a, b in zip(whole.slices, edited.slices, strict=True)] == [True, True, False]


def _compressed(path: Path, suffix: str) -> Path:
    import bz2
    import gzip
    import lzma

    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}[suffix]
    packed = path.with_name(path.name + suffix)
    with opener(packed, "wb") as fh:
        fh.write(path.read_bytes())
    return packed


@pytest.mark.parametrize("suffix", [".gz", ".gz without isal", ".bz2", ".xz"])
def test_a_compressed_file_is_read_by_batch_from_its_decompressed_copy(tmp_path, suffix, monkeypatch):
    """The reference's loader decompresses and converts a compressed file on one core before any row is
    read; the plan decompresses it once to a copy (per version of the file) and reads that by batch:
    the rows are datasets' rows of the compressed file."""
    from sftmix.sources.copies import decompressed_copy

    if suffix.endswith("without isal"):  # a platform without its wheel: the gzip module, the same bytes
        monkeypatch.setitem(sys.modules, "isal", None)
        suffix = ".gz"
    rows = _many(random.Random(7), 300_000)
    rows.insert(40, "\n")
    plain = tmp_path / "chats.jsonl"
    _write(plain, rows, bom=True)
    packed = _compressed(plain, suffix)
    assert jsonl.reads_decompressed(str(packed), "train") and not jsonl.applies(str(packed), "train")
    assert not jsonl.reads_decompressed(str(packed), "train[:5]") and not jsonl.reads_decompressed(
        str(plain), "train"
    )
    cache = tmp_path / "cache"
    copy = decompressed_copy(str(packed), str(cache))
    assert Path(copy).read_bytes() == plain.read_bytes() and Path(copy).name == "chats.jsonl"
    assert jsonl.applies(copy, "train")
    assert _our_rows(Path(copy))[1] == _reference_rows(packed, tmp_path / "datasets-cache")
    made = Path(copy).stat().st_mtime_ns
    assert (
        decompressed_copy(str(packed), str(cache)) == copy and Path(copy).stat().st_mtime_ns == made
    )  # once
    assert not [p for p in cache.rglob("*") if p.is_file() and p != Path(copy)]  # nothing else left
    rows[0] = {"id": 0, "messages": [{"role": "user", "content": "edited"}]}
    _write(plain, rows)
    packed = _compressed(plain, suffix)  # another version: another copy
    assert Path(decompressed_copy(str(packed), str(cache))).read_bytes() == plain.read_bytes()


def test_a_damaged_compressed_file_is_one_clear_error(tmp_path):
    from sftmix.sources.copies import decompressed_copy

    plain = tmp_path / "chats.jsonl"
    _write(plain, _many(random.Random(8), 100_000))
    packed = _compressed(plain, ".gz")
    packed.write_bytes(packed.read_bytes()[: packed.stat().st_size // 2])  # cut short
    with pytest.raises(DatasetError, match=r"chats.jsonl.gz.*cannot decompress the file"):
        decompressed_copy(str(packed), str(tmp_path / "cache"))
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]  # no copy, no temp file


@pytest.mark.parametrize("fault", ["damaged", "changed"])
def test_a_failed_copy_says_why_before_it_is_removed(tmp_path, monkeypatch, fault):
    """A copy that fails (a damaged file, one that changes while it is decompressed) tells its readers why
    before its temp file is removed: a reader that then finds the copy gone, or cut short, is given that
    reason, not "gone"; readers waiting for its bytes wake once it is removed (no error reaches anyone
    while the temp file is still there)."""
    from sftmix.sources import copies as sources
    from sftmix.sources.growing import GrowingFile

    plain = tmp_path / "chats.jsonl"
    _write(plain, _many(random.Random(9), 100_000))
    packed = _compressed(plain, ".gz")
    if fault == "damaged":
        packed.write_bytes(packed.read_bytes()[: packed.stat().st_size // 2])
    told: list[tuple[bool, str]] = []

    class Watched(GrowingFile):
        def grew(self, nbytes: int) -> None:
            if fault == "changed" and not told:  # appended to (a gzip member) as its copy is written
                told.append((True, "appended"))
                with open(packed, "ab") as fh:
                    fh.write(gzip.compress(b'{"messages": []}\n'))
            super().grew(nbytes)

        def failing(self, error: BaseException) -> None:
            told.append((os.path.exists(self.temp), str(error)))
            super().failing(error)

        def ended(self, error=None) -> None:
            told.append((os.path.exists(self.temp), f"ended: {error}"))
            super().ended(error)

    monkeypatch.setattr(sources, "GrowingFile", Watched)
    reason = "cannot decompress the file" if fault == "damaged" else "changed while it was decompressed"
    with pytest.raises(DatasetError, match=reason):
        sources.decompressed_copy(str(packed), str(tmp_path / "cache"))
    ends = [t for t in told if t[1] != "appended"]
    assert ends[0][0] and reason in ends[0][1], told  # (the temp file still there when first told)
    assert not ends[-1][0] and ends[-1][1].startswith("ended: "), told  # (its waiters woken once it is gone)
    file = GrowingFile(str(tmp_path / "gone.tmp"), str(tmp_path / "gone.jsonl"))
    file.failing(DatasetError(str(packed), reason))
    file.ended()  # (removed: the reason told first stands)
    with pytest.raises(DatasetError, match=reason):  # (the reader's side: gone, and why)
        jsonl.first_batch(file)


def test_a_copy_left_half_made_by_a_killed_run_is_removed(tmp_path):
    """A run killed while it decompressed (SIGKILL: no cleanup) leaves its temp file; the next run that
    decompresses the same version removes it (ours, by its marker, and its writer is gone)."""
    import subprocess

    from sftmix.runtime.storage import TMP_MARK
    from sftmix.sources.copies import decompressed_copy

    plain = tmp_path / "chats.jsonl"
    _write(plain, _many(random.Random(10), 100_000))
    packed = _compressed(plain, ".gz")
    cache = tmp_path / "cache"
    code = (
        "import os, signal, sys\n"
        "import sftmix.sources.copies as s\n"
        "def killed(self, nbytes):\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "s.ReadProgress.read = killed  # (after the first block is written)\n"
        "s.decompressed_copy(sys.argv[1], sys.argv[2])\n"
    )
    subprocess.run([sys.executable, "-c", code, str(packed), str(cache)], check=False)
    left = [p for p in cache.rglob("*") if p.is_file()]
    assert len(left) == 1 and TMP_MARK in left[0].name, left
    copy = Path(decompressed_copy(str(packed), str(cache)))
    assert [p for p in cache.rglob("*") if p.is_file()] == [copy]
    assert copy.read_bytes() == plain.read_bytes()


def test_the_plan_of_a_compressed_file_is_the_plan_of_its_content(tmp_path):
    """Slices read the copy by batch, keyed by what they read: the same keys as the plain file's, so
    finished slices are reused whichever of the two a mixer names."""
    from sftmix.config.config import DatasetEntry, MixerConfig, OutputSpec, TokenizerSpec
    from sftmix.config.run_options import RunOptions
    from sftmix.planning.plan import build_plan

    plain = tmp_path / "chats.jsonl"
    _write(plain, _many(random.Random(9), 200_000))
    packed = _compressed(plain, ".gz")

    def plan(path: Path):
        mixer = MixerConfig(
            datasets=[DatasetEntry(path=str(path), amount=1.0)],
            tokenizer=TokenizerSpec(name_or_path="examples/tokenizer", chat_template="olmo"),
            output=OutputSpec(path=str(tmp_path / "out")),
        )
        return build_plan(mixer, RunOptions(work_dir=str(tmp_path / "work"), slice_bytes=50_000))

    ours, theirs = plan(packed), plan(plain)
    assert len(ours.slices) > 1 and all(isinstance(s.source, JsonlSource) for s in ours.slices)
    assert [s.key for s in ours.slices] == [s.key for s in theirs.slices]
    assert ours.datasets[0].fingerprint == theirs.datasets[0].fingerprint
    assert ours.slices[0].dataset == str(packed)


@pytest.mark.slow
def test_shards_of_a_compressed_file_are_those_of_datasets(prefect_api, tmp_path, monkeypatch):

    examples = Path(__file__).parent.parent / "examples"
    plain = tmp_path / "arithmetic.jsonl"
    plain.write_bytes((examples / "data" / "arithmetic.jsonl").read_bytes())
    _shards_match_datasets(_compressed(plain, ".gz"), 2.0, 256, 4096, tmp_path, monkeypatch)


def _shards_match_datasets(
    data: Path, amount: float, max_seq_length: int, slice_bytes: int, tmp_path: Path, monkeypatch
) -> None:
    """The flow's shards of ``data`` read by batch, in several slices, are those of ``datasets``' load."""
    from sftmix.config.config import DatasetEntry, MixerConfig, OutputSpec, TokenizerSpec
    from sftmix.config.run_options import RunOptions
    from tokenize_mixer.flows.tokenize_mixer import tokenize_mixer

    examples = Path(__file__).parent.parent / "examples"

    def convert(name: str) -> dict:
        mixer = MixerConfig(
            datasets=[DatasetEntry(path=str(data), amount=amount)],
            tokenizer=TokenizerSpec(name_or_path=str(examples / "tokenizer"), chat_template="olmo"),
            max_seq_length=max_seq_length,
            output=OutputSpec(path=str(tmp_path / name)),
        )
        run = RunOptions(work_dir=str(tmp_path / f"work-{name}"), slice_bytes=slice_bytes, runner="thread")
        return tokenize_mixer(mixer=mixer, run=run)

    ours = convert("ours")
    assert ours["slices_total"] > 1
    monkeypatch.setenv("TOKENIZE_MIXER_JSON_READER", "datasets")
    assert convert("datasets")["digests"] == ours["digests"]


def test_ranges_fetched_ahead_give_the_batches_the_builder_reads(tmp_path, monkeypatch):
    """A gs:// object's batches are found in ranges fetched ahead (``_fetched_batches``), not by a seek
    and readline per batch: the same bounds and bytes as :func:`jsonl.batch_bounds` on random files,
    with ranges and batches small enough that lines straddle both (run here on local files: the same
    reads)."""
    rng = random.Random(41)
    for trial in range(300):
        lines = [
            b"x" * rng.choice([0, 1, 2, rng.randrange(1, 40), rng.randrange(40, 200)])
            for _ in range(rng.randrange(0, 30))
        ]
        data = b"\n".join(lines) + (b"\n" if rng.random() < 0.5 else b"")
        if not data:
            continue
        path = tmp_path / f"t{trial}.jsonl"
        path.write_bytes(data)
        monkeypatch.setattr(jsonl_batches, "BATCH_BYTES", rng.randrange(1, 120))
        monkeypatch.setattr(jsonl_scanning, "REMOTE_CHUNK", rng.randrange(1, 70))
        monkeypatch.setattr(jsonl_scanning, "REMOTE_READERS", rng.randrange(1, 5))
        bounds = jsonl.batch_bounds(str(path))
        fetched = list(jsonl_scanning._fetched_batches(str(path), len(data)))
        assert [(a, b) for a, b, _ in fetched] == bounds, trial
        assert [d for _, _, d in fetched] == [data[a:b] for a, b in bounds]
        assert jsonl_scanning._first_batch_end(str(path), len(data)) == bounds[0][1]


def test_a_file_read_as_it_is_written_gives_its_batches_then_its_writers_error(tmp_path, monkeypatch):
    """A copy followed while a thread writes it piece by piece and renames it (sftmix.sources.growing) gives the
    bounds of the whole file's batches, each once written; a reader that begins after the rename reads the
    renamed file; one whose writer fails gets the writer's error, after the batches written whole."""
    import threading

    from sftmix.sources.growing import GrowingFile, open_landing

    rng = random.Random(43)
    for trial in range(40):
        data = b"".join(b"x" * rng.randrange(0, 90) + b"\n" for _ in range(rng.randrange(1, 40)))
        monkeypatch.setattr(jsonl_batches, "BATCH_BYTES", rng.randrange(1, 120))
        final, temp = tmp_path / f"t{trial}.jsonl", tmp_path / f"t{trial}.jsonl.tmp"
        temp.write_bytes(b"")
        file, fails = GrowingFile(str(temp), str(final)), trial % 4 == 3

        def write(file=file, temp=temp, final=final, fails=fails, data=data, trial=trial) -> None:
            pieces = random.Random(trial)
            with open(temp, "ab") as fh:
                at = 0
                while at < len(data):
                    piece = data[at : at + pieces.randrange(1, 50)]
                    fh.write(piece)
                    fh.flush()
                    file.grew(len(piece))
                    at += len(piece)
            if fails:
                temp.unlink()
                file.ended(DatasetError("chats.jsonl.gz", "cannot decompress the file: cut short"))
                return
            os.replace(temp, final)
            file.ended()

        followed: list = []

        def follow(file=file, followed=followed) -> None:
            try:
                followed.extend(jsonl_scanning._growing_bounds(file))
            except DatasetError as exc:
                followed.append(exc)

        threads = [threading.Thread(target=follow), threading.Thread(target=write)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if fails:
            assert isinstance(followed[-1], DatasetError) and "cut short" in followed[-1].reason, trial
            with pytest.raises(DatasetError, match="cut short"):
                list(jsonl_scanning._growing_bounds(file))
            with pytest.raises(FileNotFoundError):
                open_landing(str(final), str(temp))
            continue
        bounds = jsonl.batch_bounds(str(final))
        assert followed == bounds, trial  # found as it was written
        assert list(jsonl_scanning._growing_bounds(file)) == bounds  # begun after the rename
        os.close(open_landing(str(final), str(temp)))


def test_a_copy_being_written_is_scanned_once_for_two_readers(tmp_path, monkeypatch):
    """The plan made ahead of the plan and the plan both count a compressed file's copy as it is written:
    it is read once, and both get its batches (the second at once, when the first has them all)."""
    import threading

    from sftmix.sources.growing import GrowingFile

    rows = _many(random.Random(44), 3 * (1 << 16))
    plain = tmp_path / "chats.jsonl"
    _write(plain, rows)
    data = plain.read_bytes()
    monkeypatch.setattr(jsonl_batches, "BATCH_BYTES", 1 << 14)
    temp, final = tmp_path / "copy.tmp", tmp_path / "copy.jsonl"
    temp.write_bytes(b"")
    file = GrowingFile(str(temp), str(final))
    scanned: list[tuple[int, int]] = []
    scan_batch = jsonl_scanning._scan_batch
    monkeypatch.setattr(
        jsonl_scanning,
        "_scan_batch",
        lambda path, a, b, growing="": scanned.append((a, b)) or scan_batch(path, a, b, growing),
    )
    told: list[list] = [[], []]
    layouts: list = [None, None]

    def read(k: int) -> None:
        layouts[k] = jsonl.scan_growing(file, lambda batch, schema: told[k].append(batch.sha256))

    readers = [threading.Thread(target=read, args=(k,)) for k in range(2)]
    for reader in readers:
        reader.start()
    with open(temp, "ab") as fh:
        for at in range(0, len(data), 5000):
            fh.write(data[at : at + 5000])
            fh.flush()
            file.grew(len(data[at : at + 5000]))
    os.replace(temp, final)
    file.ended()
    for reader in readers:
        reader.join()
    expected = jsonl.scan(str(final))
    assert layouts[0] == layouts[1] and layouts[0].fingerprint == expected.fingerprint
    assert told[0] == told[1] == [b.sha256 for b in expected.batches] and len(told[0]) > 3
    assert sorted(scanned) == jsonl.batch_bounds(str(final))  # each batch read once


def _directory(root: Path, rng: random.Random) -> Path:
    """A directory laid out as a hub dataset of JSON Lines files: three train files (the first of
    several batches, the second without the key ``id`` and with a BOM), one test file."""

    def tools(rng: random.Random, i: int, row: dict, size: int) -> None:
        if i % 7 == 0:
            row["tools"] = [{"name": "f", "arguments": {"a": i}}]

    repo = root / "org--chats"
    (repo / "data").mkdir(parents=True)
    first = _many(rng, jsonl_batches.BATCH_BYTES + (3 << 20), tools)
    second = [{k: v for k, v in r.items() if k != "id"} for r in _many(rng, 1 << 20)]  # type: ignore[union-attr]
    _write(repo / "data" / "train-00000-of-00003.jsonl", first)
    _write(repo / "data" / "train-00001-of-00003.jsonl", second, bom=True)  # type: ignore[arg-type]
    _write(repo / "data" / "train-00002-of-00003.jsonl", _many(rng, 2 << 20, tools))
    _write(repo / "data" / "test-00000-of-00001.jsonl", first[:5])
    return repo


def _directory_rows(layout: jsonl.JsonlLayout) -> list:
    rows: list = []
    for batch in layout.batches:  # as slices read them: each its own batch
        rows += jsonl.read_rows(
            layout.source([batch]), list(range(batch.first_row, batch.first_row + batch.rows))
        )
    return rows


def test_a_directory_of_json_lines_files_gives_datasets_rows_by_batch(tmp_path):
    """The files ``datasets`` reads for a hub dataset (or a directory) of JSON Lines files are read by
    batch on all cores, rows numbered across them, each cast to the first file's features (a key a
    file lacks is null), as ``datasets.load_dataset(name)`` builds them, compressed files from their
    decompressed copies; what only ``datasets`` reads is left to it."""
    from sftmix.sources.data_files import json_data_files

    repo = _directory(tmp_path, random.Random(11))
    cache = tmp_path / "cache"
    files = json_data_files(str(repo), "train", None, str(cache))
    assert files is not None and [Path(f).name for f in files.paths] == [
        f"train-0000{k}-of-00003.jsonl" for k in range(3)
    ]
    told: list = []  # each batch as soon as it and those before it are counted, in the dataset's order
    layout = jsonl.scan_files(
        files.paths, str(repo), lambda batch, schema: told.append((batch, schema)), threads=4
    )
    assert layout is not None and len(layout.batches) == 4 and layout.columns == ("id", "messages", "tools")
    assert [batch for batch, _ in told] == list(layout.batches) and {s for _, s in told} == {
        layout.schema_b64
    }
    datasets.disable_progress_bars()
    reference = datasets.load_dataset(
        str(repo), split="train", cache_dir=str(tmp_path / "reference"), **reference_json_options()
    )
    assert _directory_rows(layout) == reference.with_format("arrow")[:].to_pylist()
    assert json_data_files(str(repo), "test", None, str(cache)) is None  # its features come from train's
    assert json_data_files(str(repo), "train[:10]", None, str(cache)) is None  # a sliced split
    for path in (repo / "data").iterdir():  # compressed: each decompressed to a copy, then the same
        _compressed(path, ".gz")
        path.unlink()
    files = json_data_files(str(repo), "train", None, str(cache))
    assert files is not None and all(f.endswith(".jsonl.gz") for f in files.paths)
    copies = [files.local(k) for k in range(len(files.paths))]
    assert all(Path(f).is_relative_to(cache) and f.endswith(".jsonl") for f in copies)
    layout = jsonl.scan_files(files.paths, str(repo), local=files.local)
    assert layout is not None and {b.path for b in layout.batches} <= set(copies)
    reference = datasets.load_dataset(
        str(repo), split="train", cache_dir=str(tmp_path / "reference-gz"), **reference_json_options()
    )
    assert _directory_rows(layout) == reference.with_format("arrow")[:].to_pylist()


def test_a_directorys_compressed_files_are_sized_by_the_first_and_copied_once(tmp_path, caplog):
    """A dataset's compressed files are sized by the first one's copy (its slices need not wait for
    every copy); two readers of them at once (a plan made ahead of the plan, and the plan) make each copy
    once, and each one's line counts every file's bytes, whichever made its copy."""
    import logging
    import os

    from sftmix.sources.copies import DecompressedCopies
    from sftmix.sources.data_files import JsonFiles

    repo = _directory(tmp_path, random.Random(12))
    for path in sorted((repo / "data").glob("train-*")):
        _compressed(path, ".gz")
        path.unlink()
    packed = [str(p) for p in sorted((repo / "data").glob("train-*.gz"))]
    cache = str(tmp_path / "cache")
    caplog.set_level(logging.INFO, logger="sftmix.sources.copies")
    both = [DecompressedCopies("chats", packed, cache, None) for _ in range(2)]
    copies = [[c.wait(k) for k in range(len(packed))] for c in both]
    assert copies[0] == copies[1]
    assert [c._progress.done for c in both] == [sum(os.path.getsize(p) for p in packed)] * 2
    assert sorted(r.getMessage().split(" (")[0] for r in caplog.records if "decompressing" in r.message) == [
        f"decompressing {p}" for p in packed
    ]
    files = JsonFiles(packed, None, both[0])
    ratio = os.path.getsize(copies[0][0]) / os.path.getsize(packed[0])
    assert files.sizes == [round(os.path.getsize(p) * ratio) for p in packed]
    assert files.sizes[0] == os.path.getsize(copies[0][0])


def test_closed_copies_stop_at_once(tmp_path):
    """Copies closed while their files still download (a refusal, a stop): every wait for one ends with
    the reason, none is left waiting, and nothing is decompressed. Until then, a second reader of the
    files (the plan, after the plan made ahead of it) is handed the same copies: one line says how far."""
    import threading
    import time

    from sftmix.sources.copies import copies_of
    from sftmix.sources.downloads import Downloads

    plain = tmp_path / "chats.jsonl"
    _write(plain, _many(random.Random(13), 20_000))
    packed = [str(_compressed(plain, ".gz").rename(tmp_path / f"part-{k}.jsonl.gz")) for k in range(5)]
    release = threading.Event()

    def download(url: str) -> str:
        release.wait(30)
        return url

    downloads = Downloads("chats", packed, download)
    copies = copies_of("chats", packed, str(tmp_path / "cache"), downloads)
    assert copies_of("chats", packed, str(tmp_path / "cache"), downloads) is copies
    closing = threading.Thread(target=lambda: (copies.close(), downloads.close()))
    closing.start()
    closing.join(10)
    assert not closing.is_alive(), "closing the copies hangs"
    for k in range(len(packed)):
        with pytest.raises(DatasetError, match="stopped"):
            copies.wait(k)
    release.set()
    assert not (tmp_path / "cache").exists()
    again = copies_of("chats", packed, str(tmp_path / "cache"), None)  # (a later plan: made anew)
    assert again is not copies and [Path(again.wait(k)).name for k in range(len(packed))] == [
        Path(p).name.removesuffix(".gz") for p in packed
    ]
    waited = 0.0  # (all made: not kept; forgotten just after the last copy's wait returns)
    while copies_of("chats", packed, str(tmp_path / "cache"), None) is again and waited < 10:
        time.sleep(0.05)
        waited += 0.05
    assert waited < 10, "copies all made are still handed on"


def test_a_file_of_a_directory_with_a_key_the_first_never_saw_names_that_file_and_line(tmp_path):
    rng = random.Random(12)
    repo = tmp_path / "chats"
    repo.mkdir()
    later = [_chat(rng, i) for i in range(20)]
    later[13]["messages"][1]["function_calls"] = "f()"
    _write(repo / "a.jsonl", [_chat(rng, i) for i in range(30)])
    _write(repo / "b.jsonl", later[:5] + ["\n"] + later[5:])  # type: ignore[operator] (a blank line: no row)
    from sftmix.sources.data_files import json_data_files

    files = json_data_files(str(repo), "train", None, str(tmp_path / "cache"))
    assert files is not None
    layout = jsonl.scan_files(files.paths, str(repo))
    assert layout is not None and layout.n_rows == 50
    got = _directory_rows(layout)
    assert all(isinstance(r, dict) for r in got[:43] + got[44:])
    bad = got[43]
    assert isinstance(bad, jsonl.BadLine) and bad.file == str(repo / "b.jsonl") and bad.line == 15
    assert str(bad.error(str(repo))).startswith(f"{repo / 'b.jsonl'}:15: ")
    assert jsonl.row_place(layout.source(list(layout.batches)), 43) == (str(repo / "b.jsonl"), 15)
    assert jsonl.row_place(layout.source(list(layout.batches)), 2) == (str(repo / "a.jsonl"), 3)
    named = BadRowError(str(repo), 43, "no messages", 15, str(repo / "b.jsonl"))
    assert f"row 43 (0-based; line 15 of {repo / 'b.jsonl'})" in str(named)
    (repo / "c.jsonl.gz").write_bytes(b"")  # a file only datasets reads: it reads them all
    files = json_data_files(str(repo), "train", None, str(tmp_path / "cache"))
    assert files is None or jsonl.scan_files(files.paths, str(repo)) is None


#: A card declaring features other than the rows' own: ``id`` a string (the rows' are numbers), a
#: ``source`` no row has, a ``name`` in each message no row has, the columns in another order.
_DECLARED_CARD = """---
dataset_info:
  features:
  - name: messages
    list:
    - name: role
      dtype: string
    - name: name
      dtype: string
    - name: content
      dtype: string
  - name: source
    dtype: string
  - name: id
    dtype: string
---
"""


def _declared_directory(root: Path, rng: random.Random, files: int = 2) -> Path:
    """A directory of JSON Lines files (the first of several batches) whose card declares features."""
    repo = root / "org--declared"
    (repo / "data").mkdir(parents=True)
    for k in range(files):
        _write(
            repo / "data" / f"train-0000{k}-of-0000{files}.jsonl",
            _many(rng, (jsonl_batches.BATCH_BYTES + (3 << 20)) >> k),
        )
    (repo / "README.md").write_text(_DECLARED_CARD)
    return repo


def test_features_a_card_declares_are_the_ones_rows_are_cast_to(tmp_path):
    """A dataset whose card declares its features is read by batch too (not converted whole by
    ``datasets`` on one core): every batch, the first included, cast to the declared features, as
    ``datasets.load_dataset(name)`` casts them (a number to a string, a declared key no row has null,
    the declared order); a row with a key the card does not declare is a bad line that says so, where
    ``datasets`` refuses the load."""
    from sftmix.sources.data_files import json_data_files

    repo = _declared_directory(tmp_path, random.Random(21))
    cache = tmp_path / "cache"
    files = json_data_files(str(repo), "train", None, str(cache))
    assert files is not None and files.declared is not None
    told: list = []
    layout = jsonl.scan_files(
        files.paths, str(repo), lambda batch, schema: told.append(schema), declared=files.declared
    )
    assert layout is not None and layout.declared and layout.columns == ("messages", "source", "id")
    assert len(layout.batches) == 3 and set(told) == {layout.schema_b64}
    head = jsonl.first_batch(files.paths[0], files.declared)
    assert head is not None and head[1] == layout.schema_b64 and head[0].sha256 == layout.batches[0].sha256
    datasets.disable_progress_bars()
    reference = datasets.load_dataset(str(repo), split="train", cache_dir=str(tmp_path / "reference"))
    rows = _directory_rows(layout)
    assert rows == reference.with_format("arrow")[:].to_pylist()
    assert rows[0]["id"] == "0" and rows[0]["source"] is None and rows[0]["messages"][0]["name"] is None
    one = jsonl.scan_file(files.paths[1], declared=files.declared)  # a dataset of one file: the same cast
    assert one is not None and one.schema_b64 == layout.schema_b64 and one.declared
    assert jsonl.scan_files(files.paths, str(repo)).schema_b64 != layout.schema_b64  # (its rows' own)

    second = repo / "data" / "train-00001-of-00002.jsonl"
    lines = second.read_text().splitlines(keepends=True)
    row = json.loads(lines[6])
    row["messages"][0]["function_calls"] = "f()"
    lines[6] = json.dumps(row) + "\n"
    second.write_text("".join(lines))
    with pytest.raises(datasets.exceptions.DatasetGenerationError):
        datasets.load_dataset(str(repo), split="train", cache_dir=str(tmp_path / "reference-2"))
    files = json_data_files(str(repo), "train", None, str(cache))
    layout = jsonl.scan_files(files.paths, str(repo), declared=files.declared)
    bad = _directory_rows(layout)[layout.batches[-1].first_row + 6]
    assert isinstance(bad, jsonl.BadLine) and bad.line == 7 and bad.file == str(second)
    assert bad.reason.startswith(
        "key 'messages[].function_calls' is not among the features the dataset's card"
    )


#: A card naming two splits, neither 'train' (as HuggingFaceH4/ultrachat_200k's does).
_SPLITS_CARD = """---
configs:
- config_name: default
  data_files:
  - split: train_sft
    path: data/train_sft-*.jsonl
  - split: test_sft
    path: data/test_sft-*.jsonl
"""


def _split_directory(repo: Path, rng: random.Random, declared: bool) -> Path:
    (repo / "data").mkdir(parents=True)
    _write(repo / "data" / "train_sft-00000-of-00001.jsonl", _many(rng, 1 << 20))
    _write(repo / "data" / "test_sft-00000-of-00001.jsonl", _many(rng, jsonl_batches.BATCH_BYTES + (3 << 20)))
    (repo / "README.md").write_text(
        _SPLITS_CARD + (_DECLARED_CARD.removeprefix("---\n") if declared else "---\n")
    )
    return repo


def test_a_split_other_than_train_is_read_by_batch_where_its_features_are_known(tmp_path):
    """A split the card names, not 'train' and not the first, is read by batch (not converted whole by
    ``datasets``) where the card declares the features: ``datasets`` casts every split to them. Without
    them it casts a later split to what it found in the first, so only the first is read by batch."""
    from sftmix.config.config import DatasetEntry, MixerConfig, OutputSpec, TokenizerSpec
    from sftmix.config.run_options import RunOptions
    from sftmix.planning.plan import build_plan
    from sftmix.sources.data_files import json_data_files

    repo = _split_directory(tmp_path / "org--splits", random.Random(31), declared=True)
    cache = tmp_path / "cache"
    files = json_data_files(str(repo), "test_sft", None, str(cache))
    assert files is not None and files.declared is not None
    assert [Path(p).name for p in files.paths] == ["test_sft-00000-of-00001.jsonl"]
    layout = jsonl.scan_files(files.paths, str(repo), declared=files.declared)
    assert layout is not None and len(layout.batches) == 2
    datasets.disable_progress_bars()
    reference = datasets.load_dataset(str(repo), split="test_sft", cache_dir=str(tmp_path / "reference"))
    assert _directory_rows(layout) == reference.with_format("arrow")[:].to_pylist()
    mixer = MixerConfig(
        datasets=[DatasetEntry(path=str(repo), split="test_sft")],
        tokenizer=TokenizerSpec(
            name_or_path=str(Path(__file__).parent.parent / "examples" / "tokenizer"), chat_template="olmo"
        ),
        max_seq_length=256,
        output=OutputSpec(path=str(tmp_path / "out")),
    )
    plan = build_plan(mixer, RunOptions(work_dir=str(tmp_path / "work")))
    assert plan.datasets[0].n_rows == len(reference)
    assert all(
        isinstance(s.source, JsonlSource) and getattr(s.source, "arrow_files", None) is None
        for s in plan.slices
    )

    inferred = _split_directory(tmp_path / "org--inferred", random.Random(32), declared=False)
    assert json_data_files(str(inferred), "test_sft", None, str(cache)) is None
    assert json_data_files(str(inferred), "train_sft", None, str(cache)) is not None
    assert json_data_files(str(inferred), "test_sft[:10]", None, str(cache)) is None


@pytest.mark.slow
@pytest.mark.parametrize("amount", [0.25, 1.0])  # counted first; cut as its batches are counted
def test_shards_of_a_directory_of_json_lines_files_are_those_of_datasets(
    prefect_api, tmp_path, monkeypatch, amount
):
    _shards_match_datasets(
        _directory(tmp_path, random.Random(13)), amount, 1024, 4 << 20, tmp_path, monkeypatch
    )


@pytest.mark.parametrize(  # cut as counted; counted first (each reader and each on_bad_row in the loop)
    ("on_bad_row", "amount"),
    [
        ("error", 1.0),
        ("skip", 0.25),
        pytest.param("error", 0.25, marks=pytest.mark.full),
        pytest.param("skip", 1.0, marks=pytest.mark.full),
    ],
)
def test_a_column_the_card_does_not_declare_is_refused_before_any_slice(tmp_path, amount, on_bad_row):
    """Every row has a column the card does not declare (an old card): the plan refuses the run before any
    slice begins, naming the first line and the card, where each slice would fail on it; with
    ``on_bad_row: skip`` it is planned (the slices skip and count such lines)."""
    from sftmix.config.config import DatasetEntry, MixerConfig, OutputSpec, TokenizerSpec
    from sftmix.config.run_options import RunOptions
    from sftmix.errors import BadLineError
    from sftmix.planning.plan import build_plan

    repo = _declared_directory(tmp_path, random.Random(23), 1)
    data = repo / "data" / "train-00000-of-00001.jsonl"
    data.write_text(
        "".join(json.dumps({**json.loads(x), "extra": 1}) + "\n" for x in data.read_text().splitlines())
    )
    mixer = MixerConfig(
        datasets=[DatasetEntry(path=str(repo), amount=amount)],
        tokenizer=TokenizerSpec(
            name_or_path=str(Path(__file__).parent.parent / "examples" / "tokenizer"), chat_template="olmo"
        ),
        max_seq_length=256,
        output=OutputSpec(path=str(tmp_path / "out")),
        on_bad_row=on_bad_row,
    )
    begun: list = []
    run = RunOptions(work_dir=str(tmp_path / "work"))
    if on_bad_row == "skip":
        assert build_plan(mixer, run, lambda spec, ctx: begun.append(spec)).datasets[0].n_rows > 6000
        return
    with pytest.raises(BadLineError) as refused:
        build_plan(mixer, run, lambda spec, ctx: begun.append(spec))
    assert not begun
    assert f"{data}:1: key 'extra' is not among the features the dataset's card declares" in str(
        refused.value
    )


@pytest.mark.slow
@pytest.mark.parametrize(("files", "amount"), [(1, 1.0), (2, 1.0), (2, 0.25)])
def test_shards_of_a_dataset_whose_card_declares_its_features_are_those_of_datasets(
    prefect_api, tmp_path, monkeypatch, files, amount
):
    """Cut as its batches are counted (one file: :func:`jsonl.scan_file`; two: ``scan_files``), or
    counted first (0.25)."""
    _shards_match_datasets(
        _declared_directory(tmp_path, random.Random(22), files), amount, 1024, 4 << 20, tmp_path, monkeypatch
    )
