"""The reference's non-mixer flags: chains honoured, output-neutral flags accepted, the rest refused
before any work, and --tokenizer_config_only writing the tokenizer alone."""

from __future__ import annotations

import json

import pytest

from sftmix.config.reference_flags import check_flags, transform_chain
from sftmix.errors import ConfigError
from tokenize_mixer.cli import build_parser, main
from tokenize_mixer.command_line.convert_flags import mixer_from_convert_args

BASE = ["convert", "--dataset_mixer_list", "data/chat_multi.jsonl", "1.0", "--tokenizer_name_or_path", "t"]


def mixer(*extra: str):
    return mixer_from_convert_args(build_parser().parse_args([*BASE, "--output_dir", "o", *extra]))


@pytest.mark.parametrize(
    ("chain", "mask", "drop"),
    [
        ([], "assistant", True),
        (["sft_tulu_tokenize_and_truncate_v1", "sft_tulu_filter_v1"], "assistant", True),
        (["sft_tulu_tokenize_and_truncate_v1"], "assistant", False),
        (["last_turn_tulu_tokenize_and_truncate_v1", "sft_tulu_filter_v1"], "last_turn", True),
        (["last_turn_tulu_tokenize_and_truncate_v1"], "last_turn", False),
    ],
)
def test_supported_chains_set_the_mixer(chain, mask, drop):
    m = mixer(*(["--dataset_transform_fn", *chain] if chain else []))
    assert (m.mask, m.drop_untrainable) == (mask, drop)


def test_the_last_turn_chain_warns_that_the_reference_crashes_on_it(caplog):
    transform_chain(["last_turn_tulu_tokenize_and_truncate_v1", "sft_tulu_filter_v1"])
    assert "the reference itself crashes on this chain" in caplog.text


@pytest.mark.parametrize(
    "chain",
    [
        ["sft_tokenize_v1"],
        ["sft_tulu_filter_v1"],
        ["sft_tulu_filter_v1", "sft_tulu_tokenize_and_truncate_v1"],
    ],
)
def test_other_chains_are_refused_with_the_supported_list(chain):
    with pytest.raises(
        ConfigError, match="Supported chains: sft_tulu_tokenize_and_truncate_v1 sft_tulu_filter_v1"
    ):
        mixer("--dataset_transform_fn", *chain)


def test_flags_that_would_change_the_output_are_refused_and_neutral_ones_accepted(caplog):
    caplog.set_level("INFO")
    check_flags(
        {
            "visualize": ["True"],
            "dataset_skip_cache": ["True"],
            "get_tokenizer_fn": ["get_tokenizer_tulu_v2_2"],
        }
    )
    assert "--visualize does not change the output" in caplog.text
    with pytest.raises(ConfigError, match="get_tokenizer_tulu_v2_2"):
        check_flags({"get_tokenizer_fn": ["get_tokenizer_tulu_v1"]})
    with pytest.raises(ConfigError, match="slow tokenizers"):
        check_flags({"use_fast": ["False"]})
    with pytest.raises(ConfigError, match="dataset_source"):
        check_flags({"dataset_target_columns": ["input_ids", "labels", "attention_mask"]})
    check_flags(
        {"dataset_target_columns": ["input_ids", "attention_mask", "labels", "dataset_source", "extra"]}
    )


def test_a_refused_flag_is_one_line_before_any_work(tmp_path, capsys):
    code = main([*BASE, "--output_dir", str(tmp_path / "out"), "--dataset_transform_fn", "sft_tokenize_v1"])
    assert code != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "not supported" in err
    assert not (tmp_path / "out").exists()


def test_tokenizer_config_only_writes_the_tokenizer_and_nothing_else(golden_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(golden_dir)
    out = tmp_path / "out"
    args = [
        "convert",
        "--dataset_mixer_list",
        "data/does-not-matter.jsonl",
        "1.0",
        "--tokenizer_name_or_path",
        "tokenizers/dolma2",
        "--chat_template_name",
        "zephyr",
        "--output_dir",
        str(out),
        "--tokenizer_config_only",
        "True",
    ]
    assert main(args) == 0
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer"]
    config = json.loads((out / "tokenizer" / "tokenizer_config.json").read_text())
    assert (out / "tokenizer" / "tokenizer.json").exists()
    assert "<|assistant|>" in (
        config.get("chat_template") or (out / "tokenizer" / "chat_template.jinja").read_text()
    )
    assert main(args) != 0  # an existing tokenizer/ is never replaced
