"""Rows become conversations (messages + tools), with errors that say which row and why.

Three row layouts are read: ``messages`` (a list of {role, content}; the column may be named otherwise
with ``messages_key``), Alpaca (``instruction``, optional ``input``, ``output``, optional ``system``)
and ShareGPT (``conversations`` of {from, value}). The latter two become messages before the template
sees them, so all three give the same tokens for the same chat.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal

MESSAGES_KEY = "messages"
TOOLS_KEY = "tools"
SHAREGPT_KEY = "conversations"
ALPACA_KEYS = ("instruction", "output")

RowFormat = Literal["messages", "alpaca", "sharegpt"]

#: ShareGPT speaker names and the roles they become.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}


class RowFormatError(ValueError):
    """A row cannot be turned into a conversation; the caller adds dataset and row."""


@dataclass(frozen=True)
class Conversation:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The tool schemas a chat template sees: a JSON string, a dict or a list of dicts (or nothing)."""
    if tools is None or tools == "" or (isinstance(tools, float) and math.isnan(tools)):
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise RowFormatError(f"'tools' is not valid JSON ({exc.msg} at char {exc.pos})") from None
        if tools is None or tools == "":
            return None
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list):
        raise RowFormatError(f"'tools' must be a list, dict or JSON string, got {type(tools).__name__}")
    if not tools:
        return None
    if not all(isinstance(t, dict) for t in tools):
        raise RowFormatError("'tools' must hold JSON-schema objects (dicts)")
    return tools


def detect_format(
    columns: tuple[str, ...] | list[str], messages_key: str | None, declared: str = "auto"
) -> tuple[RowFormat, str]:
    """The layout of a dataset (declared, or detected from its columns), or ``ValueError`` saying
    what was expected."""
    if declared == "sharegpt" and SHAREGPT_KEY not in columns:
        raise ValueError(f"format sharegpt needs a '{SHAREGPT_KEY}' column (columns: {', '.join(columns)})")
    if declared == "alpaca" and not all(k in columns for k in ALPACA_KEYS):
        raise ValueError(
            f"format alpaca needs 'instruction' and 'output' columns (columns: {', '.join(columns)})"
        )
    if declared in ("sharegpt", "alpaca"):
        return declared, SHAREGPT_KEY if declared == "sharegpt" else "instruction"  # type: ignore[return-value]  # sharegpt or alpaca here
    if declared == "messages" and messages_key is None:
        messages_key = MESSAGES_KEY
    if messages_key is not None:
        if messages_key not in columns:
            raise ValueError(f"no {messages_key!r} column (messages_key; columns: {', '.join(columns)})")
        return "messages", messages_key
    if MESSAGES_KEY in columns:
        return "messages", MESSAGES_KEY
    if SHAREGPT_KEY in columns:
        return "sharegpt", SHAREGPT_KEY
    if all(k in columns for k in ALPACA_KEYS):
        return "alpaca", "instruction"
    raise ValueError(
        f"no '{MESSAGES_KEY}' column (columns: {', '.join(columns)}); expected messages, ShareGPT "
        f"'{SHAREGPT_KEY}', Alpaca 'instruction'/'output', or set messages_key"
    )


def _text(row: dict[str, Any], key: str, required: bool) -> str:
    value = row.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise RowFormatError(f"'{key}' must be a string, got {type(value).__name__}")
    return value


def alpaca_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    """instruction (+ a blank line + input, when there is one) -> user; output -> assistant."""
    instruction, extra = _text(row, "instruction", True), _text(row, "input", False)
    messages = []
    if system := _text(row, "system", False):
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": f"{instruction}\n\n{extra}" if extra else instruction})
    messages.append({"role": "assistant", "content": _text(row, "output", True)})
    return messages


def sharegpt_messages(turns: Any) -> list[dict[str, Any]]:
    if not isinstance(turns, list):
        raise RowFormatError(f"'{SHAREGPT_KEY}' must be a list of turns, got {type(turns).__name__}")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RowFormatError(
                f"turn {i} must be an object with 'from' and 'value', got {type(turn).__name__}"
            )
        speaker = turn.get("from")
        if speaker not in SHAREGPT_ROLES:
            raise RowFormatError(
                f"turn {i} has an unknown speaker {speaker!r} (known: {', '.join(SHAREGPT_ROLES)})"
            )
        messages.append({"role": SHAREGPT_ROLES[speaker], "content": turn.get("value")})
    return messages


def conversation_from_row(
    row: dict[str, Any], row_format: RowFormat = "messages", key: str = MESSAGES_KEY
) -> Conversation:
    """Validate a row and return its conversation: a non-empty list of {role: str, content: str|None}."""
    if row_format == "alpaca":
        messages: Any = alpaca_messages(row)
    elif row_format == "sharegpt":
        if SHAREGPT_KEY not in row:
            raise RowFormatError(f"no '{SHAREGPT_KEY}' field (fields: {', '.join(sorted(row))})")
        messages = sharegpt_messages(row[SHAREGPT_KEY])
    else:
        if key not in row:
            raise RowFormatError(f"no '{key}' field (fields: {', '.join(sorted(row))})")
        messages = row[key]
    if not isinstance(messages, list):
        raise RowFormatError(f"'{key}' must be a list of messages, got {type(messages).__name__}")
    if not messages:
        raise RowFormatError(f"'{key}' is empty")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RowFormatError(
                f"message {i} must be an object with 'role' and 'content', got {type(message).__name__}"
            )
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise RowFormatError(f"message {i} has no 'role' string")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise RowFormatError(
                f"message {i} ({role}) has content of type {type(content).__name__}; expected a string"
            )
    return Conversation(messages=messages, tools=normalize_tools(row.get(TOOLS_KEY)))
