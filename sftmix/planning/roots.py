"""An optional allow-list of the places a run may read and write (local directories, gs:// prefixes).

Two sources, one rule:

- ``TOKENIZE_MIXER_ALLOWED_ROOTS`` in the environment of the process that runs the flow (the worker):
  roots separated by ``os.pathsep`` (``:``), e.g. ``/data/sft:/scratch/tokenize-mixer:gs://my-bucket/sft``.
  Whoever starts the worker sets it; a caller of the API can set run parameters, not this.
- ``run.allowed_roots`` (a run parameter): may only *narrow* the worker's roots. Each of its roots must
  lie inside one of the worker's roots when the environment variable is set, or the run is refused.

Neither set: no restriction (the default). Set but empty: nothing is allowed.

What is checked, before any work: every dataset path, the tokenizer when it is a local directory, a
``.jinja`` chat template file, ``mixer.output.path``, the work directory (``run.work_dir``, or the default
``$TOKENIZE_MIXER_WORK_DIR`` / ``~/.cache/tokenize-mixer`` when unset) and ``run.reference``. Local
paths are resolved with :func:`os.path.realpath` (relative to the current directory, symlinks followed)
before they are compared, and a root matches a path equal to it or below it, component by component
(``/data2`` is not under ``/data``). A local output must lie strictly below a root: publishing writes a
staging directory beside it.

A hub name (``allenai/tulu-3-sft-mixture``, ``gpt2``) is not a path: a name of one or two components
of letters, digits, ``_``, ``.`` and ``-`` (each starting with a letter or digit), without a data file
suffix (``.jsonl``, ``.json.gz``, ``.parquet``, ``.csv``, ...) or a URL scheme, that does not exist on this machine
(``datasets`` and ``transformers`` load an existing local directory of that name instead of the hub).
Anything else is a path and is checked.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from sftmix.config.config import MixerConfig
from sftmix.config.run_options import RunOptions, default_work_dir
from sftmix.errors import ConfigError
from sftmix.runtime import settings
from sftmix.runtime.storage import is_remote
from sftmix.sources.paths import local_builder, looks_local

ENV = settings.ALLOWED_ROOTS.name

_HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
#: fsspec spellings of the same store.
_SCHEME_ALIASES = {"gcs": "gs"}


@dataclass(frozen=True)
class Place:
    """A local path (scheme ``""``, components of its real path) or a URL (scheme, bucket and key parts)."""

    scheme: str
    parts: tuple[str, ...]
    text: str

    def within(self, root: Place, strictly: bool = False) -> bool:
        n = len(root.parts)
        return (
            self.scheme == root.scheme
            and self.parts[:n] == root.parts
            and (len(self.parts) > n if strictly else True)
        )

    def shown(self) -> str:
        """How a refusal names it: as typed, and what it resolved to when that differs."""
        if self.scheme:
            return repr(self.text)
        real = os.path.join(*self.parts)
        return repr(self.text) if real == self.text else f"{self.text!r} (resolves to {real})"


def split_roots(value: str) -> list[str]:
    """Roots of the environment variable: ``os.pathsep``-separated, where ``gs://bucket/prefix`` keeps
    its ``:`` (a scheme piece joins the piece after it that starts with ``//``). Empty entries are ignored."""
    pieces = value.split(os.pathsep)
    roots: list[str] = []
    i = 0
    while i < len(pieces):
        piece = pieces[i].strip()
        if (
            os.pathsep == ":"
            and _SCHEME.fullmatch(piece)
            and i + 1 < len(pieces)
            and pieces[i + 1].startswith("//")
        ):
            piece = f"{piece}:{pieces[i + 1].strip()}"
            i += 1
        if piece:
            roots.append(piece)
        i += 1
    return roots


def _url(text: str, what: str) -> Place:
    scheme, _, rest = text.partition("://")
    scheme = scheme.lower()
    scheme = _SCHEME_ALIASES.get(scheme, scheme)
    parts = tuple(rest.rstrip("/").split("/"))
    if not parts[0]:
        raise ConfigError(f"{what} {text!r}: a URL needs a bucket (scheme://bucket/prefix)")
    if any(p in (".", "..") for p in parts):
        raise ConfigError(
            f"{what} {text!r}: '.' and '..' are not allowed in a URL when allowed roots are set"
        )
    return Place(scheme, parts, text)


def place(text: str, what: str) -> Place:
    """Where ``text`` (as a loader would read it) points: a URL, or a local real path."""
    if text.startswith("file://"):
        return Place("", Path(os.path.realpath(text[len("file://") :])).parts, text)
    if is_remote(text):
        return _url(text, what)
    return Place("", Path(os.path.realpath(text)).parts, text)


def root_place(text: str, what: str) -> Place:
    """A root: a URL, or an absolute local directory (``~`` expanded)."""
    if is_remote(text):
        return _url(text, what)
    local = os.path.expanduser(text.removeprefix("file://"))
    if not os.path.isabs(local):
        raise ConfigError(f"{what}: root {text!r} must be an absolute directory or a gs://bucket/prefix URL")
    return Place("", Path(os.path.realpath(local)).parts, text)


def is_hub_name(name: str, dataset: bool = False) -> bool:
    """A name the hub is asked for, not a local path (see the module docstring)."""
    if is_remote(name) or name.startswith("file://") or not _HUB_NAME.fullmatch(name):
        return False
    if dataset and (local_builder(name) is not None or looks_local(name)):
        return False  # the loader reads these as local files (sftmix.sources.whole.arrow)
    return not os.path.lexists(name)


def effective_roots(run: RunOptions) -> tuple[list[Place], str] | None:
    """The roots that bind this run and where they come from, or ``None`` (no restriction)."""
    env = settings.ALLOWED_ROOTS.raw()
    worker = None if env is None else [root_place(t, ENV) for t in split_roots(env)]
    if run.allowed_roots is None:
        return None if worker is None else (worker, ENV)
    asked = [root_place(t, "run.allowed_roots") for t in run.allowed_roots]
    if worker is not None:
        wider = [r for r in asked if not any(r.within(w) for w in worker)]
        if wider:
            raise ConfigError(
                f"run.allowed_roots {', '.join(repr(r.text) for r in wider)} "
                f"{'is' if len(wider) == 1 else 'are'} outside the worker's {ENV} "
                f"({', '.join(w.text for w in worker) or 'none'}): a run may narrow the worker's roots, "
                "not widen them"
            )
        return asked, f"run.allowed_roots (within {ENV})"
    return asked, "run.allowed_roots"


def run_paths(mixer: MixerConfig, run: RunOptions) -> list[tuple[str, str, bool]]:
    """Every path the run would read or write: (what, path, must lie strictly below a root)."""
    paths = [
        (f"mixer.datasets[{i}].path", d.path, False)
        for i, d in enumerate(mixer.datasets)
        if not is_hub_name(d.path, dataset=True)
    ]
    tok = mixer.tokenizer
    if not is_hub_name(tok.name_or_path):
        paths.append(("mixer.tokenizer.name_or_path", tok.name_or_path, False))
    if tok.chat_template and tok.chat_template.endswith(".jinja"):
        paths.append(("mixer.tokenizer.chat_template", tok.chat_template, False))
    paths.append(("mixer.output.path", mixer.output.path, not is_remote(mixer.output.path)))
    if run.work_dir is not None:
        paths.append(("run.work_dir", run.work_dir, False))
    else:
        paths.append(("the default work directory", str(default_work_dir()), False))
    if run.reference is not None:
        paths.append(("run.reference", run.reference, False))
    return paths


def check_allowed_roots(mixer: MixerConfig, run: RunOptions) -> None:
    """Refuse (``ConfigError``, one line per path) a run that would read or write outside its allowed
    roots; nothing to do when no roots are set."""
    _refuse_outside(run_paths(mixer, run), run)


def check_slices_allowed(datasets: list[str], tokenizer: str, remote_work_dir: str | None) -> None:
    """A batch of slices submitted through the API (runner ``work_pool``) reads datasets and a tokenizer
    and writes a work directory, all named by its parameters: the worker's roots bind them as they bind
    a whole run. Its local paths are the machine's own, never a parameter: the work directory must be
    remote (each machine keeps its own mirror of it)."""
    if remote_work_dir is None:
        raise ConfigError(
            "a batch of slices needs a remote work directory (gs://...): it is run by other machines"
        )
    paths = [("work_dir", remote_work_dir, False)]
    paths += [("dataset", d, False) for d in sorted(set(datasets)) if not is_hub_name(d, dataset=True)]
    if not is_hub_name(tokenizer):
        paths.append(("tokenizer", tokenizer, False))
    _refuse_outside(paths, RunOptions())


def _refuse_outside(paths: list[tuple[str, str, bool]], run: RunOptions) -> None:
    bound = effective_roots(run)
    if bound is None:
        return
    roots, source = bound
    problems = []
    for what, text, strictly in paths:
        p = place(text, what)
        if not any(p.within(r, strictly) for r in roots):
            is_a_root = strictly and any(p.within(r) for r in roots)
            below = " (is a root: it must lie below one, publishing writes beside it)" if is_a_root else ""
            problems.append(f"  {what} {p.shown()}{below}")
    if problems:
        allowed = ", ".join(r.text for r in roots) or "none"
        raise ConfigError(f"outside the allowed roots ({allowed}, from {source}):\n" + "\n".join(problems))
