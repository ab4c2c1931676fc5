"""The fast encoder against the tokenizers library, the oracle: same ids and offsets on random text for
every tokenizer in the repository and with each engine (fastokens, tiktoken), the engine's piecewise
encodes included; and refused wherever the tokenizer is not provably the one tiktoken implements."""

from __future__ import annotations

import copy
import json
import shutil
import unicodedata
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from sftmix.config.config import DatasetEntry, MixerConfig, OutputSpec, TokenizerSpec
from sftmix.config.run_options import RunOptions
from sftmix.errors import ConfigError
from sftmix.planning.plan import build_plan
from sftmix.sources.formats import Conversation
from sftmix.tokenizing.encoder_proof import analyse
from sftmix.tokenizing.encoders import FastEncoder, char_offsets, same_encodings
from sftmix.tokenizing.engines import (
    BYTE_LEVEL_PATTERN,
    ENGINE_ENV,
    ENGINES,
    PROVEN_PATTERNS,
    PROVEN_SPLIT_SEQUENCES,
    fast_engine,
)
from sftmix.tokenizing.fast_analysis import FastAnalysis, Unproven
from sftmix.tokenizing.labels import LabelMasker, MaskerEncoding
from sftmix.tokenizing.masking import Masking
from sftmix.tokenizing.segments import PrefixEncoder
from sftmix.tokenizing.sentencepiece_proof import METASPACE
from sftmix.tokenizing.templates import ChatRenderer, named_template
from sftmix.tokenizing.tokenizer import boundaries_of
from tests.test_labels import conversation
from tests.tiers import examples
from tests.tokenizer_fixtures import (
    DOLMA2_DIR,
    GOLDEN,
    claude_dir,
    deepseek_v3_dir,
    ensure_dolma2,
    gemini_dir,
    gemma3_dir,
    llama3_dir,
    mistral_sp_dir,
    tekken_dir,
)

TINY_DIR = GOLDEN / "tokenizers" / "tiny"


def _dolma2_json() -> dict:
    ensure_dolma2()
    return json.loads((DOLMA2_DIR / "tokenizer.json").read_text(encoding="utf-8"))


def _variant(name: str) -> dict:
    """dolma2's vocabulary behind each pre-tokenizer we prove (both encoders read the same vocabulary)."""
    data = _dolma2_json()
    if name in ("qwen2-regex", "o200k-regex", "tekken-regex"):
        data["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = PROVEN_PATTERNS[name.split("-")[0]]
    elif name == "qwen2-nfc":  # Qwen2's and Qwen3's shape: its regex after an NFC normalizer
        data["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = PROVEN_PATTERNS["qwen2"]
        data["normalizer"] = {"type": "NFC"}
    elif name == "gpt2-byte-level":
        data["pre_tokenizer"] = _byte_level(add_prefix_space=False)
    elif name == "isolated-split":
        data["pre_tokenizer"]["pretokenizers"][0].update(behavior="Isolated", invert=False)
    elif name == "trimming-post-processor":
        data["post_processor"] = _byte_level(add_prefix_space=True)
    return data


def _mistral_json() -> dict:
    return json.loads((mistral_sp_dir() / "tokenizer.json").read_text(encoding="utf-8"))


def _sentencepiece(name: str) -> dict:
    """Mistral v3's SentencePiece vocabulary behind each Metaspace shape we encode fast."""
    data = _mistral_json()
    if name == "mistral-v3-never":  # Metaspace that marks no first word
        data["pre_tokenizer"]["prepend_scheme"] = "never"
    elif name == "mistral-v3-always":  # transformers' Llama with legacy: a marker before every run
        data["pre_tokenizer"]["prepend_scheme"] = "always"
    elif name == "sp-prepend-normalizer":  # the legacy tokenizer.json of Llama-2 and Mistral on the hub
        data["pre_tokenizer"] = None
        data["normalizer"] = {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": METASPACE},
                {"type": "Replace", "pattern": {"String": " "}, "content": METASPACE},
            ],
        }
    elif name == "sp-replace-normalizer":  # Gemma's shape: spaces become markers in the normalizer
        data["pre_tokenizer"] = None
        data["normalizer"] = {"type": "Replace", "pattern": {"String": " "}, "content": METASPACE}
    elif name == "sp-gemma3-shape":  # Gemma 3's: then a Split on " ", which finds none left
        data["pre_tokenizer"] = {
            "type": "Split",
            "pattern": {"String": " "},
            "behavior": "MergedWithPrevious",
            "invert": False,
        }
        data["normalizer"] = {"type": "Replace", "pattern": {"String": " "}, "content": METASPACE}
    return data


def _byte_level(add_prefix_space: bool) -> dict:
    return {
        "type": "ByteLevel",
        "add_prefix_space": add_prefix_space,
        "trim_offsets": True,
        "use_regex": True,
    }


TOKENIZERS = [
    "dolma2",
    "tiny",
    "llama3",
    "tekken",
    "qwen2-regex",
    "o200k-regex",
    "tekken-regex",
    "qwen2-nfc",
    "gpt2-byte-level",
    "isolated-split",
    "trimming-post-processor",
    "mistral-v3",
    "mistral-v3-never",
    "mistral-v3-always",
    "sp-replace-normalizer",
    "sp-prepend-normalizer",
    "sp-gemma3-shape",
    "gemma3",
    "deepseek-v3",
    "claude",
    "gemini",
]
#: SentencePiece-style tokenizers: fastokens is their only engine (tiktoken has no such pipeline).
SENTENCEPIECE = (
    "mistral-v3",
    "mistral-v3-never",
    "mistral-v3-always",
    "sp-replace-normalizer",
    "sp-prepend-normalizer",
    "sp-gemma3-shape",
    "gemma3",
    "gemini",
)
#: Tokenizers only fastokens encodes fast: SentencePiece-style ones and sequences of splits.
FASTOKENS_ONLY = (*SENTENCEPIECE, "deepseek-v3")


@cache
def _proven(name: str) -> tuple[str, FastAnalysis]:
    """A test tokenizer's JSON and its analysis (seconds for the large ones): once per name, whatever
    the engine."""
    if name == "dolma2":
        text = json.dumps(_dolma2_json())
    elif name == "tiny":
        text = (TINY_DIR / "tokenizer.json").read_text(encoding="utf-8")
    elif name == "llama3":
        text = (llama3_dir() / "tokenizer.json").read_text(encoding="utf-8")
    elif name == "tekken":
        text = (tekken_dir() / "tokenizer.json").read_text(encoding="utf-8")
    elif name == "deepseek-v3":
        text = (deepseek_v3_dir() / "tokenizer.json").read_text(encoding="utf-8")
    elif name == "gemma3":
        text = (gemma3_dir() / "tokenizer.json").read_text(encoding="utf-8")
    elif name in ("claude", "gemini"):  # as transformers loads them (the files' own pipelines)
        folder = claude_dir() if name == "claude" else gemini_dir()
        text = (folder / "tokenizer.json").read_text(encoding="utf-8")
    elif name in SENTENCEPIECE:
        text = json.dumps(_sentencepiece(name))
    else:
        text = json.dumps(_variant(name))
    return text, analyse(text)


@cache
def encoders(name: str, engine: str = "auto") -> tuple[Tokenizer, FastEncoder]:
    text, analysis = _proven(name)
    if engine == "auto":  # the engine auto picks: one encoder (seconds to build) for both names of it
        picked = (
            "fastokens" if analysis.splits or analysis.metaspace else fast_engine(analysis.pattern, "auto")
        )
        return encoders(name, picked)
    rust = Tokenizer.from_str(text)
    rust.no_truncation()
    rust.no_padding()
    if name in FASTOKENS_ONLY and engine == "tiktoken":
        pytest.skip("tiktoken has no SentencePiece-style BPE, nor a sequence of splits")
    if engine == "fastokens" or name in FASTOKENS_ONLY:
        pytest.importorskip("fastokens")  # a dependency only where it has wheels (pyproject.toml)
    fast = FastEncoder(rust, analysis, engine=engine)
    assert engine == "auto" or fast.engine == engine, f"{engine} is not used for {name}"
    assert fast.engine == "fastokens" or name not in FASTOKENS_ONLY
    return rust, fast


def added_texts(rust: Tokenizer) -> list[str]:
    return sorted(t.content for t in rust.get_added_tokens_decoder().values())[:12]


FRAGMENTS = [
    "Hello",
    " world",
    "  spaced",
    "\t",
    "\n",
    "\r\n",
    "\r\n\r\n",
    "   \n ",
    " \u00a0",
    "\u0085",
    "\u2028",
    "'s",
    "'T",
    "'LL",
    "don't",
    "12345",
    " 3.14159",
    "１２３",
    "Ⅻ",
    "é",
    "e\u0301",
    "a\u0308\u0301",
    "中文字符",
    " 日本語",
    "한국어",
    "русский",
    "العربية",
    "עברית",
    "😀",
    "👍🏽",
    "👩\u200d💻",
    "🏳️\u200d🌈",
    "```python\n",
    "    return x\n",
    "<|",
    "|>",
    "<",
    "@@",
    "\x00",
    "\x7f",
    "\ufeff",
    "ﬁ",
    "ß",
    "İ",
    # o200k-style regexes split words by case class (Lu Lt Lm Lo M, then Ll Lm Lo M) and keep "/" after
    # punctuation: title-case, modifier and other letters, marks alone, camel case, contractions, paths
    "ǅungla",
    "ᾈ",
    "ʰello",
    "HelloWorld",
    "iPhoneXS",
    "ABCdef'S",
    "DON'T",
    "́x",
    "x́Y",
    "a/b//",
    " ./path/to/",
    "²",
    "٣٤٥٦",
    "𝟘𝟙",
    # SentencePiece: the text's own word markers, next to spaces or alone
    "▁",
    " ▁",
    "▁▁x",
    "[INST]",
    "[REFERENCE_DOC_1]0",
    # DeepSeek-V3's splits: digits by three, runs of ideographs and kana (not Hangul), ASCII punctuation
    # before letters, marks after letters, punctuation and symbols in runs
    "1234567",
    "漢字かなカナ",
    "ひらがなテスト123",
    "龥龦",
    "ー・",
    "(foo",
    "#define",
    "\\x",
    "«a»",
    "—x",
    "a\u0300b",
    " $100",
    "€5",
    "x++",
    "...\n\n",
    "|DSML|",
]


def texts_for(rust: Tokenizer) -> st.SearchStrategy[str]:
    pieces = st.one_of(
        st.sampled_from(FRAGMENTS + added_texts(rust)),
        st.text(max_size=8),
        st.text(alphabet=st.characters(codec="utf-8"), max_size=6),
    )
    return st.lists(pieces, max_size=24).map("".join)


def assert_same(rust: Tokenizer, fast: FastEncoder, texts: list[str]) -> None:
    assert same_encodings(rust, fast, texts) is None, [t for t in texts if same_encodings(rust, fast, [t])]


#: The default engine in the quick loop, the other in the full suite (each random-text run is minutes).
ENGINES_QUICK_FIRST = [ENGINES[0], pytest.param(ENGINES[1], marks=pytest.mark.slow)]
#: Both engines in the full run; the first (the default where installed) in the quick loop.
ENGINES_LOOP_FIRST = [ENGINES[0], *(pytest.param(e, marks=pytest.mark.full) for e in ENGINES[1:])]


#: The tokenizers whose random-text run is in the quick loop (byte-level BPE, SentencePiece-style, a
#: normalizer; DeepSeek-V3 and Gemma 3, the large vocabularies, in their own loop tests); every one in the
#: full suite.
QUICK_TOKENIZERS = ("dolma2", "qwen2-nfc", "mistral-v3")


@pytest.mark.parametrize("engine", ENGINES_QUICK_FIRST)
@pytest.mark.parametrize(
    "name", [n if n in QUICK_TOKENIZERS else pytest.param(n, marks=pytest.mark.full) for n in TOKENIZERS]
)
def test_same_ids_and_offsets_on_random_text(name, engine):
    rust, fast = encoders(name, engine)

    @settings(
        max_examples=examples(300), deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
    )
    @given(st.lists(texts_for(rust), min_size=1, max_size=4))
    def check(texts):
        assert_same(rust, fast, texts)

    check()
    assert_same(rust, fast, ["", " ", "\r\n", *added_texts(rust), "".join(added_texts(rust))])


@pytest.mark.parametrize("engine", ENGINES_LOOP_FIRST)
@pytest.mark.parametrize("name", ["dolma2", "tiny", pytest.param("llama3", marks=pytest.mark.full)])
def test_the_fast_path_itself_is_compared(name, engine):
    """Texts handed to the library would compare equal trivially: on these, dolma2 and the tiny
    tokenizer hand over none, Llama-3 only texts with one of its few unproven tokens."""
    rust, fast = encoders(name, engine)
    before = fast.fallbacks
    texts = [" ".join(FRAGMENTS[i:] + FRAGMENTS[:i]) for i in range(len(FRAGMENTS))]
    assert_same(rust, fast, texts)
    assert fast.fallbacks - before <= (len(texts) if name == "llama3" else 0)
    if name != "llama3":
        assert not fast.unsafe


@pytest.mark.parametrize("engine", ENGINES_LOOP_FIRST)
def test_a_text_with_an_unproven_token_goes_to_the_library(engine):
    rust, fast = encoders("llama3", engine)
    token = min(fast.unsafe)
    text = rust.decode([token])
    before = fast.fallbacks
    [enc] = fast.encode_batch([text])
    assert fast.fallbacks == before + 1 and list(enc.ids) == rust.encode(text, add_special_tokens=False).ids


#: Each normal form: the tokenizer that has it, and texts it would change (a decomposed accent, the Angstrom
#: sign; an ellipsis, a ligature, full-width digits, a no-break space) or whose character this Python's
#: Unicode tables leave unassigned (a newer Unicode may normalize it).
NORMALIZED_AWAY = {
    "NFC": ("qwen2-nfc", ["cafe\u0301", "\u212b ngstrom", "x a\u0308\u0301 y"]),
    "NFKC": (
        "claude",
        ["wait\u2026", "\ufb01le", "\uff11\uff12\uff13", "a\u00a0b", "cafe\u0301", "x \U0001e030 y"],
    ),
}


@pytest.mark.parametrize("engine", ENGINES_LOOP_FIRST)
@pytest.mark.parametrize("form", NORMALIZED_AWAY)
def test_a_normalizer_leaves_only_texts_in_its_form_to_the_fast_path(form, engine):
    """Qwen's NFC and Anthropic's NFKC normalizers change nothing in a text already in their form: those are
    encoded fast (and equal); a text they would change goes to the library."""
    name, changed = NORMALIZED_AWAY[form]
    rust, fast = encoders(name, engine)
    assert fast.analysis.form == form
    settled = ["café 😀 Ünïcödé", " ".join(f for f in FRAGMENTS if unicodedata.is_normalized(form, f))]
    before = fast.fallbacks
    assert_same(rust, fast, settled)
    assert fast.fallbacks == before
    assert_same(rust, fast, changed)
    assert fast.fallbacks == before + len(changed)


def test_a_missing_byte_token_that_is_never_needed_is_no_refusal():
    """Gemini's vocabulary has no ``<0x09>``, but a tab is a token of its own, which the model takes before
    any byte: proven, and tabs and characters outside the vocabulary encode as the library does. A missing
    byte that a character would need is still refused."""
    rust, fast = encoders("gemini")
    assert fast.analysis.metaspace == "never"
    assert_same(rust, fast, ["a\tb\t\tc", "\t", "🧬\t󠁁 \u0007 x", *FRAGMENTS])
    data = json.loads(_proven("gemini")[0])
    del data["model"]["vocab"]["\t"]
    with pytest.raises(Unproven, match="lacks some of the 256 byte-fallback tokens"):
        analyse(data)


def test_offsets_of_a_token_that_ends_inside_a_character():
    # "😀" is four bytes: a two-byte token then another reaches the character's end from both sides
    assert char_offsets("a😀b", np.array([1, 2, 2, 1])).tolist() == [[0, 1], [1, 2], [1, 2], [2, 3]]
    assert char_offsets("abc", np.array([2, 1])).tolist() == [[0, 2], [2, 3]]


@pytest.mark.parametrize("engine", ENGINES_LOOP_FIRST)
@pytest.mark.parametrize("name", ["dolma2", "tiny", "llama3"])
def test_piecewise_encodes_match(name, engine):
    """The engine's cut-at-added-token encodes (sftmix/tokenizing/segments.py) give the same tokens and offsets."""
    rust, fast = encoders(name, engine)
    boundaries = boundaries_of(rust)
    if boundaries is None:
        pytest.skip("no segment boundaries for this tokenizer")
    sep = boundaries.contents[0]
    texts = [sep.join(FRAGMENTS[i : i + 9]) + sep for i in range(0, len(FRAGMENTS), 3)]
    results = []
    for encode in (lambda t: rust.encode_batch(t, add_special_tokens=False), fast.encode_batch):
        encoder = PrefixEncoder(encode, boundaries)
        encs = encoder.start(texts)
        encoder.grow(encs, [5] * len(encs))  # a few tokens first: pieces cut at boundaries
        encoder.grow(encs, [None] * len(encs))
        results.append([(e.ids.tolist(), e.offsets().tolist()) for e in encs])
    assert results[0] == results[1]


@pytest.mark.parametrize("engine", ENGINES_LOOP_FIRST)
def test_label_masks_match_on_multi_turn_chats(engine):
    rust, fast = encoders("dolma2", engine)
    renderer = ChatRenderer(
        (Path("sftmix/tokenizing/templates/olmo.jinja")).read_text(), {"eos_token": "<|endoftext|>"}
    )
    chats = [
        Conversation(
            [
                {"role": "user", "content": FRAGMENTS[i % len(FRAGMENTS)] * 3},
                {"role": "assistant", "content": " ".join(FRAGMENTS[i : i + 7])},
                {"role": "user", "content": "and then?"},
                {"role": "assistant", "content": "".join(FRAGMENTS[: i + 3])},
            ],
            None,
        )
        for i in range(0, len(FRAGMENTS), 4)
    ]
    rows = []
    for encode in (lambda t: rust.encode_batch(t, add_special_tokens=False), fast.encode_batch):
        decode = lambda ids: rust.decode(ids, skip_special_tokens=False)  # noqa: E731
        masker = LabelMasker(renderer, MaskerEncoding(encode, decode, boundaries_of(rust)), Masking(64))
        rows.append([(r.ids.tolist(), r.mask.tolist(), r.status) for r in masker.tokenize(chats)])
    assert rows[0] == rows[1]


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    convs=st.lists(conversation, min_size=1, max_size=5),
    name=st.sampled_from(["dolma2", "tiny"]),
    engine=st.sampled_from(ENGINES),
    template=st.sampled_from(["olmo", "tulu"]),
    max_len=st.sampled_from([None, 12, 48]),
    drop=st.booleans(),
)
def test_the_fast_encoders_rows_are_the_librarys(convs, name, engine, template, max_len, drop):
    """Every row of random chats, its spans decoded and cut from the fast encoder's pieces, is what the
    library gives: ids, mask, status and the reason of a drop."""
    rust, fast = encoders(name, engine)
    renderer = ChatRenderer(
        named_template(template), {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}
    )
    assert_same_rows(rust, fast, renderer, convs, max_len, drop)


#: DeepSeek-V3's turn tokens (matched by the library on normalized text) around each turn, and its bos.
DEEPSEEK_TURNS = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>"
    "{% else %}{{ m['content'] }}\n\n{% endif %}{% endfor %}"
)
#: Gemma 3's turns as its template writes them (without its refusal of turns that do not alternate).
GEMMA3_TURNS = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else 'user' }}\n{{ m['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
)


@pytest.mark.full  # (the loop has both on random text and DeepSeek-V3's chat tokens)
@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    convs=st.lists(conversation, min_size=1, max_size=5),
    name=st.sampled_from(["deepseek-v3", "gemma3"]),
    max_len=st.sampled_from([None, 12, 48]),
    drop=st.booleans(),
)
def test_deepseek_and_gemma3_rows_are_the_librarys(convs, name, max_len, drop):
    """DeepSeek-V3 (segment cuts after its turn tokens: its normalizer does nothing) and Gemma 3, each with
    its own turn tokens: every row as the library gives it."""
    rust, fast = encoders(name)
    if name == "deepseek-v3":
        assert boundaries_of(rust) is not None and fast.analysis.splits
        renderer = ChatRenderer(DEEPSEEK_TURNS, {"bos_token": "<｜begin▁of▁sentence｜>"})
    else:
        assert boundaries_of(rust) is None and fast.analysis.metaspace == "never"
        renderer = ChatRenderer(GEMMA3_TURNS, {"bos_token": "<bos>"})
    assert_same_rows(rust, fast, renderer, convs, max_len, drop)


def assert_same_rows(rust, fast, renderer, convs, max_len, drop) -> None:
    """Each row of ``convs`` (status, reason; ids and mask where kept or not dropped) from the library's
    encodes and from the fast encoder's."""
    rows = []
    for encode in (lambda t: rust.encode_batch(t, add_special_tokens=False), fast.encode_batch):
        decode = lambda ids: rust.decode(ids, skip_special_tokens=False)  # noqa: E731
        encoding = MaskerEncoding(encode, decode, boundaries_of(rust))
        masker = LabelMasker(renderer, encoding, Masking(max_len, drop_untrainable=drop))
        rows.append(
            [
                (r.status, r.detail)
                + ((r.ids.tolist(), r.mask.tolist()) if r.status == 0 or not drop else ())
                for r in masker.tokenize(convs)
            ]
        )
    assert rows[0] == rows[1]


def _broken(change) -> dict:
    data = copy.deepcopy(_dolma2_json())
    change(data)
    return data


REFUSED = {
    "a normalizer other than NFC or NFKC": (
        lambda d: d.update(normalizer={"type": "Lowercase"}),
        "normalizer \\(Lowercase\\) other than NFC or NFKC",
    ),
    "NFC then lowercase": (
        lambda d: d.update(
            normalizer={"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Lowercase"}]}
        ),
        "normalizer",
    ),
    "Metaspace (SentencePiece)": (
        lambda d: d.update(
            pre_tokenizer={"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always"}
        ),
        "pre-tokenizer",
    ),
    "an lstrip added token": (lambda d: d["added_tokens"][1].update(lstrip=True), "lstrip"),
    "another regex": (
        lambda d: d["pre_tokenizer"]["pretokenizers"][0]["pattern"].update(Regex=r"\w+|\s+|[^\w\s]+"),
        "regex",
    ),
    "a split that keeps text between matches": (
        lambda d: d["pre_tokenizer"]["pretokenizers"][0].update(behavior="Removed", invert=False),
        "Split",
    ),
    "GPT-2's regex again after the split": (
        lambda d: d["pre_tokenizer"]["pretokenizers"][1].update(use_regex=True),
        "ByteLevel",
    ),
    "a prefix space": (
        lambda d: d["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True),
        "prefix",
    ),
    "merges out of rank order": (
        lambda d: d["model"].update(
            merges=[d["model"]["merges"][5], *d["model"]["merges"][:5], *d["model"]["merges"][6:]]
        ),
        "merge",
    ),
    "byte fallback": (lambda d: d["model"].update(byte_fallback=True), "byte"),
    "dropout": (lambda d: d["model"].update(dropout=0.1), "dropout"),
    "a WordPiece model": (lambda d: d["model"].update(type="WordPiece"), "WordPiece"),
    "a Roberta post-processor": (
        lambda d: d.update(
            post_processor={"type": "RobertaProcessing", "sep": ["</s>", 2], "cls": ["<s>", 0]}
        ),
        "post-processor",
    ),
    "a normalized added token behind a normalizer": (
        lambda d: (d.update(normalizer={"type": "NFC"}), d["added_tokens"][1].update(normalized=True)),
        "normalized",
    ),
    "a normalized added token that ends with another's start": (
        lambda d: d["added_tokens"].append(
            {**d["added_tokens"][1], "id": 200000, "content": "x<|fim", "normalized": True}
        ),
        "can overlap '<\\|fim_",
    ),
    "a normalized added token holding another": (
        lambda d: d["added_tokens"].append(
            {**d["added_tokens"][1], "id": 200000, "content": "[<|endoftext|>]", "normalized": True}
        ),
        "can overlap '<\\|endoftext",
    ),
    "two splits not proven as a sequence": (
        lambda d: d["pre_tokenizer"]["pretokenizers"].insert(
            0, {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": False}
        ),
        "2 Split regexes are not a sequence proven",
    ),
    "a split of a plain string before ByteLevel": (
        lambda d: d["pre_tokenizer"]["pretokenizers"][0].update(pattern={"String": " "}),
        "plain string",
    ),
    "an added token inside another": (
        lambda d: d["added_tokens"].append(
            {**d["added_tokens"][1], "id": 200000, "content": "<|endoftext|>x"}
        ),
        "prefix",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_tokenizers_that_are_not_tiktokens_are_refused(case):
    change, words = REFUSED[case]
    with pytest.raises(Unproven, match=words):
        analyse(_broken(change))


def _metaspace(d: dict, **changes) -> None:
    d["pre_tokenizer"].update(changes)


REFUSED_SENTENCEPIECE = {
    "an unknown prepend scheme": (lambda d: _metaspace(d, prepend_scheme="sometimes"), "sometimes"),
    "an added token that starts with a space": (
        lambda d: d["added_tokens"].append({**d["added_tokens"][3], "id": 40000, "content": " [X]"}),
        "starts with a space",
    ),
    "a Metaspace that splits words": (lambda d: _metaspace(d, split=True), "splits words apart"),
    "another marker": (lambda d: _metaspace(d, replacement="_"), "another character"),
    "no byte fallback": (lambda d: d["model"].update(byte_fallback=False), "byte fallback"),
    "a byte piece missing": (lambda d: d["model"]["vocab"].pop("<0x0A>"), "256 byte-fallback"),
    "whole words first": (lambda d: d["model"].update(ignore_merges=True), "ignore_merges"),
    "dropout": (lambda d: d["model"].update(dropout=0.1), "dropout"),
    "a normalizer before Metaspace": (
        lambda d: d.update(normalizer={"type": "NFKC"}),
        "normalizer \\(NFKC\\)",
    ),
    "a normalizer form of other steps": (
        lambda d: d.update(
            pre_tokenizer=None,
            normalizer={
                "type": "Sequence",
                "normalizers": [
                    {"type": "Replace", "pattern": {"String": " "}, "content": METASPACE},
                    {"type": "Prepend", "prepend": METASPACE},
                ],
            },
        ),
        "known forms",
    ),
    "Metaspace among other steps": (
        lambda d: d.update(
            pre_tokenizer={"type": "Sequence", "pretokenizers": [{"type": "Digits"}, d["pre_tokenizer"]]}
        ),
        "other steps",
    ),
    "an rstrip added token": (lambda d: d["added_tokens"][3].update(rstrip=True), "rstrip"),
}


@pytest.mark.parametrize("case", sorted(REFUSED_SENTENCEPIECE))
def test_sentencepiece_shapes_not_proven_are_refused(case):
    change, words = REFUSED_SENTENCEPIECE[case]
    data = _mistral_json()
    change(data)
    with pytest.raises(Unproven, match=words):
        analyse(data)


def test_sentencepiece_needs_fastokens(monkeypatch):
    """Where fastokens has no wheel, a SentencePiece-style tokenizer goes to the library: the run says why."""
    import sys

    assert analyse(_mistral_json()).metaspace == "first"
    monkeypatch.setitem(sys.modules, "fastokens", None)
    with pytest.raises(Unproven, match="fast only with fastokens"):
        analyse(_mistral_json())


#: The loop's SentencePiece shapes: each prepend scheme once, and a normalizer (Gemma 3 is on random text).
SENTENCEPIECE_LOOP = ("mistral-v3", "mistral-v3-always", "sp-replace-normalizer")


@pytest.mark.parametrize(
    "name", [n if n in SENTENCEPIECE_LOOP else pytest.param(n, marks=pytest.mark.full) for n in SENTENCEPIECE]
)
def test_sentencepiece_marks_and_offsets_where_the_library_does(name):
    """The marker before a run (the first only, or every one; not after an added token with ``first``, nor
    before a space or the text's own marker with Metaspace), its offsets on the run's first character even
    as a token of its own, and the text's own markers counted as three bytes:
    ids and offsets as the library gives them, on the fast path."""
    rust, fast = encoders(name)
    texts = [
        "Hi",
        " Hi",
        "▁Hi",
        "[INST] Hi",
        "[INST]Hi",
        "😀 x",
        "𝟘",
        "a ▁ b",
        "\n\nx",
        "[REFERENCE_DOC_1]0 y",
    ]
    assert_same(rust, fast, texts)
    assert fast.fallbacks == 0
    if name in ("mistral-v3", "mistral-v3-always"):
        assert [fast.prepends(t) for t in texts[:5]] == [True, False, False, False, False]
    if fast.analysis.metaspace != "never":
        [enc] = fast.encode_batch(["😀"])
        assert enc.offsets[0].tolist() == [0, 1] and rust.id_to_token(int(enc.ids[0])) == METASPACE
    if name in ("mistral-v3-always", "sp-prepend-normalizer"):  # a marker before each run, alone or not
        [enc] = fast.encode_batch(["[INST]😀[/INST]x[INST] y"])
        tokens = [rust.id_to_token(int(i)) for i in enc.ids]
        assert tokens[:2] == ["[INST]", METASPACE] and enc.offsets[1].tolist() == [6, 7]
        assert_same(rust, fast, ["[INST]😀[/INST]x[INST] y"])


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    convs=st.lists(conversation, min_size=1, max_size=5),
    template=st.sampled_from(["tulu", "zephyr", "simple_concat_with_space"]),
    max_len=st.sampled_from([None, 12, 48]),
    drop=st.booleans(),
)
def test_sentencepiece_rows_are_the_librarys(convs, template, max_len, drop):
    """Mistral v3's SentencePiece rows of random chats (no segment cuts: a Metaspace tokenizer's runs
    are not independent): ids, mask, status and the reason of a drop, as the library gives them."""
    rust, fast = encoders("mistral-v3")
    renderer = ChatRenderer(named_template(template), {"eos_token": "</s>", "bos_token": "<s>"})
    assert boundaries_of(rust) is None
    assert_same_rows(rust, fast, renderer, convs, max_len, drop)


def test_encoder_fast_refuses_before_work_and_auto_falls_back(tmp_path, caplog):
    folder = tmp_path / "tok"
    shutil.copytree(DOLMA2_DIR, folder)
    data = _dolma2_json()
    data["normalizer"] = {"type": "Lowercase"}
    (folder / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    # GPT2Tokenizer rebuilds its own pipeline from the vocabulary; this class keeps tokenizer.json's
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
        + "\n"
    )

    def plan(encoder: str):
        mixer = MixerConfig(
            datasets=[DatasetEntry(path=str(rows), amount=1.0)],
            tokenizer=TokenizerSpec(name_or_path=str(folder), chat_template="olmo", encoder=encoder),
            output=OutputSpec(path=str(tmp_path / "out")),
        )
        return build_plan(mixer, RunOptions(work_dir=str(tmp_path / "work")))

    with pytest.raises(
        ConfigError, match="the fast encoder is not proven the same tokenizer: it has a normalizer"
    ):
        plan("fast")
    with caplog.at_level("INFO", logger="sftmix.planning"):
        assert plan("auto").context.tokenizer.encoder == "hf"
    assert "the fast encoder is not used: it has a normalizer" in caplog.text
    assert plan("hf").context.tokenizer.encoder == "hf"


@pytest.mark.full
def test_the_fastest_installed_engine_is_the_default_and_one_can_be_chosen(monkeypatch):
    """fastokens is a dependency where it has wheels (pyproject.toml): there it is the default, proven for
    every pattern the tests compare; TOKENIZE_MIXER_FAST_ENGINE picks one, and a typo is refused."""
    pytest.importorskip("fastokens")
    rust, _ = encoders("dolma2")
    analysis = analyse(rust.to_str())
    monkeypatch.delenv(ENGINE_ENV, raising=False)
    assert FastEncoder(rust, analysis).engine == "fastokens"
    monkeypatch.setenv(ENGINE_ENV, "tiktoken")
    assert FastEncoder(rust, analysis).engine == "tiktoken"
    monkeypatch.setenv(ENGINE_ENV, "fastoken")
    with pytest.raises(ConfigError, match="must be auto, fastokens or tiktoken, not 'fastoken'"):
        FastEncoder(rust, analysis)


def test_the_patterns_proven_are_the_ones_tested():
    assert set(PROVEN_PATTERNS) == {"cl100k", "qwen2", "o200k", "tekken"}
    assert BYTE_LEVEL_PATTERN.startswith("'s|'t")
    assert set(PROVEN_SPLIT_SEQUENCES) == {"deepseek-v3"}
    _, fast = encoders("deepseek-v3")
    assert fast.analysis.splits == PROVEN_SPLIT_SEQUENCES["deepseek-v3"]


def test_a_normalized_added_token_with_no_normalizer_is_matched_as_the_others():
    """dolma2 has no normalizer: a ``normalized`` token that cannot overlap another is proven (the library's
    second pass finds what one pass would), and encodes as the library does."""
    data = _dolma2_json()
    data["added_tokens"].append(
        {**data["added_tokens"][1], "id": 100300, "content": "<｜User｜>", "normalized": True}
    )
    data["normalizer"] = {"type": "Sequence", "normalizers": []}
    analysis = analyse(data)
    rust = Tokenizer.from_str(json.dumps(data))
    fast = FastEncoder(rust, analysis)
    assert_same(rust, fast, ["a<｜User｜>b", "<|endoftext|><｜User｜><|endoftext|>", "<｜User<|endoftext|>"])
    assert fast.fallbacks == 0


def test_deepseek_v3_has_segment_cuts_and_takes_the_fast_path_on_its_chat_tokens():
    rust, fast = encoders("deepseek-v3")
    texts = ["<｜begin▁of▁sentence｜><｜User｜>你好123456<｜Assistant｜>ok<｜end▁of▁sentence｜>"]
    before = fast.fallbacks
    assert_same(rust, fast, texts)
    assert fast.fallbacks == before
    boundaries = boundaries_of(rust)
    assert boundaries is not None and rust.token_to_id("<｜User｜>") in boundaries.ids


@pytest.mark.parametrize("name", ["dolma2", "tiny", pytest.param("llama3", marks=pytest.mark.full)])
def test_decode_matches_the_library(name):
    """Any ids, split multi-byte characters and added tokens included: the same text (and the same
    replacement characters for bytes that are not UTF-8)."""
    rust, fast = encoders(name)
    assert fast.analysis.decodes
    top = rust.get_vocab_size(with_added_tokens=True)
    added = sorted(rust.get_added_tokens_decoder())

    @settings(max_examples=examples(400), deadline=None, derandomize=True)
    @given(st.lists(st.one_of(st.integers(0, min(top, 100_000) - 1), st.sampled_from(added)), max_size=30))
    def check(ids):
        assert fast.decode(ids) == rust.decode(ids, skip_special_tokens=False)

    check()


def test_decode_is_left_to_the_library_where_it_maps_added_text_to_bytes():
    data = _dolma2_json()
    data["added_tokens"].append({**data["added_tokens"][1], "id": 200001, "content": "é"})
    assert not analyse(data).decodes
    assert analyse(_dolma2_json()).decodes


def _plan_of_chats(tmp_path: Path, tokenizer: Path, user: str, assistant: str):
    """The default run's plan of 40 chats (``{i}`` in the texts is the row) with ``tulu``."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": user.format(i=i)},
                        {"role": "assistant", "content": assistant.format(i=i)},
                    ]
                }
            )
            + "\n"
            for i in range(40)
        )
    )
    mixer = MixerConfig(
        datasets=[DatasetEntry(path=str(rows), amount=1.0)],
        tokenizer=TokenizerSpec(name_or_path=str(tokenizer), chat_template="tulu"),
        output=OutputSpec(path=str(tmp_path / "out")),
    )
    return build_plan(mixer, RunOptions(work_dir=str(tmp_path / "work")))


def test_the_default_run_on_llama3_uses_the_fast_encoder(tmp_path):
    assert _plan_of_chats(tmp_path, llama3_dir(), "q{i} é 😀", "a{i}").context.tokenizer.encoder == "fast"


@pytest.mark.parametrize("name", ["deepseek-v3", pytest.param("gemma3", marks=pytest.mark.full)])
def test_the_default_run_on_deepseek_v3_and_gemma3_uses_the_fast_encoder(tmp_path, name):
    """As transformers loads them: proven (the plan's log would say which part refused it), checked on the
    run's sample rows."""
    pytest.importorskip("fastokens")
    folder = deepseek_v3_dir() if name == "deepseek-v3" else gemma3_dir()
    assert (
        _plan_of_chats(tmp_path, folder, "q{i} 漢字 123456 é 😀", " a{i}").context.tokenizer.encoder == "fast"
    )


def test_the_default_run_on_a_sentencepiece_tokenizer_uses_the_fast_encoder(tmp_path):
    """Mistral v3 (Metaspace, byte fallback), as transformers loads it: proven, checked on the run's sample
    rows, and its workers' copy (no tiktoken vocabulary) builds the same encoder."""
    pytest.importorskip("fastokens")
    from sftmix.tokenizing import tokenizer as tk_module

    plan = _plan_of_chats(tmp_path, mistral_sp_dir(), "q{i} é 😀 ▁", " a{i}")
    assert plan.context.tokenizer.encoder == "fast"
    loaded = tk_module.load_worker_tokenizer.__wrapped__(plan.context.tokenizer.file)  # a worker's own
    assert loaded.vocab is None and loaded.fast.metaspace == "first"
    fast = FastEncoder(loaded.rust, loaded.fast, loaded.vocab, None, loaded.backend_json)
    rust, _ = encoders("mistral-v3")
    assert_same(rust, fast, ["<s>[INST] Hi ▁ 😀[/INST] Hello</s>"])
    assert loaded.rust._tokenizer is None  # nothing so far needed the library


def test_a_proof_is_kept_per_tokenizer_and_a_spoiled_one_is_proved_again(tmp_path, monkeypatch):
    from sftmix.tokenizing import tokenizer as tk_module

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    key = tk_module.TokenizerKey.of(str(TINY_DIR), None)
    tk_module.fast_analysis.cache_clear()
    first = tk_module.fast_analysis(key)
    [kept] = list(tk_module.proofs_dir().iterdir())
    assert not isinstance(first, str) and json.loads(kept.read_text()) == tk_module.analysis_json(first)
    kept.write_text("{not json")
    tk_module.fast_analysis.cache_clear()
    assert tk_module.fast_analysis(key) == first
    tk_module.fast_analysis.cache_clear()


def test_a_workers_copy_from_before_the_fast_encoder_is_written_again(tmp_path):
    from sftmix.tokenizing import tokenizer as tk_module

    key = tk_module.TokenizerKey.of(str(TINY_DIR), None)
    fingerprint = tk_module.tokenizer_fingerprint(key)
    old = tmp_path / f"{fingerprint}.json"
    old.write_text(json.dumps({"backend": tk_module.rust_tokenizer(key).to_str(), "special_tokens": {}}))
    path = tk_module.save_worker_tokenizer(key, tmp_path, fingerprint)
    loaded = tk_module.load_worker_tokenizer(path)
    assert not isinstance(loaded.fast, str) and loaded.vocab is not None


@pytest.mark.parametrize("name", ["dolma2", "tiny"])
def test_a_workers_tokenizer_is_parsed_only_when_used(tmp_path, name):
    """A worker reads the segment boundaries from its copy (written by the plan) and parses the library's
    tokenizer only for a text the fast encoder hands back; a copy without the boundaries (older) still
    gives them, from the tokenizer."""
    from sftmix.tokenizing import tokenizer as tk_module

    if name == "dolma2":
        ensure_dolma2()
    key = tk_module.TokenizerKey.of(str(GOLDEN / "tokenizers" / name), None)
    fingerprint = tk_module.tokenizer_fingerprint(key)
    path = tk_module.save_worker_tokenizer(key, tmp_path, fingerprint)
    loaded = tk_module.load_worker_tokenizer(path)
    rust = tk_module.rust_tokenizer(key)
    assert loaded.boundaries == boundaries_of(rust)
    fast = FastEncoder(loaded.rust, loaded.fast, loaded.vocab, None, loaded.backend_json)
    fast.encode_batch(["Hello <|im_end|> world"])
    assert loaded.rust._tokenizer is None  # nothing so far needed the library
    assert (
        loaded.rust.encode("Hi there", add_special_tokens=False).ids
        == rust.encode("Hi there", add_special_tokens=False).ids
    )
    data = json.loads(Path(path).read_text())
    del data["boundaries"]
    older = tmp_path / "older.json"
    older.write_text(json.dumps(data))
    assert tk_module.load_worker_tokenizer(str(older)).boundaries == boundaries_of(rust)


#: Spellings of dolma2's ``tokenizer.json`` that the tokenizers library reads as the same tokenizer, as
#: other tools write them (GPT-3.5/4's cl100k files spell the word affixes as empty strings).
SPELLINGS = {
    "empty strings for null": lambda d: d["model"].update(
        continuing_subword_prefix="", end_of_word_suffix=""
    ),
    "optional keys left out": lambda d: [
        d["model"].pop(k)
        for k in ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk")
    ],
    "no model type": lambda d: d["model"].pop("type"),
    "merges as lists": lambda d: d["model"].update(
        merges=[m.split(" ") if isinstance(m, str) else m for m in d["model"]["merges"]]
    ),
    "no truncation, padding or decoder": lambda d: d.update(truncation=None, padding=None, decoder=None),
    "extra keys in added tokens": lambda d: [t.update(extra=1) for t in d["added_tokens"]],
}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_other_spellings_of_a_tokenizer_are_proven_or_passed_over(spelling, engine):
    """Each spelling, with each engine: proven and exact, or refused with a reason (the library then
    encodes); never an error from inside an engine."""
    if engine == "fastokens":
        pytest.importorskip("fastokens")
    data = _dolma2_json()
    SPELLINGS[spelling](data)
    text = json.dumps(data)
    rust = Tokenizer.from_str(text)
    try:
        analysis = analyse(text)
    except Unproven as exc:
        assert str(exc)
        return
    fast = FastEncoder(rust, analysis, engine=engine)
    assert_same(rust, fast, [*FRAGMENTS, " ".join(FRAGMENTS), *added_texts(rust)])


def test_a_shape_the_proof_does_not_read_is_unproven():
    data = _dolma2_json()
    data["model"]["vocab"] = ["not", "a", "mapping"]
    with pytest.raises(Unproven, match="a shape the proof does not read"):
        analyse(data)


def _cannot_take(*args, **kwargs):
    raise ValueError("model error: unsupported model type: Other")


def test_an_engine_that_cannot_take_a_tokenizer_is_passed_over(monkeypatch):
    """fastokens refusing a tokenizer: tiktoken takes one with a single regex (saying why), and one only
    fastokens runs (a sequence of splits, SentencePiece-style) is unproven, with fastokens' words."""
    pytest.importorskip("fastokens")
    from sftmix.tokenizing import encoders as module

    rust, _ = encoders("dolma2", "fastokens")
    others = [encoders(name)[0] for name in ("deepseek-v3", "mistral-v3")]
    monkeypatch.setattr(module, "_fastokens_from", _cannot_take)
    fast = FastEncoder(rust, _proven("dolma2")[1], engine="fastokens")
    assert fast.engine == "tiktoken"
    assert fast.pass_over_reason == (
        "fastokens cannot take this tokenizer (ValueError: model error: unsupported model type: Other)"
    )
    assert_same(rust, fast, FRAGMENTS)
    for name, rust in zip(("deepseek-v3", "mistral-v3"), others, strict=True):
        with pytest.raises(Unproven, match="fastokens cannot take this tokenizer .*unsupported model type"):
            FastEncoder(rust, _proven(name)[1])


@pytest.mark.parametrize(("name", "expected"), [("llama3", "fast"), ("deepseek-v3", "hf")])
def test_a_run_passes_over_an_engine_that_cannot_take_its_tokenizer(
    tmp_path, monkeypatch, caplog, name, expected
):
    """The plan's proof: the next engine, or the tokenizers library, each said in one line; no traceback."""
    pytest.importorskip("fastokens")
    from sftmix.tokenizing import encoders as module
    from sftmix.tokenizing.slices import worker_encoding

    monkeypatch.setattr(module, "_fastokens_from", _cannot_take)
    worker_encoding.cache_clear()
    folder = llama3_dir() if name == "llama3" else deepseek_v3_dir()
    with caplog.at_level("INFO", logger="sftmix.planning"):
        assert _plan_of_chats(tmp_path, folder, "q{i} é", " a{i}").context.tokenizer.encoder == expected
    worker_encoding.cache_clear()
    if expected == "fast":
        assert "encoder: fastokens cannot take this tokenizer (ValueError" in caplog.text
        assert "; tiktoken takes it" in caplog.text
        assert "encoder: tiktoken, proven the same tokenizer" in caplog.text
    else:
        assert "the fast encoder is not used: fastokens cannot take this tokenizer (ValueError" in caplog.text


def test_a_mistyped_engine_setting_is_refused_not_passed_over(tmp_path, monkeypatch):
    """A setting to correct is the run's error, where a tokenizer an engine cannot take is passed over."""
    from sftmix.tokenizing.slices import worker_encoding

    monkeypatch.setenv(ENGINE_ENV, "fastoken")
    worker_encoding.cache_clear()
    with pytest.raises(ConfigError, match="must be auto, fastokens or tiktoken, not 'fastoken'"):
        _plan_of_chats(tmp_path, llama3_dir(), "q{i}", " a{i}")
    worker_encoding.cache_clear()


def test_a_worker_that_cannot_build_the_proven_encoder_says_so(tmp_path, monkeypatch):
    """A worker whose fastokens cannot take what the plan proved (another machine's install): the run's
    error names the tokenizer and why, not a traceback from inside the encoder."""
    pytest.importorskip("fastokens")
    from sftmix.tokenizing import encoders as module
    from sftmix.tokenizing.slices import worker_encoding

    plan = _plan_of_chats(tmp_path, deepseek_v3_dir(), "q{i} 123", " a{i}")
    assert plan.context.tokenizer.encoder == "fast"
    monkeypatch.setattr(module, "_fastokens_from", _cannot_take)
    worker_encoding.cache_clear()
    with pytest.raises(
        ConfigError, match="the fast encoder the plan proved cannot be built here: fastokens cannot"
    ):
        worker_encoding(str(deepseek_v3_dir()), None, plan.context.tokenizer.file, "fast", "auto")
    worker_encoding.cache_clear()
