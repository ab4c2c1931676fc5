"""The output's documents in their global order, from the slices' row records: each dataset's kept rows in
selection order (a token budget's rows chosen by their tokens), concatenated in mixer order, shuffled with
``numpy.random.default_rng(seed).permutation``, cut to ``num_examples``; and each dataset's tally (kept, dropped
by reason, cut, what its budget made). Only the row records are read, through their memory maps: what it holds
per output document is one record (:data:`DOCUMENT_DTYPE`)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from sftmix.assembly.over_length import UNMASKED, OverLength, drop_rows, edits, outcome_line
from sftmix.config.selection import TokenBudget, budget_selection, selection_indices
from sftmix.errors import ChecksumError, DatasetError
from sftmix.planning.plan import Plan
from sftmix.sources.reading import DatasetPlan
from sftmix.tokenizing.row_status import DROP_REASONS, RowStatus
from sftmix.tokenizing.slices import SliceManifest, load_over_length, load_slice_rows

logger = logging.getLogger(__name__)


@dataclass
class DatasetTally:
    name: str
    selected: int = 0
    kept: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    budget: str | None = None  # what its token budget made (:func:`budget_line`)
    over_length: str | None = None  # what became of its rows longer than max_seq_length (outcome_line)


#: An output document as the tail needs it, in output order: 41 bytes, the one array that grows with the
#: output's documents while it is written (the slices' row records are read through their memory maps).
#: ``edit``: what over_length_strategy changes as it is written (``sftmix.assembly.over_length``).
DOCUMENT_DTYPE = np.dtype(
    [
        ("dataset", "<i4"),
        ("slice", "<i4"),
        ("row", "<i8"),
        ("offset", "<i8"),
        ("length", "<i8"),
        ("trainable", "<i8"),
        ("edit", "i1"),
    ]
)


def _dataset_documents(
    plan: Plan, manifests: list[SliceManifest], d: DatasetPlan
) -> tuple[np.ndarray, DatasetTally]:
    """A dataset's kept documents in selection order (:data:`DOCUMENT_DTYPE`) and its tally. Of its rows
    only the source row and status are copied (9 bytes a row); the rest is read for kept documents only,
    slice by slice from the row records' memory maps, each mapped only while it is read (a live map holds
    a file descriptor: a dataset may have tens of thousands of slices)."""

    def records(k: int) -> np.ndarray:
        return load_slice_rows(plan.context.output.work_dir, manifests[d.slices[k]])

    budget = d.amount if isinstance(d.amount, TokenBudget) else None
    rows, statuses, counts, cut = [], [], [], []
    for k in range(len(d.slices)):
        r = records(k)
        rows.append(np.array(r["row"], dtype=np.int64))
        statuses.append(np.array(r["status"], dtype=np.int8))
        if budget is not None:  # (what a token budget counts, row by row)
            counts.append(np.array(r["trainable" if budget.trainable else "length"], dtype=np.int64))
        cut.append(load_over_length(plan.context.output.work_dir, manifests[d.slices[k]]))
        del r
    first = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([r.shape[0] for r in rows], out=first[1:])
    row = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    status = np.concatenate(statuses) if statuses else np.zeros(0, np.int8)
    del rows, statuses
    over = OverLength.of(list(zip(first[:-1].tolist(), cut, strict=True)))
    strategy = plan.mixer.over_length_strategy
    drop_rows(status, over, strategy, plan.context.masking)
    if budget is None:
        sel = selection_indices(d.n_rows, d.target)
    else:
        counted = np.concatenate(counts) if counts else np.zeros(0, np.int64)
        if budget.trainable and strategy == "drop":  # (masked whole: nothing of it is trained on)
            counted[over.rows] = 0
        sel, held = _budget_rows(d, budget, row, status, counted)
        del counts, counted
    pos = np.searchsorted(row, sel)
    if pos.size and (pos.max() >= row.shape[0] or not np.array_equal(row[pos], sel)):
        raise ChecksumError(f"dataset {d.name!r}: slice checkpoints do not cover the selected rows; rerun")
    del row, sel
    chosen = status[pos]
    del status
    kept = pos[chosen == RowStatus.KEPT]
    tally = _tally_of(plan, d, pos, chosen, over)
    del pos, chosen
    docs = _kept_documents(d, kept, first, records)
    docs["edit"] = edits(kept, over, strategy, plan.context.masking)
    docs["trainable"][docs["edit"] == UNMASKED] = 0
    if budget is not None:
        made = int(docs["trainable" if budget.trainable else "length"].sum())
        tally.budget = budget_line(d, budget, made, held)
    return docs, tally


def _tally_of(
    plan: Plan, d: DatasetPlan, pos: np.ndarray, chosen: np.ndarray, over: OverLength
) -> DatasetTally:
    """The dataset's selected rows (``pos`` among its records, with their statuses ``chosen``) counted: kept,
    dropped by reason, cut; a dataset with none kept is an error."""
    tally = DatasetTally(name=d.name, selected=int(pos.size), kept=int((chosen == RowStatus.KEPT).sum()))
    for code, count in zip(*np.unique(chosen[chosen != RowStatus.KEPT], return_counts=True), strict=True):
        tally.dropped[DROP_REASONS[RowStatus(int(code))]] += int(count)
    if plan.context.masking.max_seq_length is not None:
        tally.over_length = outcome_line(
            d.name, pos, over, plan.mixer.over_length_strategy, plan.context.masking
        )
    if tally.kept == 0:
        raise DatasetError(
            d.name,
            f"no rows left after tokenization ({tally.selected} selected, dropped: {dict(tally.dropped)})",
        )
    return tally


def _kept_documents(
    d: DatasetPlan, kept: np.ndarray, first: np.ndarray, records: Callable[[int], np.ndarray]
) -> np.ndarray:
    """The kept rows (``kept`` among the dataset's records, slice ``k``'s from ``first[k]``) as documents,
    read slice by slice, each slice's records mapped only while read."""
    docs = np.empty(kept.shape[0], dtype=DOCUMENT_DTYPE)
    docs["dataset"] = d.index
    owner = np.searchsorted(first, kept, side="right") - 1  # which of the dataset's slices
    by_owner = np.argsort(owner, kind="stable")
    bounds = np.searchsorted(owner[by_owner], np.arange(len(d.slices) + 1))
    for k in range(len(d.slices)):
        group = by_owner[bounds[k] : bounds[k + 1]]
        if not group.size:
            continue
        local = kept[group] - first[k]
        r = records(k)
        docs["slice"][group] = d.slices[k]
        for name in ("row", "offset", "length", "trainable"):
            docs[name][group] = r[name][local]
        del r
    return docs


def _budget_rows(
    d: DatasetPlan, budget: TokenBudget, row: np.ndarray, status: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, int]:
    """A token budget's rows in selection order, from every row's tokens in the output (0 for a dropped
    row), and the tokens its rows hold; a budget its rows cannot reach at all is refused."""
    if row.shape[0] != d.n_rows or not np.array_equal(row, np.arange(d.n_rows)):
        raise ChecksumError(f"dataset {d.name!r}: slice checkpoints do not cover every row; rerun")
    tokens = np.where(status == RowStatus.KEPT, counts, 0)
    if not tokens.any():
        what = "trainable tokens" if budget.trainable else "tokens"
        raise DatasetError(d.name, f"amount {budget}: no kept row has {what}")
    return budget_selection(tokens, budget, d.max_repeats), int(tokens.sum())


def budget_line(d: DatasetPlan, budget: TokenBudget, made: int, held: int) -> str:
    """What a token budget made, in the summary's words: against what was asked and what the rows hold."""
    what = "trainable tokens" if budget.trainable else "tokens"
    line = f"{d.name}: {budget} asked, {made:,} made ({made / held:.2f}x the {held:,} {what} of its rows"
    if d.max_repeats is not None and budget.tokens > d.max_repeats * held:
        line += f"; cut at max_repeats {d.max_repeats:g}"
    return line + ")"


def global_order(plan: Plan, manifests: list[SliceManifest]) -> tuple[np.ndarray, list[DatasetTally]]:
    """Every output document in output order (:data:`DOCUMENT_DTYPE`): kept rows per dataset in selection
    order, concatenated in mixer order, shuffled, cut to ``num_examples``."""
    found = [_dataset_documents(plan, manifests, d) for d in plan.datasets]
    tallies = [t for _, t in found]
    every = np.concatenate([docs for docs, _ in found]) if found else np.zeros(0, DOCUMENT_DTYPE)
    del found
    perm = np.random.default_rng(plan.mixer.shuffle_seed).permutation(every.shape[0])
    n = plan.mixer.num_examples
    if n > 0:
        if n > perm.shape[0]:
            logger.warning(
                "num_examples=%d but only %d rows were kept: writing all of them", n, perm.shape[0]
            )
        perm = perm[:n]
    # (gathered as opaque records: numpy copies each whole, where a structured gather goes field by
    # field, 4-7x slower at 450k documents)
    records = np.ascontiguousarray(every).view(f"V{DOCUMENT_DTYPE.itemsize}")
    return records[perm].view(DOCUMENT_DTYPE), tallies
