"""Whether a name that is not a local path can go to the Hugging Face hub at all.

A name like ``examples/tokenizer`` is a local directory or a hub id (``owner/name``); when it is not a
directory here and the hub cannot be resolved, ``huggingface_hub`` retries for most of a minute and then
reports a connection error about the hub. One name lookup answers first, and the message says both.
"""

from __future__ import annotations

import os
import socket
from functools import lru_cache
from urllib.parse import urlparse


def _offline() -> bool:
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
    if _offline():
        return None
    problem = _hub_host_problem()
    if problem is None:
        return None
    return f"is not a local directory (relative to the current directory {os.getcwd()}), and {problem}"
