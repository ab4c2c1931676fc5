"""A hub dataset's background downloads (``sftmix.downloads``): a line every few seconds while files are
still to come, and none once all have landed; one set of downloads per dataset in a process (the plan
made ahead of the plan and the plan share it, so each file downloads once and one line says how far);
downloads that are done, closed or failed are not handed to a later plan."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from sftmix.downloads import downloads_of
from sftmix.errors import DatasetError


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "sftmix.downloads"]


def test_a_line_every_few_seconds_while_files_are_still_to_come(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TOKENIZE_MIXER_PROGRESS_SECONDS", "0.5")
    caplog.set_level(logging.INFO, logger="sftmix.downloads")
    held = threading.Event()

    def download(url: str) -> str:
        if url == "b":
            held.wait(20)
        path = tmp_path / url
        path.write_bytes(b"x" * 1_000_000)
        return str(path)

    downloads = downloads_of("org/set", ["a", "b"], download)
    assert downloads.wait("a") == str(tmp_path / "a")
    assert downloads_of("org/set", ["a", "b"], download) is downloads  # (running: shared)
    time.sleep(1.3)
    assert any(
        line.startswith("org/set: 1 of 2 files downloaded from the hub (0.00 GB, ") and "left" in line
        for line in _lines(caplog)
    ), _lines(caplog)
    held.set()
    assert downloads.wait("b") == str(tmp_path / "b")
    time.sleep(0.7)
    seen = len(_lines(caplog))
    time.sleep(1.2)
    assert len(_lines(caplog)) == seen  # every file landed: no more lines
    assert downloads_of("org/set", ["a", "b"], download) is not downloads  # done: a later plan asks afresh


def test_closed_or_failed_downloads_are_not_handed_on(tmp_path):
    def failing(url: str) -> str:
        raise ConnectionError("the hub went away")

    failed = downloads_of("org/failing", ["a"], failing)
    with pytest.raises(DatasetError, match="cannot download a: ConnectionError: the hub went away"):
        failed.wait("a")
    assert downloads_of("org/failing", ["a"], failing) is not failed
    held = threading.Event()

    def slow(url: str) -> str:
        held.wait(20)
        return str(tmp_path)

    running = downloads_of("org/closed", ["a"], slow)
    running.close()
    with pytest.raises(DatasetError, match="its download was stopped"):
        running.wait("a")
    assert downloads_of("org/closed", ["a"], slow) is not running
    held.set()
