"""Each dataset's sample rows (the first rows of its first slice): read, rendered and refused before any work
where their slice would fail on them, and what they tell the plan (tokens per row, what the template leaves out)."""

from __future__ import annotations

import logging
from pathlib import Path

from sftmix.config.config import TokenizerSpec
from sftmix.errors import DatasetError, TemplateError
from sftmix.planning.slicing import Slicing
from sftmix.sources import jsonl
from sftmix.sources.formats import (
    Conversation,
    RowFormatError,
    conversation_from_row,
)
from sftmix.sources.reading import SAMPLE_ROWS, Opened, Planning
from sftmix.tokenizing.labels import RenderError
from sftmix.tokenizing.slices import (
    SliceSpec,
    TokenizeContext,
    bad_row_error,
    rows_of,
)
from sftmix.tokenizing.templates import (
    ChatRenderer,
    ResolvedTemplate,
)
from sftmix.tokenizing.tokenizer import (
    TokenizerKey,
    ids_changed,
)
from sftmix.tokenizing.tokenizer_facts import TokenizerFacts
from sftmix.tokenizing.tokenizer_load import reference_note
from sftmix.tokenizing.unrendered import unrendered, what_it_reads

logger = logging.getLogger(__name__)


#: What a sampled row's refusal adds to the error its slice would raise.
REFUSED_SAMPLE = " (refused before any work; on_bad_row: skip drops such rows)"


def _sample_rows(spec: SliceSpec, datasets_cache: Path, on_bad_row: str) -> list[tuple[int, Conversation]]:
    """The first rows of a dataset's first slice, as conversations with their row numbers. A line that is
    not a row, or a row that is not a conversation, fails the plan where ``on_bad_row`` is error: its slice
    would fail on it, after the work before it (every row of a dataset whose card does not declare a
    column); with ``skip`` they are the slices' to count."""
    rows = (spec.rows or list(range(spec.row_start, spec.row_end)))[:SAMPLE_ROWS]
    try:
        records = rows_of(spec, str(datasets_cache), rows)
    except DatasetError:
        return []  # the slice reports it, with its rows
    out = []
    for row, record in zip(rows, records, strict=True):
        if isinstance(record, jsonl.BadLine):
            if on_bad_row == "error":
                assert isinstance(spec.source, jsonl.JsonlSource)
                raise record.error(jsonl.lines_of(spec.dataset, spec.source.path))
            continue
        try:
            out.append((row, conversation_from_row(record, spec.row_format, spec.messages_key)))  # type: ignore[arg-type]  # a RowFormat in a str field
        except RowFormatError as exc:
            if on_bad_row == "error":  # its slice would fail on it, after every slice has started
                raise bad_row_error(spec, row, f"{exc}{REFUSED_SAMPLE}") from None
            continue
    return out


def tokenizer_load_note(
    tk: TokenizerKey, facts: TokenizerFacts, ctx: TokenizeContext, texts: list[str]
) -> str | None:
    """Where the reference builds the tokenizer otherwise than its own files say and that changes the ids
    of this run's sample rows (``texts``, rendered): the warning (said once per process), else ``None``."""
    if not facts.load_changes:
        return None
    workers = ctx.tokenizer.build("hf")  # the reference's build, as the workers load it (unless renamed)
    changed = ids_changed(tk, texts, workers.rust if workers.renaming is None else None)
    note = reference_note(tk.name_or_path, facts.tokenizer_class, facts.load_changes, changed, len(texts))
    if note not in _SAID:
        _SAID.add(note)
        logger.log(logging.WARNING if changed else logging.INFO, note)
    return note if changed else None


_SAID: set[str] = set()


def sampled_tokens_per_row(ctx: TokenizeContext, rendered: list[list[str]]) -> list[tuple[float, float]]:
    """Each dataset's sampled rows' tokens on average, cut at ``max_seq_length``, and the share of them
    longer than it: the plan's estimates (the rows a run drops, and what a mask leaves out, are not known before
    the work)."""
    rust, max_len = ctx.tokenizer.build().rust, ctx.masking.max_seq_length
    found = []
    for texts in rendered:
        lengths = [len(e.ids) for e in rust.encode_batch(texts, add_special_tokens=False)] if texts else []
        over = sum(n > max_len for n in lengths) if max_len else 0
        lengths = [min(n, max_len) if max_len else n for n in lengths]
        n = max(len(lengths), 1)
        found.append((sum(lengths) / n, over / n))
    return found


def rendered_samples(renderer: ChatRenderer, dataset: Opened, slicing: Slicing) -> list[str]:
    """The sample rows' full renders. A row the chat template fails on (Gemma's own refuses a system turn)
    fails its slice where ``on_bad_row`` is error, after every slice has started: refused now, naming the
    row. Otherwise (``skip``, or ``literal_special_tokens: drop``, which may drop the row before it is
    rendered) said once, with how many of the sample it is."""
    texts, failed = [], []
    for row, conv in dataset.samples:
        try:
            texts.append(renderer.render(conv.messages, conv.tools, False))
        except Exception as exc:
            failed.append((row, str(RenderError(0, exc))))
    if not failed:
        return texts
    row, reason, ctx = *failed[0], slicing.ctx
    if ctx.on_bad_row == "error" and not ctx.tokenizer.may_drop_spelled:
        raise bad_row_error(slicing.sample(dataset), row, f"{reason}{REFUSED_SAMPLE}")
    warning = (
        f"{dataset.entry.path}: the chat template fails on {len(failed)} of {len(dataset.samples)} sampled rows "
        f"(row {row}: {reason}); each such row is dropped"
    )
    dataset.warnings.append(warning)
    logger.warning(warning)
    return texts


def probed(
    dataset: Opened,
    at: Planning,
    slicing: Slicing,
    tokenizer: TokenizerSpec,
    renderer: ChatRenderer,
    template: ResolvedTemplate,
) -> None:
    """The dataset's sample rows, and what they hold that the template never renders (a field, a role):
    said before any work, or refused (``unrendered_data: error``)."""
    dataset.samples = _sample_rows(slicing.sample(dataset), Path(at.datasets_cache), at.on_bad_row)
    for found in unrendered(renderer, [conv for _, conv in dataset.samples]):
        line = found.describe(dataset.entry.path, template.source, what_it_reads(template.text))
        if tokenizer.unrendered_data == "error":
            raise TemplateError(f"{line}; refused (unrendered_data: error): warn converts it anyway")
        dataset.left_out.append(line)
        dataset.probes.append(found.probe)
        logger.warning(line)
