"""Mixer amounts become row selections: full passes over the dataset plus a seeded draw.

Pure functions, no I/O: this is the reference's row-selection rule (open-instruct's dataset mixer) and must not
change, because every selected row's position feeds the byte-exact output.
"""

from __future__ import annotations

import logging
import re

import numpy as np
from pydantic import BaseModel, ConfigDict

from sftmix.errors import ConfigError

logger = logging.getLogger(__name__)

#: The reference seeds the extra-row draw with 42 for every dataset, whatever the shuffle seed.
SELECTION_SEED = 42


class TokenBudget(BaseModel):
    """An amount in tokens (ours; the reference has none): rows in a seeded order until the dataset's
    documents hold ``tokens`` tokens (``trainable``: trainable tokens), whole passes first when it exceeds
    the dataset (:func:`budget_selection`)."""

    model_config = ConfigDict(frozen=True)

    tokens: int
    trainable: bool = False

    def __str__(self) -> str:
        return amount_text(self)


Amount = float | int | TokenBudget

#: A token budget as written: ``"50M tokens"``, ``"20M trainable tokens"``, ``"150k tokens"``, ``"1.5B tokens"``.
BUDGET_PATTERN = r"(\d+(?:\.\d+)?)\s*([kKmMbB]?)\s+(trainable\s+)?tokens"
_SCALES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9}


def _budget(raw: str) -> TokenBudget | None:
    found = re.fullmatch(BUDGET_PATTERN, raw.strip())
    if found is None:
        return None
    number, scale, trainable = found.groups()
    return TokenBudget(tokens=round(float(number) * _SCALES[scale.lower()]), trainable=bool(trainable))


def parse_amount(text: str | float | int | TokenBudget) -> Amount:
    """``"0.5"``/``"3.0"`` is a fraction (a ``.`` makes it one), ``"100"`` is a row count, ``"50M tokens"``
    a token budget."""
    if isinstance(text, bool):
        raise ConfigError(f"amount must be a number, got {text!r}")
    if isinstance(text, int | float | TokenBudget):
        value: Amount = text
    elif isinstance(text, dict):
        value = TokenBudget.model_validate(text)
    elif (budget := _budget(str(text))) is not None:
        value = budget
    else:
        raw = str(text).strip()
        try:
            value = float(raw) if "." in raw else int(raw)
        except ValueError:
            raise ConfigError(
                f"amount {text!r} is not a number: write a fraction with a '.' (1.0 = all rows, 3.0 = upsample 3x), "
                'a whole row count (100) or a token budget ("50M tokens", "20M trainable tokens")'
            ) from None
    number = value.tokens if isinstance(value, TokenBudget) else value
    if not number > 0 or number != number or number == float("inf"):
        raise ConfigError(f"amount must be greater than 0 (got {text!r})")
    return value


def amount_text(amount: Amount) -> str:
    """The amount as the reference's CLI would be given it: a float always with a '.', an int without.
    JSON (and so the Prefect UI) has no 3 vs 3.0; as text, the meaning survives every round trip. A token
    budget in the largest unit that writes it whole (``"50M tokens"``)."""
    if isinstance(amount, TokenBudget):
        n = amount.tokens
        unit = next(u for u in ("B", "M", "k", "") if n % _SCALES[u.lower()] == 0)
        return f"{n // _SCALES[unit.lower()]}{unit} {'trainable ' if amount.trainable else ''}tokens"
    if isinstance(amount, int):
        return str(amount)
    text = repr(float(amount))
    return text if "." in text else format(amount, "f")


def every_row(amount: Amount) -> bool:
    """Whether the amount selects every row of a dataset, whatever their count (so its slices can be cut
    while its rows are counted): a fraction of 1.0 or more, or a token budget (its rows are chosen once
    they are tokenized)."""
    return isinstance(amount, TokenBudget) or (isinstance(amount, float) and amount >= 1.0)


def target_rows(amount: Amount, n_rows: int) -> int:
    """How many rows a dataset of ``n_rows`` contributes, exactly as the reference computes it (a token
    budget: every row is tokenized, its rows are chosen from their tokens)."""
    if isinstance(amount, TokenBudget):
        return n_rows
    if isinstance(amount, int) and amount > n_rows:
        return amount
    if isinstance(amount, float):
        return int(amount * n_rows)
    return int(amount)


#: The most rows a mixer may select, all datasets together: a signed 32-bit count. No SFT mixture comes
#: near it (tulu-3's has under a million rows), so an amount beyond it is a typo, refused by the plan
#: before anything is allocated for it (the selection and the output order are arrays of that length).
MAX_SELECTED_ROWS = 2**31 - 1

#: Memory the assembly keeps per selected row (row records, selection, global order, document table
#: and boundaries): measured 180 bytes (olmo output) to 284 bytes (hf_parquet) for short rows; the
#: plan refuses a selection whose assembly would surely not fit in memory.
ASSEMBLE_BYTES_PER_ROW = 180


def _count(n: int | float) -> str:
    return f"{n:,.0f}" if n < 1e15 else f"{n:.3g}"


def selection_problem(
    amount: Amount, n_rows: int, target: int, mixer_total: int, memory: int | None
) -> str | None:
    """Why a dataset's ``target`` rows (``mixer_total`` with the datasets before it) are too many to
    select, or ``None``: more than :data:`MAX_SELECTED_ROWS`, or more than ``memory`` bytes can
    assemble at :data:`ASSEMBLE_BYTES_PER_ROW` each."""
    what = f"amount {amount} selects {_count(target)} rows from its {_count(n_rows)}"
    if target > n_rows:
        what += f" (each row {_count(target / n_rows)} times)"
    if mixer_total > target:
        what += f", {_count(mixer_total)} in the whole mixer"
    fix = "; give a smaller amount (1.0 = every row once, 3.0 = upsample 3x, 1000 = 1000 rows)"
    if mixer_total > MAX_SELECTED_ROWS:
        return (
            f"{what}: a mixer may select at most {_count(MAX_SELECTED_ROWS)} rows (2**31 - 1, a signed 32-bit "
            f"count; no SFT mixture comes near it){fix}"
        )
    need = mixer_total * ASSEMBLE_BYTES_PER_ROW
    if memory is not None and need > memory:
        return (
            f"{what}: assembling the output keeps about {ASSEMBLE_BYTES_PER_ROW} bytes per selected row in "
            f"memory, {need / 2**30:.1f} GiB here, more than this machine's {memory / 2**30:.1f} GiB{fix}"
        )
    return None


def small_count_warning(name: str, amount: Amount, n_rows: int) -> str | None:
    """The reference warns on counts like ``1`` that were probably meant as ``1.0``."""
    if isinstance(amount, int) and amount <= 10 and n_rows > 100:
        return (
            f"dataset {name!r}: using only {amount} row(s) of {n_rows}. Did you mean '{float(amount)}' "
            f"({amount * 100}% of the dataset)? Whole numbers are row counts, numbers with a '.' are fractions."
        )
    return None


#: Repeats of each row from which the plan warns of an upsampling (``100000.0`` for ``1.0`` is a typo
#: that makes a hundred thousand copies of a dataset).
LARGE_UPSAMPLE = 100


def large_upsample_warning(name: str, amount: Amount, n_rows: int, target: int) -> str | None:
    """An amount that repeats each row :data:`LARGE_UPSAMPLE` times or more, in words with its rows."""
    if n_rows <= 0 or target < LARGE_UPSAMPLE * n_rows:
        return None
    return (
        f"dataset {name!r}: amount {amount} repeats each of its {n_rows:,} rows about {target // n_rows:,} "
        f"times ({target:,} rows in the output; the plan's size line estimates its tokens and bytes)"
    )


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


def budget_selection(tokens: np.ndarray, budget: TokenBudget, max_repeats: float | None = None) -> np.ndarray:
    """Source rows of a token budget in selection order: whole passes over the rows while the budget exceeds
    what they hold (``tokens``: each row's tokens in the output, 0 for a row the run drops), then rows in the
    seeded order of the reference's extra-row draw (:func:`extra_rows`) until the budget is reached, so the
    last row takes it at most one document past. ``max_repeats`` caps the budget at that many passes."""
    n_rows, total = tokens.shape[0], int(tokens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    want = budget.tokens if max_repeats is None else min(budget.tokens, int(max_repeats * total))
    full, rest = divmod(want, total)
    passes = np.tile(np.arange(n_rows, dtype=np.int64), full)
    if rest == 0:
        return passes
    order = np.random.RandomState(SELECTION_SEED).permutation(n_rows).astype(np.int64)
    reached = int(np.searchsorted(np.cumsum(tokens[order]), rest, side="left")) + 1
    return np.concatenate([passes, order[:reached]])
