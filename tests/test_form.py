"""The Custom run form in words: the flow's parameter schema as Prefect builds it, and configs and
deployments that keep their meaning whether they are written flat or in the form's shape."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prefect.utilities.callables import parameter_schema
from prefect.utilities.schema_tools import validate

from sftmix.config.config import TOKENIZERS_OWN, TokenizerSpec
from sftmix.config.run_file import RunFile, load_run_file
from sftmix.config.run_options import RunOptions
from sftmix.errors import ConfigError
from sftmix.tokenizing.templates import NAMED_TEMPLATES
from tokenize_mixer.flows.tokenize_mixer import tokenize_mixer

ROOT = Path(__file__).parent.parent
MODELS = ("DatasetEntry", "MixerConfig", "TokenizerSpec", "OutputSpec", "RunOptions", "RunFile")


@pytest.fixture(scope="module")
def schema() -> dict:
    return parameter_schema(tokenize_mixer.fn).model_dump()


def properties(schema: dict) -> list[tuple[str, dict]]:
    """Every property of every section, nested groups included, by its path."""
    found = []

    def walk(where: str, props: dict) -> None:
        for name, prop in props.items():
            found.append((f"{where}.{name}", prop))
            walk(f"{where}.{name}", prop.get("properties", {}))

    for name, definition in schema["definitions"].items():
        walk(name, definition["properties"])
    return found


def test_no_field_is_a_union_with_null_or_defaults_to_null(schema):
    text = json.dumps(schema)
    assert '"null"' not in text and "anyOf" not in text
    assert all(prop.get("default", "set") is not None for _, prop in properties(schema))


def test_every_section_and_field_has_a_title_in_words_and_help(schema):
    for name, definition in schema["definitions"].items():
        assert definition["title"] not in MODELS, name
    for where, prop in properties(schema):
        if "$ref" in prop:  # titled by its section (or by its own title)
            continue
        assert prop.get("title") and prop.get("description"), where
        assert "_" not in prop["title"], where  # not a field name
        assert not re.search(r"\b(str|int|None|Optional|YAML|Python)\b", prop["description"]), where


def test_the_template_is_one_choice_and_a_file_is_a_separate_field(schema):
    tokenizer = schema["definitions"]["TokenizerSpec"]["properties"]
    assert tokenizer["chat_template"]["type"] == "string"
    assert tokenizer["chat_template"]["enum"] == [TOKENIZERS_OWN, *NAMED_TEMPLATES]
    assert tokenizer["chat_template"]["default"] == TOKENIZERS_OWN
    assert tokenizer["chat_template_file"]["type"] == "string"
    assert TokenizerSpec(name_or_path="t", chat_template=TOKENIZERS_OWN).chat_template is None
    from_form = TokenizerSpec(name_or_path="t", chat_template=TOKENIZERS_OWN, chat_template_file="my.jinja")
    assert from_form == TokenizerSpec(name_or_path="t", chat_template="my.jinja")  # as a config says it
    with pytest.raises(ValueError, match="not both"):
        TokenizerSpec(name_or_path="t", chat_template="olmo", chat_template_file="my.jinja")
    with pytest.raises(ValueError, match="is a .jinja file"):
        TokenizerSpec(name_or_path="t", chat_template_file="my.txt")


def test_rare_options_are_grouped_last_in_each_section(schema):
    defs = schema["definitions"]
    assert list(defs["MixerConfig"]["properties"]) == [
        "datasets",
        "tokenizer",
        "max_seq_length",
        "over_length_strategy",
        "output",
        "advanced",
    ]
    assert "dask_address" in defs["RunOptions"]["properties"]["advanced"]["properties"]
    assert "allowed_roots" in defs["RunOptions"]["properties"]["advanced"]["properties"]
    for name in ("MixerConfig", "TokenizerSpec", "OutputSpec", "RunOptions"):
        assert list(defs[name]["properties"])[-1] == "advanced", name
        assert defs[name]["properties"]["advanced"]["title"] != "Advanced", name  # says what is in it


def test_flat_and_grouped_configs_mean_the_same(tmp_path):
    flat = load_run_file(ROOT / "examples" / "mixer.yaml")
    data = yaml.safe_load((ROOT / "examples" / "mixer.yaml").read_text())
    data["mixer"]["advanced"] = {"shuffle_seed": data["mixer"].pop("shuffle_seed")}
    data["mixer"]["tokenizer"]["advanced"] = {"add_bos": False}
    data["run"] = {"advanced": data["run"]}
    (tmp_path / "grouped.yaml").write_text(yaml.safe_dump(data))
    assert load_run_file(tmp_path / "grouped.yaml") == flat
    data["mixer"]["shuffle_seed"] = 7
    (tmp_path / "both.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="shuffle_seed is given twice"):
        load_run_file(tmp_path / "both.yaml")


def test_an_empty_form_field_means_not_set():
    run = RunOptions.model_validate(
        {"work_dir": " ", "reference": "", "allowed_roots": [], "advanced": {"dask_address": ""}}
    )
    assert (run.work_dir, run.reference, run.allowed_roots, run.dask_address) == (None, None, None, None)


def test_the_api_accepts_the_deployments_and_the_forms_shapes(schema):
    """What Prefect's server checks before it creates a run (enforce_parameter_schema): the stored
    parameters of every deployment, and the form's grouped shape, pass; a stranger's unknown key in a
    section without a group, or a template that is not a choice, does not."""
    deployments = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())["deployments"]
    for deployment in deployments:
        if deployment["entrypoint"].endswith(":tokenize_mixer"):
            assert validate(deployment["parameters"], schema) == [], deployment["name"]
            RunFile.model_validate(deployment["parameters"])
    form = {
        "mixer": {
            "datasets": [{"path": "d.jsonl", "amount": "0.25"}],
            "tokenizer": {
                "name_or_path": "t",
                "chat_template": TOKENIZERS_OWN,
                "advanced": {"add_bos": True},
            },
            "output": {"path": "out", "advanced": {"packing": "none"}},
            "advanced": {"mask": "last_turn"},
        },
        "run": {"advanced": {"slice_rows": 10}},
    }
    assert validate(form, schema) == []
    # the nulls older deployments store for unset options (as our my-mixer template did) still pass
    old_style = {**form, "run": {"work_dir": None, "slice_rows": None, "allowed_roots": None}}
    old_style["mixer"] = {**form["mixer"], "max_seq_length": None}
    assert validate(old_style, schema) == []
    assert RunFile.model_validate(old_style).run.work_dir is None
    for bad in (
        {**form, "mixer": {**form["mixer"], "datasets": [{"path": "d.jsonl", "amont": "1"}]}},
        {**form, "mixer": {**form["mixer"], "tokenizer": {"name_or_path": "t", "chat_template": "x.jinja"}}},
    ):
        assert validate(bad, schema) != []
