"""A byte-level BPE vocabulary as bytes: GPT-2's byte alphabet, tiktoken's ranks, the merges, and the
vocabulary packed as JSON that loads in milliseconds. The proof and the fast encoder both read it.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from sftmix.tokenizing.fast_analysis import Unproven


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (the GPT-2 table), character -> byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def bpe_ranks(vocab: dict[str, int], added: dict[str, int]) -> dict[bytes, int]:
    alphabet = byte_alphabet()
    ranks: dict[bytes, int] = {}
    for text, i in vocab.items():
        if added.get(text) == i:
            continue
        try:
            ranks[bytes(alphabet[c] for c in text)] = i
        except KeyError:
            raise Unproven(f"vocabulary entry {text!r} is not byte-level") from None
    if len(ranks) != len(vocab) - sum(1 for t, i in added.items() if vocab.get(t) == i):
        raise Unproven("two vocabulary entries are the same bytes")
    if any(bytes([b]) not in ranks for b in range(256)):
        raise Unproven("its vocabulary lacks some of the 256 bytes")
    if set(ranks.values()) & set(added.values()):
        raise Unproven("an added token shares its id with a vocabulary entry of other text")
    return ranks


def bpe_merges(raw: list[Any]) -> list[tuple[str, str]]:
    out = []
    for m in raw:
        pair = tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
        if len(pair) != 2:
            raise Unproven(f"merge {m!r} is not a pair")
        out.append((str(pair[0]), str(pair[1])))
    return out


def vocabulary(tokenizer_json: str) -> tuple[dict[bytes, int], dict[str, int]]:
    """The BPE vocabulary as tiktoken's ranks (token bytes -> id) and the added tokens (text -> id)."""
    data = json.loads(tokenizer_json)
    added = {t["content"]: int(t["id"]) for t in data.get("added_tokens") or []}
    return bpe_ranks(data["model"]["vocab"], added), added


def pack_vocabulary(ranks: dict[bytes, int], added: dict[str, int]) -> dict[str, Any]:
    """:func:`vocabulary` as JSON that loads in milliseconds (one string of every token's bytes)."""
    items = sorted(ranks.items(), key=lambda kv: kv[1])
    return {
        "bytes": b"".join(t for t, _ in items).decode("latin-1"),
        "lengths": [len(t) for t, _ in items],
        "ids": [i for _, i in items],
        "added": added,
    }


def unpack_vocabulary(packed: dict[str, Any]) -> tuple[dict[bytes, int], dict[str, int]]:
    blob = packed["bytes"].encode("latin-1")
    ranks, at = {}, 0
    for length, i in zip(packed["lengths"], packed["ids"], strict=True):
        ranks[blob[at : at + length]] = i
        at += length
    return ranks, {str(k): int(v) for k, v in packed["added"].items()}
