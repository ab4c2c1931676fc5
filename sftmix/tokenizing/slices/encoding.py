"""The run's tokenizer and template as the workers get them (:class:`WorkerTokenizer`,
:class:`WorkerTemplate`), and what they build in a worker process: its encoding (the fast encoder where the
plan proved it) and its masker, once per process and run settings."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from pydantic import BaseModel, ConfigDict

from sftmix.config.config import TokenizerSpec
from sftmix.errors import ConfigError
from sftmix.runtime import settings
from sftmix.tokenizing.encoders import FastEncoder
from sftmix.tokenizing.fast_analysis import Unproven
from sftmix.tokenizing.labels import LabelMasker, MaskerEncoding
from sftmix.tokenizing.literal_tokens import LiteralReport, LiteralRule, Renaming, literal_rule
from sftmix.tokenizing.masking import Masking
from sftmix.tokenizing.prefix_renders import SkeletonStore
from sftmix.tokenizing.restarts import Restarts
from sftmix.tokenizing.segments import SegmentBoundaries
from sftmix.tokenizing.slices.manifest import SliceManifest
from sftmix.tokenizing.templates import ChatRenderer
from sftmix.tokenizing.tokenizer import (
    TokenizerKey,
    fast_analysis,
    load_hf_tokenizer,
    load_worker_tokenizer,
    rust_tokenizer,
    save_split_worker_tokenizer,
    segment_boundaries,
    special_tokens,
)
from sftmix.tokenizing.tokenizer_load import TokenizerLoad


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


class WorkerTokenizer(BaseModel):
    """The run's tokenizer as every worker builds it (:meth:`build`): where the plan found it and how it
    loaded it, the workers' copy it wrote (``file``), the ``encoder`` it chose (``fast`` where proven) and what
    ``literal_special_tokens`` asks of each row's spelled special tokens."""

    model_config = ConfigDict(frozen=True)

    name_or_path: str
    revision: str | None = None
    load: TokenizerLoad = "reference"
    file: str | None = None  # the workers' copy, written once by the plan (split: the renamed tokenizer)
    encoder: str = "hf"  # "fast": proven the same tokenizer by the plan (sftmix/tokenizing/encoders.py)
    literal_special_tokens: str = "keep"

    @classmethod
    def of(cls, spec: TokenizerSpec, key: TokenizerKey, file: str | None) -> WorkerTokenizer:
        """The mixer's tokenizer as the plan loaded it (``key``), with the workers' copy it wrote."""
        return cls(
            name_or_path=key.name_or_path,
            revision=key.revision,
            load=key.load,
            file=file,
            literal_special_tokens=spec.literal_special_tokens,
        )

    def key(self) -> TokenizerKey:
        """The tokenizer, loaded as the plan loaded it."""
        return TokenizerKey.of(self.name_or_path, self.revision, self.load)

    def build(self, encoder: str | None = None) -> WorkerEncoding:
        """This process's encoding (``encoder`` instead of the run's: the plan's sample check), with the
        fast engine :data:`sftmix.runtime.settings.FAST_ENGINE` names now (part of the cache's key)."""
        return worker_encoding(
            self.name_or_path,
            self.revision,
            self.file,
            encoder or self.encoder,
            settings.FAST_ENGINE.raw(),
            self.load,
        )

    def with_template(self, template_text: str) -> WorkerTokenizer:
        """The workers' tokenizer for ``template_text``: spelled special tokens read as text (``split``)
        need a copy with the template's own renamed (written once, beside the workers' copy)."""
        if self.literal_special_tokens != "split":
            return self
        assert self.file is not None
        return self.model_copy(update={"file": save_split_worker_tokenizer(self.file, template_text)})

    def literal_rule(self) -> LiteralRule | None:
        """What the setting asks of each row (none: ``keep``, the reference's)."""
        if self.literal_special_tokens == "keep":
            return None
        return _literal_rule_of(self.build(), self.literal_special_tokens)

    def literal_report(self, manifests: Sequence[SliceManifest]) -> LiteralReport:
        """What the run did with special tokens its rows spell (the run report's, the check's)."""
        spelled = sum(m.findings.spelled_special_tokens for m in manifests)
        return LiteralReport(mode=self.literal_special_tokens, spelled_rows=spelled)

    @property
    def may_drop_spelled(self) -> bool:
        """Whether a row that spells a special token may be dropped before it is rendered (``drop``)."""
        return self.literal_special_tokens == "drop"


class WorkerTemplate(BaseModel):
    """The run's chat template as the plan resolved it: its text, and where it came from (for messages)."""

    model_config = ConfigDict(frozen=True)

    text: str
    source: str = ""

    def build(self, encoding: WorkerEncoding) -> ChatRenderer:
        """Its renderer for ``encoding``, the template's own special tokens under their new names where the
        tokenizer renamed them (``split``)."""
        return ChatRenderer(self.text_for(encoding), encoding.special_tokens)

    def text_for(self, encoding: WorkerEncoding) -> str:
        renaming = encoding.renaming
        return self.text if renaming is None else renaming.template(self.text)


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
    encoding: WorkerEncoding, template: WorkerTemplate, masking: Masking, skeleton_dir: str | None = None
) -> LabelMasker:
    """One masker per worker process and run settings: its template and pasted-prefix shapes are reused by
    every slice the process tokenizes, and the shapes' skeletons by every process of the machine (kept in
    ``skeleton_dir``, the work directory's)."""
    renderer = template.build(encoding)
    store = None
    if skeleton_dir is not None:
        text = template.text_for(encoding)
        store = SkeletonStore(skeleton_dir, SkeletonStore.renderer_key_of(text, encoding.special_tokens))
    return LabelMasker(renderer, encoding.for_masker(), masking, store, drop_early=encoding.fast is None)


@lru_cache(maxsize=4)
def _literal_rule_of(encoding: WorkerEncoding, mode: str) -> LiteralRule | None:
    added = lambda: [t.content for t in encoding.rust.get_added_tokens_decoder().values() if t.special]  # noqa: E731
    return literal_rule(mode, encoding.renaming, added)
