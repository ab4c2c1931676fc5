"""Render + tokenize + assistant-only label mask for a batch of conversations.

The reference's rule: tokenize the full render once; an assistant turn ``i``
is the character span ``[len(render(m[:i], gen=True)), len(render(m[:i+1])))`` and a token is
trainable when its offsets overlap a span. When a prefix render is not a literal prefix of the full
render (the ``olmo`` template on multi-turn chats), spans come from token counts of the prefixes and
are then checked against the message content; a row that fails the check is dropped, as in the
reference. No I/O here: the caller supplies the renderer and tokenizers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sftmix.sources.formats import Conversation
from sftmix.tokenizing.masking import Masking, apply_policy
from sftmix.tokenizing.prefix_renders import PastedPrefix, PrefixRenders, SkeletonStore, common_prefix_length
from sftmix.tokenizing.restarts import Restarts
from sftmix.tokenizing.row_status import RowStatus, TokenizedRow
from sftmix.tokenizing.segments import Encoded, PrefixEncoder, SegmentBoundaries, span_masks
from sftmix.tokenizing.templates import ChatRenderer

#: Tails of prefix renders up to this many characters have their token counts remembered (at most
#: this many of them): they are the template's own text, repeated in every row.
_MEMO_CHARS, _MEMO_ENTRIES = 256, 65536


class RenderError(Exception):
    """The template failed on a whole conversation (not a prefix): row ``index`` of the batch."""

    def __init__(self, index: int, cause: Exception) -> None:
        self.index = index
        self.cause = cause
        super().__init__(f"chat template failed: {type(cause).__name__}: {cause}")


class _SpanFailure(Exception):
    pass


@dataclass
class _Pending:
    """A row waiting for prefix token counts (the fallback path)."""

    row: int
    indices: list[int]
    headers: list[str | PastedPrefix | None]
    throughs: list[str | PastedPrefix]
    first: tuple[int, int] | None = None  # the first turn's span once counted (capped)

    def first_turn(self) -> list[str | PastedPrefix]:
        """The prefixes of the first assistant turn whose token counts give its span."""
        return [t for t in (self.headers[0], self.throughs[0]) if t is not None]

    def turns_to_count(self) -> list[str | PastedPrefix]:
        """The prefixes of every assistant turn whose span is not counted yet."""
        pairs = zip(self.headers, self.throughs, strict=True)
        if self.first is not None:
            next(pairs)
        return [t for pair in pairs for t in pair if t is not None]


def _empty_row() -> TokenizedRow:
    return TokenizedRow(ids=np.zeros(0, np.int64), mask=np.zeros(0, np.uint8), status=RowStatus.KEPT)


def assistant_indices(messages: Sequence[dict]) -> list[int]:
    return [i for i, m in enumerate(messages) if m.get("role") == "assistant"]


@dataclass(frozen=True)
class MaskerEncoding:
    """The tokenizer as a masker uses it: ``encode_batch`` and ``decode``; ``boundaries``: where added
    tokens split a render; ``restarts``: where the tokenizer restarts inside a run
    (``sftmix.tokenizing.restarts``), for prefix counts that no added token shortens; ``restore``: the
    render's text as the reference's span check compares it with the rows, where the template's special
    tokens were renamed (``sftmix.tokenizing.literal_tokens``)."""

    encode_batch: Callable[[list[str]], list]
    decode: Callable[[list[int]], str]
    boundaries: SegmentBoundaries | None = None
    restarts: Restarts | None = None
    restore: Callable[[str], str] | None = None


class LabelMasker:
    """Tokenizes conversations and marks assistant tokens trainable."""

    def __init__(
        self,
        renderer: ChatRenderer,
        encoding: MaskerEncoding,
        masking: Masking | None = None,
        skeletons: SkeletonStore | None = None,
        drop_early: bool = True,
    ) -> None:
        """``drop_early``: a row that fails the span check at its first assistant turn is dropped having
        tokenized only that far (the same rows and reasons as checking it whole: tests/test_segments.py).
        Worth it for every row where encoding is slow (the tokenizers library). With a fast encoder the
        second round of pieces costs more than the tokens it saves, except in rows that open with an
        assistant turn: its span then starts at the render's first token, before the template's header
        (and system prompt, where the template adds one), and the check fails there in nearly every
        such row (2,163 of 2,206 in ShareGPT's first 6,000 under ``olmo``). Those are checked first
        whatever this says."""
        masking = masking or Masking()
        self.renderer = renderer
        self.restore = encoding.restore
        self.encode_batch = encoding.encode_batch
        self.decode = encoding.decode
        self.boundaries = encoding.boundaries
        self.restarts = encoding.restarts
        self.max_seq_length = masking.max_seq_length
        self.mask = masking.mask
        self.spans = masking.spans
        self.policy = masking.policy
        # rows that will be dropped need no tokens; with exact spans any row may be kept
        self.skip_untrainable = masking.skips_untrainable()
        self.drop_early = drop_early
        self.prefixes = PrefixRenders(renderer.render, store=skeletons)
        self.encoder = PrefixEncoder(encoding.encode_batch, encoding.boundaries)
        self._tail_counts: dict[str, int] = {}

    def _cap(self, n: int) -> int:
        return n if self.max_seq_length is None else min(n, self.max_seq_length)

    @property
    def _reach(self) -> int | None:
        """Tokens a kept row is encoded to: one past ``max_seq_length``, so that a render of exactly that
        many tokens is told from a longer one (which loses its tail: ``TokenizedRow.truncated``)."""
        return None if self.max_seq_length is None else self.max_seq_length + 1

    def _cut(self, enc: Encoded) -> bool:
        return self.max_seq_length is not None and enc.length > self.max_seq_length

    def tokenize(self, conversations: Sequence[Conversation]) -> list[TokenizedRow]:
        if self.mask in ("all", "generation_tags"):
            return self._tokenize_whole(conversations)
        rendered = _render_each(conversations, lambda c: self.renderer.render(c.messages, c.tools, False))
        encs = self.encoder.start(rendered)
        results = [_empty_row() for _ in rendered]
        char_spans: list[list[tuple[int, int]] | None] = [None] * len(rendered)
        pending: list[_Pending] = []
        for i, (conv, text) in enumerate(zip(conversations, rendered, strict=True)):
            try:
                found = self._char_spans(conv, text, i)
            except _SpanFailure as exc:
                results[i].status, results[i].detail = RowStatus.SPAN_UNVERIFIED, str(exc)
                continue
            if isinstance(found, _Pending):
                pending.append(found)
            else:
                char_spans[i] = found
        if pending and self.skip_untrainable and self.boundaries is not None:
            early = pending if self.drop_early else [p for p in pending if p.headers[0] is None]
            if early:
                self._drop_early(conversations, rendered, encs, results, early)
                pending = [p for p in pending if results[p.row].status == RowStatus.KEPT]
        todo = [
            i for i, row in enumerate(results) if row.status == RowStatus.KEPT or not self.skip_untrainable
        ]
        self.encoder.grow([encs[i] for i in todo], [self._reach] * len(todo))
        spanned = []
        for i in todo:
            row = results[i]
            row.ids = encs[i].ids[: self.max_seq_length]
            row.truncated = self._cut(encs[i])
            if char_spans[i] is not None and row.status == RowStatus.KEPT:
                spanned.append(i)
            else:
                row.mask = np.zeros(row.ids.shape[0], dtype=np.uint8)
        chosen = [spans for i in spanned if (spans := char_spans[i]) is not None]
        masks = span_masks(  # the overlap rule
            [encs[i] for i in spanned],
            [results[i].ids.shape[0] for i in spanned],
            [spans[-1:] for spans in chosen] if self.mask == "last_turn" else chosen,
        )
        for i, mask in zip(spanned, masks, strict=True):
            results[i].mask = mask
        if pending:
            self._token_count_spans(conversations, rendered, encs, results, pending)
        if self.spans == "exact":
            self._exact_spans(conversations, rendered, encs, results)
        if self.policy:
            apply_policy(self.policy, self.renderer, conversations, rendered, encs, results)
        for row in results:
            if row.status == RowStatus.KEPT and not row.mask.any():
                row.status, row.detail = (
                    RowStatus.NO_TRAINABLE,
                    "no assistant token survives (none, or truncated)",
                )
        return results

    def _drop_early(
        self,
        conversations: Sequence[Conversation],
        rendered: list[str],
        encs: list[Encoded],
        results: list[TokenizedRow],
        pending: list[_Pending],
    ) -> None:
        """Rows whose first assistant span fails the reference's check are dropped having tokenized
        only through that span: the check of the whole row would fail there first, with the same words."""
        assert self.boundaries is not None
        reach = [
            common_prefix_length(str(p.throughs[0]), rendered[p.row]) + self.boundaries.longest
            for p in pending
        ]
        self.encoder.grow([encs[p.row] for p in pending], [1] * len(pending), reach)
        firsts = [p.first_turn() for p in pending]
        counts = iter(self._prefix_token_counts(rendered, encs, pending, firsts))
        for p in pending:
            start = 0 if p.headers[0] is None else self._cap(next(counts))
            end = self._cap(next(counts))
            p.first = start, end
            enc = encs[p.row]
            if not (
                enc.complete
                or enc.length > end
                or (self.max_seq_length is not None and enc.length >= self.max_seq_length)
            ):
                continue  # the span's tokens are not all known yet
            problem = self._verify(
                conversations[p.row].messages, enc, rendered[p.row], [(p.indices[0], start, end)]
            )
            if problem is not None:
                results[p.row].status, results[p.row].detail = RowStatus.SPAN_UNVERIFIED, problem

    def _prefix_token_counts(
        self,
        rendered: list[str],
        encs: list[Encoded],
        pending: list[_Pending],
        prefixes: list[list[str | PastedPrefix]],
    ) -> list[int]:
        """Token counts of each pending row's ``prefixes``, in order: the full render's tokens up to the
        last boundary the prefix shares with it, plus its own tail (not tokenized when those alone
        already reach ``max_seq_length``: the count is capped there)."""
        bases: list[int] = []
        tails: list[str | None] = []
        for p, texts in zip(pending, prefixes, strict=True):
            known = None
            if self.boundaries is not None:
                known = tuple(a.tolist() for a in encs[p.row].boundary_tokens(self.boundaries))
            for prefix in texts:
                base, tail = self._shared(prefix, rendered[p.row], encs[p.row], known)
                full = self.max_seq_length is not None and base >= self.max_seq_length
                bases.append(base)
                tails.append(None if full else tail)
        return [
            b + (0 if t is None else n) for b, t, n in zip(bases, tails, self._counts(tails), strict=True)
        ]

    def _shared(
        self, prefix: str | PastedPrefix, full: str, enc: Encoded, known: tuple | None
    ) -> tuple[int, str]:
        """(tokens of ``full`` the prefix shares, its own tail to count): at the last added token or
        restart inside a run that it shares, whichever leaves the shorter tail; else the whole prefix,
        made one at a time (all the prefixes of a long chat together are quadratic)."""
        found = None
        if known is not None and self.boundaries is not None:
            found = self.boundaries.cut(prefix, full, *known)
        if self.restarts is not None and (found is None or len(found[1]) > _MEMO_CHARS):
            inside = self.restarts.last_shared(prefix, full, enc)
            if inside is not None and (found is None or len(inside[1]) < len(found[1])):
                found = inside
        return found if found is not None else (0, str(prefix))

    def _counts(self, texts: list[str | None]) -> list[int]:
        """Token counts of ``texts`` (0 for None). A prefix's own tail after its cut is mostly the
        template's literal text (an end-of-turn marker, the next header), the same in every row: short
        ones are counted once per process."""
        counts = [0] * len(texts)
        todo: dict[str, list[int]] = {}
        for k, text in enumerate(texts):
            if text is None:
                continue
            known = self._tail_counts.get(text)
            if known is not None:
                counts[k] = known
            else:
                todo.setdefault(text, []).append(k)
        if todo:
            for text, encoding in zip(todo, self.encode_batch(list(todo)), strict=True):
                n = len(encoding.ids)
                for k in todo[text]:
                    counts[k] = n
                if len(text) <= _MEMO_CHARS:
                    if len(self._tail_counts) >= _MEMO_ENTRIES:
                        self._tail_counts.clear()
                    self._tail_counts[text] = n
        return counts

    def _exact_spans(
        self,
        conversations: Sequence[Conversation],
        rendered: list[str],
        encodings: list[Encoded],
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
            row.mask = enc.span_mask(row.ids.shape[0], spans[-1:] if self.mask == "last_turn" else spans)
            row.status, row.detail = RowStatus.KEPT, None
            row.reference_drops = dropped and bool(row.mask.any())

    def _tokenize_whole(self, conversations: Sequence[Conversation]) -> list[TokenizedRow]:
        """Modes with no prefix renders: 'all' (every token) and 'generation_tags' (tokens overlapping
        the template's ``{% generation %}`` blocks, found in the one full render)."""
        spans: list[list[tuple[int, int]]] = []
        if self.mask == "generation_tags":
            pairs = _render_each(
                conversations, lambda c: self.renderer.render_with_generation_spans(c.messages, c.tools)
            )
            rendered, spans = [text for text, _ in pairs], [marked for _, marked in pairs]
        else:
            rendered = _render_each(conversations, lambda c: self.renderer.render(c.messages, c.tools, False))
        results = []
        encs = self.encoder.start(rendered)
        self.encoder.grow(encs, [self._reach] * len(encs))
        for i, enc in enumerate(encs):
            ids = enc.ids[: self.max_seq_length]
            if self.mask == "generation_tags":
                mask = _generation_mask(enc.offsets(ids.shape[0]), spans[i])
            else:
                mask = np.ones(ids.shape[0], dtype=np.uint8)
            results.append(TokenizedRow(ids=ids, mask=mask, status=RowStatus.KEPT, truncated=self._cut(enc)))
        if self.policy:
            apply_policy(self.policy, self.renderer, conversations, rendered, encs, results)
        for row in results:
            if not row.mask.any():
                row.status = RowStatus.NO_TRAINABLE
        return results

    def _char_spans(self, conv: Conversation, text: str, row: int) -> list[tuple[int, int]] | _Pending:
        """Character spans of the assistant turns, or what the row needs for token counts instead."""
        indices = assistant_indices(conv.messages)
        pasted = self.prefixes.paste_lazy(conv, text, indices)
        if pasted is not None:
            return _pasted_spans(text, row, indices, pasted)
        headers: list[str | PastedPrefix | None] = []
        throughs: list[str | PastedPrefix] = []
        spans: list[tuple[int, int]] = []
        stable = True
        for idx in indices:
            try:
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
            if stable and (span := _prefix_span(text, header, through)) is not None:
                spans.append(span)
            else:
                stable = False
        if stable:
            return spans
        return _Pending(row=row, indices=indices, headers=headers, throughs=throughs)

    def _token_count_spans(
        self,
        conversations: Sequence[Conversation],
        rendered: list[str],
        encs: list[Encoded],
        results: list[TokenizedRow],
        pending: list[_Pending],
    ) -> None:
        counts = iter(
            self._prefix_token_counts(rendered, encs, pending, [p.turns_to_count() for p in pending])
        )
        for p in pending:
            row = results[p.row]
            n = row.ids.shape[0]
            spans: list[tuple[int, int, int]] = []
            for k, (idx, header) in enumerate(zip(p.indices, p.headers, strict=True)):
                if k == 0 and p.first is not None:
                    spans.append((idx, *p.first))
                    continue
                start = 0 if header is None else self._cap(next(counts))
                end = self._cap(next(counts))
                spans.append((idx, start, end))
            for _, start, end in spans[-1:] if self.mask == "last_turn" else spans:
                s, e = max(0, start), min(end, n)
                if s < e:
                    row.mask[s:e] = 1
            problem = self._verify(conversations[p.row].messages, encs[p.row], rendered[p.row], spans)
            if problem is not None:
                row.mask[:] = 0
                row.status, row.detail = RowStatus.SPAN_UNVERIFIED, problem

    def _verify(
        self,
        messages: Sequence[dict],
        enc: Encoded,
        rendered: str,
        spans: list[tuple[int, int, int]],
    ) -> str | None:
        """The reference's check that each token-count span starts at, and covers, its content (in the
        row's tokens, ``enc`` truncated to ``max_seq_length``)."""
        ids = enc.ids[: self.max_seq_length]
        n = ids.shape[0]
        shortest_after: list[int] | None = None
        for idx, start, end in spans:
            content = messages[idx].get("content")
            if not content:
                continue
            truncated_tail = end >= n
            start, end = max(0, start), min(end, n)
            if start >= end:
                continue
            decoded = enc.decoded(start, end)
            if decoded is None:
                decoded = self.decode(ids[start:end].tolist())
            if self.restore is not None:
                decoded = self.restore(decoded)
            stripped = decoded.lstrip()
            if truncated_tail and stripped and content.startswith(stripped):
                continue
            problem = None
            at = decoded.find(content)
            if at < 0:
                problem = f"span of message {idx} does not cover its content"
            elif not stripped.startswith(content):
                problem = f"span of message {idx} starts inside the assistant header"
            else:
                tail = decoded[at + len(content) :]
                if shortest_after is None:
                    shortest_after = _shortest_after(messages)
                if len(tail) >= shortest_after[idx + 1]:
                    for later in range(idx + 1, len(messages)):
                        later_content = messages[later].get("content")
                        if later_content and later_content in tail:
                            problem = f"span of message {idx} runs into message {later}"
                            break
            # the reference checks only a turn whose content is in the render (asked only now: a search
            # of the whole render per turn, and a turn that passes passes either way)
            if problem is not None and content in (
                rendered if self.restore is None else self.restore(rendered)
            ):
                return problem
        return None


def _pasted_spans(
    text: str, row: int, indices: list[int], pasted: list[tuple[PastedPrefix | None, PastedPrefix]]
) -> list[tuple[int, int]] | _Pending:
    """``LabelMasker._char_spans`` of a row whose prefixes are pasted (no template runs, so none fails)."""
    spans: list[tuple[int, int]] = []
    for header, through in pasted:
        span = _prefix_span(text, header, through)
        if span is None:
            headers: list[str | PastedPrefix | None] = [h for h, _ in pasted]
            throughs: list[str | PastedPrefix] = [t for _, t in pasted]
            return _Pending(row=row, indices=indices, headers=headers, throughs=throughs)
        spans.append(span)
    return spans


def _prefix_span(
    text: str, header: str | PastedPrefix | None, through: str | PastedPrefix
) -> tuple[int, int] | None:
    """A turn's characters in the full render ``text``: from its header's end (its prefix render with
    the generation prompt; none for a first message) to its own prefix render's end, where both are
    prefixes of ``text`` in that order; ``None`` where not (the row is then masked by token counts)."""
    start = 0 if header is None else len(header)
    if start <= len(through) and (header is None or _starts(text, header)) and _starts(text, through):
        return start, len(through)
    return None


def _shortest_after(messages: Sequence[dict]) -> list[int]:
    """The shortest content after each message: a decoded tail shorter than that cannot contain one."""
    shortest = [0] * (len(messages) + 1)
    shortest[-1] = 1 << 62
    for k in range(len(messages) - 1, -1, -1):
        c = messages[k].get("content")
        shortest[k] = min(shortest[k + 1], len(c)) if c else shortest[k + 1]
    return shortest


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


def _generation_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """transformers' ``return_assistant_tokens_mask`` rule (5.x): every token whose offsets overlap a
    ``{% generation %}`` block, zero-width tokens inside a block included (unlike the reference's
    assistant rule, which leaves those out)."""
    mask = np.zeros(offsets.shape[0], dtype=bool)
    for start, end in spans:
        mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
    return mask.astype(np.uint8)
