"""Prefix token counts taken from the full render up to where a proven tokenizer's pipeline restarts.

The reference masks a row by the token counts of its prefix renders, each encoded whole. Split at an added
token (``sftmix.tokenizing.segments``), a prefix costs only its own tail; but a template whose turn markers
are not the tokenizer's added tokens (``olmo`` with Anthropic's, Gemini's or Mistral's tokenizer) gives no
such split, and every prefix was encoded whole: four times the row's tokens. Between added tokens a proven
tokenizer (``sftmix.tokenizing.encoders``) is a known pipeline, which restarts at some characters whatever
comes before or after them:

- byte-level BPE over one of the proven regex splits (GPT-2's, cl100k's, Qwen2's, o200k's, tekken's,
  DeepSeek-V3's sequence), after no normalizer, NFC or NFKC (``line``): before an ASCII letter that follows
  a line break. Every alternative of those regexes that takes a line break stops before a letter (a run of
  breaks or whitespace, punctuation with its trailing breaks), none that takes a letter takes a line break
  before it, and none looks behind: a piece ends there and the regex restarts. What a piece before it is
  does depend on that letter being there in the same run of text (GPT-2's ``\\s+(?!\\S)`` takes two line
  breaks whole at a run's end, one at a time before a letter): so no added token may begin there, in
  either text. Neither normal form joins a line break to a letter, so normalizing either side alone gives
  the same text.
- SentencePiece-style BPE, one word per run, spaces as markers (``word``): before a marker (a space) after
  a character that is not one, where no vocabulary token holds a marker after another character: no merge
  joins the two sides, and a run that starts with a marker gets none prepended. (Not with a Prepend
  normalizer, which prepends one to every run.)

So a prefix that agrees with the full render through character ``a`` is counted from the last such
character ``c < a`` where no added token's text begins or lies across, in either text: the full render's
tokens before ``c`` plus the prefix's own tail's. Only with the fast encoder, whose proof (and the run's
sample check) these rest on. tests/test_restarts.py compares each count with the library's encode of the
whole prefix, for every family, on chats and random text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sftmix.tokenizing.fast_analysis import LINE_RESTARTS, WORD_RESTARTS, FastAnalysis
from sftmix.tokenizing.prefix_renders import PastedPrefix
from sftmix.tokenizing.segments import Encoded, agreement, text_part
from sftmix.tokenizing.sentencepiece_proof import METASPACE

#: How far back from where a prefix leaves the full render a restart is looked for (characters): past it
#: the prefix is encoded whole.
REACH = 1 << 14

#: By kind: the two characters a restart falls between (an added token holding them could lie across
#: one), and the first characters of an added token that could begin at one.
_PAIRS = {
    LINE_RESTARTS: re.compile(r"\n[A-Za-z]"),
    WORD_RESTARTS: re.compile(f"[^ {METASPACE}][ {METASPACE}]"),
}
_FIRSTS = {LINE_RESTARTS: re.compile("[A-Za-z]"), WORD_RESTARTS: re.compile(f"[ {METASPACE}]")}


@dataclass(frozen=True)
class Restarts:
    """Where this tokenizer's pipeline restarts inside a run (module docstring)."""

    kind: str  # LINE_RESTARTS or WORD_RESTARTS
    across: tuple[str, ...]  # added tokens' texts that hold the two characters a restart falls between
    beginning: tuple[str, ...]  # added tokens' texts that could begin at a restart

    @classmethod
    def of(cls, analysis: FastAnalysis | str | None, added: list[str]) -> Restarts | None:
        """The restarts of a proven tokenizer (``added``: its added tokens' texts); None where it has none."""
        if not isinstance(analysis, FastAnalysis) or analysis.restarts is None:
            return None
        kind = analysis.restarts
        across = tuple(t for t in added if _PAIRS[kind].search(t))
        return cls(kind, across, tuple(t for t in added if _FIRSTS[kind].match(t)))

    def last_shared(self, prefix: str | PastedPrefix, full: str, enc: Encoded) -> tuple[int, str] | None:
        """(the full render's tokens before the prefix's last restart, the prefix's tail from it), or None
        where there is none to take."""
        agree = agreement(prefix, full)
        c = self._last(full, agree, min(agree, enc.covered))
        if c is None or self._added_at(full, c) or self._added_at(prefix, c):
            return None
        before = enc.tokens_before(c)
        if before is None:
            return None
        return before, text_part(prefix, c, len(prefix))

    def _last(self, full: str, agree: int, covered: int) -> int | None:
        """The last restart ``c`` with ``0 < c < agree`` and ``c <= covered``, no further back than :data:`REACH`."""
        lo = max(0, agree - REACH)
        find = _last_line if self.kind == LINE_RESTARTS else _last_word
        c = find(full, lo, agree)
        while c is not None and c > covered:
            c = find(full, lo, c)
        return c

    def _added_at(self, text: str | PastedPrefix, c: int) -> bool:
        """Whether an added token's text in ``text`` begins at ``c`` or lies across it (one of length ``n``
        does where it lies in the ``2n - 2`` characters around ``c``)."""
        for token in self.beginning:
            if text_part(text, c, c + len(token)) == token:
                return True
        for token in self.across:
            n = len(token)
            if token in text_part(text, max(0, c - n + 1), c + n - 1):
                return True
        return False


def _last_line(text: str, lo: int, end: int) -> int | None:
    """The last ``c`` in ``(lo, end)`` with a line break before it and an ASCII letter at it."""
    at = text.rfind("\n", lo, end - 1)
    while at >= lo:
        if text[at + 1].isascii() and text[at + 1].isalpha():
            return at + 1
        at = text.rfind("\n", lo, at)
    return None


def _last_word(text: str, lo: int, end: int) -> int | None:
    """The last ``c`` in ``(lo, end)`` with a space or marker at it and neither before it."""
    while end > lo:
        c = max(text.rfind(" ", lo, end), text.rfind(METASPACE, lo, end))
        if c <= 0:
            return None
        if text[c - 1] not in (" ", METASPACE):
            return c
        end = c
    return None
