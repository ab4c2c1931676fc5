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
        per.get(d.name, {}).get("final_instances_in_output", d.kept) != d.kept for d in report.per_dataset
    )
    rows = []
    for d in report.per_dataset:
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
    lines = [
        "# tokenize-mixer run",
        "",
        f"**Output** `{report.output_dir}` ({report.publish})",
        "",
        "| what | this run |",
        "|---|---|",
        f"| slices | {report.slices_total} total, {report.slices_computed} computed, {report.slices_reused} reused, "
        f"{report.slices_rechecked} recomputed after a failed check |"
        if report.publish != UP_TO_DATE
        else f"| slices | none run: the output, published {report.published_at}, holds this run's shards |",
        f"| rows | {report.rows_in} in, {report.rows_kept} kept, dropped {report.rows_dropped or 'none'} |",
        f"| documents | {report.documents} in {report.parts} part(s), dtype {report.token_dtype} |",
        f"| tokens | {report.tokens:,} ({report.trainable_tokens:,} trainable) |",
        *(f"| budget | {line} |" for line in report.budgets),
        *(f"| over length | {line} |" for line in report.over_length),
        f"| time | {report.time_line()} |",
    ]
    if report.validation is not None:
        verdict = "matches" if report.validation.matches else "DIFFERS"
        lines.append(f"| reference | `{report.validation.reference}`: {verdict} |")
    if report.check_findings is not None:
        lines += ["", "## Check (tokenize-mixer check)", ""]
        lines += [f"- {Finding(**f).console_line()}" for f in report.check_findings] or [
            "clean: nothing broken, nothing that changes training"
        ]
        if report.check_notes:
            # a list, not a code block: the UI wraps list items, and a code block runs off its right edge
            lines += [""] + [
                ("  - " if note.startswith(" ") else "- ") + note.strip() for note in report.check_notes
            ]
    lines += ["", "## Digests (sha256)", "", "| file | sha256 |", "|---|---|"]
    lines += [f"| `{name}` | `{digest}` |" for name, digest in sorted(report.digests.items())]
    if report.warnings:
        lines += ["", "## Warnings", ""] + [f"- {w}" for w in report.warnings]
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
