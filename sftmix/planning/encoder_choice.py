"""Which encoder the workers use: the fast one where the plan proves it the same tokenizer on this run's sample
rows (and its own analysis), else the library's; proved once per tokenizer and texts in a process."""

from __future__ import annotations

import logging

from sftmix.config.config import TokenizerSpec
from sftmix.errors import ConfigError, MixerError
from sftmix.sources.reading import digest
from sftmix.tokenizing.encoders import same_encodings
from sftmix.tokenizing.fast_analysis import Unproven
from sftmix.tokenizing.slices import (
    TokenizeContext,
)
from sftmix.tokenizing.tokenizer import (
    TokenizerKey,
    load_worker_tokenizer,
)
from sftmix.tokenizing.tokenizer_facts import tokenizer_facts
from sftmix.tokenizing.tokenizer_load import built_as

logger = logging.getLogger(__name__)


def choose_encoder(spec: TokenizerSpec, tk: TokenizerKey, ctx: TokenizeContext, texts: list[str]) -> str:
    """``fast`` where the fast encoder is proven this tokenizer (its analysis, then the run's own sample rows,
    ``texts`` rendered, encoded both ways, ids and offsets), else ``hf``; ``encoder: fast`` refuses the run
    instead."""
    if spec.encoder == "hf":
        return "hf"
    asked = (tk, ctx.tokenizer.file, spec.encoder, digest(texts))
    if asked not in _ENCODER_CHOSEN:  # the head start and the plan task ask the same question
        _ENCODER_CHOSEN[asked] = _prove_encoder(spec, tk, ctx, texts)
    return _ENCODER_CHOSEN[asked]


_ENCODER_CHOSEN: dict[tuple, str] = {}


def _prove_encoder(spec: TokenizerSpec, tk: TokenizerKey, ctx: TokenizeContext, texts: list[str]) -> str:
    assert ctx.tokenizer.file is not None  # build_plan writes the workers' copy, with the proof
    found = load_worker_tokenizer(ctx.tokenizer.file).fast
    problem = found if isinstance(found, str) else None
    if problem is None:
        problem, engine = _try_fast(ctx, texts)
    if problem is None:
        assert not isinstance(found, str)
        if found.metaspace:
            how = f"SentencePiece-style BPE, prepend scheme {found.metaspace}; this run's sample rows agree"
        elif found.one_merge_per_token and not found.unsafe:
            how = "every token checked"
        else:
            how = f"texts with any of {len(found.unsafe)} tokens go to the tokenizers library"
        if found.splits:
            how += f"; its pre-tokenizer's {len(found.splits)} Splits in sequence, as fastokens runs them"
        logger.info(
            "encoder: %s, proven the same tokenizer as %s (%s; %s)",
            engine,
            tk.name_or_path,
            built_as(tk.load, tokenizer_facts(tk).tokenizer_class),
            how,
        )
        return "fast"
    if spec.encoder == "fast":
        raise ConfigError(
            f"tokenizer.encoder fast: the fast encoder is not proven the same tokenizer: {problem}"
        )
    logger.info("encoder: the tokenizers library (the fast encoder is not used: %s)", problem)
    return "hf"


def _try_fast(ctx: TokenizeContext, texts: list[str]) -> tuple[str | None, str]:
    """(why the fast encoder is not used, or None; the engine it takes): an engine that cannot build the
    encoder, or fails on a sample row, is passed over with its reason, never an error of the run."""
    try:
        encoding = ctx.tokenizer.build("fast")
        assert encoding.fast is not None
        differ = same_encodings(encoding.rust, encoding.fast, texts)
    except MixerError as exc:
        if not isinstance(exc.__cause__, Unproven):  # a setting to correct (TOKENIZE_MIXER_FAST_ENGINE)
            raise
        return str(exc.__cause__), ""  # the engine cannot take it (worker_encoding's words)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", ""
    fast = encoding.fast
    if fast.pass_over_reason is not None:
        logger.info("encoder: %s; %s takes it", fast.pass_over_reason, fast.engine)
    if differ is not None:
        return f"the two encoders disagree on a sample row of this run ({differ})", fast.engine
    return None, fast.engine
