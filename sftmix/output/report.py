"""The short report every run ends with: printed, and written as ``run_report.json``."""

from __future__ import annotations

from pydantic import BaseModel, Field

from sftmix.config.config import UNTRAINABLE_KEPT
from sftmix.runtime.sections import FlatSections
from sftmix.tokenizing.literal_tokens import LiteralReport


class _CommandClock:
    """When the command that runs the flow in this process started (set by the CLI; ``None`` when a
    Prefect worker started the flow), so the report can give the whole command's time."""

    started: float | None = None


COMMAND_CLOCK = _CommandClock()


#: ``RunReport.publish`` of a run that found the output already holding its shards and rewrote nothing.
UP_TO_DATE = "up to date"

#: Why a row is dropped, in words (the keys are the reasons in run_report.json and the statistics).
DROP_WORDS = {
    "assistant_span_unverified": "the reference's check that an assistant turn's tokens start at and cover "
    "its text failed (known causes: a chat that opens with an assistant turn; an assistant turn whose "
    "content starts with whitespace under a template that is not prefix-stable; a template that renders "
    "earlier turns otherwise in the whole chat, as the thinker templates that remove earlier thinking; a "
    "tokenizer whose normalizer changes the text, NFKC); the reference drops these too, and `spans: exact` "
    "keeps them",
    "no_trainable_tokens": "no assistant token is left to train on (no assistant turn, or all of it past "
    "max_seq_length)",
    "bad_row": "malformed and skipped (on_bad_row: skip); run_report.json names examples",
    "over_length": "longer than max_seq_length, dropped by over_length_strategy drop",
}


def drop_lines(selected: int, dropped: dict[str, int], indent: str = "    ") -> list[str]:
    """One line per drop reason: the count, its share of the rows and the reason in words."""
    return [
        f"{indent}{n:,} ({100 * n / max(selected, 1):.1f}%) {reason}: {DROP_WORDS.get(reason, reason)}"
        for reason, n in sorted(dropped.items(), key=lambda kv: -kv[1])
        if n
    ]


class DatasetReport(BaseModel):
    name: str
    selected: int
    kept: int
    dropped: dict[str, int]


class Validation(BaseModel):
    reference: str
    matches: bool
    details: str


class SliceCounts(BaseModel):
    """How many slices the run had, and where each came from."""

    slices_total: int
    slices_computed: int
    slices_reused: int
    slices_rechecked: int = Field(
        0, description="Cached slices whose files failed their digest and were recomputed."
    )


class RowCounts(BaseModel):
    """The source rows: read, kept and dropped (with examples), overall and per dataset."""

    rows_in: int
    rows_kept: int
    rows_dropped: dict[str, int]
    datasets: list[str]
    per_dataset: list[DatasetReport]
    rows_kept_by_exact_spans: int = Field(
        0, description="Source rows kept with spans: exact that the reference's span rule would have dropped."
    )
    untrainable_documents: int = Field(0, description=UNTRAINABLE_KEPT)
    drop_examples: list[dict] = Field(
        default_factory=list, description="Up to 20 dropped or skipped rows: dataset, row, reason, detail."
    )


class OutputFacts(BaseModel):
    """What the output holds: documents, tokens, parts, its files' digests and the run's document map."""

    documents: int
    tokens: int
    trainable_tokens: int
    parts: int
    whole_document_parts: bool = Field(
        False, description="The parts end at documents' ends (output.parts whole_documents), none cut."
    )
    token_dtype: str
    digests: dict[str, str]
    documents_file: str = Field(
        description="The run's document map (each document's dataset and row), which `tokenize-mixer report` "
        "and `inspect` read: in the work directory, so it lasts as long as that does."
    )


class Timings(BaseModel):
    """Where the run's time went, and its throughput."""

    wall_seconds: float = Field(description="The flow, from its start to the published output.")
    command_seconds: float | None = Field(
        None, description="The whole CLI command, the temporary Prefect API's start-up included."
    )
    first_slice_seconds: float | None = Field(
        None,
        description="When the first slice this command tokenized began, from the command's start: slices "
        "begin while the temporary Prefect API starts, and while the plan still reads a large file.",
    )
    plan_seconds: float = Field(
        0.0, description="The flow's plan: the output checks and planning, from the flow's start."
    )
    plan_ahead_seconds: float | None = Field(
        None,
        description="Where the command made the plan while the Prefect API started (part of its start-up, "
        "then handed to the flow): how long that took.",
    )
    tokenize_seconds: float
    assemble_seconds: float = Field(
        0.0, description="Writing the shards from the slices, in the output's order."
    )
    verify_seconds: float = Field(
        0.0,
        description="The output's check and digests (one read of it) and the comparison with a reference.",
    )
    tokens_per_second: float = Field(
        description="Tokens of the slices computed in this run / tokenize_seconds (0 when every slice was reused)."
    )
    steady_seconds: float = Field(
        0.0, description="First slice start to last slice end, over the slices computed in this run."
    )
    steady_tokens_per_second: float = Field(
        0.0, description="Tokens of the slices computed / steady_seconds."
    )
    time: str = Field(
        "",
        description="The times above in words: command_seconds is the whole command (the temporary Prefect "
        "API's start-up included), wall_seconds the flow alone.",
    )

    def line(self, up_to_date: bool) -> str:
        """The times in words: start-up, planning, tokenizing, writing (``up_to_date``: checking only)."""
        total = self.command_seconds if self.command_seconds is not None else self.wall_seconds
        if up_to_date:
            return (
                f"{total:.1f} s: the output checked against this run's inputs; nothing tokenized or written"
            )
        tail = max(self.wall_seconds - self.plan_seconds - self.tokenize_seconds, 0.0)
        parts = []
        if self.command_seconds is not None:
            within = [
                *(
                    [f"{self.plan_ahead_seconds:.1f} s of it planning"]
                    if self.plan_ahead_seconds is not None
                    else []
                ),
                *(
                    [f"the first slice began at {self.first_slice_seconds:.1f} s"]
                    if self.first_slice_seconds is not None
                    else []
                ),
            ]
            began = f" ({'; '.join(within)})" if within else ""
            parts.append(f"{self.command_seconds - self.wall_seconds:.1f} s start-up{began}")
        if self.plan_ahead_seconds is None or self.command_seconds is None:
            parts.append(f"{self.plan_seconds:.1f} s planning")
        parts.append(
            f"{self.tokenize_seconds:.1f} s tokenizing ({self.tokens_per_second:,.0f} tokens/s)"
            if self.tokens_per_second
            else f"{self.tokenize_seconds:.1f} s checking reused slices"
        )
        if self.assemble_seconds or self.verify_seconds:
            parts.append(
                f"{tail:.1f} s writing the output ({self.assemble_seconds:.1f} s assembling, "
                f"{self.verify_seconds:.1f} s checking; publishing follows)"
            )
        else:
            parts.append(f"{tail:.1f} s assembling, validating and checking (publishing follows)")
        return f"{total:.1f} s: " + ", ".join(parts)


class Findings(BaseModel):
    """What the run found besides counts: the check's findings and notes, what changes training, budgets and
    rows over length, the template and tokenizer, fields the template leaves out, and warnings."""

    check_findings: list[dict] | None = Field(
        None,
        description="What `tokenize-mixer check` found in the output before it was published (run.check).",
    )
    budgets: list[str] = Field(
        default_factory=list,
        description="What each token budget made: tokens asked, made, and the passes over its rows.",
    )
    over_length: list[str] = Field(
        default_factory=list,
        description="Per dataset, its rows longer than max_seq_length and what over_length_strategy made of them.",
    )
    training: list[str] = Field(
        default_factory=list,
        description="What the check found that changes training (and documents cut at max_seq_length), a line "
        "each, as the summary says them.",
    )
    check_notes: list[str] | None = Field(
        None, description="What the check measured besides findings: OLMo-core fit, template drift."
    )
    template_drift: dict | None = Field(
        None,
        description="The chat template used against the tokenizer's own: shipped none, same or differs "
        "(with a unified diff excerpt).",
    )
    warnings: list[str] = Field(default_factory=list)
    unrendered: list[str] = Field(
        default_factory=list,
        description="Message fields and roles in the sample rows that the chat template never renders.",
    )
    unrendered_rows: list[str] = Field(
        default_factory=list,
        description="The rows holding each unrendered field or role, counted by the slices over every row.",
    )
    tokenizer_load: str = Field(
        "reference",
        description="How the tokenizer was built: as the reference's transformers 5.4.0 does, or as its files say.",
    )
    tokenizer_load_note: str | None = Field(
        None,
        description="Where the reference builds the tokenizer otherwise than its own files say, what it replaces "
        "and the share of sampled rows whose ids change.",
    )
    literal: LiteralReport = Field(
        default_factory=LiteralReport, description="What the run did with special tokens its rows spell."
    )

    def template_lines(self) -> list[str]:
        """The chat template the rows were rendered with, where it came from (an unknown name that fell back
        to the tokenizer's own says so here too), and whether the tokenizer ships the same one."""
        if not self.template_drift:
            return []
        drift = self.template_drift
        shipped = {
            "same": "the tokenizer's own",
            "differs": "differs from the tokenizer's own",
            "none": "the tokenizer ships none",
        }.get(str(drift.get("shipped")), "")
        sha = str(drift.get("used_sha256", ""))[:12]
        return [f"template    {drift.get('source')} (sha256 {sha}; {shipped})"]


#: The keys of ``run_report.json`` in their order: the file is read by users, ``tokenize-mixer check``, the
#: up-to-date check and scripts, so it stays as it was when ``RunReport`` was one flat class.
RUN_REPORT_KEYS = (
    "output_dir", "publish", "published_at",
    "slices_total", "slices_computed", "slices_reused", "slices_rechecked",
    "rows_in", "rows_kept", "rows_dropped", "datasets", "per_dataset", "documents", "rows_kept_by_exact_spans",
    "untrainable_documents", "tokens", "trainable_tokens", "parts", "whole_document_parts", "token_dtype",
    "wall_seconds", "command_seconds", "first_slice_seconds", "plan_seconds", "plan_ahead_seconds",
    "tokenize_seconds", "assemble_seconds", "verify_seconds", "tokens_per_second", "steady_seconds",
    "steady_tokens_per_second", "digests", "drop_examples", "validation", "check_findings", "budgets",
    "over_length", "training", "check_notes", "template_drift", "documents_file", "warnings", "unrendered",
    "unrendered_rows", "tokenizer_load", "tokenizer_load_note", "literal", "time",
)  # fmt: skip


class RunReport(FlatSections):
    """The run's report, in sections (``slices``, ``rows``, ``output``, ``timings``, ``findings``) whose
    fields are written flat, as ``run_report.json``'s keys."""

    SECTIONS = ("slices", "rows", "output", "timings", "findings")
    KEY_ORDER = RUN_REPORT_KEYS

    output_dir: str
    publish: str = ""
    published_at: str | None = Field(
        None,
        description="When the output was published (UTC): by this run, or, for a run that found it up to "
        "date, by the run that made it.",
    )
    slices: SliceCounts
    rows: RowCounts
    output: OutputFacts
    timings: Timings
    findings: Findings = Field(default_factory=Findings)
    validation: Validation | None = None

    def time_line(self) -> str:
        """The run's times in words, as the summary and ``time`` say them."""
        return self.timings.line(self.publish == UP_TO_DATE)

    def render(self) -> str:
        """The run's summary, a line per concern, as the command prints it."""
        found, out = self.findings, self.output
        lines = [
            *self._head_lines(),
            *found.template_lines(),
            *self._rows_lines(),
            # counted over every row, or else found in the sample rows
            *(f"unrendered  {line}" for line in found.unrendered_rows or found.unrendered),
            *(
                [f"tokenizer   {found.tokenizer_load_note.removeprefix('tokenizer ')}"]
                if found.tokenizer_load_note
                else []
            ),
            *found.literal.lines(self.rows.rows_dropped.get("literal_special_token", 0)),
            f"documents   {out.documents:,} in {out.parts:,} part(s)"
            f"{' of whole documents' if out.whole_document_parts else ''}, {out.tokens:,} tokens "
            f"({out.trainable_tokens:,} trainable), dtype {out.token_dtype}",
            *(f"budget      {line}" for line in found.budgets),
            *(f"over length {line}" for line in found.over_length),
            *(f"training    {line}" for line in found.training),
            "time        " + self.time_line(),
        ]
        if self.validation is not None:
            verdict = "MATCHES" if self.validation.matches else "DIFFERS"
            lines.append(f"reference   {self.validation.reference}: {verdict}")
        return "\n".join(lines)

    def _head_lines(self) -> list[str]:
        """The output, and its slices (none for an output found up to date)."""
        if self.publish == UP_TO_DATE:
            return [
                f"output      {self.output_dir} (up to date: published {self.published_at} from this run's "
                "recipe, every file as published; nothing was rewritten, --force makes it again)"
            ]
        s = self.slices
        return [
            f"output      {self.output_dir} ({self.publish})",
            f"slices      {s.slices_total:,} total: {s.slices_computed:,} computed, {s.slices_reused:,} reused"
            + (f", {s.slices_rechecked:,} recomputed after a failed check" if s.slices_rechecked else ""),
        ]

    def _rows_lines(self) -> list[str]:
        """Rows in, kept and dropped; then, per dataset with drops, each reason in words with its share."""
        rows = self.rows
        dropped = sum(rows.rows_dropped.values())
        line = f"rows        {rows.rows_in:,} in, {rows.rows_kept:,} kept"
        if rows.untrainable_documents:
            line += f" ({rows.untrainable_documents:,} with no trainable token)"
        line += f", {dropped:,} dropped" + (" (why, per dataset, below)" if dropped else "")
        lines = [line]
        for d in rows.per_dataset:
            if not any(d.dropped.values()):
                continue
            share = 100 * d.kept / max(d.selected, 1)
            lines.append(f"  {d.name}: {d.selected:,} in, {d.kept:,} kept ({share:.1f}%)")
            lines += drop_lines(d.selected, d.dropped)
        return lines
