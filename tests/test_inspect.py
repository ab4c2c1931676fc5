"""``tokenize-mixer inspect``: a written document decoded, its trainable text marked, found by index,
dataset or source row."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sftmix.config.config import DatasetEntry, MixerConfig, OutputSpec, TokenizerSpec
from sftmix.config.run_options import RunOptions
from tokenize_mixer.cli import main
from tokenize_mixer.flows.tokenize_mixer import tokenize_mixer

EXAMPLES = Path(__file__).parent.parent / "examples"
GENERAL = EXAMPLES / "data" / "general.jsonl"


@pytest.fixture(scope="module")
def output(prefect_api, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("inspect")
    mixer = MixerConfig(
        datasets=[
            DatasetEntry(path=str(GENERAL), amount=1.0),
            DatasetEntry(path=str(EXAMPLES / "data" / "arithmetic.jsonl"), amount=20),
        ],
        tokenizer=TokenizerSpec(name_or_path=str(EXAMPLES / "tokenizer"), chat_template="tulu"),
        max_seq_length=None,
        output=OutputSpec(path=str(root / "out")),
    )
    tokenize_mixer(mixer=mixer, run=RunOptions(work_dir=str(root / "work")))
    return root / "out"


def inspect(capsys, *args: str) -> str:
    assert main(["inspect", *args, "--plain"]) == 0
    return capsys.readouterr().out


def test_a_source_row_decoded_with_its_assistant_text_marked(output, capsys):
    rows = [json.loads(line) for line in GENERAL.read_text().splitlines()]
    shown = inspect(capsys, str(output), "--dataset", "general.jsonl", "--row", "5")
    header, body = shown.split("\n", 1)
    assert re.match(r"document \d+ \(part 0, tokens \d+-\d+\): dataset '.*general.jsonl', row 5; ", header)
    marked = "".join(re.findall(r"⟦(.*?)⟧", body, flags=re.S))
    for message in rows[5]["messages"]:
        if message["role"] == "assistant":
            assert message["content"] in marked
        else:
            assert message["content"] in body and message["content"] not in marked


def test_output_to_a_file_or_pager_keeps_the_markers(output, capsys):
    assert main(["inspect", str(output), "--doc", "1"]) == 0  # captured: not a terminal
    assert "⟦" in capsys.readouterr().out


def test_by_index_and_clear_errors(output, capsys):
    first = inspect(capsys, str(output))
    assert first.startswith("document 0 ")
    assert inspect(capsys, str(output), "--doc", "3").startswith("document 3 ")
    assert main(["inspect", str(output), "--doc", "100000"]) == 2
    assert "there is no document 100000" in capsys.readouterr().err
    assert main(["inspect", str(output), "--dataset", "nope.jsonl"]) == 2
    assert "no dataset 'nope.jsonl'" in capsys.readouterr().err
    by_index = inspect(capsys, str(output), "--dataset", "0", "--row", "5")  # as the lineage columns name it
    assert by_index == inspect(capsys, str(output), "--dataset", "general.jsonl", "--row", "5")
    assert main(["inspect", str(output), "--dataset", "7"]) == 2
    assert "(datasets by index: 0: " in capsys.readouterr().err


def test_report_draws_lengths_trainable_fraction_and_shares(output, tmp_path, capsys):
    from PIL import Image

    assert main(["report", str(output), "-o", str(tmp_path)]) == 0
    png, md = tmp_path / "report.png", tmp_path / "report.md"
    with Image.open(png) as image:
        assert image.size[0] > 1000 and image.size[1] > 400
    text = md.read_text()
    assert "![token lengths" in text
    for name in ("general.jsonl", "arithmetic.jsonl"):
        assert re.search(rf"\| [^|]*{name} \| \d+ \| [\d,]+ \| [\d.]+ \| [\d.]+ \| ", text), text
    assert main(["report", str(tmp_path / "nothing")]) == 2


def test_a_rerun_into_the_output_makes_its_report_again(prefect_api, tmp_path):
    """report.png/report.md made in an output are ours (listed in its marker); a run that replaces the
    output writes them again for the new shards instead of silently dropping them."""
    from sftmix.check.report_page import write_report

    def run(amount: float) -> None:
        mixer = MixerConfig(
            datasets=[DatasetEntry(path=str(GENERAL), amount=amount)],
            tokenizer=TokenizerSpec(name_or_path=str(EXAMPLES / "tokenizer"), chat_template="tulu"),
            output=OutputSpec(path=str(tmp_path / "out"), overwrite=True),
        )
        tokenize_mixer(mixer=mixer, run=RunOptions(work_dir=str(tmp_path / "work"), runner="thread"))

    run(1.0)
    write_report(tmp_path / "out")
    before = (tmp_path / "out" / "report.md").read_text()
    run(2.0)
    after = (tmp_path / "out" / "report.md").read_text()
    assert (tmp_path / "out" / "report.png").exists() and after != before and "2x" in after


def test_against_another_output_shows_what_a_mask_policy_changes(prefect_api, tmp_path, capsys):
    """The same mixer with and without mask_thinking: inspect --against marks the thinking as trained
    only in the default output, the answers as trained in both; other text gets different tokens."""
    data = tmp_path / "think.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"question {i}"},
                {"role": "assistant", "content": f"<think>reason r{i}z</think>answer a{i}z"},
            ]
        }
        for i in range(4)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    outputs = {}
    for thinking in (False, True):
        mixer = MixerConfig(
            datasets=[DatasetEntry(path=str(data))],
            tokenizer=TokenizerSpec(name_or_path=str(EXAMPLES / "tokenizer"), chat_template="tulu"),
            mask_thinking=thinking,
            output=OutputSpec(path=str(tmp_path / f"out-{thinking}")),
        )
        tokenize_mixer(mixer=mixer, run=RunOptions(work_dir=str(tmp_path / "work")))
        outputs[thinking] = str(tmp_path / f"out-{thinking}")
    shown = inspect(capsys, outputs[False], "--row", "2", "--against", outputs[True])
    only_here = "".join(re.findall(r"\{\+(.*?)\+\}", shown, flags=re.S))
    both = "".join(re.findall(r"⟦(.*?)⟧", shown, flags=re.S))
    assert "r2z" in only_here and "a2z" not in only_here and "a2z" in both and "[-" not in shown
    shown = inspect(capsys, outputs[True], "--row", "2", "--against", outputs[False])
    assert "r2z" in "".join(re.findall(r"\[-(.*?)-\]", shown, flags=re.S))

    other = tmp_path / "other"  # another template: other tokens, a clear error
    mixer = MixerConfig(
        datasets=[DatasetEntry(path=str(data))],
        tokenizer=TokenizerSpec(name_or_path=str(EXAMPLES / "tokenizer"), chat_template="olmo"),
        output=OutputSpec(path=str(other)),
    )
    tokenize_mixer(mixer=mixer, run=RunOptions(work_dir=str(tmp_path / "work")))
    assert main(["inspect", outputs[False], "--row", "2", "--against", str(other), "--plain"]) == 2
    assert "masks can be compared only between outputs of the same text" in capsys.readouterr().err
