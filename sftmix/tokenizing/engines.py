"""What computes the ids of a proven tokenizer, and the split regexes each engine is proven for.

What computes the ids of a proven tokenizer (:data:`ENGINES`): fastokens where it is installed, else
tiktoken. fastokens reads ``tokenizer.json`` and runs the tokenizers library's pipeline in Rust, with the
pre-tokenizer's regex in PCRE2 instead of Oniguruma. The analysis (``sftmix.tokenizing.encoder_proof``)
holds for it as for tiktoken (it proves the merge order, the added tokens and the pipeline's shape, whatever
the BPE implementation that follows merges or ranks); what it adds is a third regex engine, so it is used
only for the patterns whose splits tests/test_encoders.py compares in all three on random text, and the
run's sample check, the random-text tests and the goldens run with either engine. Both give the same ids on
every proven text; a text either refuses (lone surrogates) or whose ids hold an unsafe token still goes to
the library.

Two shapes have no tiktoken equivalent, and fastokens alone encodes them, whatever the engine setting: a
pre-tokenizer that is a sequence of several Splits (DeepSeek-V3's: digits by three, CJK runs, then words;
each Split cuts the pieces of the one before, which no single regex's find-all does), proven as a whole
sequence in PCRE2 against Oniguruma (:data:`PROVEN_SPLIT_SEQUENCES`); and SentencePiece-style BPE (a
Metaspace pre-tokenizer that does not split, or a normalizer that only turns spaces into the marker; byte
fallback; ``sftmix.tokenizing.sentencepiece_proof``).
"""

from __future__ import annotations

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
