"""``mask_thinking`` (opt-in, beyond the reference): for all 21 of the reference's templates, no trained
token touches thinking text or its tags, every other token the assistant rule trains stays trained, and
rows without thinking keep their mask byte for byte."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sftmix.formats import Conversation
from sftmix.labels import RowStatus, thinking_ranges
from sftmix.templates import NAMED_TEMPLATES
from sftmix.tokenizer import TokenizerKey, rust_tokenizer
from tests.test_labels import GOLDEN, masker

SHAPES = ["plain", "closed", "unopened", "unclosed"]


def content(i: int, shape: str) -> str:
    """Thinking words are r<i>z, answer words a<i>z: unique, so where each lands is unambiguous."""
    return {
        "plain": f"The a{i}z.",
        "closed": f"<think>why r{i}z</think>\nThe a{i}z.",
        "unopened": f"why r{i}z</think>\nThe a{i}z.",  # the template's generation prompt opened it
        "unclosed": f"The a{i}z. <think>why r{i}z",
    }[shape]


turns = st.lists(st.sampled_from(SHAPES), min_size=1, max_size=4)


def conversation(shapes: list[str]) -> Conversation:
    messages = []
    for i, shape in enumerate(shapes):
        messages += [
            {"role": "user", "content": f"Question q{i}z?"},
            {"role": "assistant", "content": content(i, shape)},
        ]
    return Conversation(messages, None)


def touching(offsets: np.ndarray, text: str, word: str) -> np.ndarray:
    """Tokens whose characters overlap an occurrence of ``word``."""
    hit = np.zeros(offsets.shape[0], dtype=bool)
    for m in re.finditer(re.escape(word), text):
        hit |= (offsets[:, 0] < m.end()) & (m.start() < offsets[:, 1])
    return hit


@pytest.mark.parametrize("name", NAMED_TEMPLATES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes=turns, last_turn=st.booleans())
def test_thinking_is_never_trained_and_the_rest_of_the_turn_is(name, shapes, last_turn):
    mode = "last_turn" if last_turn else "assistant"
    conv = conversation(shapes)
    plain = masker("dolma2", name, None, True, mode=mode)
    [without] = plain.tokenize([conv])
    [with_] = masker("dolma2", name, None, True, mode=mode, mask_thinking=True).tokenize([conv])
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
        for word in ("<think>", "</think>", f"r{i}z"):
            assert not (after & touching(offsets, text, word)).any(), (name, shape, word)
        answer = touching(offsets, text, f"a{i}z") & before
        assert after[answer].all(), (name, shape, "answer")
    if all(s == "plain" for s in shapes):
        assert np.array_equal(before, after)
    if not after.any():
        assert with_.status == RowStatus.NO_TRAINABLE


def test_thinking_ranges_in_a_turn():
    text = "H<think>a</think>b c</think>d<think>e"
    assert thinking_ranges(text, 1, len(text)) == [(1, 17), (17, 28), (29, len(text))]
    assert thinking_ranges("no tags here", 0, 12) == []
