"""How each setting reaches the output's bytes, declared beside the setting (``Annotated[T, ChangesBytes(...)]``
in ``sftmix.config.config``), and what derives from the declarations: the output's recipe (what a rerun compares to
tell whether it would make other shards) and the settings in every slice's key (what a rerun compares to
reuse a slice). One declaration a setting, so a new option cannot change bytes while old slices are reused:
``tests/test_byte_settings.py`` requires one on every field.
"""

from __future__ import annotations

import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo


@dataclass(frozen=True)
class ChangesBytes:
    """``recipe``: the output's bytes follow from it, so it is recorded in the output's recipe and a changed
    value makes the output again. ``slices``: a slice's tokens follow from its value, so it is in every
    slice's key and a changed value tokenizes again (a setting that reaches the slices another way, the
    tokenizer's name through its fingerprint, says so beside it). ``unkeyed`` / ``unrecorded``: at its
    default it is left out of slice keys / recipes, as those made before the setting existed."""

    recipe: bool = True
    slices: bool = False
    unkeyed: bool = False
    unrecorded: bool = False


#: A setting the output's bytes never follow from (where it goes, how the run reports, what it refuses).
NO_BYTES = ChangesBytes(recipe=False)


def declaration(info: FieldInfo) -> ChangesBytes | None:
    return next((m for m in info.metadata if isinstance(m, ChangesBytes)), None)


def _declared(model: type[BaseModel], name: str) -> ChangesBytes:
    found = declaration(model.model_fields[name])
    if found is None:
        raise TypeError(f"{model.__name__}.{name} does not declare how it changes bytes (ChangesBytes)")
    return found


def nested_model(info: FieldInfo) -> tuple[type[BaseModel] | None, bool]:
    """The settings model a field holds, and whether it holds a list of them."""
    kind = info.annotation
    if typing.get_origin(kind) is list:
        (kind,) = typing.get_args(kind)
        return (kind, True) if isinstance(kind, type) and issubclass(kind, BaseModel) else (None, True)
    return (kind, False) if isinstance(kind, type) and issubclass(kind, BaseModel) else (None, False)


def _default(model: type[BaseModel], name: str) -> Any:
    """A field's default as its value is dumped (JSON)."""
    return model.model_fields[name].get_default(call_default_factory=True)


def recorded(settings: BaseModel) -> dict[str, Any]:
    """The settings as a recipe records them: those the output's bytes follow from, nested ones too."""
    return _recorded(type(settings), settings.model_dump(mode="json"))


def _recorded(model: type[BaseModel], dumped: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, info in model.model_fields.items():
        declared = _declared(model, name)
        if not declared.recipe or (declared.unrecorded and dumped[name] == _default(model, name)):
            continue
        inner, many = nested_model(info)
        value = dumped[name]
        if inner is not None and value is not None:
            value = [_recorded(inner, v) for v in value] if many else _recorded(inner, value)
        out[name] = value
    return out


def _sliced(settings: BaseModel) -> Iterator[tuple[BaseModel, str, ChangesBytes]]:
    """Each setting declared ``slices=True`` in ``settings`` and the models it holds (not lists of them),
    with the model that holds it and its declaration."""
    for name, info in type(settings).model_fields.items():
        declared = _declared(type(settings), name)
        inner, many = nested_model(info)
        if inner is not None and not many:
            yield from _sliced(getattr(settings, name))
        elif declared.slices:
            yield settings, name, declared


def keyed(settings: BaseModel) -> dict[str, Any]:
    """The settings every slice's key holds (by name, nested ones' too), as their values are dumped."""
    out: dict[str, Any] = {}
    for owner, name, declared in _sliced(settings):
        value = owner.model_dump(mode="json", include={name})[name]
        if not (declared.unkeyed and value == _default(type(owner), name)):
            out[name] = value
    return out
