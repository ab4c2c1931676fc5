"""Prefix token counts taken from where the tokenizer restarts inside a run (sftmix/tokenizing/restarts.py),
each against the tokenizers library's encode of the whole prefix: for every family with restarts, on random
text made to hold many of them and on rendered chats; and the masker's rows, with restarts and without,
the same."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from sftmix.sources.formats import Conversation
from sftmix.tokenizing.encoders import FastEncoder
from sftmix.tokenizing.fast_analysis import LINE_RESTARTS, WORD_RESTARTS
from sftmix.tokenizing.prefix_renders import PastedPrefix
from sftmix.tokenizing.restarts import Restarts
from sftmix.tokenizing.segments import Encoded, PrefixEncoder
from sftmix.tokenizing.templates import ChatRenderer, named_template
from tests.test_encoders import FRAGMENTS, _proven, added_texts, encoders
from tests.tiers import examples

#: Each family with restarts (a regex split: ``line``; SentencePiece-style: ``word``), and its kind.
FAMILIES = {
    "dolma2": LINE_RESTARTS,
    "qwen2-nfc": LINE_RESTARTS,
    "mistral-v3": WORD_RESTARTS,
    "claude": LINE_RESTARTS,
    "gemini": WORD_RESTARTS,
    "llama3": LINE_RESTARTS,
    "gpt2-byte-level": LINE_RESTARTS,
    "o200k-regex": LINE_RESTARTS,
    "tekken-regex": LINE_RESTARTS,
    "deepseek-v3": LINE_RESTARTS,
    "mistral-v3-always": WORD_RESTARTS,
    "mistral-v3-never": WORD_RESTARTS,
}
#: In the quick loop: one of each kind, and an NFKC normalizer; the rest in the full suite.
QUICK = ("dolma2", "mistral-v3", "claude")
#: Pieces that put restarts (and near misses) everywhere: a line break before a letter, after
#: punctuation, a space, a mark; spaces after words, runs of them, the marker itself.
NEAR_RESTARTS = [
    "\nHello",
    "\n\nThe",
    ".\nA",
    " \nB",
    "\u0301\nC",
    "\n1x",
    "\n é",
    " word",
    "  two",
    "▁x",
    "a▁",
]


def _family(name: str) -> tuple[Tokenizer, FastEncoder, Restarts]:
    rust, fast = encoders(name)
    restarts = Restarts.of(_proven(name)[1], fast.added)
    assert restarts is not None and restarts.kind == FAMILIES[name]
    return rust, fast, restarts


def _count(rust: Tokenizer, text: str) -> int:
    return len(rust.encode(text, add_special_tokens=False).ids)


def _whole(encode, full: str) -> Encoded:
    encoder = PrefixEncoder(encode, None)
    [enc] = encoder.start([full])
    encoder.grow([enc], [None])
    return enc


def assert_counts(rust: Tokenizer, fast: FastEncoder, restarts: Restarts, full: str, prefixes: list) -> int:
    """Every count taken from a restart is the library's; returns how many were (the check is not vacuous)."""
    taken = 0
    for encode in (fast.encode_batch, lambda t: rust.encode_batch(t, add_special_tokens=False)):
        enc = _whole(encode, full)
        for prefix in prefixes:
            found = restarts.last_shared(prefix, full, enc)
            if found is None:
                continue
            base, tail = found
            assert base + _count(rust, tail) == _count(rust, str(prefix)), (str(prefix), full)
            taken += 1
    return taken


def pieces_for(rust: Tokenizer) -> st.SearchStrategy[str]:
    piece = st.one_of(
        st.sampled_from(FRAGMENTS + NEAR_RESTARTS + added_texts(rust)),
        st.text(alphabet=st.characters(codec="utf-8"), max_size=4),
    )
    return st.lists(piece, max_size=30).map("".join)


@pytest.mark.parametrize(
    "name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.full) for n in FAMILIES]
)
def test_counts_from_restarts_are_the_librarys_on_random_text(name):
    """A prefix is the full text through a random point, then a random tail (a pasted one too)."""
    rust, fast, restarts = _family(name)
    taken = 0

    @settings(max_examples=examples(300), deadline=None, suppress_health_check=list(HealthCheck))
    @given(pieces_for(rust), pieces_for(rust), st.floats(0, 1))
    @example("Hello there\nworld again\nand more", " tail", 0.9)  # (a restart each family takes)
    def check(full: str, tail: str, where: float) -> None:
        nonlocal taken
        at = int(len(full) * where)
        taken += assert_counts(rust, fast, restarts, full, [full[:at] + tail, PastedPrefix(full, at, tail)])

    check()
    assert taken > 0


@pytest.mark.parametrize(
    "name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.full) for n in FAMILIES]
)
def test_counts_from_restarts_are_the_librarys_on_chat_prefixes(name):
    """The prefixes a masker asks of ``olmo`` renders: each turn's header and its render through it."""
    from tests.sharegpt import sharegpt_chats

    rust, fast, restarts = _family(name)
    renderer = ChatRenderer(named_template("olmo"), {"eos_token": "<|endoftext|>"})
    taken = 0
    for messages in sharegpt_chats(40 if name in QUICK else 150):
        full = renderer.render(messages, None, False)
        prefixes = []
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                prefixes += [
                    renderer.render(messages[:i], None, True),
                    renderer.render(messages[: i + 1], None, False),
                ]
        taken += assert_counts(rust, fast, restarts, full, prefixes)
    assert taken > 0


def test_no_restart_where_an_added_token_lies_across_it():
    """An added token holding the two characters a cut falls between (``\\nA``): no restart there."""
    rust, fast, restarts = _family("dolma2")
    spanning = dataclasses.replace(restarts, across=("x\nAb",))
    full = "one two\nAbc three\nAb"
    enc = _whole(fast.encode_batch, full)
    assert restarts.last_shared(full + "!", full, enc) is not None
    assert spanning.last_shared("one two\nAbc three\nAbd", full, enc)[1] == "Abd"  # the last one is clear
    assert (
        spanning.last_shared(
            "one twox\nAbc", "one twox\nAbc three", _whole(fast.encode_batch, "one twox\nAbc three")
        )
        is None
    )


def test_families_without_restarts_have_none():
    """A Prepend normalizer (the marker before every run), and Gemma 3's ``>▁</`` token: no word restarts."""
    for name in ("sp-prepend-normalizer", "gemma3"):
        _, fast = encoders(name)
        assert Restarts.of(_proven(name)[1], fast.added) is None
    assert Restarts.of("unproven: it has a normalizer", []) is None


@pytest.mark.parametrize("name", ["claude", pytest.param("gemini", marks=pytest.mark.full), "mistral-v3"])
def test_the_maskers_rows_are_the_same_with_restarts_and_without(name):
    """ShareGPT chats under ``olmo`` (whose turn markers are none of these tokenizers' added tokens, so
    each prefix was encoded whole): ids, masks, statuses and reasons unchanged."""
    from sftmix.tokenizing.labels import LabelMasker, MaskerEncoding
    from sftmix.tokenizing.masking import Masking
    from tests.sharegpt import sharegpt_chats

    rust, fast, restarts = _family(name)
    renderer = ChatRenderer(named_template("olmo"), {"eos_token": "<|endoftext|>"})
    convs = [Conversation(m, None) for m in sharegpt_chats(200)]
    rows = []
    for with_restarts in (restarts, None):
        encoding = MaskerEncoding(fast.encode_batch, fast.decode, restarts=with_restarts)
        masker = LabelMasker(renderer, encoding, Masking(512, drop_untrainable=True))
        rows.append([(r.ids.tolist(), r.mask.tolist(), r.status, r.detail) for r in masker.tokenize(convs)])
    assert rows[0] == rows[1]


def test_a_spans_decode_read_from_the_text_is_the_librarys():
    """Gemini's decoder (markers as spaces, byte tokens as bytes) and no marker put where the text has none:
    a span's decode is read from the text, and equals the library's for any span of any text (None where a
    span restarts a character, or the text holds the marker itself)."""
    rust, fast, _ = _family("gemini")
    assert fast.analysis.text_decodes
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


def test_no_restart_where_an_added_token_begins_in_either_text():
    """GPT-2's regex takes two line breaks whole at the end of a run and one at a time before a letter: with
    an added token ``Assist``, ``hello\\n\\nAssist me`` and ``hello\\n\\nAsk me`` differ before the ``A``, so
    neither is counted from the other there; without that token both are, exactly."""
    from tokenizers import AddedToken

    base, _ = encoders("gpt2-byte-level")
    rust = Tokenizer.from_str(base.to_str())
    rust.add_tokens([AddedToken("Assist", normalized=False)])
    analysis = _proven("gpt2-byte-level")[1]
    restarts = Restarts.of(analysis, ["Assist"])
    assert restarts is not None and restarts.beginning == ("Assist",)

    def library(text: str) -> Encoded:
        return _whole(lambda t: rust.encode_batch(t, add_special_tokens=False), text)

    pairs = [("hello\n\nAsk me", "hello\n\nAssist me"), ("hello\n\nAssist", "hello\n\nAsk me more")]
    for prefix, full in pairs:
        assert restarts.last_shared(prefix, full, library(full)) is None
    plain = Restarts.of(analysis, [])
    for prefix, full in [("hello\n\nAsk me", "hello\n\nAnd me")]:
        base_enc = _whole(lambda t: base.encode_batch(t, add_special_tokens=False), full)
        before, tail = plain.last_shared(prefix, full, base_enc)
        assert before + _count(base, tail) == _count(base, prefix)
