"""Label masking on literals and generated conversations, with real tokenizers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sftmix.sources.formats import Conversation
from sftmix.tokenizing.labels import LabelMasker, MaskerEncoding
from sftmix.tokenizing.masking import Masking
from sftmix.tokenizing.prefix_renders import common_prefix_length
from sftmix.tokenizing.row_status import RowStatus
from sftmix.tokenizing.templates import ChatRenderer, named_template
from sftmix.tokenizing.tokenizer import (
    TokenizerKey,
    load_hf_tokenizer,
    rust_tokenizer,
    segment_boundaries,
    special_tokens,
)
from tests.tiers import examples
from tests.tokenizer_fixtures import GOLDEN, ensure_dolma2

TOKENIZERS = ["tiny", "dolma2"]


def masker(
    tokenizer: str | Path,
    template: str,
    max_len: int | None,
    fast: bool,
    drop_early: bool = True,
    **masking: Any,
) -> LabelMasker:
    """``tokenizer``: a golden tokenizer's name, or a tokenizer's directory; ``masking``: the masker's
    settings but ``max_seq_length`` (``Masking``'s fields)."""
    directory = tokenizer if isinstance(tokenizer, Path) else GOLDEN / "tokenizers" / tokenizer
    if directory == GOLDEN / "tokenizers" / "dolma2":
        ensure_dolma2()
    key = TokenizerKey.of(str(directory), None)
    hf, rust = load_hf_tokenizer(key), rust_tokenizer(key)
    encoding = MaskerEncoding(
        lambda texts: rust.encode_batch(texts, add_special_tokens=False),
        lambda ids: hf.decode(ids, clean_up_tokenization_spaces=False),
        segment_boundaries(key) if fast else None,
    )
    renderer = ChatRenderer(named_template(template), special_tokens(hf))
    return LabelMasker(renderer, encoding, Masking(max_len, **masking), drop_early=drop_early)


PIECES = list("abc xyz.,!?\n é日🚀") + ["<|im_end|>", "<|im_start|>", "<|endoftext|>", " the", "\n\n"]
text = st.lists(st.sampled_from(PIECES), max_size=30).map("".join)
role = st.sampled_from(["user", "assistant", "system"])
conversation = st.lists(st.tuples(role, text), min_size=1, max_size=12).map(
    lambda turns: Conversation(messages=[{"role": r, "content": c} for r, c in turns], tools=None)
)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    convs=st.lists(conversation, min_size=1, max_size=4),
    tokenizer=st.sampled_from(TOKENIZERS),
    max_len=st.sampled_from([None, 16, 64]),
)
def test_prefix_counts_from_the_full_tokenization_are_exact(convs, tokenizer, max_len):
    """The linear-time olmo fallback gives exactly what tokenizing every prefix gives."""
    fast = masker(tokenizer, "olmo", max_len, fast=True).tokenize(convs)
    slow = masker(tokenizer, "olmo", max_len, fast=False).tokenize(convs)
    for a, b in zip(fast, slow, strict=True):
        assert a.status == b.status
        assert np.array_equal(a.ids, b.ids) and np.array_equal(a.mask, b.mask)


@settings(max_examples=examples(40), deadline=None)
@given(convs=st.lists(conversation, min_size=1, max_size=4), template=st.sampled_from(["tulu", "olmo"]))
def test_mask_never_covers_text_outside_assistant_turns(convs, template):
    m = masker("tiny", template, None, fast=True)
    for conv, row in zip(convs, m.tokenize(convs), strict=True):
        assert row.mask.shape == row.ids.shape
        if not any(msg["role"] == "assistant" for msg in conv.messages):
            assert not row.mask.any() and row.status == RowStatus.NO_TRAINABLE
        opens_with_assistant = (
            conv.messages[0]["role"] == "assistant"
        )  # reference: span from 0, header included
        if (
            template == "tulu" and row.mask.any() and not opens_with_assistant
        ):  # trainable: assistant text + eos
            trainable = m.decode(row.ids[row.mask.astype(bool)].tolist())
            allowed = "".join(
                msg["content"] + "<|endoftext|>\n" for msg in conv.messages if msg["role"] == "assistant"
            )
            assert set(trainable) <= set(allowed)


def test_common_prefix_length():
    assert common_prefix_length("abcdef", "abcxyz") == 3
    assert common_prefix_length("abc", "abc") == 3
    assert common_prefix_length("", "abc") == 0
    assert common_prefix_length("abcd", "abc") == 3


@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_assistant_first_and_truncated_rows(tokenizer):
    m = masker(tokenizer, "olmo", 40, fast=True)
    rows = m.tokenize(
        [
            Conversation([{"role": "assistant", "content": "I speak first."}], None),
            Conversation(
                [{"role": "user", "content": "long " * 200}, {"role": "assistant", "content": "cut"}], None
            ),
        ]
    )
    # the span starts at 0, as in the reference; whitespace-only tokens (empty trimmed offsets) stay masked
    assert rows[0].status == RowStatus.KEPT and rows[0].mask.sum() >= rows[0].mask.size - 2
    assert rows[1].status == RowStatus.NO_TRAINABLE and rows[1].ids.shape[0] == 40
