"""Tokenizing only a prefix of a render, in pieces cut at added tokens, gives the whole text's tokens."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sftmix.segments import PrefixEncoder
from sftmix.tokenizer import TokenizerKey, rust_tokenizer, segment_boundaries
from tests.test_labels import PIECES, TOKENIZERS, conversation, masker
from tests.tokenizer_fixtures import GOLDEN, ensure_dolma2

#: Pieces that make added tokens meet, overlap and almost match across a cut.
EDGES = [*PIECES, "<|im_end|><|im_start|>", "<|im_", "end|>", "<|", "|>", "<|endoftext|>\n", " \n"]


def _tokenizer(name: str):
    if name == "dolma2":
        ensure_dolma2()
    key = TokenizerKey.of(str(GOLDEN / "tokenizers" / name), None)
    return rust_tokenizer(key), segment_boundaries(key)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    texts=st.lists(st.lists(st.sampled_from(EDGES), max_size=60).map("".join), min_size=1, max_size=5),
    name=st.sampled_from(TOKENIZERS),
    want=st.lists(st.integers(1, 80), min_size=5, max_size=5),
    chars_per_token=st.sampled_from([0.05, 0.5, 1.0, 3.0, 50.0]),
)
def test_pieces_give_the_whole_texts_tokens(texts, name, want, chars_per_token):
    rust, boundaries = _tokenizer(name)
    assert boundaries is not None
    encoder = PrefixEncoder(lambda t: rust.encode_batch(t, add_special_tokens=False), boundaries)
    encoder._chars, encoder._tokens = chars_per_token * 1000, 1000  # how far each piece reaches
    encs = encoder.start(texts)
    encoder.grow(encs, want[: len(texts)])
    encoder.grow(encs, [w + 7 for w in want[: len(texts)]])  # growing again appends
    for text, enc, n in zip(texts, encs, want, strict=False):
        whole = rust.encode(text, add_special_tokens=False)
        assert enc.length >= min(n + 7, len(whole.ids))
        assert enc.ids.tolist() == whole.ids[: enc.length]
        assert enc.offsets().tolist() == [list(o) for o in whole.offsets[: enc.length]]
        starts, ends, at = enc.boundary_tokens(boundaries)
        assert all(whole.ids[i] in boundaries.ids for i in at.tolist())
        assert [tuple(whole.offsets[i]) for i in at.tolist()] == list(
            zip(starts.tolist(), ends.tolist(), strict=True)
        )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    convs=st.lists(conversation, min_size=1, max_size=6),
    tokenizer=st.sampled_from(TOKENIZERS),
    template=st.sampled_from(["olmo", "tulu", "zephyr"]),
    max_len=st.sampled_from([None, 8, 16, 64]),
    mode=st.sampled_from(["assistant", "last_turn"]),
)
def test_rows_dropped_early_are_the_rows_the_whole_check_drops(convs, tokenizer, template, max_len, mode):
    """Dropping a row after its first span (tokenizing no further) keeps and drops exactly the rows, with
    the same reasons, that tokenizing every prefix in full does; kept rows have the same bytes."""
    slow = masker(tokenizer, template, max_len, fast=False, mode=mode).tokenize(convs)
    fast = masker(tokenizer, template, max_len, fast=True, mode=mode, drop_untrainable=True).tokenize(convs)
    for a, b in zip(fast, slow, strict=True):
        assert (a.status, a.detail) == (b.status, b.detail)
        if a.status == 0:
            assert np.array_equal(a.ids, b.ids) and np.array_equal(a.mask, b.mask)


def test_segments_are_independent_only_without_a_normalizer_or_a_prefix_space():
    """``boundaries_of`` reads the normalizer and the pre-tokenizer's own JSON, never the whole
    tokenizer's; this is what the whole JSON says for each kind."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers

    from sftmix.tokenizer import boundaries_of

    def build(normalizer=None, pre=None) -> Tokenizer:
        tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
        if normalizer is not None:
            tok.normalizer = normalizer
        if pre is not None:
            tok.pre_tokenizer = pre
        tok.add_special_tokens([AddedToken("<|end|>", special=True), AddedToken("<x>", lstrip=True)])
        return tok

    split = pre_tokenizers.Split(Regex(r"\s+"), behavior="isolated")
    dependent = [
        build(normalizers.NFC(), pre_tokenizers.Whitespace()),
        build(pre=pre_tokenizers.Metaspace()),
        build(pre=pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=True)])),
    ]
    for tok in dependent:
        assert boundaries_of(tok) is None, tok.to_str()[:300]
    for tok in (
        build(),
        build(pre=pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False)])),
    ):
        found = boundaries_of(tok)
        assert found is not None
        assert found.contents == ("<|end|>",)  # <x> strips spaces around it: no boundary
        assert found.every == ("<x>", "<|end|>")
