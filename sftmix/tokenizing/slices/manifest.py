"""What a finished slice holds on disk: its files, their record types, and its manifest (written last,
with the files' digests: a slice counts as done only when its manifest exists and every digest matches)."""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, Field

from sftmix.runtime.sections import FlatSections

#: Bump when the bytes a slice holds for the same inputs change; part of every content key.
SLICE_FORMAT_VERSION = "3"  # 3: a dropped row records length 0 (its tokens are not all made)

ROW_DTYPE = np.dtype(
    [("row", "<i8"), ("offset", "<i8"), ("length", "<i8"), ("trainable", "<i8"), ("status", "<i1")]
)

ARTIFACTS = ("tokens.npy", "mask.npy", "rows.npy")

#: The kept rows longer than ``max_seq_length`` (their index among the slice's row records, and whether
#: their last kept token is trainable): what ``over_length_strategy`` changes at assembly, so a changed
#: strategy tokenizes nothing again. Beside ``ARTIFACTS`` (whose bytes ``SLICE_FORMAT_VERSION`` pins).
OVER_LENGTH = "over_length.npy"

OVER_LENGTH_DTYPE = np.dtype([("index", "<i8"), ("trainable_end", "?")])

MANIFEST = "manifest.json"

#: A running slice's rows done so far (``{"rows": n, "of": total}``), for the run's progress
#: (``flows.progress``): rewritten at most every ``PROGRESS_SECONDS`` while it is tokenized, gone before its
#: manifest is written. A view only: never fsynced, and never a reason to fail the slice.
PROGRESS = "progress.json"

PROGRESS_SECONDS = 1.0

#: The work directory's folder of template skeletons (``sftmix.tokenizing.prefix_renders.SkeletonStore``).
SKELETONS = "skeletons"

#: A slice at least this large whose every row has an all-zero mask points at a broken template.
ALL_ZERO_SLICE_ROWS = 32


class FileDigest(BaseModel):
    bytes: int
    sha256: str


class RowFindings(BaseModel):
    """What the slice's rows held besides their counts: rows kept otherwise than the reference would,
    rows over length, unrendered fields, and examples of the drops."""

    kept_by_exact_spans: int = Field(
        0, description="Rows kept with spans: exact that the reference's span rule would have dropped."
    )
    untrainable_kept: dict[str, int] = Field(
        default_factory=dict, description="Rows kept with an all-zero mask (drop_untrainable off), by reason."
    )
    spelled_special_tokens: int = Field(
        0,
        description="Rows kept whose text spells a special token, read as text (split: sftmix.tokenizing.literal_tokens).",
    )
    over_length: int | None = Field(
        None,
        description=f"Kept rows longer than max_seq_length, listed in {OVER_LENGTH} (None: made by a version "
        "that did not record them; over_length_strategy terminate or drop makes such a slice again).",
    )
    unrendered_rows: dict[str, int] | None = Field(
        None,
        description="Rows holding each of the slice spec's unrendered items (None: made by a version that did "
        "not count them).",
    )
    drop_examples: list[dict] = Field(default_factory=list)


class SliceTiming(BaseModel):
    """How long the slice took, and when (for the run's steady-state throughput and its progress)."""

    seconds: float
    started_at: float = Field(
        0.0, description="Wall-clock start (epoch seconds), for steady-state throughput."
    )
    finished_at: float = 0.0


class SliceEncoding(BaseModel):
    """What made the slice's ids."""

    encoder: str = Field(
        "hf",
        description="What made the ids: 'hf' (the tokenizers library) or 'fast' (proven the same; fast_engine).",
    )
    library_texts: int = Field(
        0, description="With the fast encoder: texts it handed to the tokenizers library (an unproven token)."
    )
    fast_engine: str = Field(
        "",
        description="With the fast encoder: what computed its ids ('fastokens' or 'tiktoken': the same ids).",
    )


class SliceManifest(FlatSections):
    """The persisted result of a slice task: small, and enough to trust (or distrust) the files. Kept in
    sections (``findings``, ``timing``, ``encoding``) written flat, in place: ``manifest.json`` keeps the
    keys and order of earlier versions, so their checkpoints are read and reused."""

    SECTIONS = ("findings", "timing", "encoding")

    key: str
    dataset: str
    row_start: int
    row_end: int
    rows: int
    kept: int
    tokens: int
    trainable_tokens: int
    dropped: dict[str, int]
    findings: RowFindings = Field(default_factory=RowFindings)
    token_dtype: str
    files: dict[str, FileDigest]
    timing: SliceTiming
    format_version: str = SLICE_FORMAT_VERSION
    encoding: SliceEncoding = Field(default_factory=SliceEncoding)
