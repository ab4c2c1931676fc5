"""What a run needs to know of its tokenizer, kept per tokenizer directory so that a command whose
tokenizer did not change never imports transformers (its import and ``AutoTokenizer`` cost 1.3-2 s of
every command on 2 cores, more than the rest of a small run's planning).

Kept in the user's cache, under a key made of the directory's contents (each file's bytes, hashed; a
file too large to be part of a tokenizer, a model's weights, by size and time), the transformers and
tokenizers versions and :data:`FACTS_VERSION`: any change loads the tokenizer again. Hub names are not
kept (what a name means can change on the hub): they load as before. What is kept is what the loaded
tokenizer gave, so a run gives the same bytes either way (a test runs both).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from sftmix.errors import TokenDtypeError
from sftmix.runtime.storage import write_cache_file
from sftmix.tokenizing.encoder_proof import ANALYSIS_VERSION
from sftmix.tokenizing.tokenizer import (
    TOKEN_DTYPES,
    TokenizerKey,
    largest_token_id,
    load_changes,
    load_hf_tokenizer,
    save_worker_tokenizer,
    special_tokens,
    tokenizer_fingerprint,
)

#: Part of every key: raise it when what is kept, or how it is made, changes.
FACTS_VERSION = 3  # 3: eos_id

#: Files above this size are keyed by size and modification time, not by their bytes.
HASHED_FILE_LIMIT = 64 * 1024 * 1024

#: A kept copy of a saved tokenizer lists its files in this file, written last.
FILE_LIST = "tokenize-mixer-files.json"


@dataclass(frozen=True)
class TokenizerFacts:
    """The loaded tokenizer's answers that a plan and an output need (after the reference's ``<pad>``)."""

    fingerprint: str
    chat_template: str | dict[str, str] | None
    bos_token: str | None
    special_tokens: dict[str, str]
    vocab_size: int
    largest_id: int
    tokenizer_class: str = ""  # the class that built it (sftmix.tokenizing.tokenizer_load)
    load_changes: tuple[str, ...] = ()  # what the reference's build has in place of its files' parts
    eos_id: int | None = None  # the id over_length_strategy terminate ends a cut row with

    def token_dtype(self, rule: str = "vocab_size") -> np.dtype:
        """Smallest unsigned dtype for the token parts; 'vocab_size' is the reference's rule."""
        top = self.vocab_size - 1 if rule == "vocab_size" else self.largest_id
        for dt in TOKEN_DTYPES:
            if top <= np.iinfo(dt).max:
                return np.dtype(dt)
        raise TokenDtypeError(f"vocabulary of {top + 1} ids does not fit any unsigned integer dtype")


def facts_dir() -> Path:
    """``$XDG_CACHE_HOME/tokenize-mixer/tokenizer-facts``."""
    from sftmix.config.run_options import cache_subdir

    return cache_subdir("tokenizer-facts")


@lru_cache(maxsize=4)
def _kept_dir(key: TokenizerKey) -> Path | None:
    """This tokenizer's directory in the cache, or ``None`` where nothing is kept (a hub name)."""
    if not os.path.isdir(key.name_or_path):
        return None
    from importlib.metadata import PackageNotFoundError, version

    h = hashlib.sha256()
    for package in ("transformers", "tokenizers"):
        try:
            h.update(f"{package} {version(package)}\n".encode())
        except PackageNotFoundError:
            h.update(f"{package} none\n".encode())
    h.update(
        f"facts {FACTS_VERSION} analysis {ANALYSIS_VERSION} revision {key.revision} load {key.load}\n".encode()
    )
    for entry in sorted(os.scandir(key.name_or_path), key=lambda e: e.name):
        if not entry.is_file():
            continue
        stat = entry.stat()
        h.update(f"{entry.name}\0{stat.st_size}\0".encode())
        if stat.st_size > HASHED_FILE_LIMIT:
            h.update(f"{stat.st_mtime_ns}\n".encode())
            continue
        with open(entry.path, "rb") as fh:
            h.update(hashlib.file_digest(fh, "sha256").digest())
    return facts_dir() / h.hexdigest()[:32]


@lru_cache(maxsize=4)
def tokenizer_facts(key: TokenizerKey) -> TokenizerFacts:
    """The facts, kept ones where this tokenizer's are kept; else from the loaded tokenizer (and kept)."""
    kept = _kept_dir(key)
    if kept is not None:
        try:
            data = json.loads((kept / "facts.json").read_text(encoding="utf-8"))
            return TokenizerFacts(**{**data, "load_changes": tuple(data.get("load_changes") or ())})
        except (OSError, ValueError, TypeError):
            pass
    tok = load_hf_tokenizer(key)
    facts = TokenizerFacts(
        fingerprint=tokenizer_fingerprint(key),
        chat_template=tok.chat_template,
        bos_token=tok.bos_token,
        special_tokens=special_tokens(tok),
        vocab_size=int(tok.vocab_size),
        largest_id=int(largest_token_id(tok)),
        tokenizer_class=type(tok).__name__,
        load_changes=load_changes(key),
        eos_id=None if tok.eos_token_id is None else int(tok.eos_token_id),
    )
    if kept is not None:
        write_cache_file(kept / "facts.json", json.dumps(asdict(facts), sort_keys=True).encode("utf-8"))
    return facts


def worker_tokenizer_file(key: TokenizerKey, directory: str | os.PathLike[str]) -> str:
    """:func:`sftmix.tokenizing.tokenizer.save_worker_tokenizer`, copied from the kept one where there is one."""
    from sftmix.runtime.storage import atomic_write_bytes

    fingerprint = tokenizer_facts(key).fingerprint
    path = os.path.join(directory, f"{fingerprint}.json")
    kept = _kept_dir(key)
    if kept is not None and not os.path.isfile(path):
        try:
            data = (kept / "worker.json").read_bytes()
            if json.loads(data).get("analysis_version") == ANALYSIS_VERSION:
                atomic_write_bytes(path, data)
                return path
        except (OSError, ValueError, AttributeError):
            pass
    written = save_worker_tokenizer(key, directory, fingerprint)
    if kept is not None and not (kept / "worker.json").is_file():
        write_cache_file(kept / "worker.json", Path(written).read_bytes())
    return written


def write_tokenizer_dir(key: TokenizerKey, template_text: str, directory: Path) -> None:
    """:func:`save_tokenizer`'s files (the tokenizer with the run's chat template, as
    the reference saves it), copied from the kept ones where there are."""
    kept = _kept_dir(key)
    if kept is None:
        save_tokenizer(key, template_text, directory)
        return
    saved = kept / f"saved-{hashlib.sha256(template_text.encode('utf-8')).hexdigest()[:32]}"
    names = _saved_names(saved)
    if names is None:
        save_tokenizer(key, template_text, directory)
        _keep_saved(directory, saved)
        return
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copyfile(saved / name, directory / name)


def save_tokenizer(key: TokenizerKey, template_text: str, directory: Path) -> None:
    """The tokenizer with the chat template used, as the reference saves it (not digested)."""
    # A shallow copy is enough: only chat_template differs, and save_pretrained reads the rest (a deep
    # copy of a 100k-entry vocabulary cost about a second at the end of every run).
    tok = copy.copy(load_hf_tokenizer(key))
    tok.chat_template = template_text
    directory.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(directory))
    template_file, config_file = directory / "chat_template.jinja", directory / "tokenizer_config.json"
    if template_file.exists() and config_file.exists():
        config = json.loads(config_file.read_text(encoding="utf-8"))
        if "chat_template" not in config:
            config["chat_template"] = template_file.read_text(encoding="utf-8")
            config_file.write_text(json.dumps(config, indent=2), encoding="utf-8")


def _saved_names(saved: Path) -> list[str] | None:
    """The files of a complete kept copy (its list is written last), or ``None``."""
    try:
        names = json.loads((saved / FILE_LIST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(names, list) or not all(isinstance(n, str) and (saved / n).is_file() for n in names):
        return None
    return names


def _keep_saved(directory: Path, saved: Path) -> None:
    """A copy of ``directory``'s files in ``saved``, its list last (a copy missing one is never used)."""
    names = sorted(p.name for p in directory.iterdir() if p.is_file())
    for name in names:
        write_cache_file(saved / name, (directory / name).read_bytes())
    write_cache_file(saved / FILE_LIST, json.dumps(names).encode("utf-8"))
