"""Two OLMo-core outputs compared as a trainer reads them: their documents, tokens and masks across parts.

Digests compare files, so two outputs that hold the same documents but end their parts elsewhere (a
whole-documents layout against the reference's, another ``part_bytes``) differ in every part. Here each
output is read as one stream of tokens, one of masks and one of document starts (each part's ``.csv.gz``
moved by the tokens before it), so layout is told from content; where the content differs, the first
differing token is found in that stream and its document named in each output (dataset and row, from the
run's document map or the ``.csv.gz`` lineage columns). Everything is read in bounded chunks.

A document the reference's layout cuts at a part's end is two lines of boundaries; so a start that lies
at one output's part boundary and not in the other is taken for such a cut.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from sftmix.output.olmo_format import BOUNDS_PART, MASK_PART, RUN_REPORT, STATS_JSON, TOKENS_PART
from sftmix.runtime.storage import open_npy

CHUNK = 1 << 20


@dataclass(frozen=True)
class Layout:
    """An output's parts: how many, and the global token where each begins (its token dtype's width)."""

    directory: Path
    firsts: list[int]
    itemsize: int

    @classmethod
    def of(cls, directory: Path) -> Layout | None:
        """``None`` for what is not an OLMo-core output whose parts pair up (every part's token ids, mask and
        boundaries there)."""
        firsts, total, itemsize = [], 0, None
        for k in range(len(list(directory.glob(TOKENS_PART.replace("{:04d}", "*"))))):
            if not all(
                (directory / name.format(k)).is_file() for name in (TOKENS_PART, MASK_PART, BOUNDS_PART)
            ):
                return None
            tokens = (directory / TOKENS_PART.format(k)).stat().st_size
            n = (directory / MASK_PART.format(k)).stat().st_size
            if n == 0 or tokens % n or (itemsize is not None and tokens // n != itemsize):
                return None
            itemsize = tokens // n
            firsts.append(total)
            total += n
        return None if not firsts or itemsize is None else cls(directory, [*firsts, total], itemsize)

    @property
    def parts(self) -> int:
        return len(self.firsts) - 1

    def files(self, pattern: str) -> list[Path]:
        return [self.directory / pattern.format(k) for k in range(self.parts)]

    def starts(self) -> Iterator[tuple[int, int, tuple[int, int] | None]]:
        """Each line of the boundaries in output order: its global start, its part, its lineage (dataset
        index and row) where the output has those columns."""
        for k in range(self.parts):
            with gzip.open(self.directory / BOUNDS_PART.format(k), "rt") as fh:
                for line in fh:
                    fields = line.split(",")
                    lineage = (int(fields[2]), int(fields[3])) if len(fields) >= 4 else None
                    yield self.firsts[k] + int(fields[0]), k, lineage


class _Chain:
    """Files read as one stream."""

    def __init__(self, paths: list[Path]) -> None:
        self._paths = iter(paths)
        self._fh: BinaryIO | None = None

    def read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            if self._fh is None:
                path = next(self._paths, None)
                if path is None:
                    break
                self._fh = open(path, "rb")  # noqa: SIM115 (closed when read to its end)
            data = self._fh.read(n - len(out))
            if not data:
                self._fh.close()
                self._fh = None
            out += data
        return out

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def first_difference(a: list[Path], b: list[Path]) -> int | None:
    """The first byte at which the concatenations of ``a`` and ``b`` differ (one ending first: its length)."""
    ca, cb = _Chain(a), _Chain(b)
    offset = 0
    try:
        while True:
            ba, bb = ca.read(CHUNK), cb.read(CHUNK)
            if ba != bb:
                n = min(len(ba), len(bb))
                diff = np.flatnonzero(np.frombuffer(ba[:n], np.uint8) != np.frombuffer(bb[:n], np.uint8))
                return offset + (int(diff[0]) if diff.size else n)
            if not ba:
                return None
            offset += len(ba)
    finally:
        ca.close()
        cb.close()


def _same_documents(a: Layout, b: Layout) -> bool:
    """Whether the two outputs' document starts agree, but for a start at one output's part boundary
    (the reference's layout cuts a document there)."""
    cuts_a, cuts_b = set(a.firsts[1:-1]), set(b.firsts[1:-1])
    sa, sb = a.starts(), b.starts()
    x, y = next(sa, None), next(sb, None)
    while x is not None or y is not None:
        if x is not None and y is not None and x[0] == y[0]:
            x, y = next(sa, None), next(sb, None)
        elif y is None or (x is not None and x[0] < y[0]):
            if x is None or x[0] not in cuts_a:
                return False
            x = next(sa, None)
        else:
            if y[0] not in cuts_b:
                return False
            y = next(sb, None)
    return True


def differing_streams(a: Layout, b: Layout) -> list[str]:
    """Which of tokens, masks and documents differ, read across parts (in that order)."""
    same_width = a.itemsize == b.itemsize
    found = [
        (
            "tokens",
            not same_width or first_difference(a.files(TOKENS_PART), b.files(TOKENS_PART)) is not None,
        ),
        ("masks", first_difference(a.files(MASK_PART), b.files(MASK_PART)) is not None),
        ("documents", not _same_documents(a, b)),
    ]
    return [name for name, differs in found if differs]


def parts_text(a: Layout, b: Layout) -> str:
    def parts(n: int) -> str:
        return f"{n} part" + ("" if n == 1 else "s")

    return f"{parts(a.parts)} vs {parts(b.parts)}"


def first_differing_token(a: Layout, b: Layout) -> int | None:
    """The first global token whose id or mask differs (the token streams compared as they are, with
    one width)."""
    if a.itemsize != b.itemsize:
        return 0
    found = [
        first_difference(a.files(TOKENS_PART), b.files(TOKENS_PART)),
        first_difference(a.files(MASK_PART), b.files(MASK_PART)),
    ]
    tokens = [found[0] // a.itemsize if found[0] is not None else None, found[1]]
    known = [t for t in tokens if t is not None]
    return min(known) if known else None


@dataclass(frozen=True)
class Source:
    """Where a document of an output came from, as far as the output says."""

    document: int | None  # its number in the output (from the run's document map)
    dataset: str | None
    row: int | None
    place: str  # in words

    def same_row(self, other: Source) -> bool | None:
        if None in (self.dataset, self.row, other.dataset, other.row):
            return None
        return (self.dataset, self.row) == (other.dataset, other.row)


def document_at(layout: Layout, token: int) -> Source:
    """The document holding global ``token``: from the run's document map where it is still there, else the
    boundaries (with their lineage columns, when written)."""
    mapped = document_map_source(layout.directory, token)
    if mapped is not None:
        return mapped
    names = _lineage_names(layout.directory)
    last = None
    for line, (start, part, lineage) in enumerate(layout.starts()):
        if start > token:
            break
        last = (line, start, part, lineage)
    if last is None:
        return Source(None, None, None, f"token {token} (no document)")
    line, start, part, lineage = last
    if lineage is None:
        return Source(None, None, None, f"the document from token {start} (line {line} of the boundaries)")
    name = names[lineage[0]] if lineage[0] < len(names) else str(lineage[0])
    return Source(
        None, name, lineage[1], f"the document from token {start}: dataset {name!r}, row {lineage[1]}"
    )


def document_map_source(directory: Path, token: int) -> Source | None:
    """The document holding global ``token``, by the run's document map (``None`` where it is gone)."""
    try:
        report = json.loads((directory / RUN_REPORT).read_text(encoding="utf-8"))
        documents = open_npy(report["documents_file"])
        doc = int(np.searchsorted(documents["start"], token, side="right")) - 1
        record = documents[doc]
        name, row = report["datasets"][int(record["dataset"])], int(record["row"])
    except (OSError, KeyError, ValueError, IndexError, TypeError):
        return None
    return Source(doc, name, row, f"document {doc}: dataset {name!r}, row {row}")


def _lineage_names(directory: Path) -> list[str]:
    try:
        stats = json.loads((directory / STATS_JSON).read_text(encoding="utf-8"))
        return [str(d["name"]) for d in stats["lineage"]["datasets"]]
    except (OSError, KeyError, ValueError, TypeError):
        return []


def documents_line(a: Layout, b: Layout) -> str | None:
    """Where two outputs' contents first differ: the document there in each, and whether they are the same
    source row (``None`` where the token streams are the same)."""
    token = first_differing_token(a, b)
    if token is None:
        return None
    here, there = document_at(a, token), document_at(b, token)
    same = here.same_row(there)
    verdict = {True: "the same source row", False: "other source rows", None: "source rows unknown"}[same]
    return f"first differing token {token:,}: in the first output {here.place}; in the second {there.place} ({verdict})"
