"""Command-line flags derived from the settings they set: a mixer field declared with :class:`Flag` gets
``--name`` (and ``--kebab-name``) on ``convert``, its choices, default and help taken from the field,
so a new setting is spelled once (its field) and the command line follows."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from sftmix.config.byte_settings import nested_model


@dataclass(frozen=True)
class Flag:
    """Declares a ``convert`` flag for the field it annotates; ``name`` where the flag is not the field's."""

    name: str | None = None


@dataclass(frozen=True)
class FlagSpec:
    """One derived flag: where its value goes in the mixer (``("tokenizer", "encoder")``) and how it reads."""

    path: tuple[str, ...]
    name: str
    default: Any
    help: str
    choices: tuple[str, ...] | None
    boolean: bool
    whole_number: bool = False


def _flag_of(info: FieldInfo) -> Flag | None:
    return next((m for m in info.metadata if isinstance(m, Flag)), None)


def _choices(info: FieldInfo) -> tuple[str, ...] | None:
    args = typing.get_args(info.annotation) if typing.get_origin(info.annotation) is typing.Literal else ()
    return tuple(str(a) for a in args) or None


def flags(model: type[BaseModel], path: tuple[str, ...] = ()) -> list[FlagSpec]:
    """Every flag declared in ``model`` and the models it nests, in declaration order."""
    found: list[FlagSpec] = []
    for name, info in model.model_fields.items():
        inner, many = nested_model(info)
        if inner is not None and not many:
            found += flags(inner, (*path, name))
            continue
        flag = _flag_of(info)
        if flag is None:
            continue
        found.append(
            FlagSpec(
                path=(*path, name),
                name=flag.name or name,
                default=info.default,
                help=info.description or "",
                choices=_choices(info),
                boolean=info.annotation is bool,
                whole_number=info.annotation is int,
            )
        )
    return found


def with_flags(data: dict[str, Any], values: dict[str, Any], model: type[BaseModel]) -> dict[str, Any]:
    """``data`` (a mixer's fields, nested ones as dicts) with each flag's value from ``values`` (by flag
    name; ``None`` leaves the field as it is)."""
    for spec in flags(model):
        value = values.get(spec.name)
        if value is None:
            continue
        inner = data
        for key in spec.path[:-1]:
            inner = inner.setdefault(key, {})
        inner[spec.path[-1]] = value
    return data
