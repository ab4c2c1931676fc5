"""Pasted prefix renders are Jinja's bytes, or are not used: for our templates, for the tokenizer
templates users bring, and for templates written to look inside message texts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sftmix.sources.formats import Conversation
from sftmix.tokenizing.labels import assistant_indices
from sftmix.tokenizing.prefix_renders import PrefixRenders, SkeletonStore
from sftmix.tokenizing.templates import NAMED_TEMPLATES, ChatRenderer, named_template
from tests.tiers import examples

SPECIALS = {"eos_token": "<|endoftext|>", "bos_token": "<|bos|>"}

#: Templates that look inside texts in ways only some conversations reveal.
TRIM_LAST = (
    "{% for m in messages %}<{{ m['role'] }}>{% if loop.last %}{{ m['content'] | trim }}"
    "{% else %}{{ m['content'] }}{% endif %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
TILDE_THEN_TRIM = (
    "{% for m in messages %}{% if loop.last %}{{ ('<' ~ m['role'] ~ '>' ~ m['content']) | trim }}"
    "{% else %}<{{ m['role'] }}>{{ m['content'] }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
THINK_BRANCH = (
    "{% for m in messages %}<{{ m['role'] }}>{% if '</think>' in m['content'] %}"
    "{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
JSON_LAST = (
    "{% for m in messages %}{% if loop.last %}{{ m | tojson }}{% else %}<{{ m['role'] }}>"
    "{{ m['content'] }}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' "
    "+ m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA31_LIKE = (  # the shape of Llama-3.1's own template, tools and dates left out
    "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + "
    "message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)
TRIM_TRUTH = (
    "{% for m in messages %}<{{ m['role'] }}>{% if m['content'] | trim %}{{ m['content'] }}{% else %}(empty)"
    "{% endif %}</s>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
STRIP_CHARS = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'].strip('ab') }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
LENGTH_BRANCH = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% if m['content'] | length > 5 %}"
    "[long]{% endif %}</s>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)

TEMPLATES = {
    **{name: named_template(name) for name in NAMED_TEMPLATES},  # all 21 of the reference's
    "trim_last": TRIM_LAST,
    "tilde_then_trim": TILDE_THEN_TRIM,
    "think_branch": THINK_BRANCH,
    "json_last": JSON_LAST,
    "llama3_like": LLAMA3_LIKE,
    "llama31_like": LLAMA31_LIKE,
    "length_branch": LENGTH_BRANCH,
    "trim_truth": TRIM_TRUTH,
    "strip_chars": STRIP_CHARS,
}
TEXTS = [
    "hi",
    " padded ",
    "a\nb",
    'quote " and \\ slash',
    "</think>answer",
    "<think>why</think>answer",
    "<think>\nwhy\n</think>\n\nanswer",
    "x" * 7,
    "",
    "\ue000odd",
    "  ",
]


def real_prefixes(renderer: ChatRenderer, conv: Conversation) -> list[tuple[str | None, str]]:
    out = []
    for idx in assistant_indices(conv.messages):
        header = None if idx == 0 else renderer.render(conv.messages[:idx], None, True)
        out.append((header, renderer.render(conv.messages[: idx + 1], None, False)))
    return out


def check(template: str, conv: Conversation, prefixes: PrefixRenders | None = None) -> bool:
    """Pasted prefixes equal Jinja's whenever pasting is used; True when it was used."""
    renderer = ChatRenderer(template, SPECIALS)
    prefixes = prefixes or PrefixRenders(renderer.render)
    try:
        full = renderer.render(conv.messages, None, False)
        expected = real_prefixes(renderer, conv)
    except Exception:
        return False
    pasted = prefixes.paste(conv, full, assistant_indices(conv.messages))
    if pasted is not None:
        assert pasted == expected
    return pasted is not None


def chat(*pairs: tuple[str, str | None]) -> Conversation:
    return Conversation([{"role": r, "content": c} for r, c in pairs], None)


def test_our_templates_are_pasted_and_exact():
    for name in ("olmo", "tulu"):
        conv = chat(("user", "a"), ("assistant", " b "), ("user", "c\n"), ("assistant", "d"))
        assert check(TEMPLATES[name], conv), name
        # a later system message changes olmo's opening: the prefixes differ from the start
        late_system = chat(
            ("user", "a"), ("assistant", "b"), ("system", "s"), ("user", "c"), ("assistant", "d")
        )
        assert check(TEMPLATES[name], late_system), name


@pytest.mark.parametrize("name", ["trim_last", "llama3_like", "llama31_like"])
def test_trimmed_texts_are_pasted_trimmed(name):
    conv = chat(
        ("system", " s "), ("user", " a "), ("assistant", "\n b \t"), ("user", "c"), ("assistant", " d ")
    )
    assert check(TEMPLATES[name], conv)


@pytest.mark.parametrize("name", ["think_branch", "length_branch", "trim_truth", "strip_chars"])
def test_templates_that_look_inside_texts_are_rendered(name):
    conv = chat(("user", " a "), ("assistant", "b</think>c "), ("user", "c"), ("assistant", " d "))
    assert not check(TEMPLATES[name], conv)


@pytest.mark.parametrize("name", ["tilde_then_trim", "json_last"])
def test_transformations_the_recording_cannot_see_are_caught(name):
    conv = chat(("user", " a "), ("assistant", ' "b" '), ("user", "c"), ("assistant", " d "))
    assert not check(TEMPLATES[name], conv)


def test_rows_with_tools_or_structured_fields_are_rendered():
    conv = Conversation([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], [{"x": 1}])
    assert not check(TEMPLATES["olmo"], conv)
    structured = Conversation(
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "tool_calls": [{"f": 1}]}],
        None,
    )
    assert not check(TEMPLATES["olmo"], structured)


messages = st.lists(
    st.tuples(
        st.sampled_from(["user", "assistant", "system", "environment", "wizard"]),
        st.one_of(st.none(), st.sampled_from(TEXTS), st.text(max_size=12)),
    ),
    min_size=1,
    max_size=8,
)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@settings(max_examples=examples(150), deadline=None)
@given(convs=st.lists(messages, min_size=1, max_size=4))
def test_pasted_prefixes_are_jinjas_bytes(name, convs):
    """Any conversations, any order: one shared cache, and every pasted prefix equals Jinja's."""
    renderer = ChatRenderer(TEMPLATES[name], SPECIALS)
    shared = PrefixRenders(renderer.render)
    for pairs in convs:
        check(TEMPLATES[name], chat(*pairs), shared)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_skeletons_kept_for_other_workers_paste_the_same_bytes(name, tmp_path):
    """A worker that reads another's skeletons (the work directory's store) pastes what building them
    gives, and Jinja's bytes; a damaged or foreign file is built again and replaced."""
    renderer = ChatRenderer(TEMPLATES[name], SPECIALS)
    key = SkeletonStore.renderer_key_of(TEMPLATES[name], SPECIALS)
    convs = [
        chat(("user", "hi"), ("assistant", "<think>why</think>answer")),
        chat(("system", " padded "), ("user", 'quote " and \\ slash'), ("assistant", "a\nb"), ("user", ""),
             ("assistant", "x" * 7)),
        chat(("assistant", "first"), ("user", "  "), ("assistant", None)),
    ]  # fmt: skip
    writer = SkeletonStore(tmp_path, key)
    built = PrefixRenders(renderer.render, store=writer)
    for conv in convs:
        check(TEMPLATES[name], conv, built)
    assert writer.read == 0  # (a conversation the template refuses makes no skeleton)
    reader = SkeletonStore(tmp_path, key)
    renders = []
    kept = PrefixRenders(lambda *a: renders.append(a) or renderer.render(*a), store=reader)
    for conv in convs:
        used = check(TEMPLATES[name], conv, kept)
        assert used == check(TEMPLATES[name], conv, PrefixRenders(renderer.render))
    assert reader.read == writer.written and not renders  # nothing built again
    for path in tmp_path.rglob("*.json"):  # damaged: built again (the same bytes), and replaced
        path.write_text(path.read_text().replace('"sha256": "', '"sha256": "0', 1))
    again = SkeletonStore(tmp_path, key)
    for conv in convs:
        check(TEMPLATES[name], conv, PrefixRenders(renderer.render, store=again))
    assert again.read == 0 and again.written == writer.written
    other = SkeletonStore(tmp_path, SkeletonStore.renderer_key_of(TEMPLATES[name] + " ", SPECIALS))
    assert other.load(next(iter(kept._skeletons))) == (False, None)  # another template: not its file
