"""What the proof of a fast encoder holds (:class:`FastAnalysis`), and why a tokenizer is not proven.

The proof itself is :func:`sftmix.tokenizing.encoder_proof.analyse`; its result is cached with the
tokenizer's facts and rebuilt in every worker, so it is a small value of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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


#: :attr:`FastAnalysis.restarts` of a regex-split byte-level BPE: before an ASCII letter after a line break.
LINE_RESTARTS = "line"
#: :attr:`FastAnalysis.restarts` of SentencePiece-style BPE: before a marker after a character that is not one.
WORD_RESTARTS = "word"
