"""A plan's rows as its slices make them, tokenized in this process (no flow, no Prefect API)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from sftmix.planning.plan import Plan
from sftmix.tokenizing.slices import load_slice_arrays, tokenize_slice


def tokenized_rows(plan: Plan) -> Iterator[tuple[Any, np.ndarray | None, np.ndarray | None]]:
    """Each row of each slice, in plan order: its record (``row``, ``status``, ...), and a kept row's tokens
    and label mask (``None`` for a dropped one)."""
    for spec in plan.slices:
        tokens, masks, records = load_slice_arrays(
            plan.context.output.work_dir, tokenize_slice(spec, plan.context)
        )
        for r in records:
            if r["offset"] < 0:
                yield r, None, None
                continue
            at = slice(int(r["offset"]), int(r["offset"] + r["length"]))
            yield r, np.asarray(tokens[at]), np.asarray(masks[at])
