"""No secret in a log line, whatever logger writes it and wherever the line goes (the console, a log
file, the Prefect UI through its API handler).

With ``-v`` every library logs at DEBUG, and some log what they send: the ``websockets`` client logs
the ``Authorization: Basic ...`` header of Prefect's events socket and its ``{"type": "auth", "token":
...}`` message. So the secrets this process knows (the Prefect API's auth string or key, a hub token)
are replaced by ``***`` in every log record as it is made (a record factory: before any handler or
filter sees it), in the raw form and in the base64 form of an HTTP basic ``Authorization`` header.
"""

from __future__ import annotations

import base64
import logging
import os
import threading
from typing import Any

from sftmix.runtime import settings

#: Environment settings whose values are secrets (read when the console is set up, here and in workers).
SECRET_SETTINGS = (
    "PREFECT_API_AUTH_STRING",
    "PREFECT_SERVER_API_AUTH_STRING",
    "PREFECT_API_KEY",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    settings.AUTH_STRING.name,
)
MASK = "***"
#: Shorter values are not redacted: they would mask ordinary words (no real secret is this short).
_MIN_LENGTH = 6

_secrets: tuple[str, ...] = ()
_lock = threading.Lock()
_installed = False


def add_secret(value: str | None) -> None:
    """Redact ``value`` (and its basic-auth form) from every log record made from now on."""
    global _secrets
    if not value or len(value) < _MIN_LENGTH:
        return
    forms = {value, base64.b64encode(value.encode("utf-8")).decode("ascii")}
    with _lock:
        _secrets = tuple(sorted(set(_secrets) | forms, key=len, reverse=True))
    _install()


def add_secrets_from_environment() -> None:
    for name in SECRET_SETTINGS:
        add_secret(os.environ.get(name))


def redact(text: str) -> str:
    for secret in _secrets:
        if secret in text:
            text = text.replace(secret, MASK)
    return text


def _redact_record(record: logging.LogRecord) -> None:
    try:
        message = record.getMessage()
    except Exception:  # a malformed record is the logging module's to report
        return
    clean = redact(message)
    if clean != message:
        record.msg, record.args = clean, None
    if record.exc_info and record.exc_text is None:
        text = logging.Formatter().formatException(record.exc_info)
        clean = redact(text)
        if clean != text:
            record.exc_text = clean


def _install() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    make_record = logging.getLogRecordFactory()

    def redacting_factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        if _secrets:
            _redact_record(record)
        return record

    logging.setLogRecordFactory(redacting_factory)
