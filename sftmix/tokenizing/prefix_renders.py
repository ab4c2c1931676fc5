"""Prefix renders by pasting: the template runs once per conversation *shape*, not per row and turn.

The masking rule needs ``render(m[:i], gen=True)`` and ``render(m[:i+1])`` for every assistant turn
``i``: two Jinja renders per turn, each as long as the chat so far, so a 40-turn chat costs the
square of what a 2-turn chat of the same text costs. Most templates never look inside a message's
text; they only paste it between their own literals. For those, every render is a function of the
conversation's shape (roles, which fields are set, which are empty) with the texts pasted in, so we
render each shape once with placeholders and build every row's prefixes by pasting its texts.

Why pasting gives Jinja's exact bytes, checked rather than assumed:

- a placeholder is a ``str`` that records every way a template can look inside it (comparison,
  hashing, length, membership, indexing, iteration, truth of a derived text, any ``str`` method but
  ``strip``/``lstrip``/``rstrip`` of a whole text, which yield a new placeholder for the stripped text);
  a shape whose renders do any of that is rendered with Jinja, row by row, as before;
- each shape is rendered with two unlike placeholder sets (different letters, lengths, padding, with
  quotes and backslashes inside): a transformation the recording cannot see (``~`` then ``trim``,
  JSON escaping) changes them differently, and a shape whose two renders disagree is refused;
- every row's pasted full render must equal its real full render (which the caller makes anyway),
  otherwise that row is rendered with Jinja.

The decision uses only the shape and the row itself, so the output never depends on which rows a
process saw before (slicing, worker count).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from sftmix.sources.formats import Conversation

logger = logging.getLogger(__name__)

#: Private-use characters that open and close placeholders; a text containing one is never pasted.
_MARKS = ("\ue000", "\ue001", "\ue002", "\ue003")
_MARK_RE = re.compile("[" + "".join(_MARKS) + "]")


@dataclass(frozen=True)
class _PlaceholderSet:
    head: str
    tail: str

    def text(self, n: int) -> str:
        return f"{self.head}{n}{self.tail}"

    @property
    def pattern(self) -> re.Pattern[str]:
        return re.compile(re.escape(self.head) + r"(\d+)" + re.escape(self.tail))


_SETS = (
    _PlaceholderSet(head=' \n\ue000a"\\', tail="\ue001\n "),
    _PlaceholderSet(head='\t \r\n\ue002QzB\\"', tail="x\ue003\r\n\t "),
)


#: ``str`` methods a placeholder answers with another placeholder: the pasted value is the same method
#: applied to the real text (e.g. the ``trim`` filter of Llama-3's template).
_DERIVABLE = frozenset({"strip", "lstrip", "rstrip"})


class _Probe:
    """What a template did to the placeholders during one shape's renders: the ways it looked inside
    them, and the texts it derived from them (numbered after the fields, in order of first use)."""

    def __init__(self, placeholders: _PlaceholderSet, n_fields: int) -> None:
        self.looked: set[str] = set()
        self.placeholders = placeholders
        self.n_fields = n_fields
        self.derived: list[tuple[int, str]] = []
        self._ids: dict[tuple[int, str], int] = {}

    def derive(self, base: int, method: str) -> _Placeholder:
        n = self._ids.get((base, method))
        if n is None:
            n = self._ids[base, method] = self.n_fields + len(self.derived)
            self.derived.append((base, method))
        return _Placeholder.make(self.placeholders.text(n), self, n)


class _Placeholder(str):
    """A message text standing in for any text: pasting it is fine, looking inside it is recorded."""

    _probe: _Probe
    _id: int | None  # the text it stands for; None for a concatenation that contains placeholders

    @classmethod
    def make(cls, text: str, probe: _Probe, n: int | None = None) -> _Placeholder:
        obj = cls(text)
        obj._probe = probe
        obj._id = n
        return obj

    def __str__(self) -> str:
        return self

    def __bool__(self) -> bool:
        if self._id is not None and self._id < self._probe.n_fields:
            return True  # a field's placeholder stands only for a non-empty text (empty ones stay "")
        self._probe.looked.add("__bool__")  # a derived text or a concatenation may be empty
        return True

    def __add__(self, other: Any) -> Any:
        result = str.__add__(self, other)
        return result if result is NotImplemented else _Placeholder.make(result, self._probe)

    def __radd__(self, other: Any) -> Any:
        if not isinstance(other, str):
            return NotImplemented
        return _Placeholder.make(str.__add__(other, self), self._probe)


def _recording(name: str) -> Callable[..., Any]:
    original = getattr(str, name)
    derivable = name in _DERIVABLE

    def method(self: _Placeholder, *args: Any, **kwargs: Any) -> Any:
        if derivable and self._id is not None and not kwargs and args in ((), (None,)):
            return self._probe.derive(self._id, name)
        self._probe.looked.add(name)
        return original(self, *args, **kwargs)

    method.__name__ = name
    return method


_LOOKING = (
    "__eq__",
    "__ne__",
    "__lt__",
    "__le__",
    "__gt__",
    "__ge__",
    "__hash__",
    "__len__",
    "__contains__",
    "__getitem__",
    "__iter__",
    "__mod__",
    "__mul__",
    "__rmul__",
    "__format__",
)
for _name in (*_LOOKING, *(n for n in dir(str) if not n.startswith("_") and n != "maketrans")):
    setattr(_Placeholder, _name, _recording(_name))


@dataclass(frozen=True)
class _Prefix:
    """One prefix render: its first ``shared`` pieces are the full render's, then ``tail`` pieces."""

    shared: int
    tail: tuple[str | int, ...]

    @cached_property
    def literal(self) -> str | None:
        """The tail as one string when it is the template's own text alone (most tails: an end-of-turn
        marker, the next header), made once per shape instead of once per row."""
        if any(isinstance(p, int) for p in self.tail):
            return None
        return "".join(self.tail)  # type: ignore[arg-type]  # only str pieces: checked above


@dataclass(frozen=True)
class _Skeleton:
    fields: tuple[tuple[int, str], ...]  # placeholder n stands for messages[i][key]
    derived: tuple[tuple[int, str], ...]  # then placeholder len(fields) + k is str.<method>(placeholder base)
    full: tuple[str | int, ...]
    turns: tuple[tuple[_Prefix | None, _Prefix], ...]  # (header, through) per assistant turn


def _pieces(rendered: str, placeholders: _PlaceholderSet) -> tuple[str | int, ...] | None:
    parts = placeholders.pattern.split(rendered)
    pieces: list[str | int] = []
    for k, part in enumerate(parts):
        if k % 2:
            pieces.append(int(part))
        elif _MARK_RE.search(part):
            return None  # a placeholder came out altered: the template transformed a text
        elif part:
            pieces.append(part)
    return tuple(pieces)


def _shape(conv: Conversation) -> tuple | None:
    """What a render may depend on besides the texts; ``None`` when the row cannot be pasted. (A text
    holding a placeholder's mark is refused where it shows: in the full render, see ``_pasted``.)"""
    if conv.tools is not None:
        return None
    shape = []
    for m in conv.messages:
        fields: list[tuple[str, str | int | None]] = []
        for key, value in m.items():
            if isinstance(value, str):
                fields.append((key, value if key == "role" or not value else 1))
            elif value is None:
                fields.append((key, None))
            else:
                return None
        shape.append(tuple(fields))
    return tuple(shape)


class PastedPrefix:
    """A pasted prefix render: the row's full render up to ``end``, then ``tail``. It becomes one string
    only when asked (``str``): all the prefixes of an n-turn chat together are quadratic in its length,
    one at a time linear. (A plain class with slots: two are made per assistant turn of every row, and a
    frozen dataclass's construction costs several times as much.)"""

    __slots__ = ("end", "full", "tail")

    def __init__(self, full: str, end: int, tail: str) -> None:
        self.full = full
        self.end = end
        self.tail = tail

    def __len__(self) -> int:
        return self.end + len(self.tail)

    def __str__(self) -> str:
        return self.full[: self.end] + self.tail

    def prefix_of(self, text: str) -> bool:
        """``text.startswith(str(self))``, without building the string when ``text`` is the full render."""
        if text is self.full:
            return text.startswith(self.tail, self.end)
        return text.startswith(str(self))


#: Bump when a skeleton's meaning or its file's layout changes: files of another version are not read.
SKELETON_FORMAT = 1


def _skeleton_json(skeleton: _Skeleton | None) -> Any:
    if skeleton is None:
        return None

    def prefix(p: _Prefix | None) -> Any:
        return None if p is None else [p.shared, list(p.tail)]

    return {
        "fields": [list(f) for f in skeleton.fields],
        "derived": [list(d) for d in skeleton.derived],
        "full": list(skeleton.full),
        "turns": [[prefix(h), prefix(t)] for h, t in skeleton.turns],
    }


def _skeleton_from_json(data: Any) -> _Skeleton | None:
    if data is None:
        return None

    def prefix(p: Any) -> _Prefix | None:
        return None if p is None else _Prefix(int(p[0]), tuple(p[1]))

    return _Skeleton(
        fields=tuple((int(i), str(k)) for i, k in data["fields"]),
        derived=tuple((int(b), str(m)) for b, m in data["derived"]),
        full=tuple(data["full"]),
        turns=tuple((prefix(h), _required(prefix(t))) for h, t in data["turns"]),
    )


def _digest(body: Any) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode("utf-8")).hexdigest()


def _required(prefix: _Prefix | None) -> _Prefix:
    if prefix is None:
        raise ValueError("a turn without its render")
    return prefix


class SkeletonStore:
    """Skeletons kept in a directory that a run's workers share, so that each shape's placeholder renders
    (the quadratic part: two placeholder sets, every prefix of the shape) are made once per run, not
    once per worker process: with 64 workers, 63 times fewer. A skeleton is a function of the template,
    the special tokens and the shape alone, so reading it gives what building it gives; each file carries
    the digest of its content and its key, and a file that does not match is built again and replaced."""

    def __init__(self, directory: str | Path, renderer_key: str) -> None:
        self.directory = Path(directory)
        self.renderer_key = renderer_key
        self.read = self.written = 0

    @staticmethod
    def renderer_key_of(template_text: str, special_tokens: dict[str, str]) -> str:
        text = json.dumps([SKELETON_FORMAT, template_text, sorted(special_tokens.items())])
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def _key(self, shape: tuple) -> str:
        return hashlib.sha256(f"{self.renderer_key}\n{shape!r}".encode()).hexdigest()

    def _path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}.json"

    def load(self, shape: tuple) -> tuple[bool, _Skeleton | None]:
        """(found, skeleton): found is False when there is no usable file."""
        key = self._key(shape)
        try:
            data = json.loads(self._path(key).read_text(encoding="utf-8"))
            if data["key"] != key or data["sha256"] != _digest(data["skeleton"]):
                return False, None
            skeleton = _skeleton_from_json(data["skeleton"])
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            return False, None
        self.read += 1
        return True, skeleton

    def save(self, shape: tuple, skeleton: _Skeleton | None) -> None:
        from sftmix.runtime.storage import atomic_write_bytes

        key = self._key(shape)
        body = _skeleton_json(skeleton)
        data = {"key": key, "sha256": _digest(body), "skeleton": body}
        path = self._path(key)
        try:
            atomic_write_bytes(path, json.dumps(data).encode("utf-8"))  # (its folder made as needed)
        except OSError as exc:  # a full or read-only disk: this process keeps its own, as before
            logger.debug("cannot keep a template skeleton in %s: %s", path, exc)
            return
        self.written += 1


class PrefixRenders:
    """The (header, through) prefix renders of each assistant turn, pasted when the shape allows."""

    def __init__(
        self,
        render: Callable[[list[dict], list | None, bool], str],
        max_shapes: int = 4096,
        store: SkeletonStore | None = None,
    ) -> None:
        self._render = render
        self._skeletons: dict[tuple, _Skeleton | None] = {}
        self._max_shapes = max_shapes
        self._store = store

    def paste(
        self, conv: Conversation, full: str, indices: Sequence[int]
    ) -> list[tuple[str | None, str]] | None:
        """Prefixes for the assistant turns ``indices`` of a row whose real full render is ``full``;
        ``None`` when they must come from Jinja."""
        pasted = self.paste_lazy(conv, full, indices)
        if pasted is None:
            return None
        return [(None if h is None else str(h), str(t)) for h, t in pasted]

    def paste_lazy(
        self, conv: Conversation, full: str, indices: Sequence[int]
    ) -> list[tuple[PastedPrefix | None, PastedPrefix]] | None:
        """:meth:`paste`, each prefix a :class:`PastedPrefix` (linear memory in the chat's length)."""
        found = self._pasted(conv, full, indices)
        if found is None:
            return None
        skeleton, values, offsets = found

        def build(prefix: _Prefix) -> PastedPrefix:
            tail = prefix.literal
            if tail is None:
                tail = "".join([p if isinstance(p, str) else values[p] for p in prefix.tail])
            return PastedPrefix(full, offsets[prefix.shared], tail)

        return [(None if h is None else build(h), build(t)) for h, t in skeleton.turns]

    def content_spans(
        self, conv: Conversation, full: str, indices: Sequence[int]
    ) -> list[tuple[int, int]] | None:
        """Exact character spans in ``full`` of the assistant turns ``indices``: from the first character
        of the turn's content to where the turn's own render (``render(m[:i+1])``) stops agreeing with the
        full render, and never before the content's end. ``None`` unless the row is pasted and each
        content appears exactly once, as itself or stripped (then the span is known, not inferred)."""
        found = self._pasted(conv, full, indices)
        if found is None:
            return None
        skeleton, values, offsets = found
        n_fields = len(skeleton.fields)
        spans = []
        for idx, (_, through) in zip(indices, skeleton.turns, strict=True):
            if (idx, "content") not in skeleton.fields:
                return None  # no content (a tool call only): nothing to anchor the span on
            field = skeleton.fields.index((idx, "content"))
            ids = {field} | {n_fields + k for k, (base, _) in enumerate(skeleton.derived) if base == field}
            at = [j for j, p in enumerate(skeleton.full) if isinstance(p, int) and p in ids]
            if len(at) != 1:
                return None
            start, content_end = offsets[at[0]], offsets[at[0] + 1]
            base = offsets[through.shared]
            tail = "".join([p if isinstance(p, str) else values[p] for p in through.tail])
            end = base + common_prefix_length(tail, full[base : base + len(tail)])
            spans.append((start, max(end, content_end)))
        return spans

    def _pasted(
        self, conv: Conversation, full: str, indices: Sequence[int]
    ) -> tuple[_Skeleton, list[str], list[int]] | None:
        """The row's skeleton, its pasted values and the character offset of every piece of ``full``;
        ``None`` unless pasting gives exactly ``full``."""
        shape = _shape(conv)
        if shape is None or any(mark in full for mark in _MARKS):  # (``in``: 20x a regex's speed)
            return None
        if shape not in self._skeletons:
            if len(self._skeletons) >= self._max_shapes:
                self._skeletons.clear()
            found, skeleton = (False, None) if self._store is None else self._store.load(shape)
            if not found:
                skeleton = self._build(conv.messages, indices)
                if self._store is not None:
                    self._store.save(shape, skeleton)
            self._skeletons[shape] = skeleton
        skeleton = self._skeletons[shape]
        if skeleton is None:
            return None
        values = [conv.messages[i][key] for i, key in skeleton.fields]
        for base, method in skeleton.derived:
            values.append(getattr(str, method)(values[base]))
        pasted = [p if isinstance(p, str) else values[p] for p in skeleton.full]
        if "".join(pasted) != full:
            return None
        return skeleton, values, list(itertools.accumulate(map(len, pasted), initial=0))

    def _build(self, messages: Sequence[dict], indices: Sequence[int]) -> _Skeleton | None:
        fields = [(i, k) for i, m in enumerate(messages) for k, v in m.items() if k != "role" and v]
        built = []
        for placeholders in _SETS:
            probe = _Probe(placeholders, len(fields))
            by_field = {f: _Placeholder.make(placeholders.text(n), probe, n) for n, f in enumerate(fields)}
            stand_in = [{k: by_field.get((i, k), v) for k, v in m.items()} for i, m in enumerate(messages)]
            try:
                skeleton = self._build_one(stand_in, indices, placeholders, fields)
            except Exception:
                return None  # the row's own renders will raise it, with the row named
            if skeleton is None or probe.looked:
                return None
            built.append(replace(skeleton, derived=tuple(probe.derived)))
        # Equal full renders and equal (shared, tail) splits of them are equal prefix renders.
        return built[0] if built[0] == built[1] else None

    def _build_one(
        self,
        stand_in: list[dict],
        indices: Sequence[int],
        placeholders: _PlaceholderSet,
        fields: list[tuple[int, str]],
    ) -> _Skeleton | None:
        """One placeholder set's skeleton. Each prefix render is split against the full render as soon
        as it is made: a chat of n turns keeps n short tails, not n renders as long as the chat (a
        5,000-turn chat held gigabytes of them)."""
        full = _pieces(self._render(stand_in, None, False), placeholders)
        if full is None:
            return None  # a placeholder came out altered
        turns = []
        for idx in indices:
            header = None
            if idx:
                pieces = _pieces(self._render(stand_in[:idx], None, True), placeholders)
                if pieces is None:
                    return None
                header = _split(pieces, full)
            pieces = _pieces(self._render(stand_in[: idx + 1], None, False), placeholders)
            if pieces is None:
                return None
            turns.append((header, _split(pieces, full)))
        return _Skeleton(fields=tuple(fields), derived=(), full=full, turns=tuple(turns))


def common_prefix_length(a: str, b: str) -> int:
    """Length of the longest common prefix (binary search over C-speed slice comparisons)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _split(prefix: tuple[str | int, ...] | None, full: tuple[str | int, ...]) -> _Prefix:
    assert prefix is not None
    shared = 0
    for a, b in zip(prefix, full, strict=False):
        if a != b:
            break
        shared += 1
    return _Prefix(shared=shared, tail=prefix[shared:])
