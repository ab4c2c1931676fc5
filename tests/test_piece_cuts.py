"""Prefix token counts cut inside a run (sftmix/tokenizing/piece_cuts.py), each against the tokenizers
library's encode of the whole prefix: for every family with cuts, on random text made to hold many cut
points and on rendered chats; and the masker's rows, with cuts and without, the same."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from sftmix.sources.formats import Conversation
from sftmix.tokenizing.encoders import LINE_CUTS, WORD_CUTS, FastEncoder
from sftmix.tokenizing.piece_cuts import PieceCuts
from sftmix.tokenizing.prefix_renders import PastedPrefix
from sftmix.tokenizing.segments import Encoded, PrefixEncoder
from sftmix.tokenizing.templates import ChatRenderer, named_template
from tests.test_encoders import FRAGMENTS, _proven, added_texts, encoders
from tests.tiers import examples

#: Each family the cuts know (a regex split: line cuts; SentencePiece-style: word cuts), and its kind.
FAMILIES = {
    "dolma2": LINE_CUTS,
    "qwen2-nfc": LINE_CUTS,
    "mistral-v3": WORD_CUTS,
    "claude": LINE_CUTS,
    "gemini": WORD_CUTS,
    "llama3": LINE_CUTS,
    "gpt2-byte-level": LINE_CUTS,
    "o200k-regex": LINE_CUTS,
    "tekken-regex": LINE_CUTS,
    "deepseek-v3": LINE_CUTS,
    "mistral-v3-always": WORD_CUTS,
    "mistral-v3-never": WORD_CUTS,
}
#: In the quick loop: one of each kind, and an NFKC normalizer; the rest in the full suite.
QUICK = ("dolma2", "mistral-v3", "claude")
#: Pieces that put cut points (and near misses) everywhere: a line break before a letter, after
#: punctuation, a space, a mark; spaces after words, runs of them, the marker itself.
NEAR_CUTS = ["\nHello", "\n\nThe", ".\nA", " \nB", "\u0301\nC", "\n1x", "\n é", " word", "  two", "▁x", "a▁"]


def _family(name: str) -> tuple[Tokenizer, FastEncoder, PieceCuts]:
    rust, fast = encoders(name)
    cuts = PieceCuts.of(_proven(name)[1], fast.added)
    assert cuts is not None and cuts.kind == FAMILIES[name]
    return rust, fast, cuts


def _count(rust: Tokenizer, text: str) -> int:
    return len(rust.encode(text, add_special_tokens=False).ids)


def _whole(encode, full: str) -> Encoded:
    encoder = PrefixEncoder(encode, None)
    [enc] = encoder.start([full])
    encoder.grow([enc], [None])
    return enc


def assert_counts(rust: Tokenizer, fast: FastEncoder, cuts: PieceCuts, full: str, prefixes: list) -> int:
    """Every cut prefix's count is the library's; returns how many were cut (the check is not vacuous)."""
    cut = 0
    for encode in (fast.encode_batch, lambda t: rust.encode_batch(t, add_special_tokens=False)):
        enc = _whole(encode, full)
        for prefix in prefixes:
            found = cuts.cut(prefix, full, enc)
            if found is None:
                continue
            base, tail = found
            assert base + _count(rust, tail) == _count(rust, str(prefix)), (str(prefix), full)
            cut += 1
    return cut


def pieces_for(rust: Tokenizer) -> st.SearchStrategy[str]:
    piece = st.one_of(
        st.sampled_from(FRAGMENTS + NEAR_CUTS + added_texts(rust)),
        st.text(alphabet=st.characters(codec="utf-8"), max_size=4),
    )
    return st.lists(piece, max_size=30).map("".join)


@pytest.mark.parametrize(
    "name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.full) for n in FAMILIES]
)
def test_cut_counts_are_the_librarys_on_random_text(name):
    """A prefix is the full text through a random point, then a random tail (a pasted one too)."""
    rust, fast, cuts = _family(name)
    cut = 0

    @settings(max_examples=examples(300), deadline=None, suppress_health_check=list(HealthCheck))
    @given(pieces_for(rust), pieces_for(rust), st.floats(0, 1))
    def check(full: str, tail: str, where: float) -> None:
        nonlocal cut
        at = int(len(full) * where)
        cut += assert_counts(rust, fast, cuts, full, [full[:at] + tail, PastedPrefix(full, at, tail)])

    check()
    assert cut > 0


@pytest.mark.parametrize(
    "name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.full) for n in FAMILIES]
)
def test_cut_counts_are_the_librarys_on_chat_prefixes(name):
    """The prefixes a masker asks of ``olmo`` renders: each turn's header and its render through it."""
    from tests.sharegpt import sharegpt_chats

    rust, fast, cuts = _family(name)
    renderer = ChatRenderer(named_template("olmo"), {"eos_token": "<|endoftext|>"})
    cut = 0
    for messages in sharegpt_chats(40 if name in QUICK else 150):
        full = renderer.render(messages, None, False)
        prefixes = []
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                prefixes += [
                    renderer.render(messages[:i], None, True),
                    renderer.render(messages[: i + 1], None, False),
                ]
        cut += assert_counts(rust, fast, cuts, full, prefixes)
    assert cut > 0


def test_a_cut_is_refused_where_an_added_token_could_span_it():
    """An added token holding the two characters a cut falls between (``\\nA``): no cut there."""
    rust, fast, cuts = _family("dolma2")
    spanning = dataclasses.replace(cuts, spanning=("x\nAb",))
    full = "one two\nAbc three\nAb"
    enc = _whole(fast.encode_batch, full)
    assert cuts.cut(full + "!", full, enc) is not None
    assert spanning.cut("one two\nAbc three\nAbd", full, enc)[1] == "Abd"  # the last one is clear
    assert (
        spanning.cut("one twox\nAbc", "one twox\nAbc three", _whole(fast.encode_batch, "one twox\nAbc three"))
        is None
    )


def test_families_without_cuts_have_none():
    """A Prepend normalizer (the marker before every run), and Gemma 3's ``>▁</`` token: no word cuts."""
    for name in ("sp-prepend-normalizer", "gemma3"):
        _, fast = encoders(name)
        assert PieceCuts.of(_proven(name)[1], fast.added) is None
    assert PieceCuts.of("unproven: it has a normalizer", []) is None


@pytest.mark.parametrize("name", ["claude", pytest.param("gemini", marks=pytest.mark.full), "mistral-v3"])
def test_the_maskers_rows_are_the_same_with_cuts_and_without(name):
    """ShareGPT chats under ``olmo`` (whose turn markers are none of these tokenizers' added tokens, so
    each prefix was encoded whole): ids, masks, statuses and reasons unchanged."""
    from sftmix.tokenizing.labels import LabelMasker
    from tests.sharegpt import sharegpt_chats

    rust, fast, cuts = _family(name)
    renderer = ChatRenderer(named_template("olmo"), {"eos_token": "<|endoftext|>"})
    convs = [Conversation(m, None) for m in sharegpt_chats(200)]
    rows = []
    for with_cuts in (cuts, None):
        masker = LabelMasker(
            renderer, fast.encode_batch, fast.decode, 512, None, skip_untrainable=True, cuts=with_cuts
        )
        rows.append([(r.ids.tolist(), r.mask.tolist(), r.status, r.detail) for r in masker.tokenize(convs)])
    assert rows[0] == rows[1]


def test_a_spans_decode_read_from_the_text_is_the_librarys():
    """Gemini's decoder (markers as spaces, byte tokens as bytes) and no marker put where the text has none:
    a span's decode is read from the text, and equals the library's for any span of any text (None where a
    span cuts a character, or the text holds the marker itself)."""
    rust, fast, _ = _family("gemini")
    assert fast.analysis.decodes
    read = 0

    @settings(max_examples=examples(300), deadline=None, suppress_health_check=list(HealthCheck))
    @given(pieces_for(rust), st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), max_size=6))
    def check(text: str, spans: list[tuple[float, float]]) -> None:
        nonlocal read
        enc = _whole(fast.encode_batch, text)
        ids = enc.ids.tolist()
        for a, b in spans:
            lo, hi = sorted((int(a * len(ids)), int(b * len(ids))))
            decoded = enc.decoded(lo, hi)
            if decoded is not None:
                assert decoded == rust.decode(ids[lo:hi], skip_special_tokens=False), (text, lo, hi)
                read += 1

    check()
    assert read > 0
