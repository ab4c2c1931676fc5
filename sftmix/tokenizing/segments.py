"""Tokenizing a render only as far as the output needs it, with the bytes of tokenizing all of it.

A tokenizer splits its input at added tokens (``<|im_end|>``, ``<|endoftext|>``, ...) before anything
else, and with no normalizer and no pre-tokenizer that treats the start of a piece specially, every
piece between them is tokenized on its own. So a text cut right after such a token tokenizes, on each
side, into exactly the tokens the whole text has there. Two things follow:

- multi-turn masking stays linear: the token count of a prefix render that agrees with the full render
  up to such a token is the full render's count there plus the count of the prefix's own short tail;
- a row truncated at ``max_seq_length`` tokens, or dropped because its first assistant span fails the
  reference's check, needs only the pieces before that point: the rest is never tokenized.

Every cut is checked against the tokenizer's own output (the piece must end with that added token, at
the cut) and against every added token that could match across the cut; a cut that fails either check
is not used, and the text is tokenized to its end instead.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from itertools import chain
from typing import Any

import numpy as np

from sftmix.tokenizing.encoders import FastEncoding
from sftmix.tokenizing.prefix_renders import PastedPrefix, common_prefix_length
from sftmix.tokenizing.sentencepiece_proof import METASPACE


@dataclass(frozen=True)
class SegmentBoundaries:
    """The added tokens after which tokenization restarts (see the module docstring)."""

    ids: frozenset[int]
    contents: tuple[str, ...]  # texts of these added tokens
    longest: int  # characters of the longest added token (how far a match can look ahead)
    every: tuple[str, ...] = ()  # texts of every added token (the ones a cut must not straddle)

    @cached_property
    def pattern(self) -> re.Pattern[str]:
        """(An attribute once read: ``cut`` asks for it a few times per assistant turn.)"""
        return _added_pattern(self.contents)

    @property
    def is_boundary(self) -> np.ndarray:
        """``is_boundary[min(id, len - 1)]``: whether a token id is one of these (the last entry, past
        every boundary id, is False)."""
        return _boundary_table(self.ids)

    def cut(
        self,
        text: str | PastedPrefix,
        full: str,
        starts: Sequence[int],
        ends: Sequence[int],
        index: Sequence[int],
    ) -> tuple[int, str]:
        """(tokens before the cut, tail to tokenize) for ``text``, exact for this tokenizer.

        ``starts``/``ends`` are the character offsets of the boundary tokens in ``full`` and ``index``
        their positions among its tokens (lists are quicker to search than arrays). A cut at the end of
        such a token, or at its start when ``text`` itself continues with an added token there, is a
        segment boundary in both strings.
        A pasted prefix of ``full`` is read only near the cut (never built whole: a long chat's
        prefixes together are quadratic).
        """
        agree = agreement(text, full)
        if not isinstance(text, PastedPrefix) or text.full is not full:
            text = str(text)
        length = len(text)
        reach = self.longest - 1
        # latest boundary token starting at or before `agree` (its start is a candidate cut)
        j = bisect_right(starts, agree) - 1
        while j >= 0:
            start, end = int(starts[j]), int(ends[j])
            if end <= agree and (end == length or end + reach <= agree):
                return int(index[j]) + 1, text_part(text, end, length)
            near = text_part(text, max(0, start - reach), start + self.longest)
            at = min(start, reach)
            if self.pattern.match(near, at) and self._clean_before(near, at):
                return int(index[j]), text_part(text, start, length)
            j -= 1
        return 0, str(text)

    def _clean_before(self, text: str, c: int) -> bool:
        """No added-token match in ``text`` straddles position ``c`` (matches found as ``finditer``
        finds them from ``c - longest + 1``)."""
        at, stop = max(0, c - self.longest + 1), c + self.longest
        while (m := self.pattern.search(text, at, stop)) is not None and m.start() < c:
            if m.end() > c:
                return False
            at = m.end()
        return True

    def next_cut(self, text: str, at: int) -> int | None:
        """The first position ``>= at`` (and before the end) right after a boundary token that no
        added token could match across; ``None`` when there is none."""
        for m in self.pattern.finditer(text, max(0, at - self.longest)):
            c = m.end()
            if c >= len(text):
                return None
            if c >= at and not self._straddled(text, c):
                return c
        return None

    def _straddled(self, text: str, c: int) -> bool:
        """Whether any added token (of all of them, longest first at each start) could match in
        ``text`` from before ``c`` to after it."""
        lo = max(0, c - self.longest + 1)
        for m in _overlapping_pattern(self.every or self.contents).finditer(text, lo, c + self.longest):
            if m.start() >= c:
                break
            if m.start() + len(m.group(1)) > c:
                return True
        return False


def agreement(text: str | PastedPrefix, full: str) -> int:
    """How many first characters ``text`` shares with ``full`` (a pasted prefix of ``full`` read only
    after its end)."""
    if isinstance(text, PastedPrefix) and text.full is full:
        shared = full[text.end : text.end + len(text.tail)]
        return text.end + (len(shared) if shared == text.tail else common_prefix_length(text.tail, shared))
    text = str(text)
    return len(text) if full.startswith(text) else common_prefix_length(text, full)


def text_part(text: str | PastedPrefix, lo: int, hi: int) -> str:
    """``str(text)[lo:hi]``."""
    if isinstance(text, str):
        return text[lo:hi]
    end = text.end
    if hi <= end:
        return text.full[lo:hi]
    head = text.full[lo:end] if lo < end else ""
    return head + text.tail[max(0, lo - end) : hi - end]


def _added_token_chars(piece: Any, i: int) -> tuple[int, int]:
    """``piece.token_to_chars(i)`` of token ``i``, an added token: a fast encoding finds it from the
    tokens' bytes, without every token's offsets (which a row masked by token counts never reads)."""
    if isinstance(piece, FastEncoding):
        start, end = piece.added_token_chars(np.array([i], dtype=np.int64))[0]
        return int(start), int(end)
    return piece.token_to_chars(i)


@lru_cache(maxsize=8)
def _boundary_table(ids: frozenset[int]) -> np.ndarray:
    table = np.zeros(max(ids, default=-1) + 2, dtype=bool)
    table[sorted(ids)] = True
    return table


def _alternation(contents: tuple[str, ...]) -> str:
    return "|".join(re.escape(c) for c in sorted(contents, key=len, reverse=True))


@lru_cache(maxsize=8)
def _added_pattern(contents: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile(_alternation(contents))


@lru_cache(maxsize=8)
def _overlapping_pattern(contents: tuple[str, ...]) -> re.Pattern[str]:
    """Every start of a match (lookahead: matches may overlap), the longest alternative at each."""
    return re.compile(f"(?=({_alternation(contents)}))")


def overlap_mask(offsets: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """1 for every token of non-zero width whose offsets overlap a span."""
    mask = np.zeros(offsets.shape[0], dtype=bool)
    if not spans or offsets.shape[0] == 0:
        return mask.astype(np.uint8)
    starts, ends = np.ascontiguousarray(offsets[:, 0]), np.ascontiguousarray(offsets[:, 1])
    nonempty = starts != ends
    if np.all(starts[1:] >= starts[:-1]) and np.all(ends[1:] >= ends[:-1]):
        # offsets in order (as tokens of one text are): each span's tokens are one run, found by search
        for s, e in spans:
            mask[np.searchsorted(ends, s, side="right") : np.searchsorted(starts, e, side="left")] = True
    else:
        for s, e in spans:
            mask |= (starts < e) & (s < ends)
    return (mask & nonempty).astype(np.uint8)


def span_masks(
    encs: Sequence[Encoded], limits: Sequence[int], spans: Sequence[Sequence[tuple[int, int]]]
) -> list[np.ndarray]:
    """``[e.span_mask(limit, s) ...]``: the rows that are one fast-encoder piece made together
    (``FastEncoding.span_masks``), the others one by one."""
    out: list[np.ndarray | None] = [None] * len(encs)
    together = [i for i, e in enumerate(encs) if e._one_fast_piece() is not None]
    if together:
        masks = FastEncoding.span_masks(
            [encs[i].pieces[0] for i in together],
            [min(limits[i], encs[i].length) for i in together],
            [spans[i] for i in together],
        )
        for i, mask in zip(together, masks, strict=True):
            out[i] = mask
    return [
        mask if mask is not None else e.span_mask(limit, s)
        for e, limit, s, mask in zip(encs, limits, spans, out, strict=True)
    ]


@dataclass
class Encoded:
    """The tokens of a text's first ``covered`` characters, as pieces the tokenizer made separately.

    Every piece after the first starts with the boundary token that ended the one before (then left
    out): a post-processor that treats a text's first token apart (offsets trimmed or not) sees, in
    each piece, the same first token the whole text has."""

    text: str
    pieces: list[Any] = field(default_factory=list)  # tokenizers.Encoding (or FastEncoding) of each piece
    piece_ids: list[Any] = field(default_factory=list)  # each piece's ids (list or array), read once
    bases: list[int] = field(default_factory=list)  # where each piece starts in ``text``
    skips: list[int] = field(default_factory=list)  # leading tokens of each piece that are not its own
    covered: int = 0
    length: int = 0  # tokens so far
    last_boundary: tuple[int, int] | None = None  # (id, start) of the token that ends the last piece
    _ids: np.ndarray | None = None
    _boundaries: tuple[SegmentBoundaries, tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None
    _byte_ends: np.ndarray | None = None  # bytes of the text through each token (see decoded)
    _spans: tuple[np.ndarray, np.ndarray] | None = None  # every token's (starts, ends), once asked
    _utf8: bytes | None = None

    @property
    def complete(self) -> bool:
        return self.covered >= len(self.text)

    def add(self, piece: Any, ids: list[int], base: int, skip: int, end: int) -> None:
        """``ids``: ``piece.ids``, which the tokenizers library builds as a new list at every read."""
        self.pieces.append(piece)
        self.piece_ids.append(ids)
        self.bases.append(base)
        self.skips.append(skip)
        self.covered = end
        self.length += len(ids) - skip
        self._ids = self._boundaries = self._byte_ends = self._spans = None
        self.last_boundary = None
        if not self.complete:
            self.last_boundary = (int(ids[-1]), base + _added_token_chars(piece, len(ids) - 1)[0])

    def clear(self) -> None:
        self.pieces, self.piece_ids, self.bases, self.skips = [], [], [], []
        self.covered = self.length = 0
        self.last_boundary = self._ids = self._boundaries = self._byte_ends = self._spans = None

    @property
    def ids(self) -> np.ndarray:
        if self._ids is None:
            parts = [
                np.asarray(ids, dtype=np.int64)[k:] for ids, k in zip(self.piece_ids, self.skips, strict=True)
            ]
            self._ids = parts[0] if len(parts) == 1 else np.concatenate([np.zeros(0, np.int64), *parts])
        return self._ids

    def offsets(self, limit: int | None = None) -> np.ndarray:
        """(start, end) character offsets in ``text`` of the first ``limit`` tokens, as (n, 2)."""
        out, left = [], self.length if limit is None else min(limit, self.length)
        for piece, ids, base, skip in zip(self.pieces, self.piece_ids, self.bases, self.skips, strict=True):
            if left <= 0:
                break
            n = min(left, len(ids) - skip)
            pairs = piece.offsets[skip : skip + n]  # a list of tuples, or the fast encoder's array
            if not isinstance(pairs, np.ndarray):
                pairs = np.fromiter(chain.from_iterable(pairs), dtype=np.int64, count=2 * n).reshape(-1, 2)
            out.append(pairs + base)
            left -= n
        return np.concatenate(out) if out else np.zeros((0, 2), dtype=np.int64)

    def tokens_before(self, c: int) -> int | None:
        """How many tokens end at or before character ``c`` (within what is covered), where every later
        one starts at or after it; None where a token lies across ``c``."""
        if c > self.covered:
            return None
        if self._spans is None:
            offsets = self.offsets()
            self._spans = offsets[:, 0], offsets[:, 1]
        starts, ends = self._spans
        k = int(np.searchsorted(ends, c, side="right"))
        if k < starts.shape[0] and starts[k] < c:
            return None
        return k

    def span_mask(self, limit: int, spans: Sequence[tuple[int, int]]) -> np.ndarray:
        """``overlap_mask(self.offsets(limit), spans)``: for one fast-encoder piece read from the tokens'
        bytes (``FastEncoding.span_mask``), which makes no offsets; otherwise from the offsets."""
        piece = self._one_fast_piece()
        if piece is not None and (mask := piece.span_mask(min(limit, self.length), spans)) is not None:
            return mask
        return overlap_mask(self.offsets(limit), spans)

    def _one_fast_piece(self) -> FastEncoding | None:
        """The fast encoding of the whole text so far, where it is one piece from the text's start (most
        rows): its tokens, offsets and bytes are the row's as they are."""
        if len(self.pieces) == 1 and self.skips[0] == 0 and isinstance(self.pieces[0], FastEncoding):
            return self.pieces[0]
        return None

    def decoded(self, start: int, end: int) -> str | None:
        """The fast encoder's ``decode(ids[start:end])`` read from the text, where that is what it is:
        every piece the fast encoder's, whose tokens' bytes are the text's bytes (the offsets rest on it)
        and whose decoding is proven to be those bytes. ``None`` otherwise."""
        if self._byte_ends is None:
            if not self.pieces or not all(isinstance(p, FastEncoding) for p in self.pieces):
                return None
            encoder = self.pieces[0].encoder
            reads = encoder.analysis.decodes or encoder.analysis.text_decodes
            if not reads or any(p.encoder is not encoder for p in self.pieces):
                return None
            if len(self.pieces) == 1 and self.skips[0] == 0:  # (most rows: one piece, its sums made)
                self._byte_ends = self.pieces[0].byte_ends
            else:
                self._byte_ends = np.cumsum(encoder.lengths[self.ids])
        lo = 0 if start == 0 else int(self._byte_ends[start - 1])
        hi = 0 if end == 0 else int(self._byte_ends[end - 1])
        if self.text.isascii():
            return self.text[lo:hi]
        if self._utf8 is None:
            self._utf8 = self.text.encode("utf-8")
        if self.pieces[0].encoder.analysis.text_decodes and not _text_is_decode(
            self.text, self._utf8, lo, hi
        ):
            return None
        return self._utf8[lo:hi].decode("utf-8", errors="replace")

    def boundary_tokens(self, boundaries: SegmentBoundaries) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(starts, ends, positions) of the boundary tokens among the tokens so far."""
        if self._boundaries is not None and self._boundaries[0] is boundaries:
            return self._boundaries[1]
        table = boundaries.is_boundary
        at = np.flatnonzero(table[np.minimum(self.ids, table.shape[0] - 1)])
        if (piece := self._one_fast_piece()) is not None:
            chars = piece.added_token_chars(at)
            found = chars[:, 0], chars[:, 1], at
            self._boundaries = (boundaries, found)
            return found
        chars = np.zeros((at.shape[0], 2), dtype=np.int64)
        first = 0
        k = 0
        for piece, ids, base, skip in zip(self.pieces, self.piece_ids, self.bases, self.skips, strict=True):
            last = first + len(ids) - skip
            end = int(np.searchsorted(at, last))
            if end > k:
                local = at[k:end] - first + skip
                if isinstance(piece, FastEncoding):
                    chars[k:end] = piece.added_token_chars(local) + base
                else:  # the library builds every token's offsets at a read of .offsets: ask for these only
                    for j, t in enumerate(local.tolist()):
                        chars[k + j] = piece.token_to_chars(t)
                    chars[k:end] += base
                k = end
            first = last
        found = chars[:, 0], chars[:, 1], at
        self._boundaries = (boundaries, found)
        return found


def _text_is_decode(text: str, utf8: bytes, lo: int, hi: int) -> bool:
    """Whether bytes ``lo:hi`` of a SentencePiece-style text decode as themselves: whole characters (a span
    ending inside one decodes to a replacement character per byte, which Python's decoder does not make),
    in a text that holds no marker of its own (which decodes as a space)."""
    if any(at < len(utf8) and (utf8[at] & 0xC0) == 0x80 for at in (lo, hi)):
        return False
    return METASPACE not in text


class PrefixEncoder:
    """Tokenizes texts in pieces cut at segment boundaries, only until each has what it needs."""

    def __init__(
        self, encode_batch: Callable[[list[str]], list], boundaries: SegmentBoundaries | None
    ) -> None:
        self.encode_batch = encode_batch
        self.boundaries = boundaries
        self._chars = 4 * 4096  # characters and tokens seen so far (a starting guess of 4 per token)
        self._tokens = 4096

    def start(self, texts: Sequence[str]) -> list[Encoded]:
        return [Encoded(text) for text in texts]

    def grow(
        self,
        encs: Sequence[Encoded],
        tokens: Sequence[int | None],
        chars: Sequence[int] | None = None,
    ) -> None:
        """Extend each ``encs[i]`` until it has ``tokens[i]`` tokens (``None``: all of them) and covers
        ``chars[i]`` characters, or its whole text."""

        def short(i: int) -> bool:
            e, n = encs[i], tokens[i]
            if e.complete:
                return False
            return n is None or e.length < n or (chars is not None and e.covered < chars[i])

        wanted = [i for i in range(len(encs)) if short(i)]
        to_end: set[int] = set()
        while wanted:
            texts, cuts, bases = [], [], []
            per_token = self._chars / self._tokens
            for i in wanted:
                e, cut, n = encs[i], None, tokens[i]
                if self.boundaries is not None and n is not None and i not in to_end:
                    target = e.covered + max(1, int((n - e.length) * per_token))
                    if chars is not None:
                        target = max(target, chars[i])
                    cut = self.boundaries.next_cut(e.text, target)
                base = 0 if e.last_boundary is None else e.last_boundary[1]
                cuts.append(cut)
                bases.append(base)
                texts.append(e.text[base:cut])
            pieces = self.encode_batch(texts)
            again = []
            for i, cut, base, text, piece in zip(wanted, cuts, bases, texts, pieces, strict=True):
                e, ids = encs[i], piece.ids
                if not self._fits(e, piece, ids, base, cut is not None, len(text)):
                    e.clear()  # the tokenizer did not split where it was expected to: start over, whole
                    to_end.add(i)
                    again.append(i)
                    continue
                skip = 0 if e.last_boundary is None else 1
                self._chars += len(text)
                self._tokens += len(ids)
                e.add(piece, ids, base, skip, len(e.text) if cut is None else cut)
                if short(i):
                    again.append(i)
            wanted = again

    def _fits(self, e: Encoded, piece: Any, ids: list[int], base: int, cut: bool, length: int) -> bool:
        """The piece starts with the boundary token the last one ended with and, when it was cut, ends
        with a boundary token at the cut. (Offsets of single tokens: reading ``piece.offsets`` builds
        them all.)"""
        if e.last_boundary is not None and (
            len(ids) == 0
            or ids[0] != e.last_boundary[0]
            or _added_token_chars(piece, 0) != (0, e.covered - base)
        ):
            return False
        if cut:
            assert self.boundaries is not None
            if (
                len(ids) == 0
                or int(ids[-1]) not in self.boundaries.ids
                or _added_token_chars(piece, len(ids) - 1)[1] != length
            ):
                return False
        return True
