"""What ``over_length_strategy`` makes of the rows cut at ``max_seq_length``, applied at assembly.

Every slice records its kept rows whose render has more tokens than ``max_seq_length``, and whether the
last kept token of each is trainable (``sftmix.tokenizing.slices.OVER_LENGTH``); the slice's tokens are
the reference's (``keep``). So the strategy changes only what is written from them, and a changed strategy
tokenizes nothing again:

- ``keep``: as the reference, the row keeps its cut end, trained on, without EOS;
- ``terminate``: where the last kept token is trainable, its id becomes EOS and stays trainable; a cut in
  text that is not trained on (a later user turn) is left as it is;
- ``drop``: the row is masked whole, so the reference's filter of untrainable rows (``sft_tulu_filter_v1``)
  removes it; without that filter it is kept with nothing trained on, as the reference keeps such rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sftmix.tokenizing.masking import Masking
from sftmix.tokenizing.row_status import RowStatus

#: A document's change at writing (``DOCUMENT_DTYPE``'s ``edit``): none, its last token becomes EOS, or
#: its mask becomes all zero.
UNCHANGED, TERMINATED, UNMASKED = 0, 1, 2


@dataclass
class OverLength:
    """A dataset's rows longer than ``max_seq_length`` (positions among its row records, ascending) and
    whether each one's last kept token is trainable."""

    rows: np.ndarray
    trainable_end: np.ndarray

    @classmethod
    def of(cls, pieces: list[tuple[int, np.ndarray]]) -> OverLength:
        """From each slice's records (``OVER_LENGTH_DTYPE``) with the position of its first row record."""
        rows = [first + found["index"] for first, found in pieces]
        ends = [found["trainable_end"] for _, found in pieces]
        return cls(
            np.concatenate(rows) if rows else np.zeros(0, np.int64),
            np.concatenate(ends).astype(bool) if ends else np.zeros(0, bool),
        )

    def edited(self, strategy: str) -> np.ndarray:
        """The rows whose written document the strategy changes (at assembly, not in the slices)."""
        if strategy == "terminate":
            return self.rows[self.trainable_end]
        if strategy == "drop":
            return self.rows
        return self.rows[:0]


def drop_rows(status: np.ndarray, over: OverLength, strategy: str, masking: Masking) -> None:
    """``drop`` with the filter on: the cut rows are dropped (their status, a copy of the records', says so)."""
    if masking.drops_masked_whole(strategy):
        cut = over.rows[status[over.rows] == RowStatus.KEPT]
        status[cut] = RowStatus.OVER_LENGTH


def edits(kept: np.ndarray, over: OverLength, strategy: str, masking: Masking) -> np.ndarray:
    """Each kept row's change at writing (:data:`UNCHANGED`, :data:`TERMINATED`, :data:`UNMASKED`)."""
    out = np.zeros(kept.shape[0], np.int8)
    changed = over.edited(strategy)
    if changed.size and not masking.drops_masked_whole(strategy):
        out[np.isin(kept, changed)] = TERMINATED if strategy == "terminate" else UNMASKED
    return out


def outcome_line(
    name: str, selected: np.ndarray, over: OverLength, strategy: str, masking: Masking
) -> str | None:
    """What became of the dataset's selected rows longer than ``max_seq_length``, in the summary's words (``None``
    where there are none). ``selected``: positions among the row records, a row once per time it is taken."""
    cut = np.isin(selected, over.rows)
    n = int(cut.sum())
    if not n:
        return None
    head = f"{name}: {n:,} rows longer than max_seq_length {masking.max_seq_length}"
    if strategy == "drop":
        return f"{head}: {n:,} {masking.untrained_fate()} (over_length_strategy drop)"
    ended = int(np.isin(selected[cut], over.rows[over.trainable_end]).sum())  # (cut in trained text)
    if strategy == "keep":
        return (
            f"{head}: {n:,} kept without EOS, {ended:,} of them cut in trained text "
            "(over_length_strategy terminate ends those with a trainable EOS)"
        )
    line = f"{head}: {ended:,} ended with a trainable EOS (over_length_strategy terminate)"
    if n > ended:
        line += f", {n - ended:,} kept without EOS (cut in text that is not trained on)"
    return line
