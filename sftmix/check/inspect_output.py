"""Look at written shards the way a person checks them: one document decoded, trainable text marked.

Reads only the output (parts, ``.csv.gz`` boundaries, ``tokenizer/``) plus, to find a dataset's row,
the run's document map that ``run_report.json`` points to.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sftmix.errors import ConfigError
from sftmix.output.digest import RUN_REPORT
from sftmix.output.olmo_format import BOUNDS_PART, MASK_PART, TOKENS_PART, read_boundaries
from sftmix.runtime.storage import open_npy


@dataclass
class Document:
    index: int
    part: int
    start: int
    tokens: np.ndarray
    mask: np.ndarray
    dataset: str | None = None
    row: int | None = None


def _report(out: Path) -> dict:
    try:
        return json.loads((out / RUN_REPORT).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _dtype(out: Path) -> np.dtype:
    name = _report(out).get("token_dtype")
    if name:
        return np.dtype(name)
    stats = json.loads((out / "dataset_statistics.json").read_text(encoding="utf-8"))
    return np.dtype(stats.get("token_dtype") or "uint32")


def _bounds(out: Path, part: int) -> np.ndarray:
    return read_boundaries(out / BOUNDS_PART.format(part))


def load_document(output: str | Path, index: int) -> Document:
    """Document ``index`` (0-based, in output order) with its tokens and mask."""
    out = Path(output)
    if not (out / TOKENS_PART.format(0)).exists():
        raise ConfigError(f"{out} holds no {TOKENS_PART.format(0)}: not a tokenize-mixer output")
    dtype, first, part = _dtype(out), 0, 0
    while (out / BOUNDS_PART.format(part)).exists():
        bounds = _bounds(out, part)
        if index < first + bounds.shape[0]:
            s, e = (int(x) for x in bounds[index - first])
            tokens = np.memmap(out / TOKENS_PART.format(part), dtype=dtype, mode="r")[s:e]
            mask = np.memmap(out / MASK_PART.format(part), dtype=np.bool_, mode="r")[s:e]
            doc = Document(index, part, s, np.asarray(tokens), np.asarray(mask))
            _name_source(out, doc)
            return doc
        first += bounds.shape[0]
        part += 1
    raise ConfigError(f"{out} has {first} documents; there is no document {index}")


def _document_map(out: Path) -> tuple[np.ndarray, list[str]] | None:
    report = _report(out)
    try:
        return open_npy(report["documents_file"]), list(report["datasets"])
    except (OSError, KeyError, ValueError, TypeError):
        return None


def _name_source(out: Path, doc: Document) -> None:
    mapped = _document_map(out)
    if mapped is not None and doc.index < mapped[0].shape[0]:
        rec = mapped[0][doc.index]
        doc.dataset, doc.row = mapped[1][int(rec["dataset"])], int(rec["row"])


def find_document(output: str | Path, dataset: str | None, row: int | None) -> int:
    """The index of the first document of ``dataset`` (its name, file name, or index in the mixer, as the
    lineage columns give it) and source ``row``, when given."""
    out = Path(output)
    mapped = _document_map(out)
    if mapped is None:
        raise ConfigError(
            f"the document map of {out} is gone (its run's work directory was cleaned): use --doc N"
        )
    documents, names = mapped
    wanted = np.ones(documents.shape[0], dtype=bool)
    if dataset is not None:
        matches = [i for i, n in enumerate(names) if n == dataset or Path(n).name == dataset]
        if not matches and dataset.isdigit() and int(dataset) < len(names):
            matches = [int(dataset)]  # the dataset's index in the mixer, as the lineage columns give it
        if not matches:
            listed = ", ".join(f"{i}: {n}" for i, n in enumerate(names))
            raise ConfigError(f"no dataset {dataset!r} in {out} (datasets by index: {listed})")
        wanted &= np.isin(documents["dataset"], matches)
    if row is not None:
        wanted &= documents["row"] == row
    hits = np.flatnonzero(wanted)
    if hits.size == 0:
        what = f"row {row}" + (f" of {dataset!r}" if dataset else "")
        raise ConfigError(
            f"{what} is not in {out} (not selected by the mixer, or dropped: see run_report.json)"
        )
    return int(hits[0])


#: Where a token is trained when two outputs' masks of one document are compared.
NEITHER, BOTH, ONLY_HERE, ONLY_THERE = 0, 1, 2, 3
#: Plain-text markers per state (git's word-diff style for the differences).
PLAIN_MARKERS = {NEITHER: ("", ""), BOTH: ("⟦", "⟧"), ONLY_HERE: ("{+", "+}"), ONLY_THERE: ("[-", "-]")}


def against(doc: Document, other_output: str | Path) -> Document:
    """The same source row's document in another output (a masking policy's effect is seen by making
    the same mixer twice): its tokens must be the same, only the masks may differ."""
    if doc.dataset is None or doc.row is None:
        raise ConfigError("the document's source row is unknown (no document map): cannot find it elsewhere")
    other = load_document(other_output, find_document(other_output, doc.dataset, doc.row))
    if not np.array_equal(other.tokens, doc.tokens):
        raise ConfigError(
            f"row {doc.row} of {doc.dataset!r} has other tokens in {other_output} (another tokenizer, "
            "template or max length): masks can be compared only between outputs of the same text"
        )
    return other


def mask_diff_segments(doc: Document, other: Document, decode) -> list[tuple[str, int]]:
    """The document's text in runs of (text, state): trained in neither, both, only here, only there."""
    here, there = doc.mask.astype(bool), other.mask.astype(bool)
    state = np.where(here & there, BOTH, np.where(here, ONLY_HERE, np.where(there, ONLY_THERE, NEITHER)))
    out: list[tuple[str, int]] = []
    if state.shape[0] == 0:
        return out
    change = np.flatnonzero(np.diff(state)) + 1
    for lo, hi in zip([0, *change.tolist()], [*change.tolist(), state.shape[0]], strict=True):
        out.append((decode(doc.tokens[lo:hi].tolist()), int(state[lo])))
    return out


def segments(doc: Document, decode) -> list[tuple[str, bool]]:
    """The document's text in runs of (text, trainable)."""
    out: list[tuple[str, bool]] = []
    if doc.tokens.shape[0] == 0:
        return out
    change = np.flatnonzero(np.diff(doc.mask.astype(np.int8))) + 1
    for lo, hi in zip([0, *change.tolist()], [*change.tolist(), doc.tokens.shape[0]], strict=True):
        out.append((decode(doc.tokens[lo:hi].tolist()), bool(doc.mask[lo])))
    return out
