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
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

#: The first character names are drawn from (U+100000, Supplementary Private Use Area-B).
FIRST_NAME = 0x100000
#: The settings, the reference's first.
MODES = ("keep", "split", "drop")


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
