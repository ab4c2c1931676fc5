"""Two encoders for one tokenizer: the tokenizers library (the oracle) and a fast one, used only where proven.

:class:`FastEncoder` encodes with a fast engine (``sftmix.tokenizing.engines``) a tokenizer that
``sftmix.tokenizing.encoder_proof.analyse`` proved the library's, and re-encodes with the library any text
whose output it cannot vouch for; :class:`FastEncoding` is what it returns.

Offsets come from token byte lengths (a cumulative sum) mapped to characters; a token that ends inside a
multi-byte character reaches that character's end, as the tokenizers library reports it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cached_property
from typing import Any, cast

import numpy as np

from sftmix.tokenizing.bpe_vocabulary import vocabulary
from sftmix.tokenizing.engines import BYTE_LEVEL_PATTERN, fast_engine
from sftmix.tokenizing.fast_analysis import FastAnalysis, Unproven
from sftmix.tokenizing.pipeline_steps import in_form
from sftmix.tokenizing.sentencepiece_proof import BYTE_PIECES, METASPACE


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
