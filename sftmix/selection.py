"""Mixer amounts become row selections: full passes over the dataset plus a seeded draw.

Pure functions, no I/O: this is the reference's row-selection rule (SPEC.md, Inputs) and must not
change, because every selected row's position feeds the byte-exact output.
"""

from __future__ import annotations

import logging

import numpy as np

from .errors import ConfigError

logger = logging.getLogger(__name__)

#: The reference seeds the extra-row draw with 42 for every dataset, whatever the shuffle seed.
SELECTION_SEED = 42

Amount = float | int


def parse_amount(text: str | float | int) -> Amount:
    """``"0.5"``/``"3.0"`` is a fraction (a ``.`` makes it one), ``"100"`` is a row count."""
    if isinstance(text, bool):
        raise ConfigError(f"amount must be a number, got {text!r}")
    if isinstance(text, int | float):
        value: Amount = text
    else:
        raw = str(text).strip()
        try:
            value = float(raw) if "." in raw else int(raw)
        except ValueError:
            raise ConfigError(
                f"amount {text!r} is not a number: write a fraction with a '.' (1.0 = all rows, 3.0 = upsample 3x) "
                "or a whole row count (100)"
            ) from None
    if not value > 0 or value != value or value == float("inf"):
        raise ConfigError(f"amount must be greater than 0 (got {text!r})")
    return value


def target_rows(amount: Amount, n_rows: int) -> int:
    """How many rows a dataset of ``n_rows`` contributes, exactly as the reference computes it."""
    if isinstance(amount, int) and amount > n_rows:
        return amount
    if isinstance(amount, float):
        return int(amount * n_rows)
    return int(amount)


def small_count_warning(name: str, amount: Amount, n_rows: int) -> str | None:
    """The reference warns on counts like ``1`` that were probably meant as ``1.0``."""
    if isinstance(amount, int) and amount <= 10 and n_rows > 100:
        return (
            f"dataset {name!r}: using only {amount} row(s) of {n_rows}. Did you mean '{float(amount)}' "
            f"({amount * 100}% of the dataset)? Whole numbers are row counts, numbers with a '.' are fractions."
        )
    return None


def extra_rows(n_rows: int, target: int) -> np.ndarray:
    """The ``target % n_rows`` rows drawn without replacement after the full passes."""
    k = target % n_rows if n_rows else 0
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    rng = np.random.RandomState(SELECTION_SEED)
    return rng.choice(n_rows, size=k, replace=False).astype(np.int64)


def selection_indices(n_rows: int, target: int) -> np.ndarray:
    """Source row of every selected position, in selection order (full passes, then the draw)."""
    if n_rows <= 0:
        return np.zeros(0, dtype=np.int64)
    full = target // n_rows
    passes = np.tile(np.arange(n_rows, dtype=np.int64), full)
    return np.concatenate([passes, extra_rows(n_rows, target)])


def selected_source_rows(n_rows: int, target: int) -> np.ndarray | None:
    """Sorted unique source rows that are selected at least once; ``None`` means every row."""
    if n_rows > 0 and target >= n_rows:
        return None
    return np.sort(extra_rows(n_rows, target))
