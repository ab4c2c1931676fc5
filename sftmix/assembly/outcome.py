"""What a run made: the slices' outcome (computed or reused, how fast), the check of the staged output as
the writers run it, and the run's report built from the plan, that outcome and the assembled output. Core
objects, so the report is made and tested without a Prefect API; the flow adds the tail's times and the
publish."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sftmix.assembly.assemble import AssembleResult
from sftmix.check.findings import CheckReport, Recorded, check_output
from sftmix.config.run_options import RunOptions
from sftmix.output.report import (
    DatasetReport,
    Findings,
    OutputFacts,
    RowCounts,
    RunReport,
    SliceCounts,
    Timings,
    Validation,
)
from sftmix.planning.plan import Plan
from sftmix.planning.span_losses import span_loss_line
from sftmix.tokenizing.row_status import DROP_REASONS, RowStatus
from sftmix.tokenizing.slices import SliceManifest
from sftmix.tokenizing.unrendered import counted_lines

#: Examples of dropped rows a report keeps.
DROP_EXAMPLES = 20


@dataclass
class SliceOutcome:
    manifests: list[SliceManifest]
    computed: int
    reused: int
    rechecked: int
    seconds: float
    steady_seconds: float
    steady_tokens_per_second: float
    computed_tokens: int = 0  # tokens of the slices computed in this run (not reused)

    @classmethod
    def of(
        cls, manifests: list[SliceManifest], reused: list[bool], seconds: float, rechecked: int = 0
    ) -> SliceOutcome:
        """The outcome of ``manifests`` (in plan order), ``reused[i]`` telling the ones not computed now;
        the steady window spans the computed ones."""
        fresh = [m for m, r in zip(manifests, reused, strict=True) if not r]
        span = max((m.timing.finished_at for m in fresh), default=0.0) - min(
            (m.timing.started_at for m in fresh), default=0.0
        )
        return cls(
            manifests=manifests,
            computed=len(fresh),
            reused=len(manifests) - len(fresh),
            rechecked=rechecked,
            seconds=seconds,
            steady_seconds=round(max(span, 0.0), 3),
            steady_tokens_per_second=round(sum(m.tokens for m in fresh) / span, 1) if span > 0 else 0.0,
            computed_tokens=sum(m.tokens for m in fresh),
        )


def check_for(
    plan: Plan, run: RunOptions, staging: Path, documents: Path, outcome: SliceOutcome, drift: dict | None
) -> Callable[..., CheckReport] | None:
    """The check of the staged output with this run's facts (the writers call it as they write, so one
    read of each chunk gives findings and digests); ``None`` where ``run.check`` is off or the output is
    not OLMo-core's."""
    if run.check == "off" or plan.mixer.output.format != "olmo":
        return None
    recorded = Recorded(
        token_dtype=plan.context.output.token_dtype,
        template=drift,
        documents_file=str(documents),
        dataset_names=[d.name for d in plan.datasets],
        unrendered=plan.unrendered,
        literal=plan.context.tokenizer.literal_report(outcome.manifests),
        tokenizer_load_note=plan.tokenizer_load_note or "",
        # strict refuses an output with findings, unpublished: its document numbers open nothing
        published=run.check != "strict",
    )
    return functools.partial(check_output, staging, plan.mixer.max_seq_length, recorded=recorded)


_SPAN_DROPS = DROP_REASONS[RowStatus.SPAN_UNVERIFIED]


def _training_lines(result: AssembleResult) -> list[str]:
    """What the span check's drops cost each dataset's training, where they cost it anything."""
    lines = (span_loss_line(t.name, t.selected, t.dropped.get(_SPAN_DROPS, 0)) for t in result.tallies)
    return [line for line in lines if line is not None]


def run_report(
    plan: Plan,
    outcome: SliceOutcome,
    result: AssembleResult,
    digests: dict[str, str],
    validation: Validation | None,
    plan_seconds: float,
) -> RunReport:
    """The report of an assembled output, before its tail's times, the check's findings and the publish."""
    manifests = outcome.manifests
    return RunReport(
        output_dir=plan.mixer.output.path,
        slices=SliceCounts(
            slices_total=len(plan.slices),
            slices_computed=outcome.computed,
            slices_reused=outcome.reused,
            slices_rechecked=outcome.rechecked,
        ),
        rows=_row_counts(plan, result, manifests),
        output=OutputFacts(
            documents=result.documents,
            tokens=result.tokens,
            trainable_tokens=result.trainable_tokens,
            parts=result.parts,
            whole_document_parts=plan.mixer.output.parts == "whole_documents",
            token_dtype=plan.context.output.token_dtype,
            digests=digests,
            documents_file=result.documents_path,
        ),
        timings=Timings(
            wall_seconds=0.0,
            plan_seconds=plan_seconds,
            plan_ahead_seconds=plan.seconds if plan.made_ahead else None,
            tokenize_seconds=round(outcome.seconds, 3),
            tokens_per_second=_throughput(outcome),
            steady_seconds=outcome.steady_seconds,
            steady_tokens_per_second=outcome.steady_tokens_per_second,
        ),
        findings=Findings(
            budgets=[t.budget for t in result.tallies if t.budget is not None],
            over_length=[t.over_length for t in result.tallies if t.over_length is not None],
            training=_training_lines(result),
            warnings=plan.warnings,
            unrendered=plan.unrendered,
            unrendered_rows=_unrendered_rows(plan, manifests),
            tokenizer_load=plan.context.tokenizer.load,
            tokenizer_load_note=plan.tokenizer_load_note,
            literal=plan.context.tokenizer.literal_report(manifests),
        ),
        validation=validation,
    )


def _row_counts(plan: Plan, result: AssembleResult, manifests: list[SliceManifest]) -> RowCounts:
    """The rows in, kept and dropped, overall and per dataset, with examples of the drops."""
    dropped: Counter[str] = Counter()
    for t in result.tallies:
        dropped.update(t.dropped)
    return RowCounts(
        rows_in=sum(t.selected for t in result.tallies),
        rows_kept=sum(t.kept for t in result.tallies),
        rows_dropped=dict(sorted(dropped.items())),
        datasets=[d.name for d in plan.datasets],
        per_dataset=[
            DatasetReport(name=t.name, selected=t.selected, kept=t.kept, dropped=dict(t.dropped))
            for t in result.tallies
        ],
        rows_kept_by_exact_spans=sum(m.findings.kept_by_exact_spans for m in manifests),
        untrainable_documents=result.untrainable_documents,
        drop_examples=[{"dataset": m.dataset, **e} for m in manifests for e in m.findings.drop_examples][
            :DROP_EXAMPLES
        ],
    )


def _throughput(outcome: SliceOutcome) -> float:
    """One throughput everywhere: tokens of the slices computed in this run over the tokenizing time."""
    if outcome.computed_tokens and outcome.seconds > 0:
        return round(outcome.computed_tokens / outcome.seconds, 1)
    return 0.0


def _unrendered_rows(plan: Plan, manifests: list[SliceManifest]) -> list[str]:
    """Per dataset, the rows holding each field or role the template never renders, counted by its slices."""
    lines: list[str] = []
    for d in plan.datasets:
        lines += counted_lines(
            d.name,
            plan.slices[d.slices[0]].unrendered if d.slices else [],
            [manifests[k].findings.unrendered_rows for k in d.slices],
            sum(manifests[k].rows for k in d.slices),
        )
    return lines
