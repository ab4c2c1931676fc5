"""The steps of a ``tokenizer.json`` pipeline that every proof reads alike: the normalizer (none, NFC or
NFKC), the post-processor's offset trimming, and the added tokens matched as plain text. A step the proof
does not read raises :class:`~sftmix.tokenizing.fast_analysis.Unproven`.
"""

from __future__ import annotations

from typing import Any, Literal, cast
from unicodedata import category, is_normalized

from sftmix.tokenizing.fast_analysis import Unproven

#: Normalizers that change nothing in a text already in their form (:func:`normal_form`).
NORMAL_FORMS = ("NFC", "NFKC")
NormalForm = Literal["NFC", "NFKC"]


def normal_form(normalizer: Any) -> str | None:
    """The form of a normalizer that is NFC (Qwen2's and Qwen3's) or NFKC (Anthropic's), alone or in a
    sequence of them (NFKC where any is: a text in NFKC is in NFC too); none, or an empty sequence
    (DeepSeek-V3's, which changes nothing), is None. On a text already in that form it changes nothing,
    characters or alignments, so the pipeline is the one without it (added tokens matched on normalized
    text included); any other normalizer is refused, named."""
    if normalizer_does_nothing(normalizer):
        return None
    steps = normalizer.get("normalizers") if node_kind(normalizer) == "Sequence" else [normalizer]
    kinds = {node_kind(step) for step in steps or [normalizer]}
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
    return node_kind(normalizer) == "Sequence" and all(
        normalizer_does_nothing(step) for step in normalizer.get("normalizers") or []
    )


def node_kind(node: Any) -> str:
    return str(node.get("type")) if isinstance(node, dict) else type(node).__name__


def post_processor_trims(node: Any) -> list[bool]:
    """The ByteLevel offset trims the post-processor makes with special tokens off (each one's
    ``add_prefix_space``); anything else it does there must change neither ids nor offsets."""
    if node is None:
        return []
    kind = node.get("type")
    if kind == "Sequence":
        trims = [t for step in node.get("processors", []) for t in post_processor_trims(step)]
        if len(trims) > 1:
            raise Unproven("its post-processor trims offsets twice")
        return trims
    if kind == "ByteLevel":
        return [bool(node.get("add_prefix_space", True))] if node.get("trim_offsets", True) else []
    if kind == "TemplateProcessing":  # adds its tokens only with special tokens on
        return []
    raise Unproven(f"its post-processor is {kind!r}")


def plain_added_tokens(
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
