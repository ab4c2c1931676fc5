"""The plan's line every few seconds while it reads a dataset whose rows are counted first
(``sftmix.read_progress``): how far, at what rate, how long is left; none once the read has ended, and
none where the size is unknown."""

from __future__ import annotations

import logging
import time

from sftmix.read_progress import ReadProgress


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "sftmix.read_progress"]


def test_a_line_every_few_seconds_while_the_plan_reads(monkeypatch, caplog):
    monkeypatch.setenv("TOKENIZE_MIXER_PROGRESS_SECONDS", "0.5")
    caplog.set_level(logging.INFO, logger="sftmix.read_progress")
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
