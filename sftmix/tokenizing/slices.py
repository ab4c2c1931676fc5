"""One slice's checkpoint: tokens, label mask and per-row facts, with a manifest written last.

A slice is a range of source rows of one dataset (only the rows the mixer selects). Its directory,
named by the slice's content key, holds ``tokens.npy`` (kept rows back to back), ``mask.npy`` and
``rows.npy`` (one record per tokenized row); ``manifest.json`` lands last with the files' digests, so a
slice counts as done only when its manifest exists and every digest matches.

With a remote work directory (``gs://``) the files are written locally first (the machine's mirror),
then uploaded with the manifest object last; a machine that needs a slice it did not compute fetches
it and checks the digests before trusting it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from pydantic import BaseModel, Field

from sftmix.config.config import local_mirror
from sftmix.errors import (
    BadRowError,
    ChecksumError,
    ConfigError,
    DatasetError,
    MixerError,
    TemplateError,
    row_label,
)
from sftmix.runtime import settings
from sftmix.runtime.ownership import remove_abandoned_temps
from sftmix.runtime.parallel import available_cpus
from sftmix.runtime.storage import (
    atomic_write_bytes,
    atomic_write_with,
    download_file,
    is_remote,
    join_url,
    open_npy,
    read_npy_of,
    read_remote_bytes,
    sha256_file,
    storage_errors,
    temp_name,
    upload_file,
    write_remote_bytes,
)
from sftmix.sources import jsonl, parquet
from sftmix.sources.dataset import read_rows, release_mapped_data, row_line
from sftmix.sources.formats import Conversation, RowFormatError, conversation_from_row
from sftmix.sources.jsonl import JsonlSource
from sftmix.sources.parquet import ParquetSource
from sftmix.tokenizing.encoders import FastEncoder, Unproven
from sftmix.tokenizing.labels import (
    DROP_REASONS,
    UNTRAINABLE,
    LabelMasker,
    MaskPolicy,
    RenderError,
    RowStatus,
    TokenizedRow,
)
from sftmix.tokenizing.literal_tokens import LiteralReport, LiteralRule, Renaming, literal_rule
from sftmix.tokenizing.prefix_renders import SkeletonStore
from sftmix.tokenizing.restarts import Restarts
from sftmix.tokenizing.segments import SegmentBoundaries
from sftmix.tokenizing.templates import ChatRenderer
from sftmix.tokenizing.tokenizer import (
    TokenizerKey,
    check_ids_fit,
    fast_analysis,
    load_hf_tokenizer,
    load_worker_tokenizer,
    rust_tokenizer,
    save_split_worker_tokenizer,
    segment_boundaries,
    special_tokens,
)
from sftmix.tokenizing.tokenizer_load import TokenizerLoad
from sftmix.tokenizing.unrendered import holds

logger = logging.getLogger(__name__)

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


class TokenizeContext(BaseModel):
    """What every slice of a run shares: tokenizer, template, truncation, dtype, where to write."""

    tokenizer: str
    tokenizer_revision: str | None = None
    tokenizer_load: TokenizerLoad = "reference"
    tokenizer_file: str | None = None
    template_text: str
    max_seq_length: int | None
    token_dtype: str
    work_dir: str
    remote_work_dir: str | None = None
    datasets_cache: str
    on_bad_row: str = "error"
    mask: str = "assistant"
    mask_thinking: bool = False
    mask_tool_calls: bool = False
    mask_tool_outputs: bool = False
    spans: str = "reference"
    drop_untrainable: bool = True
    template_source: str = ""
    literal_special_tokens: str = "keep"  # (split: tokenizer_file is the renamed tokenizer)
    batch_size: int = 256
    encoder: str = "hf"  # "fast": the fast encoder, proven the same tokenizer by the plan (sftmix/tokenizing/encoders.py)
    # Not a slice setting (every slice records its over-length rows): whether the run's over_length_strategy
    # reads those records, so that a slice made before they were recorded is made again.
    over_length_recorded: bool = False

    def tokenizer_key(self) -> TokenizerKey:
        """The run's tokenizer, loaded as the plan loaded it."""
        return TokenizerKey.of(self.tokenizer, self.tokenizer_revision, self.tokenizer_load)


def workers_context(settings: dict[str, Any], **found: Any) -> TokenizeContext:
    """What every slice shares: the mixer's slice settings (:func:`sftmix.config.byte_settings.for_slices`,
    each a field here by its name) and what the plan found. Spelled special tokens read as text need the
    workers' tokenizer with the template's own renamed (written once, beside the workers' copy)."""
    ctx = TokenizeContext(**settings, **found)
    if ctx.literal_special_tokens == "split":
        assert ctx.tokenizer_file is not None
        ctx.tokenizer_file = save_split_worker_tokenizer(ctx.tokenizer_file, ctx.template_text)
    return ctx


class SliceSpec(BaseModel):
    """One unit of work: rows ``[row_start, row_end)`` of one dataset (or the listed subset)."""

    unrendered: list[str] = Field(
        default_factory=list,
        description="What the plan found the template leaves out of this dataset's rows (field:NAME, "
        "role:NAME): the slice counts the rows that hold each. Not part of the key (the template and rows are).",
    )

    key: str
    index: int
    dataset_index: int
    dataset: str
    split: str
    revision: str | None = None
    row_format: str = "messages"
    messages_key: str = "messages"
    arrow_files: list[str] | None = Field(
        default=None, description="The dataset's Arrow cache files, when they hold exactly its rows."
    )
    row_start: int
    row_end: int
    rows: list[int] | None = Field(default=None, description="Selected rows; None = every row in the range.")
    jsonl: JsonlSource | None = Field(
        default=None,
        description="A JSON Lines file read by batch (sftmix.sources.jsonl): its batches that hold these rows.",
    )
    parquet: ParquetSource | None = Field(
        default=None,
        description="A Parquet file read by row group (sftmix.sources.parquet): its row groups that hold these rows.",
    )
    est_bytes: int = Field(
        default=0, description="Source bytes it holds, estimated: bigger slices start first."
    )

    def row_list(self) -> list[int]:
        return list(range(self.row_start, self.row_end)) if self.rows is None else list(self.rows)

    def describe(self) -> str:
        return f"{self.dataset} rows {self.row_start}-{self.row_end - 1}"


class FileDigest(BaseModel):
    bytes: int
    sha256: str


class SliceManifest(BaseModel):
    """The persisted result of a slice task: small, and enough to trust (or distrust) the files."""

    key: str
    dataset: str
    row_start: int
    row_end: int
    rows: int
    kept: int
    tokens: int
    trainable_tokens: int
    dropped: dict[str, int]
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
    token_dtype: str
    files: dict[str, FileDigest]
    seconds: float
    started_at: float = Field(
        0.0, description="Wall-clock start (epoch seconds), for steady-state throughput."
    )
    finished_at: float = 0.0
    format_version: str = SLICE_FORMAT_VERSION
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


def slice_dir(work_dir: str | Path, key: str) -> Path:
    return Path(work_dir) / "slices" / key[:2] / key


def remote_slice_url(remote_work_dir: str, key: str) -> str:
    return join_url(remote_work_dir, "slices", key[:2], key)


def read_manifest(work_dir: str | Path, key: str, remote: str | None = None) -> SliceManifest | None:
    """The slice's manifest (the remote one when the work directory is remote), or ``None``."""
    try:
        if remote is not None:
            data = read_remote_bytes(join_url(remote_slice_url(remote, key), MANIFEST))
            return None if data is None else SliceManifest.model_validate_json(data)
        path = slice_dir(work_dir, key) / MANIFEST
        return SliceManifest.model_validate_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _local_problem(work_dir: str | Path, manifest: SliceManifest, hash_files: bool = True) -> str | None:
    root = slice_dir(work_dir, manifest.key)
    on_disk = read_manifest(work_dir, manifest.key)
    if on_disk is None:
        return "manifest missing or unreadable"
    if on_disk.files != manifest.files:
        return "manifest on disk differs from the recorded result"
    for name, digest in manifest.files.items():
        path = root / name
        if not path.is_file():
            return f"{name} missing"
        if path.stat().st_size != digest.bytes:
            return f"{name} has {path.stat().st_size} bytes, expected {digest.bytes}"
        if hash_files and sha256_file(path) != digest.sha256:
            return f"{name} fails its sha256"
    return None


def verify_slice(
    work_dir: str | Path, manifest: SliceManifest, remote: str | None = None, hash_files: bool = True
) -> str | None:
    """``None`` when every file is here with the recorded size and sha256; else what is wrong. With a
    remote work directory a missing or bad local copy is fetched again first."""
    problem = _local_problem(work_dir, manifest, hash_files)
    if problem is None or remote is None:
        return problem
    remote_manifest = read_manifest(work_dir, manifest.key, remote)
    if remote_manifest is None:
        return f"{problem}; remote manifest missing or unreadable"
    if remote_manifest.files != manifest.files:
        return f"{problem}; remote manifest differs from the recorded result"
    root, url = slice_dir(work_dir, manifest.key), remote_slice_url(remote, manifest.key)
    try:
        for name in [*manifest.files, MANIFEST]:
            download_file(join_url(url, name), root / name)
    except Exception as exc:  # a missing or unreadable object: the slice is recomputed
        return f"{problem}; cannot fetch it: {type(exc).__name__}: {exc}"
    problem = _local_problem(work_dir, manifest)
    return None if problem is None else f"remote copy: {problem}"


def verify_slices(
    work_dir: str | Path, checks: list[tuple[SliceManifest, bool]], remote: str | None = None
) -> list[str | None]:
    """:func:`verify_slice` of each ``(manifest, hash_files)``, on every core (reading and hashing
    release the GIL): a rerun that reuses its slices reads each once, and at 22 B tokens (~110 GB of
    slices) one core would take minutes for what the disk reads in well under one."""
    if not checks:
        return []
    pool = ThreadPoolExecutor(max_workers=min(len(checks), available_cpus()), thread_name_prefix="verify")
    try:
        found = [pool.submit(verify_slice, work_dir, m, remote, hash_files) for m, hash_files in checks]
        return [f.result() for f in found]
    finally:
        pool.shutdown(cancel_futures=True)  # (stopped: the slices not yet read are not read)


def push_slice(ctx: TokenizeContext, manifest: SliceManifest) -> None:
    """Upload a finished slice to the remote work directory, manifest object last."""
    if ctx.remote_work_dir is None:
        return
    root, url = slice_dir(ctx.work_dir, manifest.key), remote_slice_url(ctx.remote_work_dir, manifest.key)
    for name in manifest.files:
        upload_file(root / name, join_url(url, name))
    write_remote_bytes(join_url(url, MANIFEST), (root / MANIFEST).read_bytes())


def load_slice_rows(work_dir: str | Path, manifest: SliceManifest) -> np.ndarray:
    """The row records of a finished slice (small: the plan of the output needs only these)."""
    return _read_records(work_dir, manifest, "rows.npy", ROW_DTYPE)


def load_over_length(work_dir: str | Path, manifest: SliceManifest) -> np.ndarray:
    """The slice's kept rows longer than ``max_seq_length`` (:data:`OVER_LENGTH_DTYPE`); none are read
    where the manifest counts none."""
    if not manifest.over_length:
        return np.zeros(0, OVER_LENGTH_DTYPE)
    return _read_records(work_dir, manifest, OVER_LENGTH, OVER_LENGTH_DTYPE)


def _read_records(work_dir: str | Path, manifest: SliceManifest, name: str, dtype: np.dtype) -> np.ndarray:
    try:
        return read_npy_of(slice_dir(work_dir, manifest.key) / name, dtype)
    except (OSError, ValueError, EOFError) as exc:  # (EOFError: numpy's, for an empty file)
        raise ChecksumError(f"slice {manifest.key[:12]} ({manifest.dataset}): unreadable: {exc}") from None


def unrecorded_over_length(ctx: TokenizeContext, manifest: SliceManifest) -> str | None:
    """Why a finished slice cannot serve this run: it was made before its over-length rows were recorded,
    and the run's ``over_length_strategy`` needs them."""
    if ctx.over_length_recorded and manifest.over_length is None:
        return "made before over-length rows were recorded (over_length_strategy needs them)"
    return None


def load_slice_arrays(
    work_dir: str | Path, manifest: SliceManifest
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Memory-mapped tokens, mask and row records of a finished slice."""
    root = slice_dir(work_dir, manifest.key)
    try:
        tokens = open_npy(root / "tokens.npy")
        mask = open_npy(root / "mask.npy")
        rows = open_npy(root / "rows.npy")
    except (OSError, ValueError) as exc:
        raise ChecksumError(f"slice {manifest.key[:12]} ({manifest.dataset}): unreadable: {exc}") from None
    return tokens, mask, rows


class _Writer:
    """Hides the real file from ``np.save``: its ``tofile`` shortcut reports a full disk as a short
    write without an errno; plain ``write`` calls raise ENOSPC like everything else."""

    def __init__(self, fh: BinaryIO) -> None:
        self.write = fh.write


def _save_npy(path: Path, array: np.ndarray) -> FileDigest:
    atomic_write_with(path, lambda fh: np.save(_Writer(fh), array, allow_pickle=False))
    return FileDigest(bytes=path.stat().st_size, sha256=sha256_file(path))


def _masker(ctx: TokenizeContext) -> LabelMasker:
    """One masker per worker process and run settings: its template and pasted-prefix shapes are
    reused by every slice the process tokenizes, and the shapes' skeletons by every process of the
    machine (kept in the work directory, ``SKELETONS``)."""
    return _cached_masker(
        encoding_for(ctx),
        ctx.template_text,
        ctx.max_seq_length,
        ctx.mask,
        ctx.spans,
        ctx.drop_untrainable,
        MaskPolicy(ctx.mask_thinking, ctx.mask_tool_calls, ctx.mask_tool_outputs),
        os.path.join(ctx.work_dir, SKELETONS),
    )


def masked_samples(ctx: TokenizeContext, conversations: list[Conversation]) -> list[TokenizedRow] | None:
    """The run's masker over ``conversations`` (a plan's sampled rows): what the plan estimates from before
    any work; ``None`` where there are none or the masker fails on one."""
    if not conversations:
        return None
    try:
        return _masker(ctx).tokenize(conversations)
    except RenderError:
        return None


def trainable_per_row(ctx: TokenizeContext, conversations: list[Conversation]) -> float | None:
    """The trainable tokens the run's masker gives each of ``conversations`` on average (none for a row it
    drops): what a trainable token budget's plan estimates from; ``None`` where the masker fails on one."""
    rows = masked_samples(ctx, conversations)
    if rows is None:
        return None
    return sum(int(r.mask.sum()) for r in rows if r.status == RowStatus.KEPT) / len(rows)


@dataclass(frozen=True, eq=False)
class WorkerEncoding:
    """The tokenizer as a worker uses it: the library's Rust tokenizer, and the fast encoder where proven."""

    rust: Any
    special_tokens: dict[str, str]
    boundaries: SegmentBoundaries | None
    fast: FastEncoder | None
    renaming: Renaming | None = None  # split's (sftmix.tokenizing.literal_tokens)
    restarts: Restarts | None = None  # where the fast encoder's tokenizer restarts inside a run

    def encode_batch(self, texts: list[str]) -> list:
        if self.fast is not None:
            return self.fast.encode_batch(texts)
        return self.rust.encode_batch(texts, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        if self.fast is not None:
            return self.fast.decode(ids)
        return self.rust.decode(ids, skip_special_tokens=False)  # what hf.decode does for fast tokenizers

    @property
    def fallbacks(self) -> int:
        """Texts the fast encoder handed to the library so far (in this process)."""
        return 0 if self.fast is None else self.fast.fallbacks

    @property
    def engine(self) -> str:
        return "" if self.fast is None else self.fast.engine


def encoding_for(ctx: TokenizeContext, encoder: str | None = None) -> WorkerEncoding:
    """This process's encoding for the run (``encoder`` instead of the run's: the plan's sample check),
    with the fast engine :data:`ENGINE_ENV` names now (part of the cache's key)."""
    return worker_encoding(
        ctx.tokenizer,
        ctx.tokenizer_revision,
        ctx.tokenizer_file,
        encoder or ctx.encoder,
        settings.FAST_ENGINE.raw(),
        ctx.tokenizer_load,
    )


@lru_cache(maxsize=4)  # one per process: the plan's sample check and in-process slices share it
def worker_encoding(
    tokenizer: str,
    revision: str | None,
    tokenizer_file: str | None,
    encoder: str,
    engine: str | None = None,
    load: TokenizerLoad = "reference",
) -> WorkerEncoding:
    if tokenizer_file and os.path.isfile(tokenizer_file):
        loaded = load_worker_tokenizer(tokenizer_file)
        rust, specials, boundaries, found = loaded.rust, loaded.special_tokens, loaded.boundaries, loaded.fast
        vocab, backend_json, renamed = loaded.vocab, loaded.backend_json, loaded.renaming
    else:  # e.g. another machine of a remote work directory: load it as the plan did
        key = TokenizerKey.of(tokenizer, revision, load)
        rust, boundaries, found = rust_tokenizer(key), segment_boundaries(key), fast_analysis(key)
        specials = special_tokens(load_hf_tokenizer(key))
        vocab = backend_json = renamed = None
    fast = None
    if encoder == "fast":
        if isinstance(found, str):  # the plan proved it with the same tokenizer: its files changed since
            raise ConfigError(
                f"tokenizer {tokenizer!r} changed after the plan: the fast encoder is not proven ({found})"
            )
        try:
            fast = FastEncoder(rust, found, vocab, engine, backend_json)
        except Unproven as exc:  # (a worker whose fastokens is not the plan's machine's)
            raise ConfigError(
                f"tokenizer {tokenizer!r}: the fast encoder the plan proved cannot be built here: {exc}"
            ) from exc
    # restarts only where the fast encoder is proven and chosen: the library's path stays the library's
    restarts = None if fast is None else Restarts.of(found, fast.added)
    return WorkerEncoding(rust, specials, boundaries, fast, renamed, restarts)


@lru_cache(maxsize=4)
def _cached_masker(
    encoding: WorkerEncoding,
    template_text: str,
    max_seq_length: int | None,
    mask: str,
    spans: str = "reference",
    skip_untrainable: bool = False,
    policy: MaskPolicy | None = None,
    skeleton_dir: str | None = None,
) -> LabelMasker:
    renaming = encoding.renaming
    if renaming is not None:  # the template's own special tokens under their new names
        template_text = renaming.template(template_text)
    renderer = ChatRenderer(template_text, encoding.special_tokens)
    store = None
    if skeleton_dir is not None:
        store = SkeletonStore(
            skeleton_dir, SkeletonStore.renderer_key_of(template_text, encoding.special_tokens)
        )
    return LabelMasker(
        renderer=renderer,
        encode_batch=encoding.encode_batch,
        decode=encoding.decode,
        max_seq_length=max_seq_length,
        boundaries=encoding.boundaries,
        restarts=encoding.restarts,
        mode=mask,
        spans=spans,
        skip_untrainable=skip_untrainable,
        policy=policy,
        skeletons=store,
        drop_early=encoding.fast is None,
        restore=None if renaming is None else renaming.restore,
    )


def _skipped(reason: str) -> TokenizedRow:
    return TokenizedRow(np.zeros(0, np.int64), np.zeros(0, np.uint8), RowStatus.BAD_ROW, reason)


def bad_row_error(spec: SliceSpec, row: int, reason: str) -> BadRowError:
    """The error for a malformed row, with its line when the dataset is a local JSON Lines file, or its
    file and line in a dataset of several (found by reading the file: only on this error path)."""
    if spec.jsonl is not None and (place := jsonl.row_place(spec.jsonl, row)) is not None:
        return BadRowError(spec.dataset, row, reason, place[1], place[0])
    return BadRowError(spec.dataset, row, reason, row_line(spec.dataset, spec.split, row))


@lru_cache(maxsize=4)
def _literal_rule_of(encoding: WorkerEncoding, mode: str) -> LiteralRule | None:
    added = lambda: [t.content for t in encoding.rust.get_added_tokens_decoder().values() if t.special]  # noqa: E731
    return literal_rule(mode, encoding.renaming, added)


def _literal_rule(ctx: TokenizeContext) -> LiteralRule | None:
    if ctx.literal_special_tokens == "keep":
        return None
    return _literal_rule_of(encoding_for(ctx), ctx.literal_special_tokens)


def literal_report(ctx: TokenizeContext, manifests: Sequence[SliceManifest]) -> LiteralReport:
    """What the run did with special tokens its rows spell (the run report's, the check's)."""
    spelled = sum(m.spelled_special_tokens for m in manifests)
    return LiteralReport(mode=ctx.literal_special_tokens, spelled_rows=spelled)


def _tokenize_batch(
    masker: LabelMasker,
    spec: SliceSpec,
    rows: list[int],
    records: Sequence[dict | jsonl.BadLine],
    skip_bad: bool,
    literal: LiteralRule | None = None,
    holding: Counter[str] | None = None,
) -> list[TokenizedRow]:
    """Tokenize a batch; a malformed row (format or template error) raises, or with ``skip_bad``
    becomes a counted ``bad_row`` with its reason while the rest of the batch goes on. ``literal``: what
    ``literal_special_tokens`` asks of each row; ``holding`` counts the rows holding each of the spec's
    unrendered items."""
    results: list[TokenizedRow | None] = [None] * len(rows)
    convs: dict[int, Conversation] = {}
    spelled: set[int] = set()  # rows whose text spells a special token (split reads it as text)
    for j, (row, record) in enumerate(zip(rows, records, strict=True)):
        if isinstance(record, jsonl.BadLine):  # a line of the file that is not a row
            if not skip_bad:
                assert spec.jsonl is not None
                raise record.error(jsonl.lines_of(spec.dataset, spec.jsonl.path))
            results[j] = _skipped(record.detail)
            continue
        try:
            convs[j] = conv = conversation_from_row(record, spec.row_format, spec.messages_key)  # type: ignore[arg-type]
            if holding is not None:
                holding.update(p for p in spec.unrendered if holds(conv.messages, p))
            if literal is not None and (found := literal.read((conv.messages, conv.tools))) is not None:
                if literal.drops:
                    results[j] = TokenizedRow(
                        np.zeros(0, np.int64), np.zeros(0, np.uint8), RowStatus.LITERAL_SPECIAL, found
                    )
                    del convs[j]
                else:
                    spelled.add(j)
        except RowFormatError as exc:
            convs.pop(j, None)
            if not skip_bad:
                raise bad_row_error(spec, row, str(exc)) from None
            results[j] = _skipped(str(exc))
    while convs:
        order = list(convs)
        try:
            for j, res in zip(order, masker.tokenize([convs[j] for j in order]), strict=True):
                res.spelled = j in spelled
                results[j] = res
            break
        except RenderError as exc:
            j = order[exc.index]
            if not skip_bad:
                raise bad_row_error(spec, rows[j], str(exc)) from None
            results[j] = _skipped(str(exc))
            del convs[j]
    return [r for r in results if r is not None]


def remote_tokenizer_url(remote_work_dir: str, tokenizer_file: str) -> str:
    return join_url(remote_work_dir, "tokenizers", os.path.basename(tokenizer_file))


def push_worker_tokenizer(ctx: TokenizeContext) -> None:
    """Put the worker tokenizer in the remote work directory (once): a worker on another machine reads
    it there instead of needing the tokenizer's own location."""
    if ctx.remote_work_dir is None or not ctx.tokenizer_file:
        return
    url = remote_tokenizer_url(ctx.remote_work_dir, ctx.tokenizer_file)
    if read_remote_bytes(url) is None:
        upload_file(ctx.tokenizer_file, url)


def context_here(ctx: TokenizeContext) -> TokenizeContext:
    """With a remote work directory, the planning machine's local paths mean nothing on another machine
    (and are never taken from a caller): this process uses its own mirror of the work directory (slices,
    datasets cache) and fetches the worker tokenizer from the work directory."""
    if ctx.remote_work_dir is None:
        return ctx
    mirror = local_mirror(ctx.remote_work_dir)
    if Path(ctx.work_dir) == mirror:
        return ctx
    tokenizer_file = ctx.tokenizer_file
    if tokenizer_file:
        local = mirror / "tokenizers" / os.path.basename(tokenizer_file)
        if not local.is_file():
            url = remote_tokenizer_url(ctx.remote_work_dir, tokenizer_file)
            with storage_errors(f"cannot fetch the worker tokenizer {url}"):
                if read_remote_bytes(url) is not None:
                    download_file(url, local)
        tokenizer_file = str(local)
    return ctx.model_copy(
        update={
            "work_dir": str(mirror),
            "datasets_cache": str(mirror / "datasets-cache"),
            "tokenizer_file": tokenizer_file,
        }
    )


def on_this_machine(ctx: TokenizeContext, spec: SliceSpec) -> tuple[TokenizeContext, SliceSpec]:
    """:func:`context_here`, and a slice that opens its dataset itself instead of reading the planner's
    Arrow files (or its copies of a hub dataset's or a ``gs://`` object's files), when the context is not
    the planner's."""
    here = context_here(ctx)
    if here is ctx:
        return ctx, spec
    update: dict[str, Any] = {"arrow_files": None}
    # Files the planner read that this machine lacks (its copies of a hub dataset's files): datasets
    # opens the dataset here. Files it has, and gs:// objects, are read as planned (checksums agree).
    if spec.parquet is not None and not all(
        is_remote(f.path) or os.path.isfile(f.path) for f in spec.parquet.footers
    ):
        update["parquet"] = None
    elif spec.parquet is not None and spec.parquet.spilled:  # (the planner's spills lie in its work dir)
        update["parquet"] = spec.parquet.model_copy(update={"spilled": []})
    if spec.jsonl is not None and not all(
        is_remote(f) or os.path.isfile(f) for f in jsonl.files_of(spec.jsonl)
    ):
        update["jsonl"] = None
    return here, spec.model_copy(update=update)


def tokenize_slice(spec: SliceSpec, ctx: TokenizeContext, reuse: bool = False) -> SliceManifest:
    """Tokenize one slice and write its checkpoint; returns the manifest (written last).

    ``reuse``: a slice whose manifest is already written, with files that verify, is done; it is
    returned as it is. That is the case when a run was stopped between the manifest and Prefect's
    own result record (the orchestrator's cache is not the only proof a slice finished)."""
    ctx, spec = on_this_machine(ctx, spec)
    if reuse:
        done = read_manifest(ctx.work_dir, spec.key, ctx.remote_work_dir)
        if (
            done is not None
            and unrecorded_over_length(ctx, done) is None
            and verify_slice(ctx.work_dir, done, ctx.remote_work_dir) is None
        ):
            return done
    try:
        return _tokenize_slice(spec, ctx)
    finally:
        release_mapped_data()  # the next slice maps what it reads; resident memory stays per slice
        jsonl.release()
        parquet.release()


def rows_of(spec: SliceSpec, datasets_cache: str, rows: list[int]) -> Sequence[dict | jsonl.BadLine]:
    """Rows of the slice's dataset by index: from its JSON Lines batches, its Parquet row groups, its
    Arrow files, or datasets."""
    if spec.jsonl is not None:
        return jsonl.read_rows(spec.jsonl, rows)
    if spec.parquet is not None:
        return parquet.read_rows(spec.parquet, rows)
    return read_rows(spec.dataset, spec.split, spec.revision, datasets_cache, rows, spec.arrow_files)


def _tokenize_slice(spec: SliceSpec, ctx: TokenizeContext) -> SliceManifest:
    started, started_at = time.perf_counter(), time.time()
    rows = spec.row_list()
    dtype = np.dtype(ctx.token_dtype)
    masker = _masker(ctx)
    fallbacks_before = encoding_for(ctx).fallbacks
    token_chunks: list[np.ndarray] = []
    mask_chunks: list[np.ndarray] = []
    records = np.zeros(len(rows), dtype=ROW_DTYPE)
    records["row"] = rows
    tally = _Tally(holding=Counter({p: 0 for p in spec.unrendered}))
    offset = 0
    noted = time.monotonic()
    for b in range(0, len(rows), ctx.batch_size):
        if b and time.monotonic() - noted >= PROGRESS_SECONDS:
            noted = time.monotonic()
            note_progress(slice_dir(ctx.work_dir, spec.key), b, len(rows))
        batch_rows = rows[b : b + ctx.batch_size]
        try:
            raw = rows_of(spec, ctx.datasets_cache, batch_rows)
        except MixerError:
            raise
        except Exception as exc:  # Arrow/datasets failures while reading, named with the rows
            raise DatasetError(
                spec.dataset, f"cannot read rows {batch_rows[0]}-{batch_rows[-1]} (0-based): {exc}"
            ) from None
        results = _tokenize_batch(
            masker, spec, batch_rows, raw, ctx.on_bad_row == "skip", _literal_rule(ctx), tally.holding
        )
        for j, res in enumerate(results):
            rec = records[b + j]
            kept = res.status == RowStatus.KEPT or (not ctx.drop_untrainable and res.status in UNTRAINABLE)
            rec["length"] = res.ids.shape[0] if kept else 0  # a dropped row's tokens may not all be made
            if not kept:
                reason = DROP_REASONS[res.status]
                tally.dropped[reason] += 1
                if len(tally.examples) < 5:
                    tally.examples.append({"row": batch_rows[j], "reason": reason, "detail": res.detail})
            elif res.status != RowStatus.KEPT:
                tally.untrainable[DROP_REASONS[res.status]] += 1
            tally.rescued += int(kept and res.reference_drops)
            tally.spelled += int(kept and res.spelled)
            rec["status"] = int(RowStatus.KEPT if kept else res.status)
            if kept:
                check_ids_fit(res.ids, dtype, f"dataset {spec.dataset!r}, {row_label(batch_rows[j])}")
                rec["offset"] = offset
                rec["trainable"] = int(res.mask.sum())
                if res.truncated:
                    tally.over_length.append((b + j, bool(res.mask[-1])))
                token_chunks.append(res.ids.astype(dtype))
                mask_chunks.append(res.mask.astype(np.uint8))
                offset += res.ids.shape[0]
            else:
                rec["offset"] = -1
                if res.status == RowStatus.BAD_ROW:
                    logger.warning(
                        "dataset %r, %s skipped: %s", spec.dataset, row_label(batch_rows[j]), res.detail
                    )
                logger.debug(
                    "dataset %s row %d dropped: %s (%s)", spec.dataset, batch_rows[j], reason, res.detail
                )
    _refuse_all_zero(spec, ctx, len(rows), tally)
    if spec.parquet is not None:
        parquet.confirm()  # rows decoded batch by batch came from the version the plan read
    tokens = np.concatenate(token_chunks) if token_chunks else np.zeros(0, dtype=dtype)
    mask = np.concatenate(mask_chunks) if mask_chunks else np.zeros(0, dtype=np.uint8)
    return _checkpoint(spec, ctx, tokens, mask, records, tally, (started, started_at, fallbacks_before))


@dataclass
class _Tally:
    """What a slice's rows came to besides their tokens, for its manifest."""

    holding: Counter[str]  # rows holding each field or role the template does not render
    dropped: Counter[str] = field(default_factory=Counter)
    untrainable: Counter[str] = field(default_factory=Counter)  # kept with an all-zero mask
    rescued: int = 0  # kept by exact spans where the reference's rule drops
    spelled: int = 0  # kept rows whose text spells a special token (split)
    examples: list[dict] = field(default_factory=list)
    over_length: list[tuple[int, bool]] = field(default_factory=list)  # (row record, last token trainable)


def note_progress(root: Path, rows: int, of: int) -> None:
    """Say that ``rows`` of the slice's ``of`` rows are tokenized (:data:`PROGRESS`)."""
    final = root / PROGRESS
    tmp = temp_name(final)
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(json.dumps({"rows": rows, "of": of}).encode("utf-8"))
        os.replace(tmp, final)
    except OSError as exc:
        logger.debug("cannot note the progress of %s: %s", root, exc)
        with contextlib.suppress(OSError):
            tmp.unlink()


def read_progress(root: Path, since: float) -> float | None:
    """The share of a running slice's rows done, as its worker last noted it at or after ``since`` (epoch
    seconds: an earlier run's note says nothing of this one); ``None`` where there is none."""
    path = root / PROGRESS
    try:
        if path.stat().st_mtime < since:
            return None
        noted = json.loads(path.read_bytes())
        return min(1.0, int(noted["rows"]) / max(1, int(noted["of"])))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _refuse_all_zero(spec: SliceSpec, ctx: TokenizeContext, rows: int, tally: _Tally) -> None:
    """A large slice of which no row has a trainable token points at a broken template."""
    no_trainable = DROP_REASONS[RowStatus.NO_TRAINABLE]
    if rows >= ALL_ZERO_SLICE_ROWS and tally.dropped[no_trainable] + tally.untrainable[no_trainable] == rows:
        raise TemplateError(
            f"{spec.describe()}: all {rows} rows have an all-zero label mask with template "
            f"{ctx.template_source or 'in use'} (mask {ctx.mask}): the template's assistant turns are not "
            "found in its output, or these rows have none; check the template and the rows' roles"
        )


def _checkpoint(
    spec: SliceSpec,
    ctx: TokenizeContext,
    tokens: np.ndarray,
    mask: np.ndarray,
    records: np.ndarray,
    tally: _Tally,
    times: tuple[float, float, int],
) -> SliceManifest:
    """The slice's files, then its manifest (written last: the slice is done when it is)."""
    started, started_at, fallbacks_before = times
    root = slice_dir(ctx.work_dir, spec.key)
    where = f"cannot write the checkpoint of {spec.describe()} (work directory {ctx.work_dir})"
    with storage_errors(where):
        with contextlib.suppress(FileNotFoundError):
            (root / PROGRESS).unlink()  # (ours: the slice's progress while it ran)
        remove_abandoned_temps(root)  # a worker killed while writing this slice left them
        files = {
            "tokens.npy": _save_npy(root / "tokens.npy", tokens),
            "mask.npy": _save_npy(root / "mask.npy", mask),
            "rows.npy": _save_npy(root / "rows.npy", records),
            OVER_LENGTH: _save_npy(root / OVER_LENGTH, np.array(tally.over_length, dtype=OVER_LENGTH_DTYPE)),
        }
    kept = records["status"] == RowStatus.KEPT
    manifest = SliceManifest(
        key=spec.key,
        dataset=spec.dataset,
        row_start=spec.row_start,
        row_end=spec.row_end,
        rows=len(records),
        kept=int(kept.sum()),
        tokens=int(tokens.shape[0]),
        trainable_tokens=int(records["trainable"][kept].sum()),
        dropped=dict(sorted(tally.dropped.items())),
        untrainable_kept=dict(sorted(tally.untrainable.items())),
        kept_by_exact_spans=tally.rescued,
        spelled_special_tokens=tally.spelled,
        over_length=len(tally.over_length),
        unrendered_rows=dict(sorted(tally.holding.items())),
        drop_examples=tally.examples,
        token_dtype=tokens.dtype.name,
        files=files,
        seconds=round(time.perf_counter() - started, 3),
        started_at=started_at,
        finished_at=time.time(),
        encoder=ctx.encoder,
        fast_engine=encoding_for(ctx).engine,
        library_texts=encoding_for(ctx).fallbacks - fallbacks_before,
    )
    with storage_errors(where):
        atomic_write_bytes(root / MANIFEST, json.dumps(manifest.model_dump(), indent=1).encode("utf-8"))
    push_slice(ctx, manifest)
    return manifest
