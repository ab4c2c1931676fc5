"""The proof for SentencePiece-style BPE (spaces as a marker, byte fallback, no regex), which fastokens
alone encodes: the Metaspace step's schemes, its marker and byte pieces, and the decoder whose output is
the text's own characters.
"""

from __future__ import annotations

import json
from typing import Any

from sftmix.tokenizing.bpe_vocabulary import bpe_merges
from sftmix.tokenizing.engines import fastokens_installed
from sftmix.tokenizing.fast_analysis import WORD_RESTARTS, FastAnalysis, Unproven
from sftmix.tokenizing.pipeline_steps import node_kind, plain_added_tokens, post_processor_trims

#: SentencePiece's word marker: a space is this character, and a text's first word starts with one.
METASPACE = "\u2581"
#: Where SentencePiece-style pipelines put a marker the text lacks: Metaspace's schemes ``first`` (before
#: the text, unless it starts with an added token or a space), ``always`` (the same before every run between
#: added tokens) and ``never``; ``prepend``, a Prepend normalizer (the legacy form: before every run, even
#: one that starts with a space).
METASPACE_SCHEMES = ("first", "always", "never")


def metaspace_scheme(normalizer: Any, pre: Any) -> str | None:
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
    if node_kind(pre) != "Metaspace":
        if _mentions_metaspace(pre):
            raise Unproven("it uses a Metaspace step in a pipeline of other steps")
        if METASPACE in json.dumps(normalizer, ensure_ascii=False):
            raise Unproven("its normalizer writes SentencePiece's marker in steps other than the known forms")
        return None
    if normalizer is not None:
        raise Unproven(f"it has a normalizer ({node_kind(normalizer)}) before its Metaspace pre-tokenizer")
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


def analyse_sentencepiece(data: dict[str, Any], scheme: str) -> FastAnalysis:
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
    if post_processor_trims(data.get("post_processor")):
        raise Unproven("its post-processor trims offsets")
    added = plain_added_tokens(data.get("added_tokens") or [], prefixes=True)
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
    merged = {a + b for a, b in bpe_merges(data["model"].get("merges") or [])}
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


def _marker_inside(piece: str) -> bool:
    """Whether a vocabulary piece holds the marker after a character that is not one (Gemma 3's ``>▁</``):
    a merge could then join a word to the marker before the next."""
    stripped = piece.lstrip(METASPACE)
    return METASPACE in stripped


def _falls_back(byte: int, vocab: dict[str, Any]) -> bool:
    """Whether the byte's fallback token is there, or never needed: the model takes a character from the
    vocabulary before its bytes, and an ASCII byte is only ever its own character (Gemini's vocabulary has
    a tab but no ``<0x09>``)."""
    return BYTE_PIECES[byte] in vocab or (byte < 0x80 and chr(byte) in vocab)
