"""Special tokens written literally in the rows (``<|im_end|>`` inside a ShareGPT answer).

The tokenizer reads such text as the special token itself, so the model learns to emit it mid-answer
(the reference's way, ``keep``). ``split`` reads it as plain text, as the tokenizers library's
``encode_special_tokens`` does, while the template's own special tokens stay special; ``drop`` skips the
row (counted).

Split gives the template's special tokens other names: in the template's text and the special-token
variables it renders, each special token the template writes is renamed to a character of Unicode's
Supplementary Private Use Area-B, and in the tokenizer the added token is renamed the same way (same id);
special tokens the template never writes are no longer added tokens at all. One tokenizer then reads the
template's tokens as special and the rows' as text. A row holding one of those characters itself is a
bad row (it would read as a template token). What the masker compares with the rows (the reference's
span check) is read with the tokens' own names again.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

from pydantic import BaseModel, Field

from sftmix.sources.formats import RowFormatError

#: The first character names are drawn from (U+100000, Supplementary Private Use Area-B).
FIRST_NAME = 0x100000
#: The settings, the reference's first.
MODES = ("keep", "split", "drop")
#: The tokenizer setting that chooses among them, as a person's messages name it.
SETTING = "literal_special_tokens"


@dataclass(frozen=True)
class Renaming:
    """Each special token the template writes (``names``: its text -> its new name), and the special
    tokens nobody writes but the rows may (``unnamed``: read as text)."""

    names: dict[str, str]
    unnamed: tuple[str, ...] = ()
    _back: dict[int, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._back.update({ord(name): text for text, name in self.names.items()})

    @cached_property
    def _pattern(self) -> re.Pattern[str] | None:
        return _alternation(self.names)

    def template(self, text: str) -> str:
        """The template's text with its special tokens renamed."""
        if self._pattern is None:
            return text
        return self._pattern.sub(lambda m: self.names[m.group(0)], text)

    def variables(self, special_tokens: dict[str, str]) -> dict[str, str]:
        """The special-token variables a template renders (``eos_token``, ...), renamed."""
        return {k: self.template(v) for k, v in special_tokens.items()}

    def restore(self, text: str) -> str:
        """``text`` with the template's tokens under their own names again."""
        return text.translate(self._back) if self._back else text

    def backend(self, backend_json: str) -> str:
        """The tokenizer (``tokenizer.json``'s text) whose added tokens are the renamed ones: a special
        token the template writes has its new name, one it does not is read as text."""
        data = json.loads(backend_json)
        unnamed = set(self.unnamed)
        added = []
        for token in data.get("added_tokens") or []:
            content = token.get("content")
            if content in self.names:
                added.append({**token, "content": self.names[content]})
            elif content not in unnamed:
                added.append(token)
        data["added_tokens"] = added
        vocab = (data.get("model") or {}).get("vocab")
        if isinstance(vocab, dict):  # (the library takes an added token's id from its vocabulary entry)
            data["model"]["vocab"] = {self.names.get(k, k): v for k, v in vocab.items()}
        elif isinstance(vocab, list):  # a Unigram model's [piece, score]
            data["model"]["vocab"] = [
                [self.names.get(p[0], p[0]), *p[1:]] if isinstance(p, list) and p else p for p in vocab
            ]
        return json.dumps(data, ensure_ascii=False)


def renaming(template_text: str, special_tokens: dict[str, str], specials: list[str]) -> Renaming:
    """The renaming for a template (and the special-token variables it renders) and the tokenizer's
    special added tokens ``specials``."""
    written = "\n".join([template_text, *special_tokens.values()])
    names: dict[str, str] = {}
    unnamed = []
    for text in sorted(set(specials), key=lambda t: (-len(t), t)):
        if text and text in written:
            names[text] = chr(FIRST_NAME + len(names))
        else:
            unnamed.append(text)
    return Renaming(names, tuple(unnamed))


def literals_in(row: Any, specials: re.Pattern[str] | None) -> str | None:
    """The first special token written literally in a row's text."""
    if specials is None:
        return None
    for text in strings_of(row):
        found = specials.search(text)
        if found is not None:
            return found.group(0)
    return None


def specials_pattern(specials: list[str]) -> re.Pattern[str] | None:
    """One search for any of the special tokens' texts."""
    return _alternation({t: t for t in specials if t})


def strings_of(value: Any) -> Iterator[str]:
    """Every string in a row (messages, their fields, tool calls ...), depth first."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from strings_of(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from strings_of(v)


def _alternation(texts: dict[str, str]) -> re.Pattern[str] | None:
    if not texts:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))


@dataclass(frozen=True)
class LiteralRule:
    """What the setting looks for in a row: a special token's text (drop: the row is skipped; split: the
    row is counted), and for split a character given to the template's own special tokens (the row would
    read as them)."""

    pattern: re.Pattern[str] | None  # the special tokens' texts
    drops: bool
    reserved: re.Pattern[str] | None = None  # split's names of the template's tokens

    def read(self, strings: Any) -> str | None:
        """Why the row is dropped (drop), or the special token it spells (split; ``None``: none); a row
        holding a name of the template's tokens is refused (``RowFormatError``)."""
        found = literals_in(strings, self.pattern)
        if found is not None and self.drops:
            return f"it spells the special token {found!r} ({SETTING}: drop)"
        if (name := literals_in(strings, self.reserved)) is not None:
            raise RowFormatError(
                f"it holds U+{ord(name):X}, a character {SETTING} split gives to the template's own special tokens"
            )
        return found


def literal_rule(mode: str, names: Renaming | None, specials: Callable[[], list[str]]) -> LiteralRule | None:
    """The rule of ``mode`` for a tokenizer (``names``: split's renaming; ``specials``: its special
    added tokens' texts, asked for drop); ``None`` where rows are read as the reference reads them."""
    if mode == "split" and names is not None:
        return LiteralRule(
            specials_pattern([*names.names, *names.unnamed]),
            False,
            specials_pattern(list(names.names.values())),
        )
    if mode == "drop":
        pattern = specials_pattern(specials())
        return None if pattern is None else LiteralRule(pattern, drops=True)
    return None


def cannot_rename(token: str) -> str:
    """Why split cannot run with this tokenizer: the library gives a renamed token another id."""
    return (
        f"{SETTING} split cannot rename the template's special token {token!r} in this tokenizer (the "
        "tokenizers library gives the renamed token another id); keep or drop work"
    )


class LiteralReport(BaseModel):
    """What the run did with special tokens spelled in its rows: in the run report, and the check's."""

    mode: str = Field(
        "keep", description="How text in the rows that spells a special token was read: keep, split or drop."
    )
    spelled_rows: int = Field(
        0, description="Rows kept whose text spells a special token, read as plain text (split)."
    )

    @classmethod
    def of_report(cls, report: dict[str, Any]) -> LiteralReport:
        """From a run report's JSON (one written before this model kept the two at its top)."""
        if isinstance(found := report.get("literal"), dict):
            return cls.model_validate(found)
        return cls(
            mode=str(report.get(SETTING) or "keep"),
            spelled_rows=int(report.get("rows_spelling_special_tokens") or 0),
        )

    def lines(self, dropped: int) -> list[str]:
        """The run summary's words, where the rows were not read the reference's way (``dropped``: rows
        dropped for spelling one)."""
        if self.mode == "split":
            return [
                f"literal     {self.spelled_rows:,} kept row(s) spell a special token, read as text ({SETTING}: split)"
            ]
        if self.mode == "drop":
            return [f"literal     {dropped:,} row(s) spelling a special token dropped ({SETTING}: drop)"]
        return []

    #: The check's finding for rows read as text.
    SPELLED: ClassVar[str] = f"rows that spell a special token, read as plain text ({SETTING}: split)"

    def remedy(self) -> str:
        """What the check adds to a special token trained inside trainable text."""
        return (
            f"; where the rows spell it, {SETTING} split reads it as text, drop skips the row"
            if self.mode == "keep"
            else ""
        )

    def spelled_count(self) -> int:
        return self.spelled_rows if self.mode == "split" else 0
