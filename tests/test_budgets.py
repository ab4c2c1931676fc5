"""Token budgets (``amount: "50M tokens"``, ``"20M trainable tokens"``): rows in the seeded order of the
reference's extra-row draw until the budget, whole passes first when it exceeds the dataset, within one
document of it; deterministic; every row tokenized once, so changing the budget only assembles again."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sftmix.config.config import AMOUNT_PATTERN, DatasetEntry
from sftmix.config.selection import (
    TokenBudget,
    amount_text,
    budget_selection,
    extra_rows,
    parse_amount,
)
from sftmix.errors import ConfigError
from tests.test_check import EXAMPLES, chat


@pytest.mark.parametrize(
    ("text", "tokens", "trainable", "canonical"),
    [
        ("50M tokens", 50_000_000, False, "50M tokens"),
        ("20M trainable tokens", 20_000_000, True, "20M trainable tokens"),
        ("150k tokens", 150_000, False, "150k tokens"),
        (" 1.5B  tokens ", 1_500_000_000, False, "1500M tokens"),
        ("1234 tokens", 1234, False, "1234 tokens"),
    ],
)
def test_a_budget_is_written_as_a_person_writes_it(text, tokens, trainable, canonical):
    import re

    budget = parse_amount(text)
    assert budget == TokenBudget(tokens=tokens, trainable=trainable) and amount_text(budget) == canonical
    assert parse_amount(canonical) == budget and re.match(AMOUNT_PATTERN, text)
    entry = DatasetEntry(path="a.jsonl", amount=text)
    assert DatasetEntry.model_validate(entry.model_dump(mode="json")) == entry  # (JSON, --params, the form)


@pytest.mark.parametrize("text", ["50X tokens", "tokens", "0 tokens", "-5M tokens", "5M token budget"])
def test_a_budget_that_is_not_one_is_refused_with_the_ways_to_write_one(text):
    with pytest.raises(ConfigError, match="token budget|greater than 0"):
        parse_amount(text)


def test_max_repeats_caps_only_a_budget():
    with pytest.raises(ValueError, match="max_repeats caps a token budget"):
        DatasetEntry(path="a.jsonl", amount="3.0", max_repeats=2)
    assert DatasetEntry(path="a.jsonl", amount="5M tokens", max_repeats=2).max_repeats == 2.0


def test_the_selection_reaches_the_budget_within_one_document():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 400, size=500)
    tokens[::7] = 0  # rows the run drops: they count nothing
    for budget in (1, 999, 40_000, int(tokens.sum()), int(tokens.sum()) * 3 + 12_345):
        rows = budget_selection(tokens, TokenBudget(tokens=budget))
        made = int(tokens[rows].sum())
        assert budget <= made < budget + tokens.max()
        assert np.array_equal(rows, budget_selection(tokens, TokenBudget(tokens=budget)))  # deterministic
    full = budget_selection(tokens, TokenBudget(tokens=int(tokens.sum()) * 2 + 1))
    assert np.array_equal(full[:1000], np.tile(np.arange(500), 2))  # whole passes first
    capped = budget_selection(tokens, TokenBudget(tokens=10**9), max_repeats=2.5)
    assert int(tokens[capped].sum()) < 2.5 * tokens.sum() + tokens.max() and capped.shape[0] < 1300


def test_rows_of_one_token_each_are_the_reference_draw():
    """With every row one token, a budget of k tokens picks the rows a count of k would: the same seeded draw."""
    ones = np.ones(1000, np.int64)
    assert np.array_equal(budget_selection(ones, TokenBudget(tokens=37)), extra_rows(1000, 37))


def _rows() -> list[dict]:
    return [chat(f"question {i}? " * (1 + i % 4), f"answer number {i}. " * (1 + i % 9)) for i in range(80)]


def _statistics(out: Path) -> dict:
    return json.loads((out / "dataset_statistics.json").read_text())["per_dataset_statistics"][0]


def test_a_budget_run_is_deterministic_and_a_new_budget_only_assembles(prefect_api, tmp_path, capsys):
    """Through the command line: the budget is met within one document, the statistics and summary give the
    exact counts, the same budget gives the same bytes, and another budget (or a budget beyond the data,
    or of trainable tokens) reuses every tokenized slice."""
    from sftmix.output.digest import output_digests
    from tests.cli_runs import convert_args
    from tokenize_mixer.cli import main

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    work = tmp_path / "work"

    def convert(out: str, amount: str) -> dict:
        args = convert_args(data, work, tmp_path / out, "--slice_rows", "16")
        args[args.index(str(data)) + 1] = amount
        assert main(args) == 0
        return _statistics(tmp_path / out)

    every = convert("all", "1.0")
    held = every["final_tokens_in_output"]
    longest = 256  # max_seq_length
    stats = convert("a", "3k tokens")
    assert 3000 <= stats["final_tokens_in_output"] < 3000 + longest
    assert stats["frac_or_num_samples"] == "3k tokens" and stats["initial_instances"] < 80
    said = capsys.readouterr().out
    assert f"budget      {data}: 3k tokens asked, {stats['final_tokens_in_output']:,} made" in said
    assert "0 computed, 5 reused" in said
    convert("b", "3k tokens")
    assert output_digests(tmp_path / "a") == output_digests(tmp_path / "b") | {
        "dataset_statistics.json": output_digests(tmp_path / "a")["dataset_statistics.json"]
    }
    stats = convert("c", f"{held * 2 + 500} tokens")
    assert held * 2 + 500 <= stats["final_tokens_in_output"] < held * 2 + 500 + longest
    assert stats["is_upsampled"] and stats["initial_instances"] > 160
    stats = convert("d", "1k trainable tokens")
    assert 1000 <= stats["final_trainable_tokens_in_output"] < 1000 + longest
    assert "0 computed, 5 reused" in capsys.readouterr().out
    text = (tmp_path / "d" / "dataset_statistics.txt").read_text()
    assert "Token budget: 1k trainable tokens" in text


def test_the_plan_estimates_a_budget_in_rows(tmp_path):
    from sftmix.config.config import MixerConfig
    from sftmix.config.run_options import RunOptions
    from sftmix.planning.plan import build_plan

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    mixer = MixerConfig.model_validate(
        {
            "datasets": [{"path": str(data), "amount": "50k tokens", "max_repeats": 2}],
            "tokenizer": {"name_or_path": str(EXAMPLES / "tokenizer"), "chat_template": "olmo"},
            "output": {"path": str(tmp_path / "out")},
        }
    )
    plan = build_plan(mixer, RunOptions(work_dir=str(tmp_path / "work")))
    (d,) = plan.datasets
    assert d.target == 160  # capped at two passes of its 80 rows
    assert sum(s.row_end - s.row_start for s in plan.slices) == 80  # every row, once
    mixer.datasets[0].max_repeats = None
    plan = build_plan(mixer, RunOptions(work_dir=str(tmp_path / "work")))
    assert 0.9 * 50_000 < plan.datasets[0].estimated_tokens() < 1.2 * 50_000
    assert "50k tokens" in plan.summary()
