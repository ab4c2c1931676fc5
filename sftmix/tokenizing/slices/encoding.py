"""The tokenizer and masker as a worker process uses them: built once per process and run settings, the
fast encoder where the plan proved it, and what ``literal_special_tokens`` asks of each row."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from sftmix.errors import ConfigError
from sftmix.runtime import settings
from sftmix.sources.formats import Conversation
from sftmix.tokenizing.encoders import FastEncoder
from sftmix.tokenizing.fast_analysis import Unproven
from sftmix.tokenizing.labels import LabelMasker, MaskerEncoding, RenderError
from sftmix.tokenizing.literal_tokens import LiteralReport, LiteralRule, Renaming, literal_rule
from sftmix.tokenizing.masking import Masking
from sftmix.tokenizing.prefix_renders import SkeletonStore
from sftmix.tokenizing.restarts import Restarts
from sftmix.tokenizing.row_status import RowStatus, TokenizedRow
from sftmix.tokenizing.segments import SegmentBoundaries
from sftmix.tokenizing.slices.manifest import SKELETONS, SliceManifest
from sftmix.tokenizing.slices.spec import TokenizeContext
from sftmix.tokenizing.templates import ChatRenderer
from sftmix.tokenizing.tokenizer import (
    TokenizerKey,
    fast_analysis,
    load_hf_tokenizer,
    load_worker_tokenizer,
    rust_tokenizer,
    segment_boundaries,
    special_tokens,
)
from sftmix.tokenizing.tokenizer_load import TokenizerLoad


def masker_for(ctx: TokenizeContext) -> LabelMasker:
    """One masker per worker process and run settings: its template and pasted-prefix shapes are
    reused by every slice the process tokenizes, and the shapes' skeletons by every process of the
    machine (kept in the work directory, ``SKELETONS``)."""
    return cached_masker(
        encoding_for(ctx), ctx.template_text, ctx.masking, os.path.join(ctx.work_dir, SKELETONS)
    )


def masked_samples(ctx: TokenizeContext, conversations: list[Conversation]) -> list[TokenizedRow] | None:
    """The run's masker over ``conversations`` (a plan's sampled rows): what the plan estimates from before
    any work; ``None`` where there are none or the masker fails on one."""
    if not conversations:
        return None
    try:
        return masker_for(ctx).tokenize(conversations)
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

    def for_masker(self) -> MaskerEncoding:
        restore = None if self.renaming is None else self.renaming.restore
        return MaskerEncoding(self.encode_batch, self.decode, self.boundaries, self.restarts, restore)

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
def cached_masker(
    encoding: WorkerEncoding, template_text: str, masking: Masking, skeleton_dir: str | None = None
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
    return LabelMasker(renderer, encoding.for_masker(), masking, store, drop_early=encoding.fast is None)


@lru_cache(maxsize=4)
def _literal_rule_of(encoding: WorkerEncoding, mode: str) -> LiteralRule | None:
    added = lambda: [t.content for t in encoding.rust.get_added_tokens_decoder().values() if t.special]  # noqa: E731
    return literal_rule(mode, encoding.renaming, added)


def literal_rule_for(ctx: TokenizeContext) -> LiteralRule | None:
    if ctx.literal_special_tokens == "keep":
        return None
    return _literal_rule_of(encoding_for(ctx), ctx.literal_special_tokens)


def literal_report(ctx: TokenizeContext, manifests: Sequence[SliceManifest]) -> LiteralReport:
    """What the run did with special tokens its rows spell (the run report's, the check's)."""
    spelled = sum(m.findings.spelled_special_tokens for m in manifests)
    return LiteralReport(mode=ctx.literal_special_tokens, spelled_rows=spelled)
