"""Load the tokenizer the way the reference does, and derive what depends on it.

What changes bytes is reproduced (the ``<pad>`` token the reference adds when pad is missing or equals
eos: an added special token splits text that contains it); the rest is ours: a content fingerprint for
slice keys, the output dtype, and a Rust tokenizer of our own for batch encoding with offsets.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from sftmix.errors import ConfigError, TokenDtypeError
from sftmix.sources.hub import offline_cache_problem, unreachable_hub_problem
from sftmix.sources.paths import looks_local, relative_note
from sftmix.tokenizing.bpe_vocabulary import pack_vocabulary, unpack_vocabulary, vocabulary
from sftmix.tokenizing.encoder_proof import ANALYSIS_VERSION, analyse
from sftmix.tokenizing.fast_analysis import FastAnalysis, Unproven
from sftmix.tokenizing.literal_tokens import Renaming, cannot_rename, renaming
from sftmix.tokenizing.pipeline_steps import normalizer_does_nothing
from sftmix.tokenizing.segments import SegmentBoundaries
from sftmix.tokenizing.tokenizer_load import (
    TokenizerLoad,
    load_tokenizer,
    pipeline_changes,
    tokenizer_json_path,
)

logger = logging.getLogger(__name__)

#: The dtypes a token part may have, smallest first.
TOKEN_DTYPES = (np.uint8, np.uint16, np.uint32, np.uint64)


def quiet_transformers() -> None:
    """Before transformers is imported (in this process or a worker it starts): no advice about PyTorch,
    which tokenizing never needs, on every run."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")


def import_transformers() -> Any:
    """transformers, imported believing PyTorch is absent when this process has not imported it.

    Tokenizing never needs PyTorch, but where it is installed transformers imports it while loading any
    tokenizer (its configuration module does): 8.6 s on the lent 16-core GPU machine, paid by every
    command. Its availability check is made once per process, so a process that imports PyTorch itself
    later gets a transformers without it; tokenize-mixer's own processes never do."""
    quiet_transformers()
    if "transformers" not in sys.modules and "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]  # importlib's find_spec now answers None
        try:
            import transformers
            from transformers.utils import import_utils

            import_utils.is_torch_available()  # the answer is cached for the process
        finally:
            if "torch" in sys.modules and sys.modules["torch"] is None:
                del sys.modules["torch"]
    import transformers

    return transformers


@dataclass(frozen=True)
class TokenizerKey:
    """What identifies a loaded tokenizer: hashable, so each process loads it once (and again when the
    files of a local tokenizer directory change)."""

    name_or_path: str
    revision: str | None
    stamp: tuple = ()
    load: TokenizerLoad = "reference"  # as the reference's transformers builds it, or as its files say

    @classmethod
    def of(cls, name_or_path: str, revision: str | None, load: TokenizerLoad = "reference") -> TokenizerKey:
        stamp: tuple = ()
        if os.path.isdir(name_or_path):
            stamp = tuple(
                sorted(
                    (e.name, e.stat().st_size, e.stat().st_mtime_ns)
                    for e in os.scandir(name_or_path)
                    if e.is_file()
                )
            )
        return cls(name_or_path, revision, stamp, load)


def tokenizer_path_problem(name: str) -> str | None:
    """Why ``name`` cannot be a tokenizer, found at once (the whole error message): not a directory
    here, and a local path or a hub name with no hub to ask. ``None`` for a directory or a hub name
    the hub may answer."""
    if os.path.isdir(name):
        return None
    if os.path.lexists(name):
        return f"tokenizer {name!r} is not a directory: give the directory that holds tokenizer.json"
    if looks_local(name):
        return f"tokenizer {name!r}: no such directory{relative_note(name)}"
    if (problem := unreachable_hub_problem() or offline_cache_problem(name, "model")) is not None:
        return f"tokenizer {name!r} {problem}"
    return None


@lru_cache(maxsize=4)
def load_hf_tokenizer(key: TokenizerKey) -> Any:
    """The tokenizer as ``key.load`` builds it (:mod:`sftmix.tokenizing.tokenizer_load`) plus the reference's pad
    handling."""
    import_transformers()
    name = key.name_or_path
    if (problem := tokenizer_path_problem(name)) is not None:
        raise ConfigError(problem)
    try:
        tok = load_tokenizer(key.name_or_path, key.revision, key.load)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load tokenizer {key.name_or_path!r}: {exc}") from None
    if not getattr(tok, "is_fast", False) and not hasattr(tok, "backend_tokenizer"):
        raise ConfigError(
            f"tokenizer {key.name_or_path!r} has no fast (Rust) implementation; offsets need one"
        )
    if tok.pad_token_id is None or tok.pad_token_id == tok.eos_token_id:
        if type(tok).__name__.startswith("GPTNeoXTokenizer") and tok.bos_token is None:
            tok.bos_token = tok.eos_token
        else:
            tok.add_special_tokens({"pad_token": "<pad>"})
            logger.info("tokenizer %s: added a <pad> token, as the reference does", key.name_or_path)
    return tok


def load_changes(key: TokenizerKey) -> tuple[str, ...]:
    """What the reference's build of the tokenizer has in place of its own ``tokenizer.json``'s parts that
    make ids, in words (nothing for ``load: files``, or a tokenizer with no such file)."""
    path = tokenizer_json_path(key.name_or_path, key.revision) if key.load == "reference" else None
    if path is None:
        return ()
    from tokenizers import Tokenizer

    try:
        written = json.loads(Tokenizer.from_file(path).to_str())
    except Exception as exc:  # (a file this tokenizers cannot read: the load above would have failed)
        logger.debug("tokenizer %s: cannot read %s: %s", key.name_or_path, path, exc)
        return ()
    built = json.loads(load_hf_tokenizer(key).backend_tokenizer.to_str())
    return tuple(pipeline_changes(built, written))


def ids_changed(key: TokenizerKey, texts: list[str], built: Any | None = None) -> int:
    """How many of ``texts`` the tokenizer's own files encode to other ids than ``key``'s build does
    (``built``, where the caller has it loaded: a 256k vocabulary takes seconds to load again)."""
    built = rust_tokenizer(key) if built is None else built
    own = rust_tokenizer(replace(key, load="files"))
    ours = built.encode_batch(texts, add_special_tokens=False)
    theirs = own.encode_batch(texts, add_special_tokens=False)
    return sum(a.ids != b.ids for a, b in zip(ours, theirs, strict=True))


def special_tokens(tok: Any) -> dict[str, str]:
    """The named special tokens a chat template sees (bos_token, eos_token, ...)."""
    return dict(tok.special_tokens_map)


@lru_cache(maxsize=4)
def rust_tokenizer(key: TokenizerKey) -> Any:
    """An independent copy of the Rust tokenizer with truncation and padding off."""
    from tokenizers import Tokenizer

    rust = Tokenizer.from_str(load_hf_tokenizer(key).backend_tokenizer.to_str())
    rust.no_truncation()
    rust.no_padding()
    return rust


def _adds_prefix_space(node: Any) -> bool:
    """Whether a pre-tokenizer treats the start of a segment specially (then tails are not independent)."""
    if isinstance(node, dict):
        if node.get("add_prefix_space") is True or node.get("type") == "Metaspace":
            return True
        return any(_adds_prefix_space(v) for v in node.values())
    if isinstance(node, list):
        return any(_adds_prefix_space(v) for v in node)
    return False


@lru_cache(maxsize=4)
def segment_boundaries(key: TokenizerKey) -> SegmentBoundaries | None:
    return boundaries_of(rust_tokenizer(key))


def boundaries_of(rust: Any) -> SegmentBoundaries | None:
    """Added tokens after which tokenization restarts, or ``None`` when this tokenizer's segments are not
    independent (a normalizer that does something, or a pre-tokenizer that adds a prefix space). The pre-tokenizer's own JSON,
    not the whole tokenizer's: that one holds the vocabulary and merges (0.1 s per worker for dolma2)."""
    pre, normalizer = rust.pre_tokenizer, rust.normalizer
    if not normalizer_does_nothing(
        None if normalizer is None else json.loads(normalizer.__getstate__())
    ) or _adds_prefix_space(None if pre is None else json.loads(pre.__getstate__())):
        return None
    added = rust.get_added_tokens_decoder()
    safe = {i: t for i, t in added.items() if not (t.lstrip or t.rstrip or t.single_word)}
    if not safe:
        return None
    return SegmentBoundaries(
        ids=frozenset(safe),
        contents=tuple(sorted({t.content for t in safe.values()})),
        longest=max(len(t.content) for t in added.values()),
        every=tuple(sorted({t.content for t in added.values()})),
    )


@lru_cache(maxsize=4)
def fast_analysis(key: TokenizerKey) -> FastAnalysis | str:
    """The proof that the fast encoder encodes as this tokenizer does, or why there is none. Proving checks
    every token (1-3 s), so the result is kept in the user's cache under the tokenizer's fingerprint, the
    proof's version, tiktoken's and fastokens': a machine proves each tokenizer once."""
    import tiktoken

    from sftmix.runtime.storage import write_cache_file

    try:
        from importlib.metadata import version

        fastokens = version("fastokens")
    except Exception:  # not installed (SentencePiece-style tokenizers are unproven without it)
        fastokens = "none"
    name = f"{tokenizer_fingerprint(key)}-v{ANALYSIS_VERSION}-tiktoken{tiktoken.__version__}-fastokens{fastokens}.json"
    cached = proofs_dir() / name
    try:
        return analysis_from_json(json.loads(cached.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        found: FastAnalysis | str = analyse(rust_tokenizer(key).to_str())
    except Unproven as exc:
        found = str(exc)
    write_cache_file(cached, json.dumps(analysis_json(found)).encode("utf-8"))  # (else proved again)
    return found


def proofs_dir() -> Path:
    """``$XDG_CACHE_HOME/tokenize-mixer/encoder-proofs`` (not the work directory: proofs outlive it)."""
    from sftmix.config.run_options import cache_subdir

    return cache_subdir("encoder-proofs")


def analysis_json(found: FastAnalysis | str) -> dict[str, Any]:
    return {"unproven": found} if isinstance(found, str) else found.to_json()


def analysis_from_json(data: dict[str, Any]) -> FastAnalysis | str:
    return str(data["unproven"]) if "unproven" in data else FastAnalysis.from_json(data)


@dataclass(frozen=True)
class LoadedTokenizer:
    """All a slice worker needs from the tokenizer, without importing transformers (seconds of start-up
    and hundreds of MB per worker): the exact Rust tokenizer the plan loaded, the special tokens and the
    fast encoder's proof (or why there is none)."""

    rust: Any
    special_tokens: dict[str, str]
    boundaries: SegmentBoundaries | None
    fast: FastAnalysis | str
    vocab: tuple[dict[bytes, int], dict[str, int]] | None = None  # tiktoken's, where proven
    backend_json: str | None = None  # the Rust tokenizer's JSON (what the fast engine reads)
    renaming: Renaming | None = None  # split's: the template's tokens renamed (literal_tokens)


class LazyTokenizer:
    """The library's Rust tokenizer, parsed from its JSON when first used: a worker whose fast encoder is
    proven needs it only for texts the fast one hands back (parsing costs 0.3-0.7 s per process)."""

    def __init__(self, text: str) -> None:
        self._text = text
        self._tokenizer: Any = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle: not a tokenizer's
            raise AttributeError(name)
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_str(self._text)
            tokenizer.no_truncation()
            tokenizer.no_padding()
            self._tokenizer = tokenizer
        return getattr(self._tokenizer, name)


def boundaries_json(found: SegmentBoundaries | None) -> dict[str, Any] | None:
    if found is None:
        return None
    return {
        "ids": sorted(found.ids),
        "contents": list(found.contents),
        "longest": found.longest,
        "every": list(found.every),
    }


def boundaries_from_json(data: dict[str, Any] | None) -> SegmentBoundaries | None:
    if data is None:
        return None
    return SegmentBoundaries(
        ids=frozenset(int(i) for i in data["ids"]),
        contents=tuple(data["contents"]),
        longest=int(data["longest"]),
        every=tuple(data["every"]),
    )


def save_worker_tokenizer(key: TokenizerKey, directory: str | os.PathLike[str], fingerprint: str) -> str:
    """Write (once) what :func:`load_worker_tokenizer` reads; returns its path. A copy written by another
    version of the proof (or before the fast encoder existed) is written again."""
    from sftmix.runtime.storage import atomic_write_bytes

    path = os.path.join(directory, f"{fingerprint}.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fh:
            if json.load(fh).get("analysis_version") == ANALYSIS_VERSION:
                return path
    tok = load_hf_tokenizer(key)
    found = fast_analysis(key)
    backend = rust_tokenizer(key).to_str()
    data = {
        "backend": backend,
        "special_tokens": special_tokens(tok),
        "fast": analysis_json(found),
        "analysis_version": ANALYSIS_VERSION,
        "boundaries": boundaries_json(segment_boundaries(key)),  # a worker need not parse the backend
    }
    if not isinstance(found, str) and not found.metaspace:  # tiktoken's ranks (SentencePiece has none)
        data["fast_vocabulary"] = pack_vocabulary(*vocabulary(backend))
    atomic_write_bytes(path, json.dumps(data).encode("utf-8"))
    return path


@lru_cache(maxsize=4)
def load_worker_tokenizer(path: str) -> LoadedTokenizer:
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    rust = LazyTokenizer(data["backend"])
    packed = data.get("fast_vocabulary")
    renamed = data.get("renaming")
    return LoadedTokenizer(
        rust,
        dict(data["special_tokens"]),
        boundaries_from_json(data["boundaries"]) if "boundaries" in data else boundaries_of(rust),
        analysis_from_json(data["fast"]),
        None if packed is None else unpack_vocabulary(packed),
        data["backend"],
        None if renamed is None else Renaming(dict(renamed["names"]), tuple(renamed["unnamed"])),
    )


def save_split_worker_tokenizer(worker_file: str, template_text: str) -> str:
    """The worker tokenizer of ``worker_file`` for reading spelled special tokens as text with this template
    (``sftmix.tokenizing.literal_tokens``), written (once) beside it; returns its path."""
    from tokenizers import Tokenizer

    from sftmix.runtime.storage import atomic_write_bytes

    with open(worker_file, "rb") as fh:
        raw = fh.read()
    digest = hashlib.sha256(raw + b"\0" + template_text.encode("utf-8")).hexdigest()[:32]
    path = os.path.join(os.path.dirname(worker_file), f"split-{digest}.json")
    if os.path.isfile(path):
        return path
    data = json.loads(raw)
    backend = json.loads(data["backend"])
    specials = [t["content"] for t in backend.get("added_tokens") or [] if t.get("special")]
    found = renaming(template_text, data["special_tokens"], specials)
    renamed = found.backend(data["backend"])
    rust = Tokenizer.from_str(renamed)
    ids = {t["content"]: t["id"] for t in backend.get("added_tokens") or []}
    moved = [text for text, name in found.names.items() if rust.token_to_id(name) != ids[text]]
    if moved:
        raise ConfigError(cannot_rename(moved[0]))
    try:
        proven: FastAnalysis | str = analyse(renamed)
    except Unproven as exc:
        proven = str(exc)
    out = {
        "backend": renamed,
        "special_tokens": found.variables(data["special_tokens"]),
        "fast": analysis_json(proven),
        "analysis_version": ANALYSIS_VERSION,
        "boundaries": boundaries_json(boundaries_of(rust)),
        "renaming": {"names": found.names, "unnamed": list(found.unnamed)},
    }
    if not isinstance(proven, str) and not proven.metaspace:
        out["fast_vocabulary"] = pack_vocabulary(*vocabulary(renamed))
    atomic_write_bytes(path, json.dumps(out).encode("utf-8"))
    return path


@lru_cache(maxsize=4)  # like the tokenizer it hashes: prepare_plan and build_plan both ask
def tokenizer_fingerprint(key: TokenizerKey) -> str:
    """Hash of everything in the tokenizer that changes token ids or template variables."""
    tok = load_hf_tokenizer(key)
    h = hashlib.sha256()
    h.update(tok.backend_tokenizer.to_str().encode("utf-8"))
    h.update(json.dumps(special_tokens(tok), sort_keys=True).encode("utf-8"))
    return h.hexdigest()


def largest_token_id(tok: Any) -> int:
    """The largest id this tokenizer can emit, added tokens included."""
    return max(len(tok) - 1, tok.vocab_size - 1, max(tok.get_vocab().values(), default=0))


def check_ids_fit(ids: np.ndarray, dtype: np.dtype, where: str) -> None:
    """Fail loudly where the reference would silently wrap an id around."""
    if ids.size and int(ids.max()) > np.iinfo(dtype).max:
        raise TokenDtypeError(
            f"{where}: token id {int(ids.max())} does not fit {dtype.name} (chosen from tokenizer.vocab_size); "
            "rerun with output.token_dtype_rule: largest_id"
        )
