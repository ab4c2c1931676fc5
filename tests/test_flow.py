"""The flow's checkpoints: what an edit recomputes, and what a damaged checkpoint costs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sftmix.config.config import DatasetEntry, MixerConfig, OutputSpec, TokenizerSpec
from sftmix.config.run_options import RunOptions
from sftmix.output.digest import compare
from sftmix.tokenizing.slices import slice_dir
from tokenize_mixer.flows.tokenize_mixer import tokenize_mixer

EXAMPLES = Path(__file__).parent.parent / "examples"


def demo_mixer(data: Path, out: Path, max_len: int = 256) -> MixerConfig:
    return MixerConfig(
        datasets=[
            DatasetEntry(path=str(data / "general.jsonl"), amount=2.0),
            DatasetEntry(path=str(data / "arithmetic.jsonl"), amount=0.5),
        ],
        tokenizer=TokenizerSpec(name_or_path=str(EXAMPLES / "tokenizer"), chat_template="olmo"),
        max_seq_length=max_len,
        output=OutputSpec(path=str(out)),
    )


def test_edits_recompute_only_what_they_touch(prefect_api, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(EXAMPLES / "data", data)
    run = RunOptions(work_dir=str(tmp_path / "work"), slice_rows=40, runner="thread")
    first = tokenize_mixer(mixer=demo_mixer(data, tmp_path / "o1"), run=run)
    assert first["slices_computed"] == first["slices_total"] == 1 + 3

    with open(data / "general.jsonl", "a", encoding="utf-8") as fh:  # edit one dataset
        fh.write(
            '{"messages": [{"role": "user", "content": "New?"}, {"role": "assistant", "content": "Yes."}]}\n'
        )
    second = tokenize_mixer(mixer=demo_mixer(data, tmp_path / "o2"), run=run)
    assert (second["slices_computed"], second["slices_reused"]) == (1, 3)
    # the slices the first run finished are reused from their checkpoints with no task run each
    assert _slice_task_runs_of_the_last_flow_run() == 1

    third = tokenize_mixer(mixer=demo_mixer(data, tmp_path / "o3", max_len=128), run=run)
    assert third["slices_computed"] == third["slices_total"]


@pytest.mark.parametrize(
    "damage",
    [
        "flip_byte",
        *(
            pytest.param(d, marks=pytest.mark.full)
            for d in ("truncate", "delete_manifest", "delete_result_record")
        ),
    ],
)
def test_damaged_checkpoint_is_recomputed_not_trusted(prefect_api, tmp_path, damage):
    run = RunOptions(work_dir=str(tmp_path / "work"), slice_rows=40, runner="thread")
    tokenize_mixer(mixer=demo_mixer(EXAMPLES / "data", tmp_path / "o1"), run=run)
    victim = sorted((Path(run.work_dir) / "slices").glob("*/*/tokens.npy"))[1]
    key = victim.parent.name
    if damage == "flip_byte":
        raw = bytearray(victim.read_bytes())
        raw[-1] ^= 0xFF
        victim.write_bytes(bytes(raw))
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:-7])
    elif damage == "delete_manifest":
        (victim.parent / "manifest.json").unlink()
    else:
        (Path(run.work_dir) / "prefect-results" / f"tokenize-mixer-slice-{key}").unlink()
    second = tokenize_mixer(mixer=demo_mixer(EXAMPLES / "data", tmp_path / "o2"), run=run)
    if damage == "delete_result_record":  # the slice's own manifest and files verify: it is done
        assert second["slices_computed"] == 0 and second["slices_reused"] == second["slices_total"]
        assert second["slices_rechecked"] == 0
    else:
        assert second["slices_computed"] == 1 and second["slices_reused"] == second["slices_total"] - 1
        assert second["slices_rechecked"] == 1
    assert compare(tmp_path / "o1", tmp_path / "o2").matches
    assert (slice_dir(run.work_dir, key) / "manifest.json").exists()


def test_editing_one_row_recomputes_only_its_slice(prefect_api, tmp_path, monkeypatch):
    """Row by row where datasets converts the file (an edit in a file read by batch recomputes the
    slices of its 10 MiB batch: tests/test_jsonl.py)."""
    monkeypatch.setenv("TOKENIZE_MIXER_JSON_READER", "datasets")
    data = tmp_path / "data"
    shutil.copytree(EXAMPLES / "data", data)
    mixer = demo_mixer(data, tmp_path / "o1").model_copy(
        update={"datasets": [DatasetEntry(path=str(data / "arithmetic.jsonl"), amount=1.0)]}
    )
    run = RunOptions(work_dir=str(tmp_path / "work"), slice_rows=40, runner="thread")
    first = tokenize_mixer(mixer=mixer, run=run)
    assert first["slices_total"] == 6
    lines = (data / "arithmetic.jsonl").read_text(encoding="utf-8").splitlines()
    lines[100] = lines[100].replace("What is", "What's")
    (data / "arithmetic.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    second = tokenize_mixer(
        mixer=mixer.model_copy(update={"output": OutputSpec(path=str(tmp_path / "o2"))}), run=run
    )
    assert (second["slices_computed"], second["slices_reused"]) == (1, 5)
    assert not compare(tmp_path / "o1", tmp_path / "o2").matches


def test_force_recache_and_disable_cache(prefect_api, tmp_path):
    run = RunOptions(work_dir=str(tmp_path / "work"), slice_rows=40, runner="thread")
    first = tokenize_mixer(mixer=demo_mixer(EXAMPLES / "data", tmp_path / "o1"), run=run)
    forced = tokenize_mixer(
        mixer=demo_mixer(EXAMPLES / "data", tmp_path / "o2"),
        run=run.model_copy(update={"force_recache": True}),
    )
    assert forced["slices_computed"] == forced["slices_total"] == first["slices_total"]
    assert forced["digests"] == first["digests"]

    cold = RunOptions(work_dir=str(tmp_path / "cold"), slice_rows=40, runner="thread", disable_cache=True)
    once = tokenize_mixer(mixer=demo_mixer(EXAMPLES / "data", tmp_path / "o3"), run=cold)
    twice = tokenize_mixer(mixer=demo_mixer(EXAMPLES / "data", tmp_path / "o4"), run=cold)
    assert once["slices_computed"] == twice["slices_computed"] == once["slices_total"]
    assert twice["digests"] == first["digests"]
    assert not list((tmp_path / "cold").glob("slices/*/*/manifest.json"))
    assert not list((tmp_path / "cold" / "scratch").iterdir())
    assert not (tmp_path / "cold" / "prefect-results").exists()


def test_retry_only_transient_failures():
    from prefect.states import Failed

    from sftmix.errors import BadRowError
    from tokenize_mixer.tasks.tokenize import retry_transient

    assert retry_transient(None, None, Failed(data=OSError("connection reset"))) is True
    assert retry_transient(None, None, Failed(data=BadRowError("d", 1, "bad"))) is False


def test_upsampled_rows_are_tokenized_once(prefect_api, tmp_path):
    run = RunOptions(work_dir=str(tmp_path / "work"), slice_rows=40, runner="thread")
    once = demo_mixer(EXAMPLES / "data", tmp_path / "o1")
    thrice = once.model_copy(
        update={
            "datasets": [DatasetEntry(path=str(EXAMPLES / "data" / "general.jsonl"), amount=6.0)],
            "output": OutputSpec(path=str(tmp_path / "o2")),
        }
    )
    first = tokenize_mixer(mixer=once, run=run)
    rows = len((EXAMPLES / "data" / "general.jsonl").read_text().splitlines())
    second = tokenize_mixer(mixer=thrice, run=run)  # rows x 6: the same one slice of its rows, tokenized once
    assert second["slices_total"] == 1 and second["slices_reused"] == 1
    assert second["documents"] == 6 * rows and first["documents"] == 2 * rows + 120


def test_default_workers_are_the_cpus_this_process_may_use():
    import os

    from sftmix.runtime.parallel import available_cpus

    assert 1 <= available_cpus() <= len(os.sched_getaffinity(0)) <= (os.cpu_count() or 1)


def _slice_task_runs_of_the_last_flow_run() -> int:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        last = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)[0]
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[last.id])))
    return sum(run.name.startswith("tokenize ") for run in runs)


def test_the_plans_own_lines_reach_the_runs_logs_where_no_console_shows_them(
    prefect_api, tmp_path, monkeypatch
):
    """A flow run a Prefect worker runs (a deployment, the UI) has no console of the command: the plan's
    own lines (the encoder it chose; how far a hub dataset's downloads are) are in the run's logs."""
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.logging.handlers import APILogWorker

    monkeypatch.delenv("TOKENIZE_MIXER_CONSOLE", raising=False)
    run = RunOptions(work_dir=str(tmp_path / "work"), slice_rows=40, runner="thread")
    tokenize_mixer(mixer=demo_mixer(EXAMPLES / "data", tmp_path / "out"), run=run)
    APILogWorker.drain_all(timeout=30)  # (the run's lines are sent to the API in batches)
    with get_client(sync_client=True) as client:
        last = client.read_flow_runs(sort=FlowRunSort.START_TIME_DESC, limit=1)[0]
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[last.id])))
    lines = [log.message for log in logs]
    assert sum(line.startswith("sftmix.planning.encoder_choice: encoder: ") for line in lines) == 1, lines
