"""What a run's bytes follow from, as an output's marker records it: the recipe's mixer (the settings,
as each declares how it reaches the bytes) and the stamps of the local inputs, taken before the plan
reads them (:mod:`sftmix.assembly.up_to_date` compares them with a published output's)."""

from __future__ import annotations

import os
from importlib import metadata
from typing import Any

from sftmix.config.byte_settings import recorded
from sftmix.config.config import NAMED_TEMPLATES, MixerConfig
from sftmix.runtime.storage import file_version, is_remote
from sftmix.sources.paths import local_builder
from sftmix.tokenizing.templates import named_template_file

#: Packages whose version may change the bytes a recipe gives (loading, rendering, encoding, writing).
BYTE_PACKAGES = ("tokenize-mixer", "transformers", "tokenizers", "datasets", "pyarrow", "jinja2", "numpy")


def mixer_recipe(mixer: MixerConfig) -> dict[str, Any]:
    """The mixer as the recipe records it: the settings its bytes follow from, as each declares
    (:mod:`sftmix.config.byte_settings`)."""
    return recorded(mixer)


def _stamp(path: str) -> list[int]:
    return list(file_version(path))


def _input_files(mixer: MixerConfig) -> list[str] | None:
    """Every local file the recipe is computed from; ``None`` when an input is not a local file (a hub
    name, a ``gs://`` object, a directory laid out as on the hub), whose content only a plan can tell."""
    files = []
    for entry in mixer.datasets:
        if is_remote(entry.path) or local_builder(entry.path) is None or not os.path.isfile(entry.path):
            return None
        files.append(entry.path)
    tokenizer = mixer.tokenizer.name_or_path
    if is_remote(tokenizer) or not os.path.isdir(tokenizer):
        return None
    files += sorted(e.path for e in os.scandir(tokenizer) if e.is_file())
    template = mixer.tokenizer.chat_template
    if template in NAMED_TEMPLATES:
        files.append(named_template_file(template))
    elif template and template.endswith(".jinja"):
        files.append(template)
    return files


def _versions() -> dict[str, str]:
    found = {}
    for name in BYTE_PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = ""
    return found


def input_record(mixer: MixerConfig) -> dict[str, Any] | None:
    """This run's settings, package versions and input stamps, as the marker records them; ``None``
    when an input is not a local file. Take it before reading the inputs: a file that changes while it
    is read then no longer matches what is recorded."""
    try:
        files = _input_files(mixer)
        if files is None:
            return None
        stamps = {os.path.realpath(f): _stamp(f) for f in files}
    except OSError:
        return None
    settings = mixer.model_dump(mode="json", exclude={"output": {"overwrite", "path"}})
    return {"settings": settings, "versions": _versions(), "files": stamps}
