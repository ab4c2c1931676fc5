"""Slices tokenized while the Prefect API starts (``flows.head_start``): the flow takes over the same
pool, every slice is still a task run with its persisted result, nothing is tokenized twice, and the
bytes are those of a run without a head start."""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import pytest

from sftmix.config import DatasetEntry, MixerConfig, OutputSpec, RunOptions, TokenizerSpec
from sftmix.digest import compare
from sftmix.plan import build_plan
from tokenize_mixer.flows import head_start
from tokenize_mixer.flows.tokenize_mixer import tokenize_mixer

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
        other = plan.context.model_copy(update={"max_seq_length": 128})
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
