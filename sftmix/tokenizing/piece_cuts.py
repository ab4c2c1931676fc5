"""Prefix token counts cut inside a run of text, where a proven tokenizer's pipeline restarts.

The reference masks a row by the token counts of its prefix renders, each encoded whole. Cut at an added
token (``sftmix.tokenizing.segments``), a prefix costs only its own tail; but a template whose turn markers
are not the tokenizer's added tokens (``olmo`` with Anthropic's, Gemini's or Mistral's tokenizer) gives no
such cut, and every prefix was encoded whole: four times the row's tokens. Between added tokens a proven
tokenizer (``sftmix.tokenizing.encoders``) is a known pipeline, which restarts at some characters whatever
comes before or after them:

- byte-level BPE over one of the proven regex splits (GPT-2's, cl100k's, Qwen2's, o200k's, tekken's,
  DeepSeek-V3's sequence), after no normalizer, NFC or NFKC (``line``): before an ASCII letter that follows
  a line break. Every alternative of those regexes that takes a line break stops before a letter (a run of
  breaks or whitespace, punctuation with its trailing breaks), none that takes a letter takes a line break
  before it, and none looks behind: a piece ends there and the regex restarts. Neither normal form joins a
  line break to a letter, so normalizing either side alone gives the same text.
- SentencePiece-style BPE, one word per run, spaces as markers (``word``): before a marker (a space) after
  a character that is not one, where no vocabulary token holds a marker after another character: no merge
  joins the two sides, and a run that starts with a marker gets none prepended. (Not with a Prepend
  normalizer, which prepends one to every run.)

So a prefix that agrees with the full render through character ``a`` is cut at the last such character
``c < a`` that no added token's text spans in either text: its count is the full render's tokens before
``c`` plus its own tail's. tests/test_piece_cuts.py compares each count with the library's encode of the
whole prefix, for every family, on chats and random text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sftmix.tokenizing.encoders import LINE_CUTS, METASPACE, WORD_CUTS, FastAnalysis
from sftmix.tokenizing.prefix_renders import PastedPrefix
from sftmix.tokenizing.segments import Encoded, agreement, text_part

#: How far back from where a prefix leaves the full render a cut is looked for (characters): past it the
#: prefix is encoded whole, as without cuts.
REACH = 1 << 14

#: The two characters a cut falls between, by kind (an added token holding them could span a cut).
_PAIRS = {LINE_CUTS: re.compile(r"\n[A-Za-z]"), WORD_CUTS: re.compile(f"[^ {METASPACE}][ {METASPACE}]")}


@dataclass(frozen=True)
class PieceCuts:
    """Where this tokenizer's pipeline restarts inside a run (module docstring)."""

    kind: str  # LINE_CUTS or WORD_CUTS
    spanning: tuple[str, ...]  # added tokens' texts that hold the pair a cut falls between

    @classmethod
    def of(cls, analysis: FastAnalysis | str | None, added: list[str]) -> PieceCuts | None:
        """The cuts of a proven tokenizer (``added``: its added tokens' texts); None where it has none."""
        if not isinstance(analysis, FastAnalysis) or analysis.cuts is None:
            return None
        pair = _PAIRS[analysis.cuts]
        spanning = tuple(t for t in added if pair.search(t.replace(" ", METASPACE)))
        return cls(analysis.cuts, spanning)

    def cut(self, prefix: str | PastedPrefix, full: str, enc: Encoded) -> tuple[int, str] | None:
        """(tokens before the cut, the prefix's tail to tokenize), or None where no cut is found."""
        agree = agreement(prefix, full)
        c = self._last(full, agree, min(agree, enc.covered))
        if c is None:
            return None
        if self.spanning and (self._spanned(full, c) or self._spanned(prefix, c)):
            return None
        before = enc.tokens_before(c)
        if before is None:
            return None
        return before, text_part(prefix, c, len(prefix))

    def _last(self, full: str, agree: int, covered: int) -> int | None:
        """The last cut ``c`` with ``0 < c < agree`` in the text both share, no further back than :data:`REACH`."""
        lo = max(0, agree - REACH)
        if self.kind == LINE_CUTS:
            at = full.rfind("\n", lo, agree - 1)
            while at >= lo:
                c = at + 1
                if c <= covered and full[c].isascii() and full[c].isalpha():
                    return c
                at = full.rfind("\n", lo, at)
            return None
        end = agree
        while end > lo:
            c = max(full.rfind(" ", lo, end), full.rfind(METASPACE, lo, end))
            if c <= 0:
                return None
            if c <= covered and full[c - 1] not in (" ", METASPACE):
                return c
            end = c
        return None

    def _spanned(self, text: str | PastedPrefix, c: int) -> bool:
        """Whether one of the :attr:`spanning` tokens' texts in ``text`` covers both characters around
        ``c`` (one of length ``n`` does where it lies in the ``2n - 2`` characters around ``c``); markers
        and spaces alike, as a Replace normalizer makes them before normalized tokens are matched."""
        for token in self.spanning:
            n = len(token)
            window = text_part(text, max(0, c - n + 1), c + n - 1)
            if self.kind == WORD_CUTS:
                window, token = window.replace(" ", METASPACE), token.replace(" ", METASPACE)
            if token in window:
                return True
        return False
