"""A tokenized row and its status: kept, or why it is dropped (the names statistics and reports show).

The masker makes these; the slices, assembly and reports read them, so they stand apart from the masker.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np


class RowStatus(IntEnum):
    KEPT = 0
    NO_TRAINABLE = 1
    SPAN_UNVERIFIED = 2
    BAD_ROW = 3
    LITERAL_SPECIAL = 4  # the row spells a special token, dropped (sftmix.tokenizing.literal_tokens)
    OVER_LENGTH = (
        5  # cut at max_seq_length and dropped at assembly (over_length_strategy drop); never in a slice
    )


#: Why a row was dropped, as shown in statistics and reports.
DROP_REASONS = {
    RowStatus.NO_TRAINABLE: "no_trainable_tokens",
    RowStatus.SPAN_UNVERIFIED: "assistant_span_unverified",
    RowStatus.BAD_ROW: "bad_row",
    RowStatus.LITERAL_SPECIAL: "literal_special_token",
    RowStatus.OVER_LENGTH: "over_length",
}


#: Rows that tokenize but train on nothing: the reference keeps them (all-zero mask) when its chain has no
#: ``sft_tulu_filter_v1`` step.
UNTRAINABLE = frozenset({RowStatus.NO_TRAINABLE, RowStatus.SPAN_UNVERIFIED})


@dataclass
class TokenizedRow:
    ids: np.ndarray
    mask: np.ndarray
    status: RowStatus
    detail: str | None = None
    reference_drops: bool = False  # kept by exact spans; the reference's rule would drop it
    spelled: bool = False  # its text spells a special token, read as text (sftmix.tokenizing.literal_tokens)
    truncated: bool = False  # its render has more than max_seq_length tokens (the kept ones do not cover it)
