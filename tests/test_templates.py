import hashlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sftmix.errors import TemplateError
from sftmix.tokenizing.templates import (
    NAMED_TEMPLATES,
    ChatRenderer,
    compile_template,
    named_template,
    resolve_template,
)
from tests.tiers import examples

SHARED = Path(__file__).resolve().parents[2] / "shared" / "templates"


def test_every_reference_template_name_is_carried():
    assert len(NAMED_TEMPLATES) == 21
    if SHARED.exists():
        assert set(NAMED_TEMPLATES) == {p.stem for p in SHARED.glob("*.jinja")}
    assert named_template("olmo_old") == named_template("olmo")  # its own name, the same text


@pytest.mark.parametrize("name", NAMED_TEMPLATES)
def test_named_templates_are_carried_byte_for_byte(name):
    text = named_template(name)
    if SHARED.exists():
        assert text == (SHARED / f"{name}.jinja").read_text(encoding="utf-8")
    assert hashlib.sha256(text.encode()).hexdigest()  # non-empty, readable package data


def test_resolve_rules(tmp_path):
    own = "{{ messages[0]['content'] }}"
    assert resolve_template("olmo", own, "tok").text == named_template("olmo")
    assert resolve_template(None, own, "tok").text == own
    assert resolve_template("tokenizer", own, "tok").text == own
    path = tmp_path / "mine.jinja"
    path.write_text("X{{ messages|length }}")
    assert resolve_template(str(path), own, "tok").text == "X{{ messages|length }}"
    with pytest.raises(TemplateError, match="unknown chat template 'olmo123'; did you mean 'olmo'"):
        resolve_template("olmo123", own, "tok")
    fallback = resolve_template("olmo123", own, "tok", unknown="fallback")
    assert (
        fallback.text == own
        and fallback.source == "tokenizer:tok (unknown name 'olmo123', did you mean 'olmo'?)"
    )
    with pytest.raises(TemplateError, match="'zzz': use one of"):  # no close name: none offered
        resolve_template("zzz", own, "tok")
    zephyr = resolve_template("zephyr", own, "tok", unknown="fallback")
    assert zephyr.text == named_template("zephyr") and zephyr.label == "zephyr"
    with pytest.raises(TemplateError, match="has no chat_template"):
        resolve_template(None, None, "tok")
    assert resolve_template("tulu", own, "tok", add_bos=True).text == "{{ bos_token }}" + named_template(
        "tulu"
    )


def test_renderer_matches_transformers_settings():
    r = ChatRenderer(named_template("tulu"), {"eos_token": "</s>"})
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert r.render(msgs, None, False) == "<|user|>\nhi\n<|assistant|>\nyo</s>"
    assert r.render(msgs[:1], None, True) == "<|user|>\nhi\n<|assistant|>\n"


def test_an_unknown_name_that_falls_back_is_warned_about_once(caplog):
    """The command plans ahead of the flow and the flow plans again: one warning, not two."""
    for _ in range(2):
        resolved = resolve_template("no_such_template_name", "{{ messages }}", "tok", unknown="fallback")
        assert resolved.source == "tokenizer:tok (unknown name 'no_such_template_name')"
    warned = [r for r in caplog.records if "UNKNOWN CHAT TEMPLATE 'no_such_template_name'" in r.getMessage()]
    assert len(warned) == 1


_ROLES = st.sampled_from(["system", "user", "assistant", "tool", "environment", "function"])
_TEXT = st.one_of(
    st.sampled_from(["", " ", "\n", "<think>a</think>b", "{{ x }}", "{% if %}", "\\boxed{1}", "</s>", "é😀"]),
    st.text(max_size=16),
)
_CALLS = st.lists(
    st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": _TEXT, "arguments": _TEXT})}
    ),
    max_size=2,
)
_MESSAGE = st.fixed_dictionaries(
    {"role": _ROLES, "content": st.one_of(st.none(), _TEXT)},
    optional={"tool_calls": _CALLS, "functions": _TEXT, "function_calls": _TEXT},
)
_TOOLS = st.one_of(
    st.none(),
    st.lists(
        st.fixed_dictionaries(
            {"type": st.just("function"), "function": st.fixed_dictionaries({"name": _TEXT})}
        ),
        max_size=2,
    ),
)


def _outcome(template: Any, messages: list[dict], tools: list | None, prompt: bool) -> tuple[str, str]:
    try:
        return "ok", template.render(messages=messages, tools=tools, documents=None, add_generation_prompt=prompt,
                                     eos_token="</s>", bos_token="<s>")  # fmt: skip
    except Exception as exc:  # noqa: BLE001 (the same failure both ways is the same outcome)
        return type(exc).__name__, str(exc)


@pytest.mark.parametrize("name", NAMED_TEMPLATES)
@settings(max_examples=examples(120), deadline=None, suppress_health_check=list(HealthCheck))
@given(messages=st.lists(_MESSAGE, max_size=6), tools=_TOOLS, prompt=st.booleans())
def test_our_templates_render_the_same_without_the_sandbox(name, messages, tools, prompt):
    """The templates we carry render in a plain Jinja environment (the sandbox's checks cost more than
    the rendering): on random conversations, tool calls and tools included, both environments give the
    same text, or fail the same way."""
    text = named_template(name)
    assert _outcome(compile_template(text, trusted=True), messages, tools, prompt) == _outcome(
        compile_template(text, trusted=False), messages, tools, prompt
    )


_SELECTIONS = (
    "{{ xs|selectattr('role', 'equalto', 'system')|list }}",
    "{{ xs|rejectattr('role', 'equalto', 'system')|list|length }}",
    "{{ xs|selectattr('role', '==', 'user')|map(attribute='content')|join(',') }}",
    "{{ xs|selectattr('content')|list }} {{ xs|rejectattr('content')|list }}",
    "{{ xs|selectattr('a.b', 'equalto', 1)|list }} {{ pairs|selectattr('0', 'equalto', 'x')|list }}",
    "{{ xs|selectattr('role', 'defined')|list }} {{ xs|rejectattr('role', 'undefined')|list }}",
    "{{ xs|selectattr('role', 'in', ['user', 'system'])|list }}",
    "{{ ns|select('odd')|list }} {{ ns|reject('odd')|list }} {{ ns|select|list }} {{ ns|reject|list }}",
    "{{ ns|select('greaterthan', 2)|list }} {{ ns|select('ge', 3)|first }} {{ ns|reject('lt', 3)|sum }}",
    "{{ xs|selectattr('role', 'nosuchtest')|list }}",
    "{{ xs|selectattr|list }}",
    "{{ xs|selectattr('role', 'equalto')|list }}",
    "{{ nothing|selectattr('role', 'equalto', 'x')|list }} {{ []|select('nosuchtest')|list }}",
    "{{ ['upper', 'nosuch', 'trim']|select('filter')|list }} {{ ['odd', 'x']|reject('test')|list }}",
    "{% for x in xs|selectattr('role', 'equalto', 'user') %}{{ loop.index }}{{ x.content }}{% endfor %}",
)


@pytest.mark.parametrize("source", _SELECTIONS)
@pytest.mark.parametrize("trusted", [True, False])
def test_select_filters_are_jinjas_own(source, trusted):
    """``select``/``reject``/``selectattr``/``rejectattr`` look their test up once per filter (ours) and
    give what Jinja's own filters give, errors included, in both environments."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    options: dict = {"trim_blocks": True, "lstrip_blocks": True, "extensions": [jinja2.ext.loopcontrols]}
    stock = (jinja2.Environment if trusted else ImmutableSandboxedEnvironment)(**options).from_string(source)
    ours = compile_template(source, trusted=trusted)
    values = {
        "xs": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"content": ""},
            {"role": "user", "content": "v", "a": {"b": 1}},
            {"role": "assistant", "content": None},
        ],
        "pairs": [["x", 1], ["y", 2], ["x", 3]],
        "ns": [1, 2, 3, 4, 0],
    }

    def outcome(template: Any) -> tuple[str, str]:
        try:
            return "ok", template.render(**values)
        except Exception as exc:  # noqa: BLE001 (the same failure both ways is the same outcome)
            return type(exc).__name__, str(exc)

    assert outcome(ours) == outcome(stock)
