"""Masking policies (opt-in, beyond the reference): for all 21 of the reference's templates, no trained
token touches the text a policy takes out (thinking and its tags, tool calls, tool results), every other
token the mask mode trains stays trained, and rows without such text keep their mask byte for byte."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sftmix.sources.formats import Conversation
from sftmix.tokenizing.masking import MaskPolicy, thinking_ranges
from sftmix.tokenizing.row_status import RowStatus
from sftmix.tokenizing.templates import NAMED_TEMPLATES
from sftmix.tokenizing.tokenizer import TokenizerKey, rust_tokenizer
from tests.test_labels import GOLDEN, masker
from tests.tiers import examples

SHAPES = ["plain", "closed", "unopened", "unclosed", "tool"]


def turn(i: int, shape: str) -> list[dict]:
    """One exchange. Words are unique: q<i>z asked, a<i>z answered, r<i>z thought, c<i>z called,
    e<i>z returned by a tool, b<i>z answered after it."""
    asked = {"role": "user", "content": f"Question q{i}z?"}
    if shape == "tool":
        return [
            asked,
            {"role": "assistant", "content": f"Checking a{i}z.", "function_calls": f"lookup(c{i}z)"},
            {"role": "environment", "content": f"result e{i}z"},
            {"role": "assistant", "content": f"So b{i}z."},
        ]
    content = {
        "plain": f"The a{i}z.",
        "closed": f"<think>why r{i}z</think>\nThe a{i}z.",
        "unopened": f"why r{i}z</think>\nThe a{i}z.",  # the template's generation prompt opened it
        "unclosed": f"The a{i}z. <think>why r{i}z",
    }[shape]
    return [asked, {"role": "assistant", "content": content}]


def touching(offsets: np.ndarray, text: str, word: str) -> np.ndarray:
    """Tokens whose characters overlap an occurrence of ``word``."""
    hit = np.zeros(offsets.shape[0], dtype=bool)
    for m in re.finditer(re.escape(word), text):
        hit |= (offsets[:, 0] < m.end()) & (m.start() < offsets[:, 1])
    return hit


CASES = [  # (mask mode, policy, words it takes out, words it must leave trained)
    (
        "assistant",
        MaskPolicy(mask_thinking=True),
        ("<think>", "</think>", "r{i}z"),
        ("a{i}z", "b{i}z", "c{i}z"),
    ),
    ("last_turn", MaskPolicy(mask_thinking=True), ("<think>", "</think>", "r{i}z"), ("a{i}z", "b{i}z")),
    (
        "assistant",
        MaskPolicy(mask_tool_calls=True),
        ("c{i}z", "function_calls>"),
        ("a{i}z", "b{i}z", "r{i}z"),
    ),
    ("all", MaskPolicy(mask_tool_outputs=True), ("e{i}z",), ("q{i}z", "a{i}z", "b{i}z", "c{i}z", "r{i}z")),
]


@pytest.mark.parametrize("name", NAMED_TEMPLATES)
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shapes=st.lists(st.sampled_from(SHAPES), min_size=1, max_size=4),
    case=st.sampled_from(CASES),
    spans=st.sampled_from(["reference", "exact"]),  # exact keeps the rows thinker templates fail the rule on
)
def test_a_policy_takes_out_exactly_its_text(name, shapes, case, spans):
    mode, policy, out, kept = case
    conv = Conversation([m for i, shape in enumerate(shapes) for m in turn(i, shape)], None)
    plain = masker("dolma2", name, None, True, mask=mode, spans=spans)
    try:
        [without] = plain.tokenize([conv])
    except Exception:
        return  # the template cannot render this conversation at all
    [with_] = masker("dolma2", name, None, True, mask=mode, spans=spans, policy=policy).tokenize([conv])
    assert np.array_equal(without.ids, with_.ids)
    if without.status != RowStatus.KEPT:
        assert with_.status == without.status
        return
    text = plain.renderer.render(conv.messages, None, False)
    rust = rust_tokenizer(TokenizerKey.of(str(GOLDEN / "tokenizers" / "dolma2"), None))
    enc = rust.encode(text, add_special_tokens=False)
    assert enc.ids == without.ids.tolist()
    offsets = np.array(enc.offsets, dtype=np.int64).reshape(-1, 2)
    before, after = without.mask.astype(bool), with_.mask.astype(bool)
    assert not (after & ~before).any()  # only ever less
    for i, shape in enumerate(shapes):
        for word in out:
            word = word.format(i=i)
            if word in ("<think>", "</think>") and shape in ("plain", "tool"):
                continue  # another turn's tags: checked with that turn
            assert not (after & touching(offsets, text, word)).any(), (name, shape, word)
        for word in kept:
            hit = touching(offsets, text, word.format(i=i)) & before
            assert after[hit].all(), (name, shape, word)
    if all(s == "plain" for s in shapes):
        assert np.array_equal(before, after)
    if not after.any():
        assert with_.status == RowStatus.NO_TRAINABLE


def test_a_tool_result_repeated_in_the_answer_stays_trained_in_the_answer():
    conv = Conversation(
        [
            {"role": "user", "content": "What is 6 x 7?"},
            {"role": "assistant", "content": "Let me compute.", "function_calls": "mul(6, 7)"},
            {"role": "environment", "content": "42"},
            {"role": "assistant", "content": "It is 42"},
        ],
        None,
    )
    plain = masker("dolma2", "olmo_thinker", None, True, mask="all")
    [row] = masker(
        "dolma2", "olmo_thinker", None, True, mask="all", policy=MaskPolicy(mask_tool_outputs=True)
    ).tokenize([conv])
    text = plain.renderer.render(conv.messages, None, False)
    enc = rust_tokenizer(TokenizerKey.of(str(GOLDEN / "tokenizers" / "dolma2"), None)).encode(
        text, add_special_tokens=False
    )
    offsets = np.array(enc.offsets, dtype=np.int64).reshape(-1, 2)
    result_at, answer_at = text.index("42"), text.rindex("42")
    assert result_at != answer_at
    trained = row.mask.astype(bool)
    assert not trained[(offsets[:, 0] < result_at + 2) & (result_at < offsets[:, 1])].any()
    assert trained[(offsets[:, 0] < answer_at + 2) & (answer_at < offsets[:, 1])].all()


QWEN_LIKE = (  # a tool-using model's own template: tool_calls rendered as JSON in tags
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for call in m.get('tool_calls') or [] %}\n<tool_call>\n{{ call | tojson }}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}"
)


def test_tool_calls_a_template_renders_from_a_list_are_taken_out_tags_and_all():
    from sftmix.tokenizing.labels import LabelMasker, MaskerEncoding
    from sftmix.tokenizing.masking import Masking
    from sftmix.tokenizing.templates import ChatRenderer
    from sftmix.tokenizing.tokenizer import load_hf_tokenizer, segment_boundaries, special_tokens

    key = TokenizerKey.of(str(GOLDEN / "tokenizers" / "dolma2"), None)
    rust = rust_tokenizer(key)
    conv = Conversation(
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "Checking a0z.",
                "tool_calls": [{"name": "weather", "arguments": {"city": "c0z"}}],
            },
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny b0z."},
        ],
        None,
    )

    def mask(policy: MaskPolicy) -> np.ndarray:
        masker = LabelMasker(
            ChatRenderer(QWEN_LIKE, special_tokens(load_hf_tokenizer(key))),
            MaskerEncoding(
                lambda texts: rust.encode_batch(texts, add_special_tokens=False),
                lambda ids: rust.decode(ids, skip_special_tokens=False),
                segment_boundaries(key),
            ),
            Masking(spans="exact", policy=policy),
        )
        [row] = masker.tokenize([conv])
        assert row.status == RowStatus.KEPT
        return row.mask.astype(bool)

    text = ChatRenderer(QWEN_LIKE, {}).render(conv.messages, None, False)
    enc = rust.encode(text, add_special_tokens=False)
    offsets = np.array(enc.offsets, dtype=np.int64).reshape(-1, 2)
    before, after = mask(MaskPolicy()), mask(MaskPolicy(mask_tool_calls=True))
    for word in ("c0z", "<tool_call>", "</tool_call>", '"weather"'):
        assert (before & touching(offsets, text, word)).any() and not (
            after & touching(offsets, text, word)
        ).any()
    for word in ("a0z", "b0z"):
        assert after[touching(offsets, text, word)].all()


def test_thinking_ranges_in_a_message():
    text = "H<think>a</think>b c</think>d<think>e"
    assert thinking_ranges(text, 1, len(text)) == [(1, 17), (17, 28), (29, len(text))]
    assert thinking_ranges("no tags here", 0, 12) == []
