"""A run file (``tokenize-mixer run CONFIG.yaml``): the mixer and the run's options read from YAML or JSON,
and a validation error said as a person reads it (the field's path, the closest field name for a misspelled one)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
)

from sftmix.config.byte_settings import nested_model
from sftmix.config.config import MixerConfig
from sftmix.config.run_options import RunOptions
from sftmix.errors import ConfigError


class RunFile(BaseModel):
    """The file ``tokenize-mixer run`` reads: a mixer plus optional run options."""

    model_config = ConfigDict(extra="forbid")

    mixer: MixerConfig
    run: RunOptions = Field(default_factory=RunOptions)


def format_validation_error(exc: ValidationError, source: str, model: type[BaseModel] = RunFile) -> str:
    """One line per problem, naming the field, instead of pydantic's wall of text; a key the model does not
    have, with the fields it has that are closest to it."""
    lines = [f"invalid configuration in {source}:"]
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden" and err["loc"]:
            msg = f"unknown setting{_closest_field(model, err['loc'])}"
        lines.append(f"  {where}: {msg}")
    return "\n".join(lines)


def _closest_field(model: type[BaseModel], loc: tuple[int | str, ...]) -> str:
    """``; did you mean 'max_seq_length'?`` for a mistyped key at ``loc`` (its last item) of ``model``, with
    the fields of the model that holds it; nothing where none is close."""
    import difflib

    holder: type[BaseModel] | None = model
    for key in loc[:-1]:
        if isinstance(key, int) or holder is None:
            continue  # (an index into a list of models)
        info = holder.model_fields.get(key)
        holder = None if info is None else nested_model(info)[0]
    if holder is None:
        return ""
    close = difflib.get_close_matches(str(loc[-1]), list(holder.model_fields), n=2, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def load_run_file(path: str | os.PathLike[str]) -> RunFile:
    """Read a YAML or JSON config. A file with top-level ``datasets`` is a bare mixer."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config {p}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(
            f"config {p} is not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {exc}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {p} must be a mapping with 'mixer' (and optionally 'run')")
    if "datasets" in data:
        data = {"mixer": data}
    try:
        return RunFile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, str(p))) from None
