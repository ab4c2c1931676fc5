"""A model kept in sections but written flat: its files (``run_report.json``, a slice's ``manifest.json``)
are read by users, scripts and earlier versions, so their keys and their order stay as they were when the
model was one flat class, while the code reads each concern from a section of at most a few fields."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, SerializerFunctionWrapHandler, model_serializer, model_validator


class FlatSections(BaseModel):
    """Fields whose type is a ``BaseModel`` named in ``SECTIONS`` are written as their own fields, at the
    top; ``KEY_ORDER`` is the order of the file's keys (any key it does not name follows, in field order).
    A flat dict is read back into the sections; a dict that already holds a section keeps it."""

    SECTIONS: ClassVar[tuple[str, ...]] = ()
    KEY_ORDER: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse a model whose flat keys would collide: each key must say which field it is."""
        super().__pydantic_init_subclass__(**kwargs)
        keys = cls.flat_keys()
        if len(keys) != len(set(keys)) or set(keys) & set(cls.SECTIONS):
            raise TypeError(f"{cls.__name__}: a flat key is named twice, or as a section: {keys}")

    @classmethod
    def flat_keys(cls) -> list[str]:
        """The keys of the file, in field order (the top's fields, then each section's in place)."""
        keys: list[str] = []
        for name in cls.model_fields:
            keys += list(_section(cls, name).model_fields) if name in cls.SECTIONS else [name]
        return keys

    @model_validator(mode="before")
    @classmethod
    def _sections_of_flat(cls, data: Any) -> Any:
        """A flat file's keys into their sections (each section's fields are named as its keys)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for name in cls.SECTIONS:
            if name in data:
                continue
            data[name] = {key: data.pop(key) for key in _section(cls, name).model_fields if key in data}
        return data

    @model_serializer(mode="wrap")
    def _flat(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The sections' keys at the top, in the file's order."""
        nested = handler(self)
        flat: dict[str, Any] = {}
        for key, value in nested.items():
            if key in self.SECTIONS and isinstance(value, dict):
                flat.update(value)
            else:
                flat[key] = value
        ordered = {key: flat[key] for key in self.KEY_ORDER if key in flat}
        ordered.update(flat)  # (keys the order does not name keep their place after it)
        return ordered


def _section(model: type[BaseModel], name: str) -> type[BaseModel]:
    """The model class of the section field ``name``."""
    section = model.model_fields[name].annotation
    if not (isinstance(section, type) and issubclass(section, BaseModel)):
        raise TypeError(f"{model.__name__}.{name} is named a section but is not a model")
    return section
