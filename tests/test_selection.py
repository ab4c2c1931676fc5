import numpy as np
import pytest

from sftmix.config.selection import (
    large_upsample_warning,
    parse_amount,
    selected_source_rows,
    selection_indices,
    small_count_warning,
    target_rows,
)
from sftmix.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "value"),
    [("1.0", 1.0), ("3.0", 3.0), ("0.25", 0.25), ("1", 1), ("100", 100), (2.0, 2.0), (7, 7)],
)
def test_parse_amount_dot_means_fraction(text, value):
    parsed = parse_amount(text)
    assert parsed == value and type(parsed) is type(value)


@pytest.mark.parametrize("bad", ["abc", "", "1.0.0", "0", "0.0", "-1", "nan", True])
def test_parse_amount_rejects(bad):
    with pytest.raises(ConfigError):
        parse_amount(bad)


def test_an_upsampling_of_a_hundred_times_or_more_is_warned_about_with_its_rows():
    assert large_upsample_warning("d", 99.0, 21, 2_079) is None
    said = large_upsample_warning("d", 100000.0, 21, 2_100_000)
    assert said is not None and "repeats each of its 21 rows about 100,000 times (2,100,000 rows" in said
    assert large_upsample_warning("d", 1.0, 0, 0) is None


def test_target_rows_matches_the_reference_rule():
    assert target_rows(1.0, 10) == 10
    assert target_rows(3.0, 10) == 30
    assert target_rows(0.75, 10) == 7  # int(7.5)
    assert target_rows(0.3, 10) == 3
    assert target_rows(25, 12) == 25  # a count above the size upsamples
    assert target_rows(4, 6) == 4


def test_selection_is_full_passes_then_a_seeded_draw():
    sel = selection_indices(10, 25)
    assert sel[:20].tolist() == list(range(10)) * 2
    expected_extra = np.random.RandomState(42).choice(10, 5, replace=False)
    assert sel[20:].tolist() == expected_extra.tolist()
    assert len(set(sel[20:].tolist())) == 5


def test_fraction_below_one_is_a_random_subset_not_the_first_rows():
    sel = selection_indices(100, 10)
    assert sel.tolist() != list(range(10))
    assert selected_source_rows(100, 10).tolist() == sorted(sel.tolist())
    assert selected_source_rows(100, 250) is None


def test_small_count_warning():
    assert small_count_warning("d", 1, 500) is not None
    assert small_count_warning("d", 1.0, 500) is None
    assert small_count_warning("d", 5, 50) is None


@pytest.mark.parametrize("amount", [3.0, 3, "3.0", "3", 0.5, "0.25", 1e-05, 100, "1.", ".5"])
def test_an_amount_keeps_its_meaning_through_json(amount):
    """JSON has no 3 vs 3.0 (a count vs an upsampling): amounts travel as text, by the reference's rule."""
    import json

    from sftmix.config.config import DatasetEntry

    entry = DatasetEntry(path="x", amount=amount)
    sent = json.loads(json.dumps(entry.model_dump(mode="json")))
    assert isinstance(sent["amount"], str)
    back = DatasetEntry.model_validate(sent)
    assert back.amount == entry.amount and type(back.amount) is type(entry.amount)
