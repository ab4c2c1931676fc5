"""A rerun with nothing changed is a no-op (issue 31, item 3): it says "up to date" and rewrites nothing;
a changed input, a changed output file, ``force`` or a changed recipe does the work."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from sftmix.assembly.up_to_date import up_to_date
from sftmix.config.config import OutputSpec
from sftmix.config.run_options import RunOptions
from sftmix.errors import ChecksumError
from sftmix.output.output_dir import OUTPUT_MARKER
from sftmix.output.report import UP_TO_DATE
from sftmix.planning.recipe import input_record
from tests.test_cli import cli
from tests.test_flow import EXAMPLES, demo_mixer
from tokenize_mixer.flows.tokenize_mixer import tokenize_mixer


def _snapshot(directory: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file with its mtime, inode and bytes: what 'rewrites nothing' must keep."""
    return {
        p.relative_to(directory).as_posix(): (p.stat().st_mtime_ns, p.stat().st_ino, p.read_bytes())
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _copy_demo(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    shutil.copytree(EXAMPLES / "data", data)
    return data


def test_an_unchanged_rerun_of_the_flow_rewrites_nothing(prefect_api, tmp_path):
    data = _copy_demo(tmp_path)
    mixer, run = (
        demo_mixer(data, tmp_path / "out"),
        RunOptions(work_dir=str(tmp_path / "work"), runner="thread"),
    )
    first = tokenize_mixer(mixer=mixer, run=run)
    assert first["publish"] == "created"
    before = _snapshot(tmp_path / "out")

    again = tokenize_mixer(mixer=mixer, run=run)
    assert again["publish"] == UP_TO_DATE and again["published_at"]
    assert again["slices_computed"] == again["slices_reused"] == 0
    assert again["digests"] == first["digests"] and again["tokens"] == first["tokens"]
    assert _snapshot(tmp_path / "out") == before  # not a byte, not an mtime, not an inode

    # an input touched but not changed: the plan proves the recipe the same, and the marker learns the
    # new stamps (the next rerun needs no plan); the shards stay as they were
    os.utime(data / "general.jsonl")
    assert up_to_date(mixer, run) is None
    touched = tokenize_mixer(mixer=mixer, run=run)
    assert touched["publish"] == UP_TO_DATE
    marker = json.loads((tmp_path / "out" / OUTPUT_MARKER).read_text())
    assert marker["inputs"] == input_record(mixer)
    assert up_to_date(mixer, run) is not None
    after = _snapshot(tmp_path / "out")
    assert {k: v for k, v in after.items() if k != OUTPUT_MARKER} == {
        k: v for k, v in before.items() if k != OUTPUT_MARKER
    }

    # force does the work (slices reused), and so does an output file changed since it was published
    forced = tokenize_mixer(mixer=mixer, run=run.model_copy(update={"force": True}))
    assert (forced["publish"], forced["slices_reused"]) == ("replaced", forced["slices_total"])
    stats = tmp_path / "out" / "dataset_statistics.txt"
    stats.write_text(stats.read_text() + "\n")
    assert tokenize_mixer(mixer=mixer, run=run)["publish"] == "replaced"
    assert tokenize_mixer(mixer=mixer, run=run)["publish"] == UP_TO_DATE


def test_an_up_to_date_output_is_compared_with_the_reference_from_its_digests(prefect_api, tmp_path):
    mixer = demo_mixer(EXAMPLES / "data", tmp_path / "out")
    run = RunOptions(work_dir=str(tmp_path / "work"), runner="thread")
    first = tokenize_mixer(mixer=mixer, run=run)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"files": first["digests"]}))
    checked = up_to_date(mixer, run.model_copy(update={"reference": str(good)}))
    assert checked is not None and checked.validation is not None and checked.validation.matches

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"files": {**first["digests"], "token_ids_part_0000.npy": "0" * 64}}))
    with pytest.raises(ChecksumError, match="differs from reference"):
        up_to_date(mixer, run.model_copy(update={"reference": str(bad)}))


def test_what_the_quick_check_cannot_prove_goes_to_the_plan(tmp_path):
    data = _copy_demo(tmp_path)
    mixer = demo_mixer(data, tmp_path / "out")
    assert input_record(mixer) is not None
    hub = mixer.model_copy(
        update={"tokenizer": mixer.tokenizer.model_copy(update={"name_or_path": "org/tok"})}
    )
    assert input_record(hub) is None  # a hub tokenizer: only a plan knows its content
    remote = mixer.model_copy(update={"output": OutputSpec(path="gs://bucket/out")})
    assert up_to_date(remote, RunOptions()) is None
    # the settings, every input file and the packages that compute bytes are recorded
    record = input_record(mixer)
    assert record is not None
    assert str((data / "general.jsonl").resolve()) in record["files"]
    assert any(f.endswith("olmo.jinja") for f in record["files"])
    assert {"tokenize-mixer", "transformers", "tokenizers"} <= set(record["versions"])
    longer = mixer.model_copy(update={"max_seq_length": 300})
    assert input_record(longer)["settings"] != record["settings"]  # type: ignore[index]


@pytest.mark.slow
def test_the_command_says_up_to_date_without_starting_prefect(tmp_path):
    out, work = tmp_path / "demo", tmp_path / "work"
    args = ("run", "examples/mixer.yaml", "--output_dir", str(out), "--work_dir", str(work))
    cli(*args)
    before = _snapshot(out)
    again = cli(*args)
    assert "up to date" in again.stdout and "nothing was rewritten" in again.stdout
    assert "Prefect" not in again.stderr and "slices on" not in again.stderr  # no API, no plan, no pool
    assert _snapshot(out) == before
    forced = cli(*args, "--force")
    assert "(replaced)" in forced.stdout
