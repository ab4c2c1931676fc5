"""A run whose disks cannot hold what it will write is refused before work, with the numbers; a rerun counts
only the slices still to tokenize. The free space is the one thing faked here (``free_space.free_bytes``
answers for every path); tests/test_resources.py refuses on real small file systems (tmpfs mounts)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import sftmix.planning.free_space as free_space
from sftmix.config.config import MixerConfig
from sftmix.config.run_options import RunOptions
from sftmix.errors import StorageError
from sftmix.planning.plan import build_plan
from tests.test_check import EXAMPLES, chat


def _mixer(tmp: Path, rows: int = 200) -> MixerConfig:
    data = tmp / "chats.jsonl"
    data.write_text(
        "".join(json.dumps(chat(f"question {i}?", f"answer {i}. " * 20)) + "\n" for i in range(rows))
    )
    return MixerConfig.model_validate(
        {
            "datasets": [{"path": str(data), "amount": "3.0"}],
            "tokenizer": {"name_or_path": str(EXAMPLES / "tokenizer"), "chat_template": "olmo"},
            "output": {"path": str(tmp / "out")},
        }
    )


def _free(monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    monkeypatch.setattr(free_space, "free_bytes", lambda path: (1, nbytes))


def test_a_short_disk_is_refused_with_the_numbers(tmp_path, monkeypatch):
    plan = build_plan(_mixer(tmp_path), RunOptions(work_dir=str(tmp_path / "work"), slice_rows=50))
    _free(monkeypatch, 1_000)
    with pytest.raises(StorageError) as refused:
        free_space.refuse_short_disk(plan)
    said = str(refused.value)
    assert "not enough free disk" in said and "1.0 kB is free" in said
    assert "of 4 slices to tokenize" in said and "of output staged in" in said
    assert "TOKENIZE_MIXER_DISK_CHECK=off runs it anyway" in said
    monkeypatch.setenv("TOKENIZE_MIXER_DISK_CHECK", "off")  # (an estimate known to be high)
    free_space.refuse_short_disk(plan)
    monkeypatch.delenv("TOKENIZE_MIXER_DISK_CHECK")
    _free(monkeypatch, 10**12)
    free_space.refuse_short_disk(plan)


def test_two_disks_are_counted_apart(tmp_path, monkeypatch):
    """Slices on the work directory's disk, the output on its own: each is held against its own free space."""
    plan = build_plan(_mixer(tmp_path), RunOptions(work_dir=str(tmp_path / "work"), slice_rows=50))
    work = Path(plan.context.output.work_dir)
    slices_need = free_space.slices_to_make(plan)
    assert len(slices_need) == 4

    def two_disks(path: Path) -> tuple[int, int]:
        on_work = str(path).startswith(str(work))
        return (1, 10**12) if on_work else (2, 1_000)

    monkeypatch.setattr(free_space, "free_bytes", two_disks)
    with pytest.raises(StorageError, match="output staged in") as refused:
        free_space.refuse_short_disk(plan)
    assert "slices to tokenize" not in str(refused.value)


def test_a_rerun_counts_only_the_slices_still_to_make(prefect_api, tmp_path, monkeypatch):
    """The run is refused before any slice is made; once its slices are finished, a rerun into another output
    needs room for the output alone."""
    mixer = _mixer(tmp_path)
    options = RunOptions(work_dir=str(tmp_path / "work"), runner="thread", slice_rows=50)
    from tokenize_mixer.flows.tokenize_mixer import tokenize_mixer

    _free(monkeypatch, 1_000)
    with pytest.raises(StorageError, match="not enough free disk"):
        tokenize_mixer(mixer=mixer, run=options)
    assert not (tmp_path / "work" / "slices").exists() or not any(os.scandir(tmp_path / "work" / "slices"))
    assert not (tmp_path / "out").exists()
    monkeypatch.undo()
    tokenize_mixer(mixer=mixer, run=options)
    plan = build_plan(mixer, options)
    assert free_space.slices_to_make(plan) == []
    estimate = sum(d.estimated_tokens() for d in plan.datasets) * 3  # uint16 ids and a mask byte
    _free(monkeypatch, estimate + 1)
    free_space.refuse_short_disk(plan)
    _free(monkeypatch, estimate - 1)
    with pytest.raises(StorageError) as refused:
        free_space.refuse_short_disk(plan)
    assert "slices to tokenize" not in str(refused.value)


def test_the_command_refuses_in_a_line_before_a_flow_run(prefect_api, tmp_path, monkeypatch, capsys):
    from tests.cli_runs import convert_args
    from tokenize_mixer.cli import main

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(chat(f"q{i}?", f"answer {i}.")) + "\n" for i in range(300)))
    _free(monkeypatch, 2_000)
    code = main(convert_args(data, tmp_path / "work", tmp_path / "out", "--slice_rows", "50"))
    err = capsys.readouterr().err
    assert code != 0 and "not enough free disk for this run" in err and "2.0 kB is free" in err
    assert "Traceback" not in err and "Flow run" not in err
    assert not (tmp_path / "out").exists()
