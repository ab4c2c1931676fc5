"""Each setting declares how it reaches the output's bytes (sftmix/config/byte_settings.py); the recipe, the
slices' keys and ``convert``'s flags (sftmix/config/command_flags.py) derive from the declarations, as they were before the declarations (existing outputs stay up
to date and existing slices are reused), and an option added with a declaration recomputes its slices."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from typing import Annotated, Any, Literal

import pytest
from pydantic import BaseModel, Field

from sftmix.config.byte_settings import ChangesBytes, declaration, keyed, recorded
from sftmix.config.command_flags import Flag, flags, with_flags
from sftmix.config.config import REFERENCE_PART_BYTES, DatasetEntry, MixerConfig, OutputSpec, TokenizerSpec
from sftmix.config.run_options import RunOptions
from sftmix.planning.plan import build_plan

GOLDEN = Path(__file__).parent / "golden"


def _models(model: type[BaseModel]) -> list[type[BaseModel]]:
    found = [model]
    for info in model.model_fields.values():
        kind = info.annotation
        inner = getattr(kind, "__args__", (kind,))[0] if getattr(kind, "__origin__", None) is list else kind
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            found += _models(inner)
    return found


@pytest.mark.parametrize("model", _models(MixerConfig), ids=lambda m: m.__name__)
def test_every_setting_declares_how_it_changes_bytes(model):
    missing = [name for name, info in model.model_fields.items() if declaration(info) is None]
    assert not missing, f"{model.__name__} fields without ChangesBytes: {missing}"


def _mixer(**options: Any) -> MixerConfig:
    tokenizer = {k: options.pop(k) for k in ("literal_special_tokens", "load", "encoder") if k in options}
    return MixerConfig(
        datasets=[DatasetEntry(path="a.jsonl", amount=3.0), DatasetEntry(path="b.jsonl", amount=100)],
        tokenizer=TokenizerSpec(name_or_path="tok", chat_template="olmo", **tokenizer),
        output=OutputSpec(path="out"),
        **options,
    )


def _keyed_before(m: MixerConfig) -> dict[str, Any]:
    """The slice key's settings as plan.py wrote them out before the declarations."""
    return {
        "max_seq_length": m.max_seq_length,
        "on_bad_row": m.on_bad_row,
        **({} if m.mask == "assistant" else {"mask": m.mask}),
        **(
            {}
            if m.tokenizer.literal_special_tokens == "keep"
            else {"literal_special_tokens": m.tokenizer.literal_special_tokens}
        ),
        **({"mask_thinking": True} if m.mask_thinking else {}),
        **({"mask_tool_calls": True} if m.mask_tool_calls else {}),
        **({"mask_tool_outputs": True} if m.mask_tool_outputs else {}),
        **({} if m.drop_untrainable else {"drop_untrainable": False}),
        **({} if m.spans == "reference" else {"spans": m.spans}),
    }


def _recorded_before(m: MixerConfig) -> dict[str, Any]:
    """The recipe's mixer as up_to_date.py wrote it out before the declarations."""
    recipe = m.model_dump(
        mode="json",
        exclude={
            "output": {"overwrite", "path"},
            "tokenizer": {"encoder", "unknown_template", "unrendered_data"},
            "on_bad_row": True,
        },
    )
    for name, default in (("literal_special_tokens", "keep"), ("load", "reference")):
        if recipe["tokenizer"].get(name) == default:
            del recipe["tokenizer"][name]
    for name, default in (("parts", "reference"), ("part_bytes", REFERENCE_PART_BYTES), ("lineage", False)):
        if recipe["output"].get(name) == default:
            del recipe["output"][name]
    if recipe.get("over_length_strategy") == "keep":
        del recipe["over_length_strategy"]
    for dataset in recipe["datasets"]:
        if dataset.get("max_repeats") is None:
            dataset.pop("max_repeats", None)
    return recipe


VARIANTS = [
    {},
    {"max_seq_length": 512, "on_bad_row": "skip"},
    {"mask": "last_turn", "mask_thinking": True},
    {"mask": "all", "mask_tool_calls": True, "mask_tool_outputs": True},
    {"spans": "exact", "drop_untrainable": False},
    {"literal_special_tokens": "split", "encoder": "hf"},
    {"literal_special_tokens": "drop", "load": "files", "shuffle_seed": 7, "num_examples": 3},
]


@pytest.mark.parametrize("options", VARIANTS, ids=lambda o: ",".join(o) or "defaults")
def test_keys_and_recipes_are_what_they_were(options):
    mixer = _mixer(**options)
    assert keyed(mixer) == _keyed_before(mixer)
    assert recorded(mixer) == _recorded_before(mixer)
    assert json.dumps(recorded(mixer), sort_keys=True) == json.dumps(_recorded_before(mixer), sort_keys=True)


def test_a_setting_without_bytes_changes_neither():
    a, b = _mixer(encoder="hf"), _mixer(encoder="fast")
    assert keyed(a) == keyed(b) and recorded(a) == recorded(b)
    c = MixerConfig(**{**_mixer().model_dump(), "output": {"path": "elsewhere", "overwrite": True}})
    assert recorded(c) == recorded(_mixer())


class WithKnob(MixerConfig):
    """A throwaway option, declared as a new one would be: it changes a slice's tokens."""

    knob: Annotated[int, ChangesBytes(slices=True, unkeyed=True, unrecorded=True)] = Field(default=0, ge=0)


class Undeclared(BaseModel):
    knob: int = 0


def test_an_undeclared_setting_is_refused():
    with pytest.raises(TypeError, match="Undeclared.knob does not declare"):
        keyed(Undeclared())


def test_a_new_byte_changing_option_recomputes_its_slices(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(
            json.dumps(
                {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
            )
            + "\n"
            for i in range(10)
        )
    )

    def keys(model: type[MixerConfig], **options: Any) -> list[str]:
        mixer = model(
            datasets=[DatasetEntry(path=str(rows))],
            tokenizer=TokenizerSpec(name_or_path=str(GOLDEN / "tokenizers" / "tiny"), chat_template="tulu"),
            output=OutputSpec(path=str(tmp_path / "out")),
            **options,
        )
        plan = build_plan(mixer, RunOptions(work_dir=str(tmp_path / "work"), slice_rows=4))
        return [spec.key for spec in plan.slices]

    plain, off, on, again = keys(MixerConfig), keys(WithKnob), keys(WithKnob, knob=1), keys(WithKnob, knob=2)
    assert plain == off  # at its default: the slices made before it are reused
    assert len(on) == 3 and not set(on) & set(off) and not set(on) & set(again)
    assert recorded(WithKnob(**{**_mixer().model_dump(), "knob": 1}))["knob"] == 1
    assert "knob" not in recorded(WithKnob(**_mixer().model_dump()))
    assert all(a != b for a, b in itertools.combinations([plain[0], on[0], again[0]], 2))


class WithFlaggedKnob(MixerConfig):
    """A throwaway option with a command-line flag, declared as a new one would be."""

    knob: Annotated[Literal["low", "high"], ChangesBytes(slices=True, unkeyed=True), Flag()] = Field(
        default="low", description="How loud."
    )


def test_a_flag_is_derived_from_the_setting_it_sets():
    """``convert``'s flags for mixer settings come from the fields: choices, default, help and where the
    value goes; left out, a setting keeps its default."""
    (knob,) = [s for s in flags(WithFlaggedKnob) if s.name == "knob"]
    assert knob.path == ("knob",) and knob.choices == ("low", "high") and knob.default == "low"
    assert knob.help == "How loud."
    assert with_flags({}, {"knob": "high", "other": 1}, WithFlaggedKnob) == {"knob": "high"}
    assert with_flags({}, {"knob": None}, WithFlaggedKnob) == {}
    load = next(s for s in flags(MixerConfig) if s.path == ("tokenizer", "load"))
    assert load.name == "tokenizer_load" and load.choices == ("reference", "files")


def test_convert_sets_every_flagged_setting():
    from tokenize_mixer.cli import build_parser
    from tokenize_mixer.command_line.convert_flags import mixer_from_convert_args

    base = ["convert", "--dataset_mixer_list", "a.jsonl", "1.0", "--tokenizer_name_or_path", "tok"]
    base += ["--output_dir", "out"]
    plain = mixer_from_convert_args(build_parser().parse_args(base))
    assert plain.mask_thinking is False and plain.tokenizer.literal_special_tokens == "keep"
    given = mixer_from_convert_args(
        build_parser().parse_args(
            [*base, "--mask-thinking", "--literal_special_tokens", "split", "--tokenizer_load", "files"]
            + ["--overwrite", "--spans", "exact", "--mask_tool_calls", "false"]
        )
    )
    assert given.mask_thinking is True and given.mask_tool_calls is False and given.spans == "exact"
    assert given.tokenizer.literal_special_tokens == "split" and given.tokenizer.load == "files"
    assert given.output.overwrite is True
    for spec in flags(MixerConfig):  # every one reaches its field
        value = "true" if spec.boolean else "4096" if spec.whole_number else spec.choices[-1]  # type: ignore[index]
        mixer = mixer_from_convert_args(build_parser().parse_args([*base, f"--{spec.name}", value]))
        inner: Any = mixer
        for key in spec.path:
            inner = getattr(inner, key)
        assert inner == (True if spec.boolean else 4096 if spec.whole_number else value), spec


def _named(holder: Any, name: str) -> list[Any]:
    """The values held under ``name`` anywhere in ``holder`` (its pydantic models and dataclasses)."""
    if isinstance(holder, BaseModel):
        fields = {f: getattr(holder, f) for f in type(holder).model_fields}
    elif dataclasses.is_dataclass(holder) and not isinstance(holder, type):
        fields = {f.name: getattr(holder, f.name) for f in dataclasses.fields(holder)}
    else:
        return []
    found = [value for field, value in fields.items() if field == name]
    return found + [v for value in fields.values() for v in _named(value, name)]


def test_the_slice_workers_are_handed_every_setting_their_slices_follow_from():
    """Every ``slices=True`` setting reaches the workers in their context's specs (the tokenizer's, the
    masker's, ...), once and under its own name: otherwise the workers would tokenize without it while the
    slice keys hold it. Each is set away from its default, so a spec that forgot one would hold the default."""
    from sftmix.tokenizing.slices import SliceOutput, TokenizeContext, WorkerTemplate, WorkerTokenizer
    from sftmix.tokenizing.tokenizer import TokenizerKey

    mixer = _mixer(
        max_seq_length=100,
        mask="all",
        spans="exact",
        drop_untrainable=False,
        on_bad_row="skip",
        mask_thinking=True,
        mask_tool_calls=True,
        mask_tool_outputs=True,
        literal_special_tokens="drop",
    )
    handed = keyed(mixer)
    declared = {n for n, i in MixerConfig.model_fields.items() if (d := declaration(i)) and d.slices}
    declared |= {n for n, i in TokenizerSpec.model_fields.items() if (d := declaration(i)) and d.slices}
    assert set(handed) == declared  # (every slice setting is away from its default here)
    ctx = TokenizeContext.of(
        mixer,
        WorkerTokenizer.of(mixer.tokenizer, TokenizerKey.of("tok", None), None),
        WorkerTemplate(text=""),
        SliceOutput(work_dir="w", datasets_cache="c", token_dtype="uint32"),
    )
    for name, value in handed.items():
        assert _named(ctx, name) == [value], name
