"""Data a chat template never renders: a message field (``tool_calls``, ``reasoning_content``, ...) or a
role (``tool``, ``wizard``) present in the rows but absent from every render. The reference renders such
rows all the same, and so do we (same bytes); the model then trains without that data, which a user
must hear about before hours of tokenizing, not find in ``inspect`` afterwards.

Found by rendering, not by reading the template: on the plan's sample rows, a field is unrendered where
removing it from every message leaves the render unchanged, and a role where a marker put in its
messages' content never appears in the render.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes

from sftmix.sources.formats import Conversation
from sftmix.tokenizing.templates import ChatRenderer

#: Put in a role's content to see whether the template renders it (private-use code points).
_MARKER = "\ue000tokenize-mixer-probe\ue001"


@dataclass(frozen=True)
class Unrendered:
    """``rows`` of ``of`` sample rows hold a message ``field`` (kind ``field``) or messages of a role
    (kind ``role``) that the template never renders."""

    kind: str
    name: str
    rows: int
    of: int

    @property
    def probe(self) -> str:
        """What the slices count it by: ``field:NAME`` or ``role:NAME``."""
        return f"{self.kind}:{self.name}"

    def describe(self, dataset: str, template: str, reads: str) -> str:
        what = f"message field {self.name!r}" if self.kind == "field" else f"messages of role {self.name!r}"
        return (
            f"{dataset}: {self.rows} of its first {self.of} rows hold {what}, which chat template {template} "
            f"never renders ({reads}): the model trains without it (the reference's bytes)"
        )


def unrendered(renderer: ChatRenderer, conversations: list[Conversation]) -> list[Unrendered]:
    """The fields and roles of ``conversations`` that ``renderer``'s template leaves out, with the number
    of conversations where it does."""
    fields: Counter[str] = Counter()
    roles: Counter[str] = Counter()
    for conv in conversations:
        try:
            full = renderer.render(conv.messages, conv.tools, False)
        except Exception:  # a row the template refuses: the slices report it, with its row
            continue
        keys = {
            k
            for m in conv.messages
            for k, v in m.items()
            if k not in ("role", "content") and v not in (None, "", [], {})
        }
        for key in sorted(keys):
            without = [{k: v for k, v in m.items() if k != key} for m in conv.messages]
            if _render(renderer, without, conv.tools) == full:
                fields[key] += 1
        for role in sorted({str(m.get("role")) for m in conv.messages if m.get("content")}):
            marked = [
                {**m, "content": _MARKER} if m.get("role") == role and m.get("content") else m
                for m in conv.messages
            ]
            text = _render(renderer, marked, conv.tools)
            if text is not None and _MARKER not in text:
                roles[role] += 1
    n = len(conversations)
    return [Unrendered("field", k, c, n) for k, c in sorted(fields.items())] + [
        Unrendered("role", r, c, n) for r, c in sorted(roles.items())
    ]


def holds(messages: list[dict[str, Any]], probe: str) -> bool:
    """Whether a row holds what ``probe`` (:attr:`Unrendered.probe`) names: a message with that field set,
    or a message of that role with content (as the plan's sample finds them)."""
    kind, _, name = probe.partition(":")
    if kind == "field":
        return any(m.get(name) not in (None, "", [], {}) for m in messages)
    return any(str(m.get("role")) == name and m.get("content") for m in messages)


def counted_lines(
    dataset: str, probes: list[str], counts: list[dict[str, int] | None], rows: int
) -> list[str]:
    """What the slices of a dataset (``counts``: each one's ``unrendered_rows``) counted of its ``rows``
    rows holding each of ``probes``, in words."""
    uncounted = sum(c is None for c in counts)
    return [
        counted_line(dataset, p, sum(c.get(p, 0) for c in counts if c is not None), rows, uncounted)
        for p in probes
    ]


def counted_line(dataset: str, probe: str, rows: int, of: int, uncounted: int) -> str:
    """The slices' count of rows holding ``probe`` over a dataset, in words."""
    kind, _, name = probe.partition(":")
    what = f"message field {name!r}" if kind == "field" else f"messages of role {name!r}"
    line = f"{dataset}: {rows:,} of its {of:,} rows hold {what} (counted over every row)"
    if uncounted:
        line += f"; {uncounted:,} slice(s) made by an earlier version were not counted"
    return line


def _render(renderer: ChatRenderer, messages: list[dict[str, Any]], tools: Any) -> str | None:
    try:
        return renderer.render(messages, tools, False)
    except Exception:  # the template needs what was taken away: it renders it
        return None


@lru_cache(maxsize=8)  # (said with each finding: the template is parsed once)
def what_it_reads(template_text: str) -> str:
    """The message fields and roles a template's text names, in words: ``it renders role, content and
    function_calls; roles system, user, assistant and environment``."""
    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template_text)
    except jinja2.TemplateSyntaxError:
        return "its text could not be read"
    keys, roles = set(), set()
    for node in tree.find_all(nodes.Getitem):
        if isinstance(node.arg, nodes.Const) and isinstance(node.arg.value, str):
            keys.add(node.arg.value)
    for call in tree.find_all(nodes.Call):
        if isinstance(call.node, nodes.Getattr) and call.node.attr == "get" and call.args:
            first = call.args[0]
            if isinstance(first, nodes.Const) and isinstance(first.value, str):
                keys.add(first.value)
    for compare in tree.find_all(nodes.Compare):
        for operand in [compare.expr, *(op.expr for op in compare.ops)]:
            if isinstance(operand, nodes.Const) and isinstance(operand.value, str):
                roles.add(operand.value)
    for test in tree.find_all(nodes.Filter):  # selectattr('role', 'equalto', 'system')
        consts = [a.value for a in test.args if isinstance(a, nodes.Const) and isinstance(a.value, str)]
        if consts[:2] == ["role", "equalto"] and len(consts) == 3:
            roles.add(consts[2])
    keys = {k for k in keys if re.fullmatch(r"[a-z_]+", k)}
    roles = {r for r in roles if re.fullmatch(r"[a-z_]+", r)}
    said = f"it renders {_words(sorted(keys))}" if keys else "it names no message field"
    return said + (f"; roles {_words(sorted(roles))}" if roles else "")


def _words(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]
