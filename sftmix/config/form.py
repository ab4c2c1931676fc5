"""How the configuration models show as the Prefect UI's Custom run form.

The UI draws its form from the models' JSON schema. Two shapes of that schema read as Python, not as
words: an optional field is a union with ``null``, which the form shows as type buttons (``str | None``)
and 'Property is type "None"'; and every option of a section shows at once, the rare ones among the
basics. So each model's schema is reshaped for the form, while the models themselves, the config files
and the CLI keep their meaning:

- an optional field shows as its plain type with no default, and an empty value means "not set"
  (:func:`blank_is_none` maps it back);
- the rarely changed fields of a section sit in a nested "Advanced" object at its end, which
  :func:`lift_advanced` folds back into the section, so ``advanced:`` and the flat keys mean the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: The key of a section's advanced options in the form (and accepted in configs).
ADVANCED = "advanced"


def blank_is_none(value: Any) -> Any:
    """An empty text or list from a form field means the field is not set."""
    if isinstance(value, str) and not value.strip():
        return None
    if isinstance(value, list) and not value:
        return None
    return value


def lift_advanced(data: Any, section: str) -> Any:
    """Fold a section's ``advanced`` object into the section; a field given both ways must agree."""
    if not isinstance(data, dict) or ADVANCED not in data:
        return data
    advanced = data[ADVANCED]
    if advanced is None:
        advanced = {}
    if not isinstance(advanced, dict):
        raise ValueError(f"{section}.{ADVANCED} must be a mapping of options")
    merged = {k: v for k, v in data.items() if k != ADVANCED}
    for key, value in advanced.items():
        if key in merged and merged[key] != value:
            raise ValueError(
                f"{section}: {key} is given twice, as {merged[key]!r} and as {ADVANCED}.{key} {value!r}"
            )
        merged[key] = value
    return merged


def _plain_type(prop: dict[str, Any]) -> dict[str, Any]:
    """``anyOf: [T, null]`` with ``default: null`` as T with no default (an empty field)."""
    branches = prop.get("anyOf")
    if branches is not None:
        kept = [b for b in branches if b.get("type") != "null"]
        if len(kept) == 1 and len(kept) < len(branches):
            prop = {**kept[0], **{k: v for k, v in prop.items() if k != "anyOf"}}
    if "default" in prop and prop["default"] is None:
        prop = {k: v for k, v in prop.items() if k != "default"}
    return prop


def form_schema(
    advanced: tuple[str, ...] = (), title: str = "", description: str = ""
) -> Callable[[dict[str, Any], type], None]:
    """A model's ``json_schema_extra``: plain types for optional fields, ``advanced`` grouped last under
    ``title``."""

    def reshape(schema: dict[str, Any], _model: type) -> None:
        props = {name: _plain_type(prop) for name, prop in schema.get("properties", {}).items()}
        if advanced:
            group = {name: props.pop(name) for name in advanced}
            props[ADVANCED] = {
                "type": "object",
                "title": title,
                "description": description,
                "properties": group,
            }
            # Flat keys stay valid (the model checks every key): the API must accept both shapes.
            schema.pop("additionalProperties", None)
            required = [r for r in schema.get("required", []) if r not in advanced]
            if required:
                schema["required"] = required
        schema["properties"] = props

    return reshape
