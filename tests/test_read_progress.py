"""The plan's line every few seconds while it reads a dataset whose rows are counted first
(``sftmix.runtime.read_progress``): how far, at what rate, how long is left; none once the read has ended, and
none where the size is unknown."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from sftmix.runtime.read_progress import ReadProgress


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "sftmix.runtime.read_progress"]


def test_a_line_every_few_seconds_while_the_plan_reads(monkeypatch, caplog):
    monkeypatch.setenv("TOKENIZE_MIXER_PROGRESS_SECONDS", "0.5")
    caplog.set_level(logging.INFO, logger="sftmix.runtime.read_progress")
    with ReadProgress("/data/chats.jsonl", 4_000_000_000) as progress:
        progress.read(1_000_000_000)
        time.sleep(1.3)
    lines = _lines(caplog)
    assert lines and all(line.startswith("/data/chats.jsonl: 1.0 of 4.0 GB read (") for line in lines), lines
    assert all(" s in, about " in line and line.endswith(" left") for line in lines), lines
    seen = len(lines)
    time.sleep(1.0)
    assert len(_lines(caplog)) == seen  # the read ended: no more lines
    with ReadProgress("gs://bucket/chats.jsonl", 0):  # (a size not known: nothing to say how far)
        time.sleep(0.7)
    assert len(_lines(caplog)) == seen


def test_a_decompression_says_how_far_in_the_compressed_bytes(tmp_path, monkeypatch, caplog):
    """A compressed file's copy counts the file's own bytes as it goes (what the line says how far in: the
    decompressed size is not known before the end), all of them by the end."""
    import gzip

    from sftmix.sources.copies import decompressed_copy

    monkeypatch.setenv("TOKENIZE_MIXER_PROGRESS_SECONDS", "0.5")
    caplog.set_level(logging.INFO, logger="sftmix.runtime.read_progress")
    packed = tmp_path / "chats.jsonl.gz"
    packed.write_bytes(gzip.compress(b'{"messages": []}\n' * 3_000_000, mtime=0))
    with ReadProgress(str(packed), packed.stat().st_size, "decompressed") as progress:
        copy = decompressed_copy(str(packed), str(tmp_path / "cache"), progress)
        assert progress.done == packed.stat().st_size
        time.sleep(0.7)
    assert Path(copy).read_bytes() == b'{"messages": []}\n' * 3_000_000
    lines = _lines(caplog)
    assert lines and all(x.startswith(f"{packed}: 0.0 of 0.0 GB decompressed (") for x in lines), lines


def test_a_load_by_the_datasets_library_says_it_still_loads(monkeypatch, caplog):
    from sftmix.runtime.read_progress import StillLoading

    monkeypatch.setenv("TOKENIZE_MIXER_PROGRESS_SECONDS", "0.5")
    caplog.set_level(logging.INFO, logger="sftmix.runtime.read_progress")
    with StillLoading("org/chats"):
        time.sleep(1.3)
    lines = _lines(caplog)
    assert lines and all(
        x.startswith("org/chats: still being loaded by the datasets library (on one core), ") for x in lines
    ), lines
    seen = len(lines)
    time.sleep(0.8)
    assert len(_lines(caplog)) == seen
