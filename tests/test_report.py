"""``RunReport`` is kept in sections, but ``run_report.json`` is read by users, ``tokenize-mixer check``, the
up-to-date check and bench scripts: its keys, their order and their values stay those of the flat class
it was (issue 80)."""

from __future__ import annotations

import json

from sftmix.output.report import (
    UP_TO_DATE,
    DatasetReport,
    Findings,
    OutputFacts,
    RowCounts,
    RunReport,
    SliceCounts,
    Timings,
    Validation,
)
from sftmix.tokenizing.literal_tokens import LiteralReport

#: run_report.json's keys, in order, as the flat RunReport wrote them: a change here is a change to a file
#: that users and scripts read.
PINNED_KEYS = [
    "output_dir", "publish", "published_at",
    "slices_total", "slices_computed", "slices_reused", "slices_rechecked",
    "rows_in", "rows_kept", "rows_dropped", "datasets", "per_dataset", "documents", "rows_kept_by_exact_spans",
    "untrainable_documents", "tokens", "trainable_tokens", "parts", "whole_document_parts", "token_dtype",
    "wall_seconds", "command_seconds", "first_slice_seconds", "plan_seconds", "plan_ahead_seconds",
    "tokenize_seconds", "assemble_seconds", "verify_seconds", "tokens_per_second", "steady_seconds",
    "steady_tokens_per_second", "digests", "drop_examples", "validation", "check_findings", "budgets",
    "over_length", "training", "check_notes", "template_drift", "documents_file", "warnings", "unrendered",
    "unrendered_rows", "tokenizer_load", "tokenizer_load_note", "literal", "time",
]  # fmt: skip


def _report() -> RunReport:
    return RunReport(
        output_dir="/out",
        publish="published",
        published_at="2025-01-01T00:00:00Z",
        slices=SliceCounts(slices_total=3, slices_computed=2, slices_reused=1, slices_rechecked=1),
        rows=RowCounts(
            rows_in=10,
            rows_kept=8,
            rows_dropped={"bad_row": 2},
            datasets=["a"],
            per_dataset=[DatasetReport(name="a", selected=10, kept=8, dropped={"bad_row": 2})],
            drop_examples=[{"dataset": "a", "row": 3, "reason": "bad_row"}],
        ),
        output=OutputFacts(
            documents=8,
            tokens=100,
            trainable_tokens=40,
            parts=1,
            token_dtype="uint32",
            digests={"part-0-00000.npy": "ab" * 32},
            documents_file="/work/documents.bin",
        ),
        timings=Timings(wall_seconds=2.0, command_seconds=3.0, tokenize_seconds=1.0, tokens_per_second=100.0),
        findings=Findings(
            check_findings=[], training=["t"], template_drift={"shipped": "same"}, literal=LiteralReport()
        ),
        validation=Validation(reference="ref.json", matches=True, details="same"),
    )


def test_run_report_json_keeps_its_flat_keys_in_order_and_reads_back_the_same():
    report = _report()
    written = report.model_dump_json(indent=2)
    flat = json.loads(written)
    assert list(flat) == PINNED_KEYS
    assert list(report.model_dump()) == PINNED_KEYS  # (what the flow hands the command)
    assert flat["slices_total"] == 3 and flat["rows_dropped"] == {"bad_row": 2}
    assert flat["validation"] == {"reference": "ref.json", "matches": True, "details": "same"}
    assert flat["literal"] == {"mode": "keep", "spelled_rows": 0}
    back = RunReport.model_validate_json(written)
    assert back == report and back.model_dump_json(indent=2) == written
    assert RunReport.model_validate(json.loads(written)) == report  # (as the command reads the flow's)
    assert back.render() == report.render()


def test_a_report_written_before_a_field_was_added_still_reads():
    """An older run_report.json lacks the keys added since (defaults fill them): the up-to-date check reads
    the published one."""
    flat = json.loads(_report().model_dump_json())
    for key in ("slices_rechecked", "steady_seconds", "literal", "time", "tokenizer_load", "check_findings"):
        flat.pop(key)
    back = RunReport.model_validate(flat)
    assert back.slices.slices_rechecked == 0 and back.findings.literal == LiteralReport()
    assert back.findings.check_findings is None and back.rows.rows_in == 10
    assert list(back.model_dump()) == PINNED_KEYS


def test_each_section_is_small_and_named_as_the_file_reads():
    assert sorted(RunReport.flat_keys()) == sorted(PINNED_KEYS)  # (each key once: in a section or at the top)
    for model in (RunReport, SliceCounts, RowCounts, OutputFacts, Timings, Findings):
        assert len(model.model_fields) <= 20, model.__name__


def test_an_up_to_date_report_says_it_checked_and_wrote_nothing():
    report = _report().model_copy(update={"publish": UP_TO_DATE})
    assert "nothing tokenized or written" in report.time_line()
    assert "up to date: published 2025-01-01T00:00:00Z" in report.render()
