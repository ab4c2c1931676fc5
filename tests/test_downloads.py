"""A hub dataset's background downloads (``sftmix.sources.downloads``): a line every few seconds while files are
still to come, and none once all have landed; one set of downloads per dataset in a process (the plan
made ahead of the plan and the plan share it, so each file downloads once and one line says how far);
downloads that are done, closed or failed are not handed to a later plan."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from sftmix.errors import DatasetError
from sftmix.sources.downloads import downloads_of


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "sftmix.sources.downloads"]


def test_a_line_every_few_seconds_while_files_are_still_to_come(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TOKENIZE_MIXER_PROGRESS_SECONDS", "0.5")
    caplog.set_level(logging.INFO, logger="sftmix.sources.downloads")
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


def test_the_line_ends_once_every_file_has_landed_or_failed(tmp_path, monkeypatch, caplog):
    """A file that failed for good is not still to come: with every other landed, the line (and its
    thread) ends, whether or not anyone closes the downloads."""
    monkeypatch.setenv("TOKENIZE_MIXER_PROGRESS_SECONDS", "0.2")
    caplog.set_level(logging.INFO, logger="sftmix.sources.downloads")

    def download(url: str) -> str:
        if url == "gone":
            raise PermissionError("the hub said no")
        (tmp_path / url).write_bytes(b"x")
        return str(tmp_path / url)

    before = set(threading.enumerate())
    downloads = downloads_of("org/half", ["here", "gone"], download)
    line = [t for t in threading.enumerate() if t not in before and t.name == "Downloads"]
    assert downloads.wait("here") == str(tmp_path / "here")
    with pytest.raises(DatasetError, match="cannot download gone"):
        downloads.wait("gone")
    line[0].join(10)
    assert not line[0].is_alive()
    seen = len(_lines(caplog))
    time.sleep(0.5)
    assert len(_lines(caplog)) == seen


def test_closed_or_failed_downloads_are_not_handed_on(tmp_path):
    def failing(url: str) -> str:
        raise PermissionError("the hub said no")

    failed = downloads_of("org/failing", ["a"], failing)
    with pytest.raises(DatasetError, match="cannot download a: PermissionError: the hub said no"):
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


class _Answer:
    def __init__(self, status_code: int) -> None:
        self.status_code = status_code


class _HttpError(Exception):
    """An error as the hub's clients raise one: the answer it had, with its status."""

    def __init__(self, status_code: int) -> None:
        super().__init__(f"HTTP {status_code}\nFor more information check: a page")
        self.response = _Answer(status_code)


def test_what_goes_by_is_tried_again_and_what_does_not_is_not():
    import httpx

    from sftmix.sources.downloads import passes

    assert all(passes(_HttpError(code)) for code in (408, 429, 500, 502, 503, 504))
    assert not any(passes(_HttpError(code)) for code in (401, 403, 404, 416))
    assert passes(ConnectionResetError()) and passes(TimeoutError()) and passes(httpx.ReadTimeout("slow"))
    assert not passes(FileNotFoundError()) and not passes(ValueError("not JSON"))
    try:
        try:
            raise _HttpError(503)
        except _HttpError as inner:
            raise OSError("the download failed") from inner
    except OSError as wrapped:
        assert passes(wrapped)  # (what caused it)


def test_a_download_that_fails_for_a_while_is_tried_again(tmp_path, monkeypatch, caplog):
    """The hub too busy twice, then the file: it lands, with a line for each new try; a file that is not
    there fails at once."""
    import sftmix.sources.downloads

    monkeypatch.setattr(sftmix.sources.downloads, "RETRY_SECONDS", (0.01, 0.01, 0.01))
    caplog.set_level(logging.INFO, logger="sftmix.sources.downloads")
    tries: dict[str, int] = {}

    def download(url: str) -> str:
        tries[url] = tries.get(url, 0) + 1
        if url == "busy" and tries[url] <= 2:
            raise _HttpError(503)
        if url == "gone":
            raise _HttpError(404)
        (tmp_path / url).write_bytes(b"x")
        return str(tmp_path / url)

    downloads = downloads_of("org/retried", ["busy", "gone"], download)
    assert downloads.wait("busy") == str(tmp_path / "busy") and tries["busy"] == 3
    with pytest.raises(DatasetError, match="cannot download gone: _HttpError: HTTP 404$"):
        downloads.wait("gone")
    assert tries["gone"] == 1
    again = [
        x
        for x in _lines(caplog)
        if x.startswith("org/retried: downloading busy failed (_HttpError: HTTP 503)")
    ]
    assert len(again) == 2 and again[0].endswith("trying again in 0 s"), _lines(caplog)


def test_a_download_that_never_lands_fails_after_its_last_try(tmp_path, monkeypatch):
    import sftmix.sources.downloads

    monkeypatch.setattr(sftmix.sources.downloads, "RETRY_SECONDS", (0.01, 0.01))
    tries: list[str] = []

    def download(url: str) -> str:
        tries.append(url)
        raise ConnectionResetError("the link dropped")

    with pytest.raises(DatasetError, match="cannot download a: ConnectionResetError: the link dropped"):
        downloads_of("org/dropped", ["a"], download).wait("a")
    assert len(tries) == 3
