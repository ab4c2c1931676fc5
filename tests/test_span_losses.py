"""The reference's span check's losses said before work (the plan, from the sampled rows through the run's
masker) and after it (a ``training`` line in the summary), for a dataset that loses 5% or more."""

from __future__ import annotations

import json
from pathlib import Path

from sftmix.config.config import MixerConfig
from sftmix.config.run_options import RunOptions
from sftmix.planning.plan import build_plan
from sftmix.planning.span_losses import span_loss_line

EXAMPLES = Path(__file__).parent.parent / "examples"


def _chats(path: Path, opening_with_assistant: int) -> Path:
    """40 two-turn chats under ``olmo`` (not prefix-stable), every ``opening_with_assistant``-th opening with
    the assistant's turn (whose span the reference's check cannot verify)."""
    rows = []
    for i in range(40):
        messages = [
            {"role": "user", "content": f"question {i}?"},
            {"role": "assistant", "content": f"answer {i}."},
            {"role": "user", "content": "and more?"},
            {"role": "assistant", "content": "yes, more."},
        ]
        rows.append({"messages": messages[1:] if i % opening_with_assistant == 0 else messages})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _mixer(data: Path, out: Path, spans: str = "reference") -> MixerConfig:
    return MixerConfig.model_validate(
        {
            "datasets": [{"path": str(data)}],
            "tokenizer": {"name_or_path": str(EXAMPLES / "tokenizer"), "chat_template": "olmo"},
            "max_seq_length": 512,
            "spans": spans,
            "output": {"path": str(out)},
        }
    )


def test_the_plan_warns_of_a_dataset_the_span_check_will_thin(tmp_path):
    run = RunOptions(work_dir=str(tmp_path / "work"))
    data = _chats(tmp_path / "half.jsonl", 2)
    (warning,) = [w for w in build_plan(_mixer(data, tmp_path / "o"), run).warnings if "span check" in w]
    assert f"{data}: the reference's span check will drop ~50% of its rows (16 of 32 sampled rows" in warning
    assert "starts inside the assistant header" in warning and "spans: exact (--spans exact)" in warning
    few = _chats(tmp_path / "few.jsonl", 40)  # one row in 40 (not sampled), under 5%: nothing said
    assert not [w for w in build_plan(_mixer(few, tmp_path / "o"), run).warnings if "span check" in w]
    exact = build_plan(_mixer(data, tmp_path / "o", spans="exact"), run)
    assert not [w for w in exact.warnings if "span check" in w]


def test_the_summary_names_a_dataset_that_lost_rows_to_it(prefect_api, tmp_path, capsys):
    from tests.cli_runs import convert_args
    from tokenize_mixer.cli import main

    data = _chats(tmp_path / "half.jsonl", 2)
    assert main(convert_args(data, tmp_path / "work", tmp_path / "out")) == 0
    said = capsys.readouterr().out
    line = span_loss_line(str(data), 40, 20)
    assert line is not None and f"training    {line}" in said
    assert "20 of 40 rows (50.0%) dropped by the reference's span check" in line
    assert span_loss_line("d", 100, 4) is None and span_loss_line("d", 100, 5) is not None
