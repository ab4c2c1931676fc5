"""Tokenizing only a prefix of a render, in pieces cut at added tokens, gives the whole text's tokens."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sftmix.tokenizing.prefix_renders import common_prefix_length
from sftmix.tokenizing.segments import PrefixEncoder, overlap_mask, span_masks
from sftmix.tokenizing.tokenizer import TokenizerKey, rust_tokenizer, segment_boundaries
from tests.test_encoders import encoders
from tests.test_labels import PIECES, TOKENIZERS, conversation, masker
from tests.tiers import examples
from tests.tokenizer_fixtures import GOLDEN, ensure_dolma2

#: Pieces that make added tokens meet, overlap and almost match across a cut.
EDGES = [*PIECES, "<|im_end|><|im_start|>", "<|im_", "end|>", "<|", "|>", "<|endoftext|>\n", " \n"]


def _tokenizer(name: str):
    if name == "dolma2":
        ensure_dolma2()
    key = TokenizerKey.of(str(GOLDEN / "tokenizers" / name), None)
    return rust_tokenizer(key), segment_boundaries(key)


@settings(max_examples=examples(80), deadline=None, suppress_health_check=[HealthCheck.too_slow])
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


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    convs=st.lists(conversation, min_size=1, max_size=6),
    tokenizer=st.sampled_from(TOKENIZERS),
    template=st.sampled_from(["olmo", "tulu", "zephyr"]),
    max_len=st.sampled_from([None, 8, 16, 64]),
    mode=st.sampled_from(["assistant", "last_turn"]),
    every_row=st.booleans(),
)
def test_rows_dropped_early_are_the_rows_the_whole_check_drops(
    convs, tokenizer, template, max_len, mode, every_row
):
    """Dropping a row after its first span (tokenizing no further) keeps and drops exactly the rows, with
    the same reasons, that tokenizing every prefix in full does; kept rows have the same bytes. Either for
    every row (``drop_early``) or, as with a fast encoder, for rows that open with an assistant turn."""
    slow = masker(tokenizer, template, max_len, fast=False, mask=mode).tokenize(convs)
    fast = masker(
        tokenizer, template, max_len, fast=True, mask=mode, drop_untrainable=True, drop_early=every_row
    ).tokenize(convs)
    for a, b in zip(fast, slow, strict=True):
        assert (a.status, a.detail) == (b.status, b.detail)
        if a.status == 0:
            assert np.array_equal(a.ids, b.ids) and np.array_equal(a.mask, b.mask)


def test_segments_are_independent_only_without_a_normalizer_or_a_prefix_space():
    """``boundaries_of`` reads the normalizer and the pre-tokenizer's own JSON, never the whole
    tokenizer's; this is what the whole JSON says for each kind."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers

    from sftmix.tokenizing.tokenizer import boundaries_of

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


@settings(max_examples=examples(80), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    full=st.lists(st.sampled_from(EDGES), max_size=40).map("".join),
    tail=st.lists(st.sampled_from(EDGES), max_size=6).map("".join),
    at=st.floats(0, 1),
    name=st.sampled_from(TOKENIZERS),
    pick=st.integers(0, 12),
)
def test_a_pasted_prefix_is_cut_as_its_text_is(full, tail, at, name, pick):
    """``cut`` reads a pasted prefix only near the cut; what it finds is what the whole string gives."""
    from sftmix.tokenizing.prefix_renders import PastedPrefix

    rust, boundaries = _tokenizer(name)
    assert boundaries is not None
    encoder = PrefixEncoder(lambda t: rust.encode_batch(t, add_special_tokens=False), boundaries)
    [enc] = encoder.start([full])
    encoder.grow([enc], [None])
    known = [a.tolist() for a in enc.boundary_tokens(boundaries)]
    # where templates' prefixes part from the full render: at an added token (a turn's end marker)
    marks = [m.start() for m in boundaries.pattern.finditer(full)]
    end = marks[pick] if pick < len(marks) else int(at * len(full))
    prefix = PastedPrefix(full, end, tail)
    text = str(prefix)
    found = boundaries.cut(prefix, full, *known)
    assert found == boundaries.cut(text, full, *known) == _cut_whole(boundaries, text, full, *known)
    base, rest = found
    assert base + len(rust.encode(rest, add_special_tokens=False).ids) == len(
        rust.encode(text, add_special_tokens=False).ids
    )


def _cut_whole(boundaries, text: str, full: str, starts, ends, index) -> tuple[int, str]:
    """``SegmentBoundaries.cut`` as it was first written, on whole strings: the oracle for its windows."""
    agree = common_prefix_length(text, full)
    reach = boundaries.longest - 1
    j = int(np.searchsorted(starts, agree, side="right")) - 1
    while j >= 0:
        start, end = starts[j], ends[j]
        if end <= agree and (end == len(text) or end + reach <= agree):
            return index[j] + 1, text[end:]
        if boundaries.pattern.match(text, start):
            lo = max(0, start - boundaries.longest + 1)
            matches = boundaries.pattern.finditer(text, lo, start + boundaries.longest)
            if all(not (m.start() < start < m.end()) for m in matches):
                return index[j], text[start:]
        j -= 1
    return 0, text


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    texts=st.lists(st.lists(st.sampled_from(EDGES), max_size=60).map("".join), min_size=1, max_size=4),
    name=st.sampled_from(TOKENIZERS),
    engine=st.sampled_from(["tiktoken", "fastokens"]),
    want=st.integers(1, 40),
    spans=st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), min_size=1, max_size=4),
)
def test_the_fast_encoders_pieces_give_the_librarys_offsets_and_decodes(texts, name, engine, want, spans):
    """With the fast encoder's pieces, the boundary tokens' offsets (made for those tokens only) and the
    decoded spans (read from the text) are the library's."""
    if name == "dolma2":
        ensure_dolma2()
    rust, fast = encoders(name, engine)
    boundaries = segment_boundaries(TokenizerKey.of(str(GOLDEN / "tokenizers" / name), None))
    assert boundaries is not None
    encoder = PrefixEncoder(fast.encode_batch, boundaries)
    encs = encoder.start(texts)
    encoder.grow(encs, [want] * len(texts))
    for text, enc in zip(texts, encs, strict=True):
        whole = rust.encode(text, add_special_tokens=False)
        starts, ends, at = enc.boundary_tokens(boundaries)
        assert [tuple(whole.offsets[i]) for i in at.tolist()] == list(
            zip(starts.tolist(), ends.tolist(), strict=True)
        )
        n = enc.length
        for a, b in spans:
            lo, hi = sorted((int(a * n), int(b * n)))
            decoded = enc.decoded(lo, hi)
            assert decoded is None or decoded == rust.decode(whole.ids[lo:hi], skip_special_tokens=False)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    texts=st.lists(
        st.lists(st.sampled_from(EDGES), min_size=1, max_size=60).map("".join), min_size=1, max_size=4
    ),
    name=st.sampled_from(["dolma2", "tiny", "llama3", "trimming-post-processor", "mistral-v3"]),
    want=st.sampled_from([None, None, 1, 5, 40]),
    spans=st.lists(st.tuples(st.floats(0, 1), st.floats(0, 0.6)), max_size=5),
)
def test_the_mask_read_from_token_bytes_is_the_overlap_of_the_librarys_offsets(texts, name, want, spans):
    """``Encoded.span_mask`` (from the tokens' bytes, where it can) is the overlap rule over the library's
    offsets, whatever the characters' widths, however far the text is tokenized, for any spans; and the
    boundary tokens' offsets, read through the same map from bytes to characters, are the library's."""
    if name == "dolma2":
        ensure_dolma2()
    rust, fast = encoders(name)
    encoder = PrefixEncoder(fast.encode_batch, _tokenizer(name)[1] if name in TOKENIZERS else None)
    encs = encoder.start(texts)
    encoder.grow(encs, [want] * len(texts))
    chosen_spans = [
        [(int(a * len(t)), int((a + b) * len(t))) for a, b in spans] for t in texts
    ]  # (some past the end)
    limits = [enc.length if want is None else min(want, enc.length) for enc in encs]
    # the batch's rows made together, before anything of a row is made alone (each span finds only its
    # own row's tokens); checked below against the library
    together = [m.tolist() for m in span_masks(encs, limits, chosen_spans)]
    expected = []
    for text, enc, chosen, n in zip(texts, encs, chosen_spans, limits, strict=True):
        whole = rust.encode(text, add_special_tokens=False)
        library = np.array(whole.offsets[:n], dtype=np.int64).reshape(-1, 2)
        assert enc.span_mask(n, chosen).tolist() == overlap_mask(library, chosen).tolist()
        expected.append(overlap_mask(library, chosen).tolist())
        if encoder.boundaries is not None:  # the same bytes-to-characters map places the boundary tokens
            starts, ends, at = enc.boundary_tokens(encoder.boundaries)
            assert list(zip(starts.tolist(), ends.tolist(), strict=True)) == [
                whole.offsets[i] for i in at.tolist()
            ]
    assert together == expected
    assert [m.tolist() for m in span_masks(encs[::-1], limits[::-1], chosen_spans[::-1])] == expected[::-1]
