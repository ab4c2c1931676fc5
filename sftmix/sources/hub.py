"""Whether a name that is not a local path can go to the Hugging Face hub at all.

A name like ``examples/tokenizer`` is a local directory or a hub id (``owner/name``); when it is not a
directory here and the hub cannot be resolved, ``huggingface_hub`` retries for most of a minute and then
reports a connection error about the hub. One name lookup answers first, and the message says both.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from urllib.parse import urlparse


def offline() -> bool:
    """``HF_HUB_OFFLINE``: the hub is not asked; what its cache holds is all there is."""
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


@lru_cache(maxsize=1)
def _hub_host_problem() -> str | None:
    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError as exc:
        return f"the Hugging Face hub ({host}) cannot be reached: {exc.strerror or exc}"
    return None


def unreachable_hub_problem() -> str | None:
    """Why a name that is not a local path here cannot be loaded from the hub right now, or ``None``
    (the hub resolves, or offline mode, where the cache answers at once). The reason does not repeat
    the name: the error it goes into names it (``dataset 'x': is not ...``)."""
    if offline():
        return None
    problem = _hub_host_problem()
    if problem is None:
        return None
    return f"is not a local directory (relative to the current directory {os.getcwd()}), and {problem}"


def _huggingface_home() -> Path:
    home = os.environ.get("HF_HOME")
    if home:
        return Path(home).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "huggingface"


def _hub_caches() -> list[Path]:
    """Where ``huggingface_hub`` keeps downloaded repositories (the settings it reads, in its order)."""
    named = [os.environ.get(v) for v in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE")]
    return [Path(p).expanduser() for p in named if p] + [_huggingface_home() / "hub"]


def _holds(folder: Path, name: str) -> bool:
    """Whether ``folder`` has an entry called ``name``, whatever its case (hub ids are not case-sensitive)."""
    try:
        return any(entry.lower() == name.lower() for entry in os.listdir(folder))
    except OSError:
        return False


def offline_cache_problem(
    name: str, kind: str, datasets_caches: Iterable[str | os.PathLike[str]] = ()
) -> str | None:
    """Under ``HF_HUB_OFFLINE``, why hub name ``name`` (``kind`` ``dataset`` or ``model``) cannot load: no
    local cache holds it (the hub's, and for a dataset ``datasets``' own and ``datasets_caches``), so a
    typo is said at once rather than after the loaders looked. ``None`` online or where a cache has it."""
    if not offline():
        return None
    repo, hub_caches = f"{kind}s--{name.replace('/', '--')}", _hub_caches()
    if any(_holds(cache, repo) for cache in hub_caches):
        return None
    looked = [str(c) for c in hub_caches]
    if kind == "dataset":
        prepared = name.replace("/", "___")  # ``datasets``' folder for a hub dataset it has prepared
        caches = [Path(os.environ.get("HF_DATASETS_CACHE") or _huggingface_home() / "datasets").expanduser()]
        caches += [Path(c) for c in datasets_caches]
        if any(_holds(cache, prepared) for cache in caches):
            return None
        looked += [str(c) for c in caches]
    what = "tokenizer" if kind == "model" else kind
    return (
        f"is not a local path, and HF_HUB_OFFLINE is set while no local cache holds it: a typo, or a {what} "
        "not downloaded to this machine yet (download it where the hub can be reached, or unset HF_HUB_OFFLINE; "
        "looked in " + ", ".join(looked) + ")"
    )
