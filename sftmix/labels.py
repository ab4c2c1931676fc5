"""Render + tokenize + assistant-only label mask for a batch of conversations.

The reference's rule: tokenize the full render once; an assistant turn ``i``
is the character span ``[len(render(m[:i], gen=True)), len(render(m[:i+1])))`` and a token is
trainable when its offsets overlap a span. When a prefix render is not a literal prefix of the full
render (the ``olmo`` template on multi-turn chats), spans come from token counts of the prefixes and
are then checked against the message content; a row that fails the check is dropped, as in the
reference. No I/O here: the caller supplies the renderer and tokenizers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from functools import lru_cache
from itertools import chain
from typing import Any

import numpy as np

from .formats import Conversation
from .prefix_renders import PastedPrefix, PrefixRenders, common_prefix_length
from .templates import ChatRenderer


class RowStatus(IntEnum):
    KEPT = 0
    NO_TRAINABLE = 1
    SPAN_UNVERIFIED = 2
    BAD_ROW = 3


#: Why a row was dropped, as shown in statistics and reports.
DROP_REASONS = {
    RowStatus.NO_TRAINABLE: "no_trainable_tokens",
    RowStatus.SPAN_UNVERIFIED: "assistant_span_unverified",
    RowStatus.BAD_ROW: "bad_row",
}


#: Rows that tokenize but train on nothing: the reference keeps them (all-zero mask) when its chain has no
#: ``sft_tulu_filter_v1`` step.
UNTRAINABLE = frozenset({RowStatus.NO_TRAINABLE, RowStatus.SPAN_UNVERIFIED})


class RenderError(Exception):
    """The template failed on a whole conversation (not a prefix): row ``index`` of the batch."""

    def __init__(self, index: int, cause: Exception) -> None:
        self.index = index
        self.cause = cause
        super().__init__(f"chat template failed: {type(cause).__name__}: {cause}")


@dataclass
class TokenizedRow:
    ids: np.ndarray
    mask: np.ndarray
    status: RowStatus
    detail: str | None = None
    reference_drops: bool = False  # kept by exact spans; the reference's rule would drop it


class _SpanFailure(Exception):
    pass


@dataclass
class _Pending:
    """A row waiting for prefix token counts (the fallback path)."""

    row: int
    indices: list[int]
    headers: list[str | PastedPrefix | None]
    throughs: list[str | PastedPrefix]
    boundary_starts: np.ndarray | None = None  # char offsets of segment-boundary tokens in the full render
    boundary_ends: np.ndarray | None = None
    boundary_index: np.ndarray | None = None  # their positions among the full render's tokens


@dataclass(frozen=True)
class SegmentBoundaries:
    """Added tokens split the text before pre-tokenization, and tokens never cross them. So the token
    count of a string that agrees with the full render up to such a token is the full render's count
    there plus the count of the string's own (short) tail. This keeps multi-turn masking linear."""

    ids: frozenset[int]
    contents: tuple[str, ...]  # texts of these added tokens
    longest: int  # characters of the longest added token (how far a match can look ahead)

    @property
    def pattern(self) -> re.Pattern[str]:
        return _added_pattern(self.contents)

    @property
    def id_array(self) -> np.ndarray:
        return _id_array(self.ids)

    def cut(
        self, text: str, full: str, starts: np.ndarray, ends: np.ndarray, index: np.ndarray
    ) -> tuple[int, str]:
        """(tokens before the cut, tail to tokenize) for ``text``, exact for this tokenizer.

        ``starts``/``ends`` are the character offsets of the boundary tokens in ``full`` and ``index``
        their positions among its tokens. A cut at the end of such a token, or at its start when
        ``text`` itself continues with an added token there, is a segment boundary in both strings.
        """
        agree = len(text) if full.startswith(text) else common_prefix_length(text, full)
        reach = self.longest - 1
        # latest boundary token starting at or before `agree` (its start is a candidate cut)
        j = int(np.searchsorted(starts, agree, side="right")) - 1
        while j >= 0:
            start, end = int(starts[j]), int(ends[j])
            if end <= agree and (end == len(text) or end + reach <= agree):
                return int(index[j]) + 1, text[end:]
            if self.pattern.match(text, start) and self._clean_before(text, start):
                return int(index[j]), text[start:]
            j -= 1
        return 0, text

    def _clean_before(self, text: str, c: int) -> bool:
        """No added-token match in ``text`` straddles position ``c``."""
        lo = max(0, c - self.longest + 1)
        return all(not (m.start() < c < m.end()) for m in self.pattern.finditer(text, lo, c + self.longest))


@lru_cache(maxsize=8)
def _id_array(ids: frozenset[int]) -> np.ndarray:
    return np.array(sorted(ids), dtype=np.int64)


@lru_cache(maxsize=8)
def _added_pattern(contents: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("|".join(re.escape(c) for c in sorted(contents, key=len, reverse=True)))


def assistant_indices(messages: Sequence[dict]) -> list[int]:
    return [i for i, m in enumerate(messages) if m.get("role") == "assistant"]


class LabelMasker:
    """Tokenizes conversations and marks assistant tokens trainable."""

    def __init__(
        self,
        renderer: ChatRenderer,
        encode_batch: Callable[[list[str]], list],
        decode: Callable[[list[int]], str],
        max_seq_length: int | None,
        boundaries: SegmentBoundaries | None = None,
        mode: str = "assistant",
        spans: str = "reference",
    ) -> None:
        self.renderer = renderer
        self.encode_batch = encode_batch
        self.decode = decode
        self.max_len = max_seq_length
        self.boundaries = boundaries
        self.mode = mode
        self.spans = spans
        self.prefixes = PrefixRenders(renderer.render)

    def _cap(self, n: int) -> int:
        return n if self.max_len is None else min(n, self.max_len)

    def tokenize(self, conversations: Sequence[Conversation]) -> list[TokenizedRow]:
        if self.mode in ("all", "generation_tags"):
            return self._tokenize_whole(conversations)
        rendered = _render_each(conversations, lambda c: self.renderer.render(c.messages, c.tools, False))
        encodings = self.encode_batch(rendered)
        results: list[TokenizedRow] = []
        pending: list[_Pending] = []
        for i, (conv, text, enc) in enumerate(zip(conversations, rendered, encodings, strict=True)):
            full_ids = np.asarray(enc.ids, dtype=np.int64)
            ids = full_ids if self.max_len is None else full_ids[: self.max_len]
            row = TokenizedRow(ids=ids, mask=np.zeros(ids.shape[0], dtype=np.uint8), status=RowStatus.KEPT)
            results.append(row)
            try:
                spans = self._char_spans(conv, text, pending, i)
            except _SpanFailure as exc:
                row.status, row.detail = RowStatus.SPAN_UNVERIFIED, str(exc)
                continue
            if spans is not None:  # every token's offsets, for the overlap rule
                offsets = _offsets(enc)[: ids.shape[0]]
                row.mask = _overlap_mask(offsets, spans[-1:] if self.mode == "last_turn" else spans)
            elif self.boundaries is not None:  # only the boundary tokens' offsets (converting all costs more)
                at = np.flatnonzero(np.isin(full_ids, self.boundaries.id_array))
                chars = np.array([enc.token_to_chars(j) for j in at.tolist()], dtype=np.int64).reshape(-1, 2)
                pending[-1].boundary_starts = chars[:, 0]
                pending[-1].boundary_ends = chars[:, 1]
                pending[-1].boundary_index = at
        if pending:
            self._token_count_spans(conversations, rendered, results, pending)
        if self.spans == "exact":
            self._exact_spans(conversations, rendered, encodings, results)
        for row in results:
            if row.status == RowStatus.KEPT and not row.mask.any():
                row.status, row.detail = (
                    RowStatus.NO_TRAINABLE,
                    "no assistant token survives (none, or truncated)",
                )
        return results

    def _exact_spans(
        self,
        conversations: Sequence[Conversation],
        rendered: list[str],
        encodings: list,
        results: list[TokenizedRow],
    ) -> None:
        """``spans: exact`` (beyond the reference, opt-in): where the pasted render shows each assistant
        content's exact characters, the mask is the tokens overlapping them (through the end of the turn
        as the turn's own render has it), and rows the reference rule cannot verify are kept. Rows that
        are not pasted keep the reference rule's outcome."""
        for conv, text, enc, row in zip(conversations, rendered, encodings, results, strict=True):
            spans = self.prefixes.content_spans(conv, text, assistant_indices(conv.messages))
            if spans is None:
                continue
            dropped = row.status != RowStatus.KEPT or not row.mask.any()
            offsets = _offsets(enc)[: row.ids.shape[0]]
            row.mask = _overlap_mask(offsets, spans[-1:] if self.mode == "last_turn" else spans)
            row.status, row.detail = RowStatus.KEPT, None
            row.reference_drops = dropped and bool(row.mask.any())

    def _tokenize_whole(self, conversations: Sequence[Conversation]) -> list[TokenizedRow]:
        """Modes with no prefix renders: 'all' (every token) and 'generation_tags' (tokens overlapping
        the template's ``{% generation %}`` blocks, found in the one full render)."""
        spans: list[list[tuple[int, int]]] = []
        if self.mode == "generation_tags":
            pairs = _render_each(
                conversations, lambda c: self.renderer.render_with_generation_spans(c.messages, c.tools)
            )
            rendered, spans = [text for text, _ in pairs], [marked for _, marked in pairs]
        else:
            rendered = _render_each(conversations, lambda c: self.renderer.render(c.messages, c.tools, False))
        results = []
        for i, enc in enumerate(self.encode_batch(rendered)):
            ids = np.asarray(enc.ids, dtype=np.int64)[: self.max_len]
            if self.mode == "generation_tags":
                mask = _generation_mask(enc, spans[i])[: ids.shape[0]]
            else:
                mask = np.ones(ids.shape[0], dtype=np.uint8)
            status = RowStatus.KEPT if mask.any() else RowStatus.NO_TRAINABLE
            results.append(TokenizedRow(ids=ids, mask=mask, status=status))
        return results

    def _char_spans(
        self, conv: Conversation, text: str, pending: list[_Pending], row: int
    ) -> list[tuple[int, int]] | None:
        """Character spans of the assistant turns, or ``None`` when the row needs token counts."""
        indices = assistant_indices(conv.messages)
        headers: list[str | PastedPrefix | None] = []
        throughs: list[str | PastedPrefix] = []
        spans: list[tuple[int, int]] = []
        stable = True
        pasted = self.prefixes.paste_lazy(conv, text, indices)
        for n, idx in enumerate(indices):
            try:
                if pasted is not None:
                    header, through = pasted[n]
                else:
                    header = None if idx == 0 else self.renderer.render(conv.messages[:idx], conv.tools, True)
                    through = self.renderer.render(conv.messages[: idx + 1], conv.tools, False)
            except Exception as exc:
                if stable:
                    roles = [m.get("role") for m in conv.messages[: idx + 1]]
                    raise _SpanFailure(
                        f"template failed on the prefix {roles} of message {idx}: {exc}"
                    ) from exc
                raise _SpanFailure(f"template failed on a prefix of message {idx}: {exc}") from exc
            headers.append(header)
            throughs.append(through)
            h = header or ""
            if stable and len(h) <= len(through) and _starts(text, h) and _starts(text, through):
                spans.append((len(h), len(through)))
            else:
                stable = False
        if stable:
            return spans
        pending.append(_Pending(row=row, indices=indices, headers=headers, throughs=throughs))
        return None

    def _token_count_spans(
        self,
        conversations: Sequence[Conversation],
        rendered: list[str],
        results: list[TokenizedRow],
        pending: list[_Pending],
    ) -> None:
        bases: list[int] = []
        texts: list[str] = []
        for p in pending:
            for header, through in zip(p.headers, p.throughs, strict=True):
                for pasted_or_text in (header, through):
                    if pasted_or_text is None:
                        continue
                    # made one at a time: all the prefixes of a long chat together are quadratic
                    prefix = str(pasted_or_text)
                    base, tail = 0, prefix
                    if self.boundaries is not None and p.boundary_index is not None:
                        base, tail = self.boundaries.cut(
                            prefix, rendered[p.row], p.boundary_starts, p.boundary_ends, p.boundary_index
                        )
                    bases.append(base)
                    texts.append(tail)
        counts = iter([b + len(e.ids) for b, e in zip(bases, self.encode_batch(texts), strict=True)])
        for p in pending:
            row = results[p.row]
            n = row.ids.shape[0]
            spans: list[tuple[int, int, int]] = []
            for idx, header in zip(p.indices, p.headers, strict=True):
                start = 0 if header is None else self._cap(next(counts))
                end = self._cap(next(counts))
                spans.append((idx, start, end))
            for _, start, end in spans[-1:] if self.mode == "last_turn" else spans:
                s, e = max(0, start), min(end, n)
                if s < e:
                    row.mask[s:e] = 1
            problem = self._verify(conversations[p.row].messages, row.ids, rendered[p.row], spans)
            if problem is not None:
                row.mask[:] = 0
                row.status, row.detail = RowStatus.SPAN_UNVERIFIED, problem

    def _verify(
        self, messages: Sequence[dict], ids: np.ndarray, rendered: str, spans: list[tuple[int, int, int]]
    ) -> str | None:
        """The reference's check that each token-count span starts at, and covers, its content."""
        n = ids.shape[0]
        # shortest content after each message: a decoded tail shorter than that cannot contain one
        shortest_after = [0] * (len(messages) + 1)
        shortest_after[-1] = 1 << 62
        for k in range(len(messages) - 1, -1, -1):
            c = messages[k].get("content")
            shortest_after[k] = min(shortest_after[k + 1], len(c)) if c else shortest_after[k + 1]
        for idx, start, end in spans:
            content = messages[idx].get("content")
            if not content or content not in rendered:
                continue
            truncated_tail = end >= n
            start, end = max(0, start), min(end, n)
            if start >= end:
                continue
            decoded = self.decode(ids[start:end].tolist())
            stripped = decoded.lstrip()
            if truncated_tail and stripped and content.startswith(stripped):
                continue
            if content not in decoded:
                return f"span of message {idx} does not cover its content"
            if not stripped.startswith(content):
                return f"span of message {idx} starts inside the assistant header"
            tail = decoded[decoded.index(content) + len(content) :]
            if len(tail) < shortest_after[idx + 1]:
                continue
            for later in range(idx + 1, len(messages)):
                later_content = messages[later].get("content")
                if later_content and later_content in tail:
                    return f"span of message {idx} runs into message {later}"
        return None


def _starts(text: str, prefix: str | PastedPrefix) -> bool:
    return prefix.prefix_of(text) if isinstance(prefix, PastedPrefix) else text.startswith(prefix)


def _render_each(conversations: Sequence[Conversation], render: Callable[[Conversation], Any]) -> list:
    """``render`` over a batch; the template's own error is reported with its row of the batch."""
    out = []
    for i, conv in enumerate(conversations):
        try:
            out.append(render(conv))
        except Exception as exc:
            raise RenderError(i, exc) from exc
    return out


def _offsets(enc: Any) -> np.ndarray:
    """(start, end) character offsets of every token of an encoding, as an (n, 2) array."""
    return np.fromiter(chain.from_iterable(enc.offsets), dtype=np.int64, count=2 * len(enc.ids)).reshape(
        -1, 2
    )


def _generation_mask(enc, spans: list[tuple[int, int]]) -> np.ndarray:
    """transformers' ``return_assistant_tokens_mask`` rule (5.x): every token whose offsets overlap a
    ``{% generation %}`` block, zero-width tokens inside a block included (unlike the reference's
    assistant rule, which leaves those out)."""
    offsets = _offsets(enc)
    mask = np.zeros(offsets.shape[0], dtype=bool)
    for start, end in spans:
        mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
    return mask.astype(np.uint8)


def _overlap_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    mask = np.zeros(offsets.shape[0], dtype=bool)
    if not spans or offsets.shape[0] == 0:
        return mask.astype(np.uint8)
    starts, ends = offsets[:, 0], offsets[:, 1]
    nonempty = starts != ends
    for s, e in spans:
        mask |= (starts < e) & (s < ends)
    return (mask & nonempty).astype(np.uint8)
