"""Two encoders for one tokenizer: the tokenizers library (the oracle) and a fast one, used only where proven.

tiktoken implements byte-level BPE as "merge the adjacent pair whose concatenation has the lowest rank,
leftmost first", over pieces found by a regex, after splitting at special tokens. The tokenizers library
merges "the adjacent pair earliest in the merges list, leftmost first". :func:`analyse` proves from
``tokenizer.json`` where the two are the same tokenizer:

- structure: a BPE model on bytes (no normalizer but NFC or NFKC, which only texts already in that form
  pass through fast; no dropout, byte fallback or word affixes), one of the
  regexes we test in both regex engines as a Split that keeps every match (the regex matches every
  character, so no text falls between pieces), a post-processor that adds nothing when special tokens
  are off (a ByteLevel one's offset trimming is done here as it does it), and added tokens matched as
  plain text (no strip, no single-word, none a prefix of another, so first and longest match agree);
- merges: every merge makes a vocabulary token, in the order of their ids (so "earliest merge" is
  "lowest rank" up to ties among merges that make the same token);
- every token, alone: its bytes run through both merge rules step by step. A token is *safe* when both
  pick the same pair at every step and end at the token. Inside one output token the merges made in
  context are exactly those made on its bytes alone, so an output whose tokens are all safe came from
  merges both rules make in the same order. Where each token is made by one merge (dolma2) that is a
  proof for every text; :class:`FastEncoder` re-encodes with the tokenizers library any text whose
  output holds an unsafe token (Llama-3's vocabulary, made by merging any split of each token, has 588).
  Where one token is made by several merges, ties between equal-rank merges in two different output
  tokens are the one case not decided here: the run's sample check and the tests compare both.

Offsets come from token byte lengths (a cumulative sum) mapped to characters; a token that ends inside a
multi-byte character reaches that character's end, as the tokenizers library reports it.

What computes the ids of a proven tokenizer (:data:`ENGINES`): fastokens where it is installed, else
tiktoken. fastokens reads ``tokenizer.json`` and runs the tokenizers library's pipeline in Rust, with the
pre-tokenizer's regex in PCRE2 instead of Oniguruma. The analysis above holds for it as for tiktoken (it
proves the merge order, the added tokens and the pipeline's shape, whatever the BPE implementation that
follows merges or ranks); what it adds is a third regex engine, so it is used only for the patterns whose
splits tests/test_encoders.py compares in all three on random text, and the run's sample check, the
random-text tests and the goldens run with either engine. Both give the same ids on every proven text; a
text either refuses (lone surrogates) or whose ids hold an unsafe token still goes to the library.

Two shapes have no tiktoken equivalent, and fastokens alone encodes them, whatever the engine setting: a
pre-tokenizer that is a sequence of several Splits (DeepSeek-V3's: digits by three, CJK runs, then words;
each Split cuts the pieces of the one before, which no single regex's find-all does), proven as a whole
sequence in PCRE2 against Oniguruma (:data:`PROVEN_SPLIT_SEQUENCES`); and SentencePiece-style BPE (a
Metaspace pre-tokenizer that does not split, or a normalizer that only turns spaces into the marker; byte
fallback; :func:`_analyse_sentencepiece`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any, Literal, cast
from unicodedata import category, is_normalized

import numpy as np

from sftmix.runtime import settings

_CL100K = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: o200k_base's (GPT-4o, GPT-OSS, Llama-4): cased words with contractions, digits by three.
_O200K = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: Mistral's tekken (Mistral-Nemo, Pixtral, Ministral): o200k's without contractions, digits one by one.
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

#: Split regexes that match every character and that the tokenizers library (Oniguruma) and tiktoken
#: (fancy-regex) split identically: each is compared on random text in tests/test_encoders.py.
PROVEN_PATTERNS = {"cl100k": _CL100K, "qwen2": _QWEN2, "o200k": _O200K, "tekken": _TEKKEN}
#: Engines for the ids of a proven tokenizer, fastest first (module docstring).
ENGINES = ("fastokens", "tiktoken")
#: Environment setting that picks one (``auto``, the default: the first installed).
ENGINE_ENV = settings.FAST_ENGINE.name
#: Patterns whose splits in PCRE2 (fastokens) are compared with Oniguruma's on random text.
PCRE2_PROVEN_PATTERNS = frozenset([*PROVEN_PATTERNS.values(), _GPT2])
#: The regex of a ByteLevel pre-tokenizer with ``use_regex`` (GPT-2's).
BYTE_LEVEL_PATTERN = _GPT2
#: Sequences of Split regexes (each keeping its matches, before a ByteLevel step without a regex of its own)
#: whose pieces fastokens (PCRE2) and the tokenizers library (Oniguruma) find the same: each is compared on
#: random text in tests/test_encoders.py. DeepSeek-V3's (and R1's, V3.1's, V3.2's): digits by three, runs of
#: CJK ideographs and kana, then words, punctuation and spaces.
PROVEN_SPLIT_SEQUENCES = {
    "deepseek-v3": (
        r"\p{N}{1,3}",
        "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
        " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
    ),
}


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (the GPT-2 table), character -> byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


@dataclass(frozen=True)
class FastAnalysis:
    """What :func:`analyse` proved: enough to build the fast encoder without proving again."""

    pattern: str  # the one Split regex ("" with ``splits`` or ``metaspace``)
    unsafe: tuple[int, ...]  # tokens whose merges the two rules make differently (see the module doc)
    one_merge_per_token: bool  # then every text with only safe tokens is proven, ties included
    trim: Trim | None = None  # a ByteLevel post-processor's offset trimming, done as it does it
    decodes: bool = False  # tiktoken's decode (bytes, then UTF-8 with replacement) is the library's too
    form: str | None = None  # an NFC or NFKC normalizer: only texts already in that form (where it changes
    # nothing) are fast
    metaspace: str | None = None  # SentencePiece-style BPE (no regex, no byte level): its prepend scheme
    splits: tuple[str, ...] = ()  # a proven sequence of several Split regexes (fastokens only)
    restarts: str | None = None  # where the pipeline restarts inside a run (sftmix.tokenizing.restarts)
    text_decodes: bool = False  # SentencePiece-style: a span's decode is its text (SPACED_DECODER)

    def to_json(self) -> dict[str, Any]:
        return {
            "pattern": self.pattern,
            "unsafe": list(self.unsafe),
            "one_merge_per_token": self.one_merge_per_token,
            "trim": None if self.trim is None else {"keep_first_space": self.trim.keep_first_space},
            "decodes": self.decodes,
            "form": self.form,
            "metaspace": self.metaspace,
            "splits": list(self.splits),
            "restarts": self.restarts,
            "text_decodes": self.text_decodes,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FastAnalysis:
        trim = data.get("trim")
        return cls(
            str(data["pattern"]),
            tuple(int(i) for i in data["unsafe"]),
            bool(data["one_merge_per_token"]),
            None if trim is None else Trim(bool(trim["keep_first_space"])),
            bool(data.get("decodes", False)),
            data.get("form", "NFC" if data.get("nfc") else None),  # (a proof from before NFKC)
            data.get("metaspace"),
            tuple(str(r) for r in data.get("splits", ())),
            data.get("restarts"),
            bool(data.get("text_decodes", False)),
        )


@dataclass(frozen=True)
class Trim:
    """The ByteLevel post-processor's ``trim_offsets``: a token's offsets leave out its leading and
    trailing spaces, except one leading space of the text's first token with ``add_prefix_space``."""

    keep_first_space: bool


class Unproven(Exception):
    """Why the fast encoder is not the same tokenizer (the message is shown to people)."""


def analyse(tokenizer_json: str | dict[str, Any]) -> FastAnalysis:
    """Prove the fast encoder equals this tokenizer (see the module docstring), or raise :class:`Unproven`;
    a file spelled in a way the proof does not expect is unproven too, never an error of the run."""
    try:
        return _analyse(tokenizer_json)
    except (Unproven, MemoryError):  # (a proof is kept: out of memory once is no reason for ever)
        raise
    except Exception as exc:
        raise Unproven(
            f"its tokenizer.json has a shape the proof does not read ({type(exc).__name__}: {exc})"
        ) from exc


def _analyse(tokenizer_json: str | dict[str, Any]) -> FastAnalysis:
    data = json.loads(tokenizer_json) if isinstance(tokenizer_json, str) else tokenizer_json
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise Unproven(f"its model is {model.get('type')!r}, not BPE")
    if model.get("dropout") not in (None, 0, 0.0):
        raise Unproven("its BPE has dropout")
    scheme = _metaspace_scheme(data.get("normalizer"), data.get("pre_tokenizer"))
    if scheme is not None:
        return _analyse_sentencepiece(data, scheme)
    if model.get("byte_fallback"):
        raise Unproven("its BPE falls back to byte tokens")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise Unproven("its BPE marks word pieces with a prefix or suffix")
    form = _normal_form(data.get("normalizer"))
    normalizes = not normalizer_does_nothing(data.get("normalizer"))
    splits = _splits(data.get("pre_tokenizer"))
    pattern = splits[0] if len(splits) == 1 else ""
    if not pattern and not fastokens_installed():
        raise Unproven("a sequence of Split pre-tokenizers is fast only with fastokens, not installed here")
    trims = _post_processor_trims(data.get("post_processor"))
    added = _added_tokens(data.get("added_tokens") or [], normalizes=normalizes)
    if trims and any(t[:1].isspace() or t[-1:].isspace() for t in added):
        raise Unproven("its post-processor trims offsets and an added token starts or ends with whitespace")
    ranks = _ranks(model.get("vocab") or {}, added)
    merges = _merges(model.get("merges") or [])
    index, one_merge = _merge_index(merges, ranks)
    trim = None if not trims else Trim(keep_first_space=trims[0])
    decodes = _decodes_as_bytes(data.get("decoder"), added)
    unsafe = tuple(_unsafe_tokens(ranks, index))
    return FastAnalysis(
        pattern,
        unsafe,
        one_merge,
        trim,
        decodes,
        form,
        splits=() if pattern else splits,
        restarts=LINE_RESTARTS,
    )


#: SentencePiece's word marker: a space is this character, and a text's first word starts with one.
METASPACE = "\u2581"
#: Where SentencePiece-style pipelines put a marker the text lacks: Metaspace's schemes ``first`` (before
#: the text, unless it starts with an added token or a space), ``always`` (the same before every run between
#: added tokens) and ``never``; ``prepend``, a Prepend normalizer (the legacy form: before every run, even
#: one that starts with a space).
METASPACE_SCHEMES = ("first", "always", "never")


def _metaspace_scheme(normalizer: Any, pre: Any) -> str | None:
    """The prepend scheme of a SentencePiece-style pipeline: a Metaspace pre-tokenizer that does not split
    (transformers' Llama, Mistral and Gemma conversions), a normalizer that only turns spaces into the
    marker (``never``, Gemma's), or one that prepends a marker first (``prepend``, Llama-2's and Mistral's
    legacy ``tokenizer.json``), with no pre-tokenizer; None for any other shape (no marker involved)."""
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": METASPACE}
    if normalizer == replace and (pre is None or _splits_at_a_space(pre)):
        return "never"
    legacy = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": METASPACE}, replace]}
    if pre is None and normalizer == legacy:
        return "prepend"
    if _kind(pre) != "Metaspace":
        if _mentions_metaspace(pre):
            raise Unproven("it uses a Metaspace step in a pipeline of other steps")
        if METASPACE in json.dumps(normalizer, ensure_ascii=False):
            raise Unproven("its normalizer writes SentencePiece's marker in steps other than the known forms")
        return None
    if normalizer is not None:
        raise Unproven(f"it has a normalizer ({_kind(normalizer)}) before its Metaspace pre-tokenizer")
    if pre.get("replacement") != METASPACE or pre.get("split", True):
        raise Unproven("its Metaspace pre-tokenizer splits words apart or marks them with another character")
    scheme = pre.get("prepend_scheme")
    if scheme not in METASPACE_SCHEMES:
        raise Unproven(f"its Metaspace pre-tokenizer's prepend_scheme is {scheme!r}")
    return str(scheme)


def _splits_at_a_space(pre: Any) -> bool:
    """A Split on the plain text " " that keeps the text it does not match (Gemma 3's): after a normalizer
    that made every space a marker it finds nothing, and each piece passes whole, whatever its behavior."""
    return (
        isinstance(pre, dict)
        and pre.get("type") == "Split"
        and pre.get("pattern") == {"String": " "}
        and not pre.get("invert", False)
    )


def _mentions_metaspace(node: Any) -> bool:
    if isinstance(node, dict):
        return node.get("type") == "Metaspace" or any(_mentions_metaspace(v) for v in node.values())
    return isinstance(node, list) and any(_mentions_metaspace(v) for v in node)


#: A byte-fallback token's piece: ``<0x0A>`` is the byte 10.
BYTE_PIECES = tuple(f"<0x{b:02X}>" for b in range(256))


def _analyse_sentencepiece(data: dict[str, Any], scheme: str) -> FastAnalysis:
    """SentencePiece-style BPE: spaces become the marker, no regex splits the text (each run between added
    tokens is one word), merges by the library's rule, and a character outside the vocabulary becomes its
    UTF-8 bytes' tokens. fastokens implements that pipeline from ``tokenizer.json`` except the Metaspace
    step, which is two plain edits: its Replace normalizer, and the marker a run lacks inserted here as a
    space (:meth:`FastEncoder._sentencepiece_encode`; with ``always``, after a first encode has shown where
    the added tokens are, only when a later run needs one); a Prepend normalizer fastokens runs itself. No
    merge proof like tiktoken's is needed (both run the same merge rule on the same list); the pipeline is
    held to the library by the random-text tests, the chats of tests/test_encoders.py, and every run's
    sample check."""
    model = data["model"]
    if not model.get("byte_fallback"):
        raise Unproven("its Metaspace BPE has no byte fallback (unknown characters become <unk>)")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise Unproven("its BPE marks word pieces with a prefix or suffix")
    if model.get("ignore_merges"):
        raise Unproven("its BPE takes whole words from the vocabulary before merging (ignore_merges)")
    if _post_processor_trims(data.get("post_processor")):
        raise Unproven("its post-processor trims offsets")
    added = _added_tokens(data.get("added_tokens") or [], prefixes=True)
    vocab = model.get("vocab") or {}
    if any(not _falls_back(b, vocab) for b in range(256)):
        raise Unproven("its vocabulary lacks some of the 256 byte-fallback tokens")
    if any(vocab.get(text, i) != i for text, i in added.items()):
        raise Unproven("an added token's text is a vocabulary entry with another id")
    if scheme in ("first", "always") and any(text.startswith(" ") for text in added):
        raise Unproven("an added token starts with a space (a marker prepended as one could complete it)")
    if scheme != "never" and any(METASPACE in text for text in added):
        # (the model makes it of spaces too, and the runs between added tokens are where markers go)
        raise Unproven("an added token holds SentencePiece's marker and the pipeline prepends markers")
    if not fastokens_installed():
        raise Unproven("SentencePiece-style BPE is fast only with fastokens, not installed here")
    restarts = WORD_RESTARTS if scheme != "prepend" and not any(map(_marker_inside, vocab)) else None
    return FastAnalysis(
        "", (), False, metaspace=scheme, restarts=restarts, text_decodes=_text_decodes(data, scheme)
    )


def _text_decodes(data: dict[str, Any], scheme: str) -> bool:
    """Whether a span's decode is its text: :data:`SPACED_DECODER`, no marker put where the text has none,
    and no byte token but those the model falls back to (an added token or a merge spelled ``<0x41>``
    decodes as the byte, not as its text)."""
    if scheme != "never" or data.get("decoder") != SPACED_DECODER:
        return False
    pieces = set(BYTE_PIECES)
    added = {t.get("content") for t in data.get("added_tokens") or []}
    merged = {a + b for a, b in _merges(data["model"].get("merges") or [])}
    return not (pieces & added or pieces & merged)


#: The decoder of a SentencePiece-style BPE that puts no marker where the text has none (Gemini's, Gemma's):
#: each token's text with markers as spaces, byte tokens as their bytes. A span of tokens that holds no
#: marker of the text's own and cuts no character decodes to the text's own characters there
#: (``sftmix.tokenizing.segments.Encoded.decoded``).
SPACED_DECODER = {
    "type": "Sequence",
    "decoders": [
        {"type": "Replace", "pattern": {"String": METASPACE}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ],
}


#: :attr:`FastAnalysis.restarts` of a regex-split byte-level BPE: before an ASCII letter after a line break.
LINE_RESTARTS = "line"
#: :attr:`FastAnalysis.restarts` of SentencePiece-style BPE: before a marker after a character that is not one.
WORD_RESTARTS = "word"


def _marker_inside(piece: str) -> bool:
    """Whether a vocabulary piece holds the marker after a character that is not one (Gemma 3's ``>▁</``):
    a merge could then join a word to the marker before the next."""
    stripped = piece.lstrip(METASPACE)
    return METASPACE in stripped


#: Normalizers that change nothing in a text already in their form (:func:`_normal_form`).
NORMAL_FORMS = ("NFC", "NFKC")
NormalForm = Literal["NFC", "NFKC"]


def _falls_back(byte: int, vocab: dict[str, Any]) -> bool:
    """Whether the byte's fallback token is there, or never needed: the model takes a character from the
    vocabulary before its bytes, and an ASCII byte is only ever its own character (Gemini's vocabulary has
    a tab but no ``<0x09>``)."""
    return BYTE_PIECES[byte] in vocab or (byte < 0x80 and chr(byte) in vocab)


def _normal_form(normalizer: Any) -> str | None:
    """The form of a normalizer that is NFC (Qwen2's and Qwen3's) or NFKC (Anthropic's), alone or in a
    sequence of them (NFKC where any is: a text in NFKC is in NFC too); none, or an empty sequence
    (DeepSeek-V3's, which changes nothing), is None. On a text already in that form it changes nothing,
    characters or alignments, so the pipeline is the one without it (added tokens matched on normalized
    text included); any other normalizer is refused, named."""
    if normalizer_does_nothing(normalizer):
        return None
    steps = normalizer.get("normalizers") if _kind(normalizer) == "Sequence" else [normalizer]
    kinds = {_kind(step) for step in steps or [normalizer]}
    if steps and kinds <= set(NORMAL_FORMS):
        return "NFKC" if "NFKC" in kinds else "NFC"
    raise Unproven(
        f"it has a normalizer ({', '.join(sorted(kinds - set(NORMAL_FORMS)))}) other than NFC or NFKC"
    )


def in_form(text: str, form: str) -> bool:
    """Whether ``text`` is already in ``form`` by this Python's Unicode tables and has no character they
    leave unassigned (which a newer Unicode, the tokenizers library's, may normalize)."""
    if text.isascii():
        return True
    return is_normalized(cast(NormalForm, form), text) and all(category(c) != "Cn" for c in set(text))


def normalizer_does_nothing(normalizer: Any) -> bool:
    """None, or a Sequence of no steps (nested ones included): the text passes as it is."""
    if normalizer is None:
        return True
    return _kind(normalizer) == "Sequence" and all(
        normalizer_does_nothing(step) for step in normalizer.get("normalizers") or []
    )


def _decodes_as_bytes(decoder: Any, added: dict[str, int]) -> bool:
    """Whether the library's decode is "every token's bytes, then UTF-8 with replacement": a ByteLevel
    decoder, and added tokens whose text it maps to their own UTF-8 (it maps text made only of its
    byte alphabet to those bytes, so ``é`` alone would become the byte 0xE9)."""
    if not isinstance(decoder, dict) or decoder.get("type") != "ByteLevel":
        return False
    alphabet = byte_alphabet()
    for text in added:
        if all(c in alphabet for c in text) and bytes(alphabet[c] for c in text) != text.encode("utf-8"):
            return False
    return True


def _kind(node: Any) -> str:
    return str(node.get("type")) if isinstance(node, dict) else type(node).__name__


def _splits(pre: Any) -> tuple[str, ...]:
    """The Split regexes, in order, of a pre-tokenizer that is Splits then ByteLevel: one that amounts to
    tiktoken's find-all (:data:`PROVEN_PATTERNS`), or a proven sequence (:data:`PROVEN_SPLIT_SEQUENCES`)."""
    steps = pre.get("pretokenizers", []) if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    if len(steps) == 1 and isinstance(steps[0], dict) and steps[0].get("type") == "ByteLevel":
        level = steps[0]
        if level.get("add_prefix_space") or not level.get("use_regex", True):
            raise Unproven("its ByteLevel pre-tokenizer adds a prefix space or splits with no regex")
        return (BYTE_LEVEL_PATTERN,)
    if len(steps) < 2 or not all(isinstance(s, dict) for s in steps):
        raise Unproven(f"its pre-tokenizer is not Splits then ByteLevel ({_kind(pre)})")
    *splits, level = steps
    kinds = [_kind(step) for step in steps]
    if any(kind != "Split" for kind in kinds[:-1]) or kinds[-1] != "ByteLevel":
        raise Unproven(f"its pre-tokenizer is {' then '.join(kinds)}, not Splits then ByteLevel")
    if level.get("add_prefix_space") or level.get("use_regex"):
        raise Unproven("its ByteLevel step adds a prefix space or splits again with GPT-2's regex")
    regexes = []
    for split in splits:
        keeps_matches = (split.get("behavior"), bool(split.get("invert"))) in {
            ("Isolated", False),
            ("Removed", True),
        }
        if not keeps_matches:
            raise Unproven(
                f"its Split keeps pieces as {split.get('behavior')!r} (invert {split.get('invert')})"
            )
        regex = (split.get("pattern") or {}).get("Regex")
        if not isinstance(regex, str):
            raise Unproven("its Split matches a plain string, not a regex")
        regexes.append(regex)
    if len(regexes) == 1 and regexes[0] not in PROVEN_PATTERNS.values():
        raise Unproven("its Split regex is not one proven to split the same in every regex engine we use")
    if len(regexes) > 1 and tuple(regexes) not in PROVEN_SPLIT_SEQUENCES.values():
        raise Unproven(
            f"its {len(regexes)} Split regexes are not a sequence proven to split the same in every regex engine we use"
        )
    return tuple(regexes)


def _post_processor_trims(node: Any) -> list[bool]:
    """The ByteLevel offset trims the post-processor makes with special tokens off (each one's
    ``add_prefix_space``); anything else it does there must change neither ids nor offsets."""
    if node is None:
        return []
    kind = node.get("type")
    if kind == "Sequence":
        trims = [t for step in node.get("processors", []) for t in _post_processor_trims(step)]
        if len(trims) > 1:
            raise Unproven("its post-processor trims offsets twice")
        return trims
    if kind == "ByteLevel":
        return [bool(node.get("add_prefix_space", True))] if node.get("trim_offsets", True) else []
    if kind == "TemplateProcessing":  # adds its tokens only with special tokens on
        return []
    raise Unproven(f"its post-processor is {kind!r}")


def _added_tokens(
    tokens: list[dict[str, Any]], prefixes: bool = False, normalizes: bool = True
) -> dict[str, int]:
    """Added tokens matched as plain text. ``prefixes``: one may be a prefix of another (fastokens, like the
    library, takes the longest match; tiktoken's regex would take the first). ``normalizes``: whether the
    tokenizer has a normalizer that does something; with none, a ``normalized`` token (matched by the
    library in a second pass, on the normalized text) is matched as the others are, where no text can
    hold it overlapping one of them (:func:`_overlaps`)."""
    added: dict[str, int] = {}
    normalized: list[str] = []
    for t in tokens:
        content = t.get("content", "")
        if not content:
            raise Unproven("an added token is empty")
        for flag in ("lstrip", "rstrip", "single_word", "normalized"):
            if t.get(flag) and not (flag == "normalized" and not normalizes):
                raise Unproven(f"added token {content!r} is {flag}")
        if t.get("normalized"):
            normalized.append(content)
        added[content] = int(t["id"])
    if normalized:
        first = set(added) - set(normalized)
        if (pair := _overlaps(normalized, first)) is not None:
            raise Unproven(
                f"added token {pair[0]!r}, matched after the others, can overlap {pair[1]!r} in a text"
            )
    ordered = [] if prefixes else sorted(added)
    for a, b in zip(ordered, ordered[1:], strict=False):
        if b.startswith(a):
            raise Unproven(f"added token {a!r} is a prefix of {b!r} (first and longest match may differ)")
    return added


def _overlaps(later: list[str], first: set[str]) -> tuple[str, str] | None:
    """A token of ``later`` that could take text from one of ``first`` in a single leftmost-longest pass:
    one that holds it, or ends with its start (matched there first, it would cut it off); None when none
    can. Then matching ``first`` in a pass of its own, then ``later`` between those matches (the library's
    two passes), finds what one pass over all of them finds: a token of ``first`` that starts earlier wins
    either way."""
    starts = {t[:k] for t in first for k in range(1, len(t))}
    for n in later:
        for m in first:
            if m in n:
                return n, m
        for k in range(1, len(n)):
            if n[-k:] in starts:
                return n, next(m for m in first if m.startswith(n[-k:]))
    return None


def _ranks(vocab: dict[str, int], added: dict[str, int]) -> dict[bytes, int]:
    alphabet = byte_alphabet()
    ranks: dict[bytes, int] = {}
    for text, i in vocab.items():
        if added.get(text) == i:
            continue
        try:
            ranks[bytes(alphabet[c] for c in text)] = i
        except KeyError:
            raise Unproven(f"vocabulary entry {text!r} is not byte-level") from None
    if len(ranks) != len(vocab) - sum(1 for t, i in added.items() if vocab.get(t) == i):
        raise Unproven("two vocabulary entries are the same bytes")
    if any(bytes([b]) not in ranks for b in range(256)):
        raise Unproven("its vocabulary lacks some of the 256 bytes")
    if set(ranks.values()) & set(added.values()):
        raise Unproven("an added token shares its id with a vocabulary entry of other text")
    return ranks


def _merges(raw: list[Any]) -> list[tuple[str, str]]:
    out = []
    for m in raw:
        pair = tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
        if len(pair) != 2:
            raise Unproven(f"merge {m!r} is not a pair")
        out.append((str(pair[0]), str(pair[1])))
    return out


def _merge_index(
    merges: list[tuple[str, str]], ranks: dict[bytes, int]
) -> tuple[dict[tuple[bytes, bytes], int], bool]:
    """Each merge (as bytes) -> its place in the list, after checking the list is in rank order."""
    alphabet = byte_alphabet()
    index: dict[tuple[bytes, bytes], int] = {}
    made: set[int] = set()
    one_merge, last = True, -1
    for k, (a, b) in enumerate(merges):
        left, right = bytes(alphabet[c] for c in a), bytes(alphabet[c] for c in b)
        rank = ranks.get(left + right)
        if rank is None or left not in ranks or right not in ranks:
            raise Unproven(f"merge {a!r} + {b!r} uses or makes a token outside the vocabulary")
        if rank < last:
            raise Unproven(f"merge {k} ({a!r} + {b!r}) comes after a merge that makes a later token")
        if rank in made:
            one_merge = False
        made.add(rank)
        last = rank
        index.setdefault((left, right), k)
    return index, one_merge


def _unsafe_tokens(ranks: dict[bytes, int], index: dict[tuple[bytes, bytes], int]) -> list[int]:
    """Tokens whose bytes, alone, the two merge rules take through different steps (module docstring)."""
    unsafe = []
    for token, rank in ranks.items():
        if len(token) > 1 and not _same_steps(token, ranks, index):
            unsafe.append(rank)
    return sorted(unsafe)


def _same_steps(token: bytes, ranks: dict[bytes, int], index: dict[tuple[bytes, bytes], int]) -> bool:
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        by_rank = by_merge = -1
        best_rank = best_merge = None
        for i in range(len(parts) - 1):
            pair = (parts[i], parts[i + 1])
            r = ranks.get(pair[0] + pair[1])
            if r is not None and (best_rank is None or r < best_rank):
                best_rank, by_rank = r, i
            k = index.get(pair)
            if k is not None and (best_merge is None or k < best_merge):
                best_merge, by_merge = k, i
        if by_rank < 0 or by_rank != by_merge:
            return False
        parts[by_rank : by_rank + 2] = [parts[by_rank] + parts[by_rank + 1]]
    return True


class FastEncoding:
    """The part of ``tokenizers.Encoding`` the engine reads: the engine's ids (an int64 array, never a
    list of Python ints: building one costs more than the engine's encoding), and offsets when asked."""

    __slots__ = (
        "_ascii",
        "_byte_ends",
        "_char_starts",
        "_encoder",
        "_marks",
        "_offsets",
        "_text",
        "_utf8",
        "ids",
    )

    def __init__(
        self, text: str, ids: np.ndarray, encoder: FastEncoder, marks: np.ndarray | None = None
    ) -> None:
        """``marks``: SentencePiece tokens whose first marker the text does not have."""
        self.ids = ids
        self._text = text
        self._encoder = encoder
        self._marks = marks
        self._offsets: np.ndarray | None = None
        self._byte_ends: np.ndarray | None = None
        self._ascii: bool | None = None
        self._utf8: bytes | None = None
        self._char_starts: np.ndarray | None = None

    @property
    def offsets(self) -> np.ndarray:
        """(start, end) character offsets of every token, as an (n, 2) array."""
        if self._offsets is None:
            ends = None if self._encoder.analysis.metaspace else self.byte_ends
            self._offsets = self._encoder.offsets(self._text, self.ids, self._marks, ends)
        return self._offsets

    @property
    def byte_ends(self) -> np.ndarray:
        """Bytes of the text through each token (their lengths added up): the offsets, the added tokens'
        characters and the decoded spans are read from it, so it is made once."""
        if self._byte_ends is None:
            self._byte_ends = np.cumsum(self._encoder.lengths[self.ids])
        return self._byte_ends

    @property
    def encoder(self) -> FastEncoder:
        return self._encoder

    def token_to_chars(self, i: int) -> tuple[int, int]:
        start, end = self.offsets[i]
        return int(start), int(end)

    def added_token_chars(self, tokens: np.ndarray) -> np.ndarray:
        """:attr:`offsets` of the added tokens at positions ``tokens`` (ascending), as (n, 2), without
        every token's (an added token covers whole characters; where offsets are trimmed, all are made)."""
        if self._offsets is not None or self._encoder.trim is not None or self._encoder.analysis.metaspace:
            return self.offsets[tokens]
        ends = self.byte_ends[tokens]
        starts = ends - self._encoder.lengths[self.ids[tokens]]
        if self._is_ascii():
            return np.stack([starts, ends], axis=1)
        # bytes to characters: an added token covers whole characters, so a character offset is the
        # number of characters that begin before its byte offset
        char_starts = self._byte_of_char()
        return np.stack([np.searchsorted(char_starts, starts), np.searchsorted(char_starts, ends)], axis=1)

    def span_mask(self, limit: int, spans: Sequence[tuple[int, int]]) -> np.ndarray | None:
        """``overlap_mask(offsets[:limit], spans)`` (``sftmix.tokenizing.segments``) read from the tokens' bytes, never
        making every token's offsets; ``None`` where the offsets are not the bytes mapped to characters
        (trimmed, SentencePiece markers) or a token has no bytes (:meth:`span_masks`, of this one row)."""
        return FastEncoding.span_masks([self], [limit], [spans])[0]

    @staticmethod
    def span_masks(
        pieces: Sequence[FastEncoding], limits: Sequence[int], spans: Sequence[Sequence[tuple[int, int]]]
    ) -> list[np.ndarray | None]:
        """:meth:`span_mask` of each piece, made in one pass over all their tokens (a batch's rows: a dozen
        small numpy calls per row cost more than the rule itself). A token overlaps a character span
        exactly when its bytes overlap the span's bytes: its offsets are the characters holding its first
        and last byte, so ``start < e`` is ``first byte < byte of e`` and ``s < end`` is ``byte of s <= last
        byte``. Tokens' bytes are in order, so each span's tokens are one run, found by search. The rows'
        tokens are laid end to end and each span moved by its row's bytes before it, after clipping to its
        row's bytes: a span then finds only its own row's tokens, as it does in its row alone (every token
        has bytes here; in a batch with a token of none, each row is made alone)."""
        if not pieces:
            return []
        encoder = pieces[0]._encoder
        if encoder.trim is not None or encoder.analysis.metaspace:
            return [None] * len(pieces)
        if any(p._encoder is not encoder for p in pieces):
            return [p.span_mask(limit, s) for p, limit, s in zip(pieces, limits, spans, strict=True)]
        counts = [min(limit, p.ids.shape[0]) for p, limit in zip(pieces, limits, strict=True)]
        ids = np.concatenate(
            [np.zeros(0, np.int64), *(p.ids[:n] for p, n in zip(pieces, counts, strict=True))]
        )
        lengths = encoder.lengths[ids]
        if not lengths.all():
            if len(pieces) == 1:
                return [None]
            return [p.span_mask(limit, s) for p, limit, s in zip(pieces, limits, spans, strict=True)]
        firsts = np.zeros(len(pieces) + 1, dtype=np.int64)
        np.cumsum(counts, out=firsts[1:])
        ends = np.cumsum(lengths)
        before = np.concatenate([np.zeros(1, np.int64), ends])[firsts]  # bytes of the rows before each
        rows: list[int] = []
        bounds: list[int] = []
        for r, (p, s) in enumerate(zip(pieces, spans, strict=True)):
            if not s or not counts[r]:
                continue
            rows += [r] * len(s)
            if p._is_ascii():
                bounds += [x for span in s for x in span]
            else:
                bounds += p._bytes_before([x for span in s for x in span])
        total = int(firsts[-1])
        mask = np.zeros(total, dtype=np.uint8)
        if rows:
            row = np.array(rows, dtype=np.int64)
            at = np.array(bounds, dtype=np.int64).reshape(-1, 2)
            at = np.clip(at, 0, (before[row + 1] - before[row])[:, None]) + before[row][:, None]
            lo = np.searchsorted(ends, at[:, 0], side="right")  # the first token ending after the start
            # the tokens starting before the end: each starts where the one before it ends (the first at 0)
            hi = (at[:, 1] > 0) + np.minimum(np.searchsorted(ends, at[:, 1], side="left"), total - 1)
            for a, b in zip(lo.tolist(), hi.tolist(), strict=True):
                if a < b:
                    mask[a:b] = 1
        return [mask[a:b] for a, b in zip(firsts[:-1].tolist(), firsts[1:].tolist(), strict=True)]

    def _bytes_before(self, chars: list[int]) -> list[int]:
        """The bytes of the text before each of these characters (clipped to the text): a few of them
        are found by encoding up to each in turn, cheaper than every character's (``_byte_of_char``)."""
        text = self._text
        clipped = [min(max(c, 0), len(text)) for c in chars]
        if self._char_starts is not None:
            return self._char_starts[clipped].tolist()
        found = {0: 0}
        at = byte = 0
        for c in sorted(set(clipped)):
            byte += len(text[at:c].encode("utf-8"))
            found[c] = byte
            at = c
        return [found[c] for c in clipped]

    def _is_ascii(self) -> bool:
        if self._ascii is None:
            self._ascii = self._text.isascii()
        return self._ascii

    def _byte_of_char(self) -> np.ndarray:
        """The byte where each character of the text begins (its UTF-8 lead bytes), then the text's byte
        length: character ``c`` begins at ``[c]``, and the characters before byte ``b`` (a character's
        start) are ``searchsorted(b)``. Made once per text (asked by the boundary tokens and the mask)."""
        if self._char_starts is None:
            if self._utf8 is None:
                self._utf8 = self._text.encode("utf-8")
            data = np.frombuffer(self._utf8, dtype=np.uint8)
            self._char_starts = np.append(np.flatnonzero((data & 0xC0) != 0x80), len(self._utf8))
        return self._char_starts


def char_offsets(text: str, token_bytes: np.ndarray, ends: np.ndarray | None = None) -> np.ndarray:
    """Character (start, end) of consecutive tokens of ``token_bytes`` bytes each that cover ``text``
    (``ends``: their running sum, where the caller has it)."""
    if ends is None:
        ends = np.cumsum(token_bytes, dtype=np.int64)
    out = np.empty((ends.shape[0], 2), dtype=np.int64)
    if text.isascii():
        out[:, 1] = ends
        out[:, 0] = ends - token_bytes
        return out
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    char_of_byte = np.cumsum((data & 0xC0) != 0x80, dtype=np.int64) - 1
    out[:, 0] = char_of_byte[ends - token_bytes]
    out[:, 1] = char_of_byte[ends - 1] + 1
    return out


#: Bump when :func:`analyse` proves something else: cached proofs of the old one are not used.
ANALYSIS_VERSION = 8


def vocabulary(tokenizer_json: str) -> tuple[dict[bytes, int], dict[str, int]]:
    """The BPE vocabulary as tiktoken's ranks (token bytes -> id) and the added tokens (text -> id)."""
    data = json.loads(tokenizer_json)
    added = {t["content"]: int(t["id"]) for t in data.get("added_tokens") or []}
    return _ranks(data["model"]["vocab"], added), added


def pack_vocabulary(ranks: dict[bytes, int], added: dict[str, int]) -> dict[str, Any]:
    """:func:`vocabulary` as JSON that loads in milliseconds (one string of every token's bytes)."""
    items = sorted(ranks.items(), key=lambda kv: kv[1])
    return {
        "bytes": b"".join(t for t, _ in items).decode("latin-1"),
        "lengths": [len(t) for t, _ in items],
        "ids": [i for _, i in items],
        "added": added,
    }


def unpack_vocabulary(packed: dict[str, Any]) -> tuple[dict[bytes, int], dict[str, int]]:
    blob = packed["bytes"].encode("latin-1")
    ranks, at = {}, 0
    for length, i in zip(packed["lengths"], packed["ids"], strict=True):
        ranks[blob[at : at + length]] = i
        at += length
    return ranks, {str(k): int(v) for k, v in packed["added"].items()}


def _fastokens_from(tokenizer_json: str, form: str | None = None) -> Any:
    """fastokens' tokenizer; with a normal ``form`` the file's normalizer left out (only texts already in
    that form reach it). Any error it raises means it cannot take this tokenizer: the caller passes it over."""
    import fastokens

    if form is not None:
        data = json.loads(tokenizer_json)
        data["normalizer"] = None
        tokenizer_json = json.dumps(data)
    tokenizer = fastokens.Tokenizer.from_json_str(tokenizer_json)
    tokenizer.no_truncation()  # the file's settings would apply to every text
    tokenizer.no_padding()
    return tokenizer


def _cannot_take(exc: Exception) -> Unproven:
    return Unproven(f"fastokens cannot take this tokenizer ({type(exc).__name__}: {exc})")


def fast_engine(pattern: str, requested: str | None = None) -> str:
    """The engine for a proven tokenizer with this split ``pattern``: ``requested`` (or
    :data:`ENGINE_ENV`), ``auto`` being the fastest installed one that is proven for the pattern."""
    want = (requested or settings.FAST_ENGINE.get()).strip().lower()
    if want not in ("auto", *ENGINES):
        from sftmix.errors import ConfigError

        raise ConfigError(f"{ENGINE_ENV} must be auto, {' or '.join(ENGINES)}, not {want!r}")
    if want in ("auto", "fastokens") and pattern in PCRE2_PROVEN_PATTERNS and fastokens_installed():
        return "fastokens"
    return "tiktoken"


def fastokens_installed() -> bool:
    """Whether fastokens imports here (it ships wheels for some platforms only; a test may hide it)."""
    try:
        import fastokens  # noqa: F401
    except ImportError:
        return False
    return True


class FastEncoder:
    """``encode_batch`` with a fast engine (fastokens or tiktoken), exact per the analysis; any text it
    cannot vouch for goes to the tokenizers library (an unsafe token in the output, or text the engine
    will not take)."""

    def __init__(
        self,
        rust: Any,
        analysis: FastAnalysis,
        vocab: tuple[dict[bytes, int], dict[str, int]] | None = None,
        engine: str | None = None,
        tokenizer_json: str | None = None,
    ) -> None:
        """``tokenizer_json``: ``rust.to_str()``, where the caller has it (0.1-0.3 s to make again)."""
        self.rust = rust
        self.analysis = analysis
        self.unsafe = frozenset(analysis.unsafe)
        self.trim = analysis.trim
        self.fallbacks = 0  # texts the tokenizers library encoded
        self.pass_over_reason: str | None = None  # why the engine asked for could not take this tokenizer
        if analysis.metaspace:
            self._init_sentencepiece(rust.to_str() if tokenizer_json is None else tokenizer_json)
            return
        self.engine = "fastokens" if analysis.splits else fast_engine(analysis.pattern, engine)
        if tokenizer_json is None and (vocab is None or self.engine == "fastokens"):
            tokenizer_json = rust.to_str()
        # (no vocab: tokenizer_json is given or made just above)
        ranks, added = vocab if vocab is not None else vocabulary(cast(str, tokenizer_json))
        self._vocab = ranks, added
        self._allowed = set(added)
        self._ids = self._tiktoken_ids
        if self.engine == "fastokens":
            assert tokenizer_json is not None
            self._take_fastokens(tokenizer_json)
        size = max([*ranks.values(), *added.values()]) + 1
        self.lengths = np.zeros(size, dtype=np.int64)
        self.leading, self.trailing = np.zeros(size, np.int64), np.zeros(size, np.int64)
        tokens, ids = list(ranks), np.fromiter(ranks.values(), dtype=np.int64, count=len(ranks))
        self.lengths[ids] = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
        if self.trim is not None:  # spaces at either end of a token, which trimmed offsets leave out
            stripped = np.fromiter((len(t.lstrip(b" ")) for t in tokens), dtype=np.int64, count=len(tokens))
            self.leading[ids] = self.lengths[ids] - stripped
            stripped = np.fromiter((len(t.rstrip(b" ")) for t in tokens), dtype=np.int64, count=len(tokens))
            self.trailing[ids] = self.lengths[ids] - stripped
        for text, i in added.items():
            self.lengths[i] = len(text.encode("utf-8"))
        self._unsafe_ids = np.zeros(size, dtype=bool)
        self._unsafe_ids[sorted(self.unsafe)] = True

    def _take_fastokens(self, tokenizer_json: str) -> None:
        """fastokens as the engine, or tiktoken where fastokens cannot take the tokenizer and the analysis
        has one regex (tiktoken's shape); a sequence of splits has no other engine: :class:`Unproven`."""
        try:
            self._fastokens = _fastokens_from(tokenizer_json, self.analysis.form)
        except Exception as exc:
            if self.analysis.splits:
                raise _cannot_take(exc) from exc
            self.engine, self.pass_over_reason = "tiktoken", str(_cannot_take(exc))
            return
        self._ids = self._fastokens_ids

    def _init_sentencepiece(self, tokenizer_json: str) -> None:
        """fastokens with the Metaspace step as its Replace normalizer (a marker the text lacks is a space
        inserted before the run: :meth:`_sentencepiece_encode`; a Prepend normalizer stays fastokens'), and
        each token's length in the text's own bytes: a marker is one byte (a space) where the text has no
        marker of its own, a byte-fallback token one byte."""
        data = json.loads(tokenizer_json)
        added = {t["content"]: int(t["id"]) for t in data.get("added_tokens") or []}
        vocab: dict[str, int] = data["model"]["vocab"]
        if self.analysis.metaspace != "prepend":
            data["normalizer"] = {"type": "Replace", "pattern": {"String": " "}, "content": METASPACE}
            data["pre_tokenizer"] = None
        self.engine = "fastokens"
        try:
            self._fastokens = _fastokens_from(json.dumps(data))
        except Exception as exc:  # no other engine runs this pipeline
            raise _cannot_take(exc) from exc
        self._vocab = {}, added
        self._starts = tuple(added)
        self._first_chars = frozenset(t[0] for t in added)
        size = max([*vocab.values(), *added.values()]) + 1
        self.marked = np.zeros(size, dtype=np.int64)  # with markers as 3 bytes (texts that have their own)
        self.lengths = np.zeros(size, dtype=np.int64)
        self._added_ids = np.zeros(size, dtype=bool)
        bytes_ = set(BYTE_PIECES)
        for piece, i in vocab.items():
            self.marked[i] = 1 if piece in bytes_ else len(piece.encode("utf-8"))
            self.lengths[i] = 1 if piece in bytes_ else self.marked[i] - 2 * piece.count(METASPACE)
        for text, i in added.items():  # (Gemma's "▁▁" is also what the model makes of two spaces)
            self.marked[i] = len(text.encode("utf-8"))
            self.lengths[i] = self.marked[i] - 2 * text.count(METASPACE)
            self._added_ids[i] = True
        self._unsafe_ids = np.zeros(size, dtype=bool)

    @property
    def added(self) -> list[str]:
        """The added tokens' texts (where the pipeline may restart depends on them, ``sftmix.tokenizing.restarts``)."""
        return list(self._vocab[1])

    def prepends(self, text: str) -> bool:
        """Whether Metaspace puts a marker before this text's first run (``first`` and ``always``): the text
        is not empty, does not start with an added token (those are matched before the pre-tokenizer runs)
        nor with a marker already (a space becomes one)."""
        if self.analysis.metaspace not in ("first", "always") or not text or text[0] in (" ", METASPACE):
            return False
        return not (text[0] in self._first_chars and text.startswith(self._starts))

    def _runs(self, ids: np.ndarray) -> np.ndarray:
        """Positions of the tokens that begin a run of text: the first token, and any after an added one."""
        added = self._added_ids[ids]
        return np.flatnonzero(~added & np.concatenate(([True], added[:-1])))

    def _sentencepiece_encode(self, text: str) -> tuple[np.ndarray, np.ndarray | None]:
        """The ids, and the positions of the tokens whose first marker is not in the text (the one a
        Metaspace or Prepend step put before their run); None when there are none."""
        scheme = self.analysis.metaspace
        if scheme == "prepend":  # fastokens prepends to every run itself
            ids = self._fastokens_ids(text)
            return ids, self._runs(ids)
        first = self.prepends(text)
        ids = self._fastokens_ids(" " + text if first else text)
        marks = np.zeros(1, dtype=np.int64) if first else None
        if scheme != "always" or not self._added_ids[ids].any():
            return ids, marks
        # ``always``: also a marker before each later run that does not start with a space or a marker
        runs = self._runs(ids)
        later = runs[runs > 0]
        starts = self._sentencepiece_offsets(text, ids, marks)[later, 0].tolist()
        needs = [text[c] not in (" ", METASPACE) for c in starts]
        if not any(needs):
            return ids, marks
        spaced, at = [], 0
        for c, need in zip(starts, needs, strict=True):
            if need:
                spaced += [text[at:c], " "]
                at = c
        spaced.append(text[at:])
        ids = self._fastokens_ids((" " if first else "") + "".join(spaced))
        again = self._runs(ids)  # the same runs: a space before a run's text cannot make an added token
        again = again[again > 0]
        if again.shape[0] != len(needs):
            raise ValueError("the runs of a text changed when their markers were added")
        marked = again[np.array(needs)]
        return ids, marked if marks is None else np.concatenate((marks, marked))

    def _sentencepiece_offsets(self, text: str, ids: np.ndarray, marks: np.ndarray | None) -> np.ndarray:
        """Offsets from the tokens' bytes in the text, a marker the text lacks counting none: a token that is
        only such a marker sits, as the library aligns it, on the character after it."""
        shown, lengths, mark = text, self.lengths[ids], 1
        if METASPACE in text:  # the text's own markers are 3 bytes: count in the text as the engine saw it
            shown, lengths, mark = text.replace(" ", METASPACE), self.marked[ids], 3
        if marks is None:
            return char_offsets(shown, lengths)
        lengths = lengths.copy()
        lengths[marks] -= mark
        out = char_offsets(shown, lengths)
        # a marker alone starts where the next token of its run does (a run is never empty), and char_offsets
        # gives an empty token nothing sensible to end at
        alone = marks[lengths[marks] == 0]
        out[alone, 0] = out[alone + 1, 0]
        out[alone, 1] = out[alone, 0] + 1
        return out

    @cached_property
    def encoding(self) -> Any:
        """tiktoken's encoding: the engine, or with fastokens the decoder of the spans that cannot be read
        from their text (made when first asked: 0.1 s per process)."""
        import tiktoken

        ranks, added = self._vocab
        # (with a sequence of splits it only decodes: any pattern it compiles will do)
        pattern = self.analysis.pattern or BYTE_LEVEL_PATTERN
        return tiktoken.Encoding(
            "tokenize-mixer", pat_str=pattern, mergeable_ranks=ranks, special_tokens=added
        )

    @cached_property
    def _core(self) -> Any:
        return self.encoding._core_bpe  # the per-text call, without encode()'s checks per text

    def offsets(
        self, text: str, ids: np.ndarray, marks: np.ndarray | None = None, ends: np.ndarray | None = None
    ) -> np.ndarray:
        """``ends``: the tokens' bytes added up (:attr:`FastEncoding.byte_ends`), where made already."""
        if self.analysis.metaspace:
            return self._sentencepiece_offsets(text, ids, marks)
        out = char_offsets(text, self.lengths[ids], ends)
        if self.trim is not None and ids.shape[0]:
            start, end = out[:, 0], out[:, 1]
            lead, trail = self.leading[ids], self.trailing[ids]
            if self.trim.keep_first_space:
                first = start == 0
                first[0] = True
                lead = np.where(first & (lead == 1), 0, lead)
            start = np.minimum(start + lead, end)
            out = np.stack([start, np.where(end >= trail, np.maximum(end - trail, start), end)], axis=1)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """The library's ``decode(ids, skip_special_tokens=False)`` where the analysis proved it the same."""
        if not self.analysis.decodes:
            return self.rust.decode(list(ids), skip_special_tokens=False)
        return self.encoding.decode_bytes(ids).decode("utf-8", errors="replace")

    def _tiktoken_ids(self, text: str) -> np.ndarray:
        buffer = self._core.encode_to_tiktoken_buffer(text, self._allowed)
        return np.frombuffer(buffer, dtype=np.uint32).astype(np.int64)

    def _fastokens_ids(self, text: str) -> np.ndarray:
        """One text at a time (one core: the workers are the parallelism), as a flat buffer: no
        ``Encoding`` object, no list."""
        buffer, _ = self._fastokens.encode_batch_flat([text])
        return np.frombuffer(buffer, dtype=np.uint32).astype(np.int64)

    def encode_batch(self, texts: Sequence[str]) -> list[Any]:
        out: list[Any] = []
        for text in texts:
            marks = None
            try:
                if self.analysis.metaspace:
                    ids, marks = self._sentencepiece_encode(text)
                elif self.analysis.form is not None and not in_form(text, self.analysis.form):
                    ids = None
                else:
                    ids = self._ids(text)
            except Exception:  # lone surrogates, or any text the engine refuses: the oracle encodes it
                ids = None
            if ids is None or (self.unsafe and self._unsafe_ids[ids].any()):
                self.fallbacks += 1
                out.append(self.rust.encode(text, add_special_tokens=False))
            else:
                out.append(FastEncoding(text, ids, self, marks))
        return out


def same_encodings(rust: Any, fast: FastEncoder, texts: Sequence[str]) -> str | None:
    """The first text the two encoders disagree on (ids or offsets), described; None when all agree."""
    for n, (a, b) in enumerate(
        zip(rust.encode_batch(list(texts), add_special_tokens=False), fast.encode_batch(texts), strict=True)
    ):
        if not np.array_equal(np.asarray(a.ids, dtype=np.int64), np.asarray(b.ids, dtype=np.int64)):
            return f"text {n}: ids differ"
        if not np.array_equal(
            np.asarray(a.offsets, dtype=np.int64).reshape(-1, 2),
            np.asarray(b.offsets, dtype=np.int64).reshape(-1, 2),
        ):
            return f"text {n}: offsets differ"
    return None
