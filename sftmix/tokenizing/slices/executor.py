"""Tokenizing one slice: its rows read, rendered, masked and checked, then its files and manifest
written (the manifest last)."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from sftmix.errors import BadRowError, DatasetError, MixerError, TemplateError, row_label
from sftmix.runtime.ownership import remove_abandoned_temps
from sftmix.runtime.storage import atomic_write_bytes, storage_errors
from sftmix.sources import jsonl, registry
from sftmix.sources.formats import Conversation, RowFormatError, conversation_from_row
from sftmix.tokenizing.labels import LabelMasker, RenderError
from sftmix.tokenizing.literal_tokens import LiteralRule
from sftmix.tokenizing.row_status import DROP_REASONS, RowStatus, TokenizedRow
from sftmix.tokenizing.slices.manifest import (
    ALL_ZERO_SLICE_ROWS,
    MANIFEST,
    OVER_LENGTH,
    OVER_LENGTH_DTYPE,
    PROGRESS,
    PROGRESS_SECONDS,
    ROW_DTYPE,
    RowFindings,
    SliceEncoding,
    SliceManifest,
    SliceTiming,
)
from sftmix.tokenizing.slices.spec import SliceSpec, TokenizeContext
from sftmix.tokenizing.slices.store import (
    note_progress,
    on_this_machine,
    push_slice,
    read_manifest,
    save_npy,
    slice_dir,
    unrecorded_over_length,
    verify_slice,
)
from sftmix.tokenizing.tokenizer import check_ids_fit
from sftmix.tokenizing.unrendered import holds

logger = logging.getLogger(__name__)


def _skipped(reason: str) -> TokenizedRow:
    return TokenizedRow(np.zeros(0, np.int64), np.zeros(0, np.uint8), RowStatus.BAD_ROW, reason)


def bad_row_error(spec: SliceSpec, row: int, reason: str) -> BadRowError:
    """The error for a malformed row, with its line when the dataset is a local JSON Lines file, or its
    file and line in a dataset of several (found by reading the file: only on this error path)."""
    if (place := registry.row_place(spec.source, spec.rows_at(), row)) is None:
        return BadRowError(spec.dataset, row, reason)
    return BadRowError(spec.dataset, row, reason, place[1], place[0])


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
                assert isinstance(spec.source, jsonl.JsonlSource)
                raise record.error(jsonl.lines_of(spec.dataset, spec.source.path))
            results[j] = _skipped(record.detail)
            continue
        try:
            convs[j] = conv = conversation_from_row(record, spec.row_format, spec.messages_key)  # type: ignore[arg-type]  # a RowFormat in a str field
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


def tokenize_slice(spec: SliceSpec, ctx: TokenizeContext, reuse: bool = False) -> SliceManifest:
    """Tokenize one slice and write its checkpoint; returns the manifest (written last).

    ``reuse``: a slice whose manifest is already written, with files that verify, is done; it is
    returned as it is. That is the case when a run was stopped between the manifest and Prefect's
    own result record (the orchestrator's cache is not the only proof a slice finished)."""
    ctx, spec = on_this_machine(ctx, spec)
    if reuse:
        done = read_manifest(ctx.output.work_dir, spec.key, ctx.output.remote_work_dir)
        if (
            done is not None
            and unrecorded_over_length(ctx, done) is None
            and verify_slice(ctx.output.work_dir, done, ctx.output.remote_work_dir) is None
        ):
            return done
    try:
        return _tokenize_slice(spec, ctx)
    finally:
        registry.release()  # the next slice maps what it reads; resident memory stays per slice


def rows_of(spec: SliceSpec, datasets_cache: str, rows: list[int]) -> Sequence[dict | jsonl.BadLine]:
    """Rows of the slice's dataset by index, as its source's data format reads them: its JSON Lines
    batches, its Parquet row groups, its Arrow files, or datasets."""
    return registry.read_rows(spec.source, spec.rows_at(datasets_cache), rows)


def _tokenize_slice(spec: SliceSpec, ctx: TokenizeContext) -> SliceManifest:
    started, started_at = time.perf_counter(), time.time()
    rows = spec.row_list()
    dtype = np.dtype(ctx.output.token_dtype)
    masker, encoding = ctx.masker(), ctx.tokenizer.build()
    fallbacks_before = encoding.fallbacks
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
            note_progress(slice_dir(ctx.output.work_dir, spec.key), b, len(rows))
        batch_rows = rows[b : b + ctx.batch_size]
        raw = _read_rows(spec, ctx, batch_rows)
        results = _tokenize_batch(
            masker,
            spec,
            batch_rows,
            raw,
            ctx.on_bad_row == "skip",
            ctx.tokenizer.literal_rule(),
            tally.holding,
        )
        for j, res in enumerate(results):
            rec, row = records[b + j], batch_rows[j]
            kept = res.status == RowStatus.KEPT or ctx.masking.keeps_untrained(res.status)
            rec["length"] = res.ids.shape[0] if kept else 0  # a dropped row's tokens may not all be made
            rec["status"] = int(RowStatus.KEPT if kept else res.status)
            if not kept:
                rec["offset"] = -1
                _dropped(spec, tally, res, row)
                continue
            if res.status != RowStatus.KEPT:
                tally.untrainable[DROP_REASONS[res.status]] += 1
            tally.rescued += int(res.reference_drops)
            tally.spelled += int(res.spelled)
            check_ids_fit(res.ids, dtype, f"dataset {spec.dataset!r}, {row_label(row)}")
            rec["offset"] = offset
            rec["trainable"] = int(res.mask.sum())
            if res.truncated:
                tally.over_length.append((b + j, bool(res.mask[-1])))
            token_chunks.append(res.ids.astype(dtype))
            mask_chunks.append(res.mask.astype(np.uint8))
            offset += res.ids.shape[0]
    _refuse_all_zero(spec, ctx, len(rows), tally)
    registry.finish(spec.source)  # (Parquet: rows decoded batch by batch came from the version the plan read)
    tokens = np.concatenate(token_chunks) if token_chunks else np.zeros(0, dtype=dtype)
    mask = np.concatenate(mask_chunks) if mask_chunks else np.zeros(0, dtype=np.uint8)
    return _checkpoint(spec, ctx, tokens, mask, records, tally, (started, started_at, fallbacks_before))


def _read_rows(spec: SliceSpec, ctx: TokenizeContext, rows: list[int]) -> Sequence[dict | jsonl.BadLine]:
    """A batch's rows; a failure of Arrow or ``datasets`` while reading them is named with the rows."""
    try:
        return rows_of(spec, ctx.output.datasets_cache, rows)
    except MixerError:
        raise
    except Exception as exc:
        raise DatasetError(spec.dataset, f"cannot read rows {rows[0]}-{rows[-1]} (0-based): {exc}") from None


def _dropped(spec: SliceSpec, tally: _Tally, res: TokenizedRow, row: int) -> None:
    """A row the slice drops: counted by its reason, one of the first examples, and logged."""
    reason = DROP_REASONS[res.status]
    tally.dropped[reason] += 1
    if len(tally.examples) < 5:
        tally.examples.append({"row": row, "reason": reason, "detail": res.detail})
    if res.status == RowStatus.BAD_ROW:
        logger.warning("dataset %r, %s skipped: %s", spec.dataset, row_label(row), res.detail)
    logger.debug("dataset %s row %d dropped: %s (%s)", spec.dataset, row, reason, res.detail)


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


def _refuse_all_zero(spec: SliceSpec, ctx: TokenizeContext, rows: int, tally: _Tally) -> None:
    """A large slice of which no row has a trainable token points at a broken template."""
    no_trainable = DROP_REASONS[RowStatus.NO_TRAINABLE]
    if rows >= ALL_ZERO_SLICE_ROWS and tally.dropped[no_trainable] + tally.untrainable[no_trainable] == rows:
        raise TemplateError(
            f"{spec.describe()}: all {rows} rows have an all-zero label mask with template "
            f"{ctx.template.source or 'in use'} (mask {ctx.masking.mask}): the template's assistant turns are not "
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
    encoding = ctx.tokenizer.build()  # (this process's, cached: the one that tokenized the slice)
    root = slice_dir(ctx.output.work_dir, spec.key)
    where = f"cannot write the checkpoint of {spec.describe()} (work directory {ctx.output.work_dir})"
    with storage_errors(where):
        with contextlib.suppress(FileNotFoundError):
            (root / PROGRESS).unlink()  # (ours: the slice's progress while it ran)
        remove_abandoned_temps(root)  # a worker killed while writing this slice left them
        files = {
            "tokens.npy": save_npy(root / "tokens.npy", tokens),
            "mask.npy": save_npy(root / "mask.npy", mask),
            "rows.npy": save_npy(root / "rows.npy", records),
            OVER_LENGTH: save_npy(root / OVER_LENGTH, np.array(tally.over_length, dtype=OVER_LENGTH_DTYPE)),
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
        findings=RowFindings(
            untrainable_kept=dict(sorted(tally.untrainable.items())),
            kept_by_exact_spans=tally.rescued,
            spelled_special_tokens=tally.spelled,
            over_length=len(tally.over_length),
            unrendered_rows=dict(sorted(tally.holding.items())),
            drop_examples=tally.examples,
        ),
        token_dtype=tokens.dtype.name,
        files=files,
        timing=SliceTiming(
            seconds=round(time.perf_counter() - started, 3), started_at=started_at, finished_at=time.time()
        ),
        encoding=SliceEncoding(
            encoder=ctx.tokenizer.encoder,
            fast_engine=encoding.engine,
            library_texts=encoding.fallbacks - fallbacks_before,
        ),
    )
    with storage_errors(where):
        atomic_write_bytes(root / MANIFEST, json.dumps(manifest.model_dump(), indent=1).encode("utf-8"))
    push_slice(ctx, manifest)
    return manifest
