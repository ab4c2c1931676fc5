"""What the Prefect UI shows at the end of a run: per-dataset table and a markdown run report."""

from __future__ import annotations

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from sftmix.check.findings import Finding
from sftmix.check.report_page import collect, markdown, upsampling_text
from sftmix.output.report import UP_TO_DATE, RunReport
from sftmix.runtime.storage import is_remote


def dataset_table(report: RunReport, statistics: dict) -> list[dict]:
    """One row per dataset, narrow enough for the UI's table to show whole: the dataset's name, its rows
    (an 'in output' column only when num_examples cut some kept rows), tokens, trained share, upsampling."""
    per = {s["dataset_name"]: s for s in statistics["per_dataset_statistics"]}
    cut = any(
        per.get(d.name, {}).get("final_instances_in_output", d.kept) != d.kept
        for d in report.rows.per_dataset
    )
    rows = []
    for d in report.rows.per_dataset:
        s = per.get(d.name, {})
        tokens = s.get("final_tokens_in_output", 0)
        row: dict = {
            "dataset": d.name,
            "rows": d.selected,
            "kept": d.kept,
            "dropped": ", ".join(f"{k}: {v}" for k, v in d.dropped.items()) or "0",
        }
        if cut:
            row["in output"] = s.get("final_instances_in_output", 0)
        row["tokens"] = tokens
        row["trained %"] = (
            round(100 * s.get("final_trainable_tokens_in_output", 0) / tokens, 1) if tokens else 0
        )
        row["upsampling"] = upsampling_text(s.get("upsampling_factor", 1.0))
        rows.append(row)
    return rows


def report_markdown(report: RunReport) -> str:
    """The run report as the Prefect UI's markdown artifact: a table of what the run did, then the check,
    the digests and the warnings."""
    s, rows, out, found = report.slices, report.rows, report.output, report.findings
    lines = [
        "# tokenize-mixer run",
        "",
        f"**Output** `{report.output_dir}` ({report.publish})",
        "",
        "| what | this run |",
        "|---|---|",
        f"| slices | {s.slices_total} total, {s.slices_computed} computed, {s.slices_reused} reused, "
        f"{s.slices_rechecked} recomputed after a failed check |"
        if report.publish != UP_TO_DATE
        else f"| slices | none run: the output, published {report.published_at}, holds this run's shards |",
        f"| rows | {rows.rows_in} in, {rows.rows_kept} kept, dropped {rows.rows_dropped or 'none'} |",
        f"| documents | {out.documents} in {out.parts} part(s), dtype {out.token_dtype} |",
        f"| tokens | {out.tokens:,} ({out.trainable_tokens:,} trainable) |",
        *(f"| budget | {line} |" for line in found.budgets),
        *(f"| over length | {line} |" for line in found.over_length),
        f"| time | {report.time_line()} |",
    ]
    if report.validation is not None:
        verdict = "matches" if report.validation.matches else "DIFFERS"
        lines.append(f"| reference | `{report.validation.reference}`: {verdict} |")
    if found.check_findings is not None:
        lines += ["", "## Check (tokenize-mixer check)", ""]
        lines += [f"- {Finding(**f).console_line()}" for f in found.check_findings] or [
            "clean: nothing broken, nothing that changes training"
        ]
        if found.check_notes:
            # a list, not a code block: the UI wraps list items, and a code block runs off its right edge
            lines += [""] + [
                ("  - " if note.startswith(" ") else "- ") + note.strip() for note in found.check_notes
            ]
    lines += ["", "## Digests (sha256)", "", "| file | sha256 |", "|---|---|"]
    lines += [f"| `{name}` | `{digest}` |" for name, digest in sorted(out.digests.items())]
    if found.warnings:
        lines += ["", "## Warnings", ""] + [f"- {w}" for w in found.warnings]
    return "\n".join(lines)


def publish_artifacts(report: RunReport, statistics: dict) -> None:
    create_table_artifact(
        table=dataset_table(report, statistics),
        key="tokenize-mixer-datasets",
        description="Per-dataset statistics of this run",
    )
    create_markdown_artifact(
        markdown=report_markdown(report), key="tokenize-mixer-report", description="Run report"
    )
    if not is_remote(report.output_dir):  # the same numbers as `tokenize-mixer report`, from the shards
        create_markdown_artifact(
            markdown=markdown(collect(report.output_dir), image=None),
            key="tokenize-mixer-data-report",
            description="Lengths, trainable fraction and dataset shares (tokenize-mixer report OUTPUT draws them)",
        )
