"""Progress a person can watch at any scale (issue 31, item 4): each slice counted once as it finishes,
whoever finished it; a rate over the recent past and the time left; a summary line, not one per slice."""

from __future__ import annotations

import re

import pytest

from sftmix.tokenizing.slices import SliceSpec
from tests.test_cli import cli
from tokenize_mixer.flows.progress import Board


def _spec(index: int, est_bytes: int = 1000) -> SliceSpec:
    return SliceSpec(
        key=f"k{index}", index=index, dataset_index=0, dataset="d.jsonl", split="train", revision=None,
        row_format="messages", messages_key="messages", row_start=index * 10, row_end=index * 10 + 10,
        est_bytes=est_bytes,
    )  # fmt: skip


def test_the_board_counts_each_slice_once_and_rates_only_computed_ones():
    board, specs = Board(), [_spec(i) for i in range(4)]
    seen = []
    board.add_listener(seen.append)
    board.begin(specs)
    facts = board.facts()
    assert (facts.done, facts.total, facts.seconds_left) == (
        0,
        4,
        None,
    ) and facts.left() == "time left unknown yet"
    board.finished(specs[0], rows=10, tokens=500, reused=True)
    assert board.facts().tokens_per_second == 0  # a reused slice cost no time: no rate from it
    board.finished(specs[1], rows=10, tokens=700, reused=False)
    board.finished(specs[1], rows=10, tokens=700, reused=False)  # the flow collects a head-start slice
    facts = board.facts()
    assert (facts.done, facts.reused, facts.rows, facts.tokens) == (2, 1, 20, 1200)
    assert facts.tokens_per_second > 0 and facts.seconds_left is not None and facts.fraction == 0.5
    assert re.fullmatch(
        r"progress 2/4 slices \(1 reused, 0 failed\), 50% of the input, .* tokens/s, .* rows/s \(last 30 s\), "
        r"about \d+ s left, \d+ s in",
        facts.line(),
    ), facts.line()
    board.failed_slice(specs[2])
    board.finished(_spec(9), rows=1, tokens=1, reused=False)  # not in this plan: ignored
    assert (board.facts().failed, board.facts().done) == (1, 3)
    # the flow taking over the head start's slices keeps the count; a new run starts again
    board.begin(specs, keep=True)
    assert board.facts().done == 3
    board.begin(specs)
    assert board.facts().done == 0
    assert len(seen) >= 5


def _write_manifest(work_dir, key: str, finished_at: float) -> None:
    """A slice's manifest as a worker lands it (a temp name, then a rename), 700 tokens."""
    from sftmix.tokenizing.slices import MANIFEST, SliceManifest, slice_dir
    from sftmix.tokenizing.slices.manifest import SliceTiming

    manifest = SliceManifest(
        key=key, dataset="d.jsonl", row_start=0, row_end=10, rows=10, kept=10, tokens=700,
        trainable_tokens=300, dropped={}, token_dtype="uint32", files={},
        timing=SliceTiming(seconds=1.0, finished_at=finished_at),
    )  # fmt: skip
    directory = slice_dir(work_dir, key)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / "manifest.tmp"
    tmp.write_text(manifest.model_dump_json(), encoding="utf-8")
    tmp.rename(directory / MANIFEST)


def _counted_by_the_watcher(board: Board) -> tuple[int, int, int]:
    """(done, reused, tokens) once the manifest watcher counts a slice (or after 10 s), watching stopped."""
    import time

    deadline = time.monotonic() + 10
    while board.facts().done < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    board.stop_watching()
    facts = board.facts()
    return facts.done, facts.reused, facts.tokens


def test_the_flow_taking_over_the_head_start_watches_the_manifests(tmp_path):
    """The head start counts without a watcher; the flow that keeps its count must start one, or the
    slices its workers finish are counted only when the orchestrator hands them back (40 s late, seen at
    1 B tokens)."""
    import time

    board, specs = Board(), [_spec(i) for i in range(2)]
    board.begin(specs)  # the head start: no work directory
    board.begin(specs, keep=True, work_dir=str(tmp_path))  # the flow takes over
    _write_manifest(tmp_path, "k1", time.time())
    assert _counted_by_the_watcher(board) == (1, 0, 700)


def test_an_earlier_runs_manifest_is_not_counted_until_this_run_writes_its_own(tmp_path):
    """A rerun that computes slices again (``--force``, a changed setting) finds their old manifests:
    counting them made the board say 100% while every slice was still to do."""
    import time

    _write_manifest(tmp_path, "k0", time.time() - 3600)
    board = Board()
    board.begin([_spec(0), _spec(1)], work_dir=str(tmp_path))
    time.sleep(2.5)  # two looks of the watcher
    assert board.facts().done == 0
    _write_manifest(tmp_path, "k0", time.time())
    assert _counted_by_the_watcher(board) == (1, 0, 700)


def test_a_running_slice_moves_the_bar_and_the_time_left_before_it_ends(tmp_path):
    """A worker notes its rows as it goes (sftmix.tokenizing.slices.note_progress): the share of the input and
    the time left move while no slice has ended; a note from an earlier run counts for nothing."""
    import os
    import time

    from sftmix.tokenizing.slices import PROGRESS, note_progress, slice_dir

    stale = slice_dir(tmp_path, "k1")
    note_progress(stale, 90, 100)
    os.utime(stale / PROGRESS, (time.time() - 3600,) * 2)
    board, specs = Board(), [_spec(0, est_bytes=1000), _spec(1, est_bytes=1000)]
    board.begin(specs, work_dir=str(tmp_path))
    root = slice_dir(tmp_path, "k0")
    note_progress(root, 25, 100)
    time.sleep(2.5)
    note_progress(root, 50, 100)
    deadline = time.monotonic() + 10
    while board.facts().bytes_done < 500 and time.monotonic() < deadline:
        time.sleep(0.2)
    facts = board.facts()
    assert (facts.done, facts.bytes_done, facts.fraction) == (0, 500, 0.25)
    assert facts.seconds_left is not None and facts.left().startswith("about ")
    board.finished(specs[0], rows=10, tokens=100, reused=False)
    assert board.facts().bytes_done == 1000  # (its note no longer counts once it is done)
    board.stop_watching()


@pytest.mark.slow
def test_the_console_shows_summary_lines_not_a_line_per_slice(tmp_path):
    proc = cli(
        "run", "examples/mixer.yaml", "--output_dir", str(tmp_path / "out"), "--work_dir", str(tmp_path / "w"),
        "--slice_rows", "3", env={"TOKENIZE_MIXER_PROGRESS_SECONDS": "0.5"},
    )  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if "progress " in line]
    assert lines, proc.stderr[-3000:]
    assert "81/81 slices (0 reused, 0 failed), 100% of the input" in lines[-1]
    assert "tokenizing done" in lines[-1]
    assert not re.search(r"\[\d+/81\]", proc.stderr)  # the per-slice lines are debug lines


@pytest.mark.slow
def test_the_last_slice_is_said_at_once_not_at_the_next_line(tmp_path):
    """A summary line every minute: the run is shorter, yet its 'tokenizing done' line comes as the last
    slice finishes, before the run ends."""
    proc = cli(
        "run", "examples/mixer.yaml", "--output_dir", str(tmp_path / "out"), "--work_dir", str(tmp_path / "w"),
        env={"TOKENIZE_MIXER_PROGRESS_SECONDS": "60"},
    )  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if "progress " in line]
    assert len(lines) == 1 and "tokenizing done" in lines[0], proc.stderr[-3000:]
    assert proc.stderr.index(lines[0]) < proc.stderr.index("stopping the temporary"), proc.stderr[-3000:]


def test_a_complete_count_updates_the_progress_artifact_once(prefect_api):
    """A rerun finds every slice's manifest on disk, so the count is complete from the start: each slice
    then handed back updated the UI's artifact again (an API call each, seconds for a few hundred)."""
    from prefect import flow

    from tokenize_mixer.flows.progress import BOARD, SliceProgress

    specs = [_spec(i) for i in range(50)]

    @flow
    def hand_back_every_slice() -> int:
        progress = SliceProgress(specs, every_seconds=3600)
        updates: list[dict] = []
        progress._update_artifact = lambda **fields: updates.append(fields)  # type: ignore[method-assign]
        for spec in specs:  # what the manifest watcher counts at a rerun's start
            BOARD.finished(spec, rows=1, tokens=1, reused=True)
        for spec in specs:
            progress.advance(spec, rows=1, tokens=1, reused=True)
        progress.reused([(spec, 1, 1) for spec in specs])
        return len(updates)

    assert hand_back_every_slice() == 1
