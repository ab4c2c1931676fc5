"""Rows become conversations (messages + tools), with errors that say which row and why."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

MESSAGES_KEY = "messages"
TOOLS_KEY = "tools"


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


def conversation_from_row(row: dict[str, Any]) -> Conversation:
    """Validate a ``messages`` row: a non-empty list of {role: str, content: str|None} dicts."""
    if MESSAGES_KEY not in row:
        raise RowFormatError(f"no '{MESSAGES_KEY}' field (fields: {', '.join(sorted(row))})")
    messages = row[MESSAGES_KEY]
    if not isinstance(messages, list):
        raise RowFormatError(f"'{MESSAGES_KEY}' must be a list of messages, got {type(messages).__name__}")
    if not messages:
        raise RowFormatError(f"'{MESSAGES_KEY}' is empty")
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
