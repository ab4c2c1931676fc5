"""The run's report and the check's options are core objects: made here from a plan, its slices and the
assembled output, with no Prefect API."""

from __future__ import annotations

import json
from pathlib import Path

from sftmix.assembly.assemble import assemble
from sftmix.assembly.outcome import SliceOutcome, check_for, run_report
from sftmix.config.config import DatasetEntry, MixerConfig, OutputSpec, TokenizerSpec
from sftmix.config.run_options import RunOptions
from sftmix.output.digest import output_digests
from sftmix.planning.plan import build_plan
from sftmix.tokenizing.slices import tokenize_slice

GOLDEN = Path(__file__).parent / "golden"


def test_a_report_is_made_from_the_plan_the_slices_and_the_output(tmp_path):
    rows = tmp_path / "rows.jsonl"
    chats = [
        [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}] for i in range(9)
    ]
    chats.append([{"role": "user", "content": "no answer"}])  # nothing to train: dropped and counted
    rows.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    mixer = MixerConfig(
        datasets=[DatasetEntry(path=str(rows), amount=2.0)],
        tokenizer=TokenizerSpec(name_or_path=str(GOLDEN / "tokenizers" / "tiny"), chat_template="tulu"),
        output=OutputSpec(path=str(tmp_path / "out")),
    )
    run = RunOptions(work_dir=str(tmp_path / "work"), slice_rows=6)
    plan = build_plan(mixer, run)
    manifests = [tokenize_slice(spec, plan.context) for spec in plan.slices]
    outcome = SliceOutcome.of(manifests, [False] * len(manifests), seconds=1.0)
    staging, documents = tmp_path / "staging", tmp_path / "documents.bin"
    staging.mkdir()
    check = check_for(plan, run, staging, documents, outcome, None)
    assert (
        check is not None
        and check_for(plan, run.model_copy(update={"check": "off"}), staging, documents, outcome, None)
        is None
    )
    result = assemble(plan, manifests, staging, documents, check)
    report = run_report(plan, outcome, result, output_digests(staging), None, plan_seconds=0.5)
    counted = report.rows
    assert (counted.rows_in, counted.rows_kept, counted.rows_dropped) == (20, 18, {"no_trainable_tokens": 2})
    slices = report.slices
    assert (
        slices.slices_total == slices.slices_computed == len(plan.slices) == 2 and slices.slices_reused == 0
    )
    out = report.output
    assert out.documents == 18 and out.tokens == result.tokens > out.trainable_tokens > 0
    assert report.timings.tokens_per_second == round(outcome.computed_tokens / 1.0, 1) > 0
    assert counted.drop_examples and all(e["dataset"] == str(rows) for e in counted.drop_examples)
    assert result.checked is not None and result.checked.exit_code == 0
