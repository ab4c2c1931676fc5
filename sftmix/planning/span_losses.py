"""The share of each dataset that the reference's span check will drop, said before any work.

The check (an assistant turn's tokens, counted from prefix renders, must start at its text and cover it)
can take most of a dataset: 36% of a ShareGPT sample under ``olmo``, nearly every multi-turn chat under a
template that re-renders earlier turns (``olmo_thinker_remove_intermediate_thinking``). The plan runs the
run's own masker over each dataset's sampled rows, so a run that would lose 5% or more of a dataset is
named, with the way to keep those rows (``spans: exact``), before the hours of work.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

from sftmix.sources.reading import DatasetPlan, Opened
from sftmix.tokenizing.row_status import RowStatus
from sftmix.tokenizing.slices import TokenizeContext

logger = logging.getLogger(__name__)

#: A dataset losing at least this share of its rows to the span check is warned of (plan) and named
#: among what changes training (the run's summary).
SPAN_LOSS_SHARE = 0.05

#: What ``spans: exact`` does instead, in the words of the warnings.
KEEPS_THEM = "spans: exact (--spans exact) keeps them, each assistant turn masked by its own characters"


def span_losses(datasets: Sequence[DatasetPlan], opened: Sequence[Opened], ctx: TokenizeContext) -> None:
    """Warn (in each dataset's warnings) of those whose sampled rows the span check drops at
    :data:`SPAN_LOSS_SHARE` or more."""
    if ctx.masking.spans != "reference" or ctx.masking.mask not in ("assistant", "last_turn"):
        return  # (no span check: exact spans, or masks that need no prefix renders)
    for d in datasets:
        dataset = opened[d.index]
        rows = ctx.masked_samples([conv for _, conv in dataset.samples])
        if not rows:
            continue
        failed = [r.detail or "" for r in rows if r.status == RowStatus.SPAN_UNVERIFIED]
        if len(failed) < SPAN_LOSS_SHARE * len(rows):
            continue
        common = Counter(failed).most_common(1)[0][0]
        fate = ctx.masking.untrained_action()
        warning = (
            f"{dataset.entry.path}: the reference's span check will {fate} ~{len(failed) / len(rows):.0%} of its "
            f"rows ({len(failed)} of {len(rows)} sampled rows, most often: {common}), which changes what is "
            f"trained; {KEEPS_THEM}"
        )
        dataset.warnings.append(warning)
        logger.warning(warning)


def span_loss_line(name: str, selected: int, lost: int) -> str | None:
    """The summary's line for a dataset that lost :data:`SPAN_LOSS_SHARE` or more of its rows to the check."""
    if not lost or lost < SPAN_LOSS_SHARE * selected:
        return None
    return (
        f"{name}: {lost:,} of {selected:,} rows ({lost / max(selected, 1):.1%}) dropped by the reference's span "
        f"check (assistant_span_unverified); {KEEPS_THEM}"
    )
