"""Each part of an output read once, in order, in bounded chunks (hashed as it is read), on a pool of
every core: what every part shows, added up in the part's order and then across parts."""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sftmix.check.olmo_fit import OlmoCoreFit
from sftmix.errors import ConfigError
from sftmix.output.digest import artifact_digest, digested_files
from sftmix.output.olmo_format import BOUNDS_PART, MASK_PART, TOKENS_PART, parse_boundaries
from sftmix.output.part_writing import WrittenParts
from sftmix.runtime.parallel import available_cpus
from sftmix.runtime.storage import pread_into

#: Examples kept per finding.
EXAMPLES = 5


#: Tokens read at once per part: bounded memory whatever the part size (about 15 MiB of arrays per chunk
#: in flight, a few per thread).
CHUNK = 1 << 20


@dataclass(frozen=True)
class PartReading:
    """What every part's read shares: the output, its token ids' facts, the lengths a document is measured
    against, and whether the files are hashed as read or still being written."""

    out: Path
    dtype: np.dtype
    vocab: int | None  # ids at or beyond it are not the tokenizer's (None: unknown)
    eos: int | None
    special: dict[int, str]  # the special tokens but EOS, by id
    sequence_length: int | None = None  # OLMo-core's, where its datasets are simulated
    long_doc_strategy: str = "truncate"
    max_seq_length: int | None = None  # the conversion's: a document this long was cut by the user's setting
    hashed: bool = False
    written: WrittenParts | None = None  # the parts are being written: each chunk is read once it is
    chunks: ThreadPoolExecutor | None = None  # the pool that checks chunks (None: the part's own thread)


def read_parts(reading: PartReading) -> tuple[list[PartFacts], dict[str, str] | None]:
    """Each part's facts, and with ``reading.hashed`` every file's digest. Each part is read once, in
    order, by one thread (its files hashed as they are read); the chunks' checks run on a pool of every
    core (numpy and hashlib release the GIL)."""
    count = 0
    while (reading.out / TOKENS_PART.format(count)).exists():
        count += 1
    threads = max(1, min(available_cpus(), MAX_PART_THREADS))
    with (
        ThreadPoolExecutor(max_workers=threads, thread_name_prefix="check-chunk") as chunks,
        ThreadPoolExecutor(max_workers=max(1, min(count, threads)), thread_name_prefix="check-part") as pool,
    ):
        on_pool = dataclasses.replace(reading, chunks=chunks if threads > 1 else None)
        facts = list(pool.map(functools.partial(_check_part, on_pool), range(count)))
        digests = _all_digests(reading.out, facts, pool) if reading.hashed else None
    return facts, digests


#: Threads that read parts and check their chunks (each holds a few chunks' arrays at a time).
MAX_PART_THREADS = 64


#: Chunks of one part read ahead of their checks.
READ_AHEAD = 2


def _all_digests(out: Path, facts: list[PartFacts], pool: ThreadPoolExecutor) -> dict[str, str]:
    """The output's digests as ``output_digests`` gives them: the parts' from their one read, the rest
    (statistics, anything else the output holds) hashed now."""
    known = {name: digest for f in facts for name, digest in f.digests.items()}
    files = {p.relative_to(out).as_posix(): p for p in digested_files(out)}
    rest = [name for name in files if name not in known]
    known.update(zip(rest, pool.map(artifact_digest, [files[name] for name in rest]), strict=True))
    return {name: known[name] for name in files}


@dataclass
class Documents:
    """How many documents a finding counts, and the first few (the examples it shows): what a finding
    holds does not grow with the output. Documents come in order; one seen again (cut by a chunk's edge)
    is counted once."""

    count: int = 0
    examples: list[int] = field(default_factory=list)
    last: int = -1

    def add(self, docs: np.ndarray | list[int], base: int = 0) -> None:
        """``docs``: ascending document numbers (from ``base``), none before the last ones added."""
        docs = np.asarray(docs, dtype=np.int64) + base
        docs = docs[docs > self.last]
        if docs.size:
            self.count += int(docs.size)
            self.examples += docs[: EXAMPLES - len(self.examples)].tolist()
            self.last = int(docs[-1])

    def drop_last(self) -> None:
        """The last document added is not one of these after all."""
        if self.examples and self.examples[-1] == self.last:
            self.examples.pop()
        self.count -= 1

    def merge(self, other: Documents, base: int) -> None:
        """A later part's (its documents numbered from ``base`` here)."""
        self.count += other.count
        self.examples += [base + d for d in other.examples[: EXAMPLES - len(self.examples)]]
        self.last = base + other.last if other.count else self.last


@dataclass
class PartFacts:
    """What one part shows; document numbers are the part's own (the caller adds the documents before)."""

    tokens: int = 0
    documents: int = 0
    trainable_tokens: int = 0
    uneven: list[str] = field(default_factory=list)
    untiled: list[str] = field(default_factory=list)
    too_big: list[str] = field(default_factory=list)
    empty: Documents = field(default_factory=Documents)
    long_docs: Documents = field(default_factory=Documents)
    eos_inside: Documents = field(default_factory=Documents)
    no_final_eos: Documents = field(default_factory=Documents)  # last token not EOS (but those below)
    truncated_no_eos: Documents = field(default_factory=Documents)  # the same, cut at max_seq_length
    special_trained: dict[int, Documents] = field(default_factory=dict)  # documents, by token id
    olmo_core: OlmoCoreFit | None = None
    trainable_share: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # per document
    digests: dict[str, str] = field(default_factory=dict)  # of the part's files, from the check's read
    shares: list[np.ndarray] = field(default_factory=list)  # the later parts' trainable_share, absorbed
    open_end: bool = False  # the last document lacks its EOS (and was not truncated): the next part goes on
    cut_by_parts: Documents = field(default_factory=Documents)  # documents a part boundary cut

    def absorb(self, later: PartFacts) -> None:
        """A later part's facts, its documents numbered on from this one's: where this one's last document
        goes on in the later part (the reference's layout cuts it there), its two pieces are one document."""
        cut = int(self.open_end and later.documents > 0)
        if cut:
            self.no_final_eos.drop_last()  # (its piece in this part has no EOS: it goes on)
            self.cut_by_parts.add([self.documents - 1])
        base = self.documents - cut
        self.open_end = later.open_end
        self.shares.append(later.trainable_share[cut:])
        if self.olmo_core is not None and later.olmo_core is not None:
            self.olmo_core.merge(later.olmo_core)
        self.uneven += later.uneven
        self.untiled += later.untiled
        self.too_big += later.too_big
        for name in ("empty", "long_docs", "eos_inside", "no_final_eos", "truncated_no_eos"):
            getattr(self, name).merge(getattr(later, name), base)
        for tok_id, docs in later.special_trained.items():
            self.special_trained.setdefault(tok_id, Documents()).merge(docs, base)
        self.documents += later.documents - cut
        self.tokens += later.tokens
        self.trainable_tokens += later.trainable_tokens


def _check_part(reading: PartReading, part: int) -> PartFacts:
    """One part's files, read once in order in bounded chunks (hashed as read when ``hashed``); the
    chunks are checked on ``chunks`` (here without it) and their facts added up in order."""
    f = PartFacts()
    bounds = _bounds_of(reading, part, f)
    if f.uneven or f.untiled:
        if reading.written is not None:
            reading.written.wait(part)
        if reading.hashed:
            files = (reading.out / TOKENS_PART.format(part), reading.out / MASK_PART.format(part))
            f.digests.update({p.name: artifact_digest(p) for p in files if p.exists()})
        return f
    n, max_seq_length = f.tokens, reading.max_seq_length
    starts, ends = bounds[:, 0], bounds[:, 1]
    lengths = ends - starts
    done_trainable = np.zeros(bounds.shape[0], np.int64)  # trainable tokens up to each doc's end
    special_ids = np.array(sorted(reading.special), np.int64)
    chunk = functools.partial(
        _check_chunk, ends=ends, vocab=reading.vocab, eos=reading.eos, special_ids=special_ids
    )
    carried = 0
    eos_at: list[np.ndarray] = []  # where OLMo-core's default finds document ends

    def add(c: _ChunkFacts) -> None:
        nonlocal carried
        if c.too_big is not None:
            f.too_big.append(f"part {part} offset {c.too_big}")
        done_trainable[c.ending] = c.trainable_at_ends + carried
        carried += c.trainable
        if c.eos_at is not None:
            eos_at.append(c.eos_at)
            f.eos_inside.add(c.eos_inside)
            cut = lengths[c.unended] == max_seq_length if max_seq_length else np.zeros(c.unended.size, bool)
            unended, truncated = c.unended[~cut], c.unended[cut]
            f.no_final_eos.add(unended)
            f.open_end = f.open_end or bool(unended.size and unended[-1] == bounds.shape[0] - 1)
            f.truncated_no_eos.add(truncated)
        for tok_id, docs in c.special_trained.items():  # a document cut by chunks is one document
            f.special_trained.setdefault(tok_id, Documents()).add(docs)

    f.digests.update(_read_in_chunks(reading, part, n, chunk, add))
    trainable = np.diff(done_trainable, prepend=0)
    f.trainable_share = (trainable / np.maximum(lengths, 1)).astype(np.float32)
    f.empty.add(np.flatnonzero(trainable == 0))
    f.trainable_tokens = int(trainable.sum())
    if reading.sequence_length is not None:
        f.long_docs.add(np.flatnonzero(lengths > reading.sequence_length))
        f.olmo_core = OlmoCoreFit(reading.sequence_length, reading.long_doc_strategy)
        f.olmo_core.add_part(starts, ends, n, np.concatenate(eos_at) if reading.eos is not None else None)
    return f


def _bounds_of(reading: PartReading, part: int, f: PartFacts) -> np.ndarray:
    """The part's document boundaries (hashed as read), its tokens and documents counted into ``f``, and
    whether its files are even and its boundaries tile it (``f.uneven``, ``f.untiled``)."""
    tokens_file, mask_file = reading.out / TOKENS_PART.format(part), reading.out / MASK_PART.format(part)
    token_bytes = tokens_file.stat().st_size
    mask_bytes = mask_file.stat().st_size if mask_file.exists() else 0
    bounds_file = reading.out / BOUNDS_PART.format(part)
    bounds = np.zeros((0, 2), np.int64)
    if bounds_file.exists():
        text = gzip.decompress(bounds_file.read_bytes())
        if reading.hashed:
            f.digests[bounds_file.name] = hashlib.sha256(text).hexdigest()
        bounds = parse_boundaries(text)
    dtype = reading.dtype
    n = f.tokens = token_bytes // dtype.itemsize
    f.documents = bounds.shape[0]
    starts, ends = bounds[:, 0], bounds[:, 1]
    if mask_bytes != n or token_bytes % dtype.itemsize:  # its documents cannot be read token by token
        f.uneven.append(f"part {part}: {token_bytes} token bytes ({dtype.name}), {mask_bytes} mask bytes")
    elif (
        bounds.shape[0] == 0
        or starts[0] != 0
        or ends[-1] != n
        or np.any(starts[1:] != ends[:-1])
        or np.any(ends <= starts)
    ):
        f.untiled.append(f"part {part}")
    return bounds


def _read_in_chunks(
    reading: PartReading,
    part: int,
    n: int,
    chunk: Callable[..., _ChunkFacts],
    add: Callable[[_ChunkFacts], None],
) -> dict[str, str]:
    """A part's ``n`` tokens and mask bytes read once, in order, in chunks checked by ``chunk`` (on
    ``chunks``, a few read ahead) and added in order; the two files' digests when ``hashed``."""
    tokens_file, mask_file = reading.out / TOKENS_PART.format(part), reading.out / MASK_PART.format(part)
    dtype, written, chunks, hashed = reading.dtype, reading.written, reading.chunks, reading.hashed
    token_hash, mask_hash = hashlib.sha256(), hashlib.sha256()
    pending: deque[Future[_ChunkFacts]] = deque()
    try:
        for lo in range(0, n, CHUNK):
            hi = min(n, lo + CHUNK)
            if written is not None:
                written.wait(part, min(n, hi + 1))
            t = _read_span(tokens_file, dtype, lo, hi)
            with_next = _read_span(mask_file, np.dtype(np.uint8), lo, min(n, hi + 1))
            if written is not None:
                written.read(part, hi)
            # (``a.data``: ``memoryview(a)``, which numpy's stubs allow from Python 3.12 only)
            if hashed:
                token_hash.update(t.data)
                mask_hash.update(with_next[: hi - lo].data)
            if chunks is None:
                add(chunk(t, with_next, lo))
                continue
            pending.append(chunks.submit(chunk, t, with_next, lo))
            while len(pending) > READ_AHEAD:
                add(pending.popleft().result())
        while pending:
            add(pending.popleft().result())
    finally:
        for waiting in pending:
            waiting.cancel()
    if not hashed:
        return {}
    return {tokens_file.name: token_hash.hexdigest(), mask_file.name: mask_hash.hexdigest()}


@dataclass
class _ChunkFacts:
    """What tokens ``[lo, lo + CHUNK)`` of a part show, to be added up in the part's order."""

    too_big: int | None  # the first offset of an id beyond the vocabulary
    ending: np.ndarray  # the documents that end in the chunk
    trainable_at_ends: np.ndarray  # trainable tokens of the chunk up to each of their ends
    trainable: int  # trainable tokens of the chunk
    eos_at: np.ndarray | None  # offsets of EOS tokens (None without an EOS)
    eos_inside: np.ndarray  # documents with an EOS before their end (ascending)
    unended: np.ndarray  # documents ending here whose last token is not EOS
    special_trained: dict[int, np.ndarray]  # documents that train each special token mid-text (ascending)


def _check_chunk(
    t: np.ndarray,
    with_next: np.ndarray,
    lo: int,
    ends: np.ndarray,
    vocab: int | None,
    eos: int | None,
    special_ids: np.ndarray,
) -> _ChunkFacts:
    """Tokens ``t`` from offset ``lo`` with their mask bytes and the next chunk's first mask byte."""
    hi = lo + t.shape[0]
    with_next = with_next.astype(bool)
    m = with_next[: hi - lo]
    too_big = None
    if vocab is not None and t.size and int(t.max()) >= vocab:
        too_big = lo + int(np.argmax(t >= vocab))
    # documents ending in this chunk (ends are sorted: the boundaries tile the part)
    ending = np.arange(np.searchsorted(ends, lo, side="right"), np.searchsorted(ends, hi, side="right"))
    cuts = ends[ending] - lo  # where each ends in the chunk (ascending: no document is empty)
    last = np.zeros(hi - lo, dtype=bool)  # a document's last token
    last[cuts - 1] = True
    # trainable tokens of the chunk up to each end: a sum per document (a running sum of every token
    # was the check's largest cost)
    at_ends = np.zeros(cuts.shape[0], np.int64)
    if cuts.size:
        np.cumsum(np.add.reduceat(m[: cuts[-1]], np.r_[0, cuts[:-1]], dtype=np.int64), out=at_ends)
    facts = _ChunkFacts(
        too_big=too_big,
        ending=ending,
        trainable_at_ends=at_ends,
        trainable=int(np.count_nonzero(m)),
        eos_at=None,
        eos_inside=np.zeros(0, np.int64),
        unended=np.zeros(0, np.int64),
        special_trained={},
    )
    if eos is not None:
        every_eos = np.flatnonzero(t == eos)
        facts.eos_at = every_eos + lo
        at = every_eos[~last[every_eos]]  # not a document's last token
        facts.eos_inside = np.unique(np.searchsorted(ends, lo + at, side="right"))
        facts.unended = ending[t[ends[ending] - 1 - lo] != eos]
    if special_ids.size:  # trained and followed by trained text: a header or marker, not a turn's end
        at = _positions_of(t, special_ids)
        follows = at + 1 < with_next.shape[0]
        follows[follows] = with_next[at[follows] + 1]
        at = at[m[at] & follows & ~last[at]]
        docs = np.searchsorted(ends, lo + at, side="right")
        for tok_id in np.unique(t[at]).tolist():
            facts.special_trained[int(tok_id)] = np.unique(docs[t[at] == tok_id])
    return facts


def _positions_of(t: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Where ``t`` holds one of ``ids`` (ascending). Special tokens are rare in text and most tokenizers
    number them above the text's, so the candidates at or above the lowest are found first, and the
    table lookup runs on them alone; where they are not rare, on every token."""
    lowest = int(ids[0])
    if lowest > 0:
        above = t >= lowest
        if np.count_nonzero(above) * RARE < t.shape[0]:
            candidates = np.flatnonzero(above)
            return candidates[np.isin(t[candidates], ids, kind="table")]
    return np.flatnonzero(np.isin(t, ids, kind="table"))


#: Candidates fewer than one in this many tokens are looked up one by one (``_positions_of``).
RARE = 8


def _read_span(path: Path, dtype: np.dtype, lo: int, hi: int) -> np.ndarray:
    """Items ``[lo, hi)`` of a raw array file, read into memory: a map read through would keep every
    page it touched resident until closed, so checking a large part would grow with the part."""
    data = np.empty(hi - lo, dtype=dtype)
    view, position = data.data.cast("B"), lo * dtype.itemsize
    fd = os.open(path, os.O_RDONLY)
    try:
        left = pread_into(fd, view, position)
        if left:
            raise ConfigError(
                f"{path} ended at byte {position + len(view) - left} while it was being checked"
            )
    finally:
        os.close(fd)
    return data
