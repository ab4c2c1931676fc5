"""What OLMo-core's datasets will make of an output at a training sequence length, before training.

A simulation of OLMo-core 3.0's two SFT dataset kinds, part file by part file as they read them:

- plain FSL (``NumpyFSLDataset``): each part's tokens cut into instances of ``L``; the tokens after the
  last whole instance of each part are never trained on, and documents are cut across instances;
- packed FSL (``NumpyPackedFSLDataset``, one source file per group): documents longer than ``L`` are
  truncated to ``L`` (the rest dropped) or fragmented into pieces of at most ``L``, then packed into
  instances of ``L`` by best-fit decreasing; what an instance does not fill is padding.
  Its documents come either from the ``.csv.gz`` boundaries (``use_array_if_local=False``, what our
  docs/olmo-core.md tells users to set) or, OLMo-core's default for local files, from scanning for EOS: a document
  ends after each EOS and the tokens after a part's last EOS are never read.

The test reads the same outputs with OLMo-core itself and compares every count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

STRATEGIES = ("truncate", "fragment")


class _Rooms:
    """Open instances counted by the room they have left, with the least room of at least some length
    found in short scans (one block of capacities, the blocks, one block) instead of one scan over every
    capacity: at a 32k sequence length that is most of the packing's time."""

    BLOCK = 128

    def __init__(self, capacity: int) -> None:
        self.count = np.zeros(capacity, dtype=np.int64)  # count[c]: instances with c tokens free
        self.used = np.zeros(capacity // self.BLOCK + 1, dtype=np.int64)  # capacities with some, per block

    def add(self, room: int, n: int) -> None:
        if n and room:  # a full instance has no room to offer
            if not self.count[room]:
                self.used[room // self.BLOCK] += 1
            self.count[room] += n

    def take(self, room: int, n: int) -> None:
        self.count[room] -= n
        if not self.count[room]:
            self.used[room // self.BLOCK] -= 1

    def least_at_least(self, length: int) -> int | None:
        block = length // self.BLOCK
        hit = np.flatnonzero(self.count[length : (block + 1) * self.BLOCK])
        if hit.size:
            return length + int(hit[0])
        later = np.flatnonzero(self.used[block + 1 :])
        if not later.size:
            return None
        start = (block + 1 + int(later[0])) * self.BLOCK
        return start + int(np.flatnonzero(self.count[start : start + self.BLOCK])[0])


def best_fit_decreasing_bins(lengths: np.ndarray, capacity: int) -> int:
    """Instances OLMo-core's ``InstancePacker`` opens for documents of ``lengths`` (each at most
    ``capacity``): documents longest first, each into the open instance with the least room that holds
    it, else a new one.

    The count depends only on the lengths, so documents of one length are placed together: an
    instance with room ``c`` takes ``c // length`` of them in a row (once it has taken one, its room
    left is the least that still fits), so the work grows with the number of distinct lengths, not
    with the number of documents."""
    if lengths.size == 0:
        return 0
    if int(lengths.max()) > capacity or int(lengths.min()) < 0:
        raise ValueError("document lengths must lie in [0, capacity]")
    rooms = _Rooms(capacity)
    opened = 0
    values, counts = np.unique(lengths, return_counts=True)
    for length, k in zip(values[::-1].tolist(), counts[::-1].tolist(), strict=True):
        if length == 0:
            continue  # OLMo-core's packer cannot place one (check reports the boundaries as untiled)
        while k:
            c = rooms.least_at_least(length) if length < capacity else None
            if c is None:  # new instances, each filled with `per` documents while there are some
                per = capacity // length
                full, rest = divmod(k, per)
                opened += full + (1 if rest else 0)
                rooms.add(capacity - per * length, full)
                if rest:
                    rooms.add(capacity - rest * length, 1)
                break
            per = c // length
            full = min(int(rooms.count[c]), k // per)
            if full:
                rooms.take(c, full)
                rooms.add(c - per * length, full)
                k -= full * per
            if k and rooms.count[c]:  # fewer than `per` left: one more instance takes them all
                rooms.take(c, 1)
                rooms.add(c - k * length, 1)
                k = 0
    return opened


def capped_lengths(lengths: np.ndarray, sequence_length: int, strategy: str) -> tuple[np.ndarray, int]:
    """Document lengths as packing sees them, and the tokens truncation drops."""
    if strategy not in STRATEGIES:
        raise ValueError(f"long_doc_strategy must be one of {', '.join(STRATEGIES)}, not {strategy!r}")
    lengths = np.asarray(lengths, dtype=np.int64)
    long = lengths > sequence_length
    if not long.any():
        return lengths, 0
    if strategy == "truncate":
        return np.minimum(lengths, sequence_length), int((lengths[long] - sequence_length).sum())
    whole, rest = np.divmod(lengths[long], sequence_length)
    pieces = [lengths[~long], np.full(int(whole.sum()), sequence_length, np.int64), rest[rest > 0]]
    return np.concatenate(pieces), 0


@dataclass
class PackedFit:
    instances: int = 0
    documents: int = 0  # as packed: after fragmenting, from the boundaries used
    tokens_packed: int = 0
    tokens_truncated: int = 0  # cut from documents longer than the sequence length
    tokens_unread: int = 0  # after a part's last EOS (boundaries found by EOS only)

    def add_part(self, lengths: np.ndarray, sequence_length: int, strategy: str, unread: int = 0) -> None:
        capped, truncated = capped_lengths(lengths, sequence_length, strategy)
        self.instances += best_fit_decreasing_bins(capped, sequence_length)
        self.documents += int(capped.size)
        self.tokens_packed += int(capped.sum())
        self.tokens_truncated += truncated
        self.tokens_unread += unread

    def merge(self, other: PackedFit) -> None:
        for name in ("instances", "documents", "tokens_packed", "tokens_truncated", "tokens_unread"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def padding_percent(self, sequence_length: int) -> float:
        slots = self.instances * sequence_length
        return round(100 * (slots - self.tokens_packed) / slots, 2) if slots else 0.0


@dataclass
class OlmoCoreFit:
    """Per sequence length and long-document strategy: instance counts and token shares for the
    plain and the packed FSL dataset (packed twice: boundaries from ``.csv.gz`` and from EOS)."""

    sequence_length: int
    long_doc_strategy: str
    tokens: int = 0
    fsl_instances: int = 0
    fsl_tokens_dropped: int = 0  # after each part's last whole instance
    fsl_documents_cut: int = 0  # documents that run across an instance boundary
    packed: PackedFit = field(default_factory=PackedFit)  # documents from the .csv.gz boundaries
    packed_by_eos: PackedFit = field(default_factory=PackedFit)  # OLMo-core's default for local files

    def add_part(
        self, starts: np.ndarray, ends: np.ndarray, tokens: int, eos_positions: np.ndarray | None
    ) -> None:
        """One part: its documents' ``[start, end)`` and, when the tokenizer has an EOS, where it occurs."""
        L = self.sequence_length
        self.tokens += tokens
        self.fsl_instances += tokens // L
        self.fsl_tokens_dropped += tokens % L
        inside = ends <= (tokens // L) * L
        self.fsl_documents_cut += int(((starts // L) != ((ends - 1) // L))[inside & (ends > starts)].sum())
        self.packed.add_part(ends - starts, L, self.long_doc_strategy)
        if eos_positions is not None:
            cuts = np.asarray(eos_positions, dtype=np.int64) + 1
            lengths = np.diff(cuts, prepend=0)
            unread = tokens - (int(cuts[-1]) if cuts.size else 0)
            self.packed_by_eos.add_part(lengths, L, self.long_doc_strategy, unread)

    def merge(self, other: OlmoCoreFit) -> None:
        """Add another part's figures (parts are read and packed one by one)."""
        for name in ("tokens", "fsl_instances", "fsl_tokens_dropped", "fsl_documents_cut"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.packed.merge(other.packed)
        self.packed_by_eos.merge(other.packed_by_eos)

    @property
    def packable(self) -> bool:
        """OLMo-core's packer is built on a segment tree over a power-of-two sequence length."""
        L = self.sequence_length
        return L > 0 and L & (L - 1) == 0

    def render(self) -> list[str]:
        L = self.sequence_length
        share = (lambda n: f"{100 * n / self.tokens:.2f}%") if self.tokens else (lambda n: "0%")
        p, e = self.packed, self.packed_by_eos
        lines = [
            f"OLMo-core at sequence length {L:,} (long documents: {self.long_doc_strategy}):",
            f"  plain FSL: {self.fsl_instances:,} instances; {share(self.fsl_tokens_dropped)} of tokens after "
            f"each part's last whole instance, never trained on; {self.fsl_documents_cut:,} documents cut "
            "across instances",
        ]
        if not self.packable:
            return [
                *lines,
                f"  packed FSL: not available ({L} is not a power of two, which its packer needs)",
            ]
        return [
            *lines,
            f"  packed FSL, boundaries from .csv.gz (use_array_if_local=False): {p.instances:,} instances, "
            f"{p.padding_percent(L):.2f}% padding, {share(p.tokens_truncated)} of tokens truncated",
            f"  packed FSL, boundaries by EOS (OLMo-core's default for local files): {e.instances:,} "
            f"instances, {e.padding_percent(L):.2f}% padding, {share(e.tokens_truncated)} truncated, "
            f"{share(e.tokens_unread)} after the last EOS, never read",
        ]
