"""Data a chat template never renders (a message field, a role) is said before any work, in the plan's
warnings, and found again by ``check``; the bytes stay the reference's (nothing is rendered differently)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sftmix.config.config import MixerConfig
from sftmix.config.run_options import RunOptions
from sftmix.planning.plan import build_plan
from sftmix.sources.formats import Conversation
from sftmix.tokenizing.templates import ChatRenderer, named_template
from sftmix.tokenizing.unrendered import unrendered, what_it_reads

EXAMPLES = Path(__file__).parent.parent / "examples"
SPECIALS = {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}

TOOL_CHAT = [
    {"role": "user", "content": "What is 6 x 7?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "mul", "arguments": '{"a": 6, "b": 7}'}}],
    },
    {"role": "tool", "content": "42"},
    {"role": "assistant", "content": "It is 42."},
]
OLMO_TOOL_CHAT = [  # the olmo template's own way: function_calls and environment
    {"role": "user", "content": "What is 6 x 7?"},
    {"role": "assistant", "content": "", "function_calls": "mul(6, 7)"},
    {"role": "environment", "content": "42"},
    {"role": "assistant", "content": "It is 42."},
]


def test_a_field_and_a_role_the_template_never_renders_are_found():
    renderer = ChatRenderer(named_template("olmo"), SPECIALS)
    wizard = [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "poof"}]
    found = unrendered(
        renderer,
        [Conversation(TOOL_CHAT, None), Conversation(wizard, None), Conversation(OLMO_TOOL_CHAT, None)],
    )
    assert [(u.kind, u.name, u.rows, u.of) for u in found] == [
        ("field", "tool_calls", 1, 3),
        ("role", "tool", 1, 3),
        ("role", "wizard", 1, 3),
    ]
    reads = what_it_reads(named_template("olmo"))
    assert "function_calls" in reads and "environment" in reads  # what to write instead
    assert "tool_calls" not in reads


def test_a_template_that_renders_every_field_finds_nothing():
    """function_calls and environment under olmo; plain chats under every named template."""
    renderer = ChatRenderer(named_template("olmo"), SPECIALS)
    assert unrendered(renderer, [Conversation(OLMO_TOOL_CHAT, None)]) == []
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    plain.append({"role": "assistant", "content": "hello"})
    for name in ("olmo", "tulu", "zephyr", "olmo_thinker"):
        assert unrendered(ChatRenderer(named_template(name), SPECIALS), [Conversation(plain, None)]) == [], (
            name
        )


def _mixer(tmp_path: Path, rows: list[list[dict]]) -> MixerConfig:
    data = tmp_path / "tools.jsonl"
    tmp_path.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    return MixerConfig.model_validate(
        {
            "datasets": [{"path": str(data), "amount": "1.0"}],
            "tokenizer": {"name_or_path": str(EXAMPLES / "tokenizer"), "chat_template": "olmo"},
            "output": {"path": str(tmp_path / "out")},
        }
    )


def test_the_plan_says_what_the_template_leaves_out(tmp_path):
    plan = build_plan(_mixer(tmp_path, [TOOL_CHAT, OLMO_TOOL_CHAT]), RunOptions(work_dir=str(tmp_path / "w")))
    assert len(plan.unrendered) == 2 and all(line in plan.warnings for line in plan.unrendered)
    field, role = plan.unrendered
    assert field.startswith(
        f"{tmp_path / 'tools.jsonl'}: 1 of its first 2 rows hold message field 'tool_calls'"
    )
    assert "chat template tokenize-mixer:olmo never renders" in field and "function_calls" in field
    assert "messages of role 'tool'" in role
    clean = build_plan(_mixer(tmp_path / "c", [OLMO_TOOL_CHAT]), RunOptions(work_dir=str(tmp_path / "w2")))
    assert clean.unrendered == []


def test_unrendered_data_error_refuses_the_run_before_any_work(tmp_path, capsys):
    import pytest

    from sftmix.errors import TemplateError
    from tokenize_mixer.cli import main

    mixer = _mixer(tmp_path, [TOOL_CHAT])
    mixer.tokenizer.unrendered_data = "error"
    with pytest.raises(
        TemplateError, match=r"hold message field 'tool_calls'.*refused \(unrendered_data: error\)"
    ):
        build_plan(mixer, RunOptions(work_dir=str(tmp_path / "w")))
    assert not (tmp_path / "w" / "slices").exists()  # no slice was made
    # the same from the command line, with the reference's flags: one error line, exit 2
    code = main(
        [
            "convert",
            "--dataset_mixer_list", str(tmp_path / "tools.jsonl"), "1.0",
            "--tokenizer_name_or_path", str(EXAMPLES / "tokenizer"),
            "--chat_template_name", "olmo",
            "--max_seq_length", "256",
            "--output_dir", str(tmp_path / "out"),
            "--work_dir", str(tmp_path / "w3"),
            "--unrendered_data", "error",
        ]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2, err
    assert "error: " in err and "never renders" in err and "unrendered_data: error" in err, err
    assert not (tmp_path / "out").exists()


def test_the_slices_count_every_row_that_holds_it(prefect_api, tmp_path):
    """The plan finds a field and a role on its sample (the first slice's rows); the slices count every
    row that holds them, and the run's summary and report say how many of the dataset's rows do."""
    from tests.test_check import run

    plain = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    rows = [{"messages": TOOL_CHAT if i in (1, 6, 9, 13) else plain} for i in range(16)]
    out = run(tmp_path, rows, "counted", slice_rows=4)
    report = json.loads((out / "run_report.json").read_text())
    name = str(tmp_path / "counted.jsonl")
    assert report["unrendered_rows"] == [
        f"{name}: 4 of its 16 rows hold message field 'tool_calls' (counted over every row)",
        f"{name}: 4 of its 16 rows hold messages of role 'tool' (counted over every row)",
    ]
    assert any(
        "1 of its first 4 rows hold message field 'tool_calls'" in line for line in report["unrendered"]
    )


@pytest.mark.full
def test_the_command_says_a_finding_once_as_found_once_checked_once_summed_up(tmp_path):
    """The command plans while its API starts and hands that plan to the flow: the plan's finding is
    logged once, the check finds it once and the summary counts it once (not four times: issue 70)."""
    from tests.cli_runs import convert_args
    from tests.test_cli import cli

    rows = [{"messages": TOOL_CHAT} for _ in range(8)]
    data = tmp_path / "tools.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = cli(*convert_args(data, tmp_path / "work", tmp_path / "out"))
    logged = [line for line in proc.stderr.splitlines() if "'tool_calls'" in line]
    summed = [line for line in proc.stdout.splitlines() if "'tool_calls'" in line]
    assert len(logged) == 2 and len(summed) == 1, proc.stderr + proc.stdout
    found, checked = logged
    assert "sftmix.planning.samples" in found and "never renders" in found
    assert "check WARNING" in checked
    assert summed[0].startswith("unrendered") and "8 of its 8 rows" in summed[0]
