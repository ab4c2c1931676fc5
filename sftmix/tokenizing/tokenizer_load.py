"""Which tokenizer class builds a tokenizer: the one the reference's environment picks, or its files as written.

The reference runs with transformers 5.4.0 (open-instruct e6c3044aa's ``uv.lock``). Its ``AutoTokenizer``
picks a class from ``tokenizer_config.json`` and ``config.json``, and the class may rebuild the pipeline:
``LlamaTokenizer`` replaces a byte-level ``tokenizer.json``'s pre-tokenizers with a ``Metaspace`` one,
``GPT2Tokenizer`` a ``Split`` regex with GPT-2's own. Later versions changed how the class is picked
(5.25 loads a byte-level file named ``LlamaTokenizerFast`` as the file says), not what the classes do. So
``reference`` picks the class by 5.4.0's rules, from 5.4.0's own tables
(``data/reference_tokenizer_classes.json``, made by ``tests/consumers/reference_tokenizer_table.py`` in
the locked versions), and builds it with the installed transformers; ``tests/test_reference_env.py``
holds the result to 5.4.0's ids. ``files`` builds ``TokenizersBackend``: ``tokenizer.json`` as it is.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from importlib.resources import files
from typing import Any

from sftmix.config.config import TokenizerLoad
from sftmix.errors import ConfigError
from sftmix.tokenizing.pipeline_steps import normalizer_does_nothing

#: The transformers release whose loading rules ``reference`` follows (the reference's locked version).
REFERENCE_TRANSFORMERS = "5.4.0"

#: The class that takes ``tokenizer.json`` as it is.
AS_WRITTEN = "TokenizersBackend"


@lru_cache(maxsize=1)
def reference_tables() -> dict[str, Any]:
    """transformers 5.4.0's model-type table, its class names and the model types whose hub class it
    distrusts."""
    text = files(__package__).joinpath("data/reference_tokenizer_classes.json").read_text(encoding="utf-8")
    tables = json.loads(text)
    assert tables["transformers"] == REFERENCE_TRANSFORMERS
    return tables


def _file(name: str, revision: str | None, filename: str) -> str | None:
    """One file of a tokenizer directory, or of a hub repository (from the hub's cache or the hub), or
    ``None`` where there is none."""
    if os.path.isdir(name):
        path = os.path.join(name, filename)
        return path if os.path.isfile(path) else None
    from transformers.utils import cached_file

    return cached_file(
        name,
        filename,
        revision=revision,
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
    )


def _config_file(name: str, revision: str | None, filename: str) -> dict[str, Any] | None:
    """One JSON file of a tokenizer, or ``None`` where there is none."""
    path = _file(name, revision, filename)
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"tokenizer {name!r}: cannot read {filename}: {exc}") from None
    return data if isinstance(data, dict) else None


def _resolved(class_name: str) -> str:
    """What 5.4.0 builds for a class name a config gives: its ``tokenizer_class_from_name``, retried with
    ``Fast``, the Python-only backend swapped for the Rust one, an unknown name for the Rust one."""
    classes = reference_tables()["classes"]
    found = classes.get(class_name)
    if found is None and not class_name.endswith("Fast"):
        found = classes.get(class_name + "Fast")
    if found is None or found == "PythonBackend":
        return AS_WRITTEN
    return found


def reference_class(name: str, revision: str | None) -> str | None:
    """The class transformers 5.4.0's ``AutoTokenizer`` builds ``name`` with (its rules for a tokenizer
    that ships no code of its own), or ``None`` where it would run the repository's code (then the
    installed ``AutoTokenizer`` answers, as before)."""
    tried = _reference_classes(name, revision)
    return None if tried is None else tried[0]


def _reference_classes(name: str, revision: str | None) -> tuple[str, ...] | None:
    """The classes 5.4.0 tries, in order (a later one where building the one before fails)."""
    tables = reference_tables()
    config = _config_file(name, revision, "config.json") or {}
    tokenizer_config = _config_file(name, revision, "tokenizer_config.json") or {}
    model_type = config.get("model_type") or ""
    named = tokenizer_config.get("tokenizer_class")
    auto_map = tokenizer_config.get("auto_map")
    if auto_map is not None and model_type not in tables["incorrect_hub_class"]:
        return None
    mapped = tables["model_types"].get(model_type)
    if named and mapped and mapped.removesuffix("Fast") != named.removesuffix("Fast"):
        return AS_WRITTEN, _resolved(named.removesuffix("Fast"))  # (the file as it is, else the named class)
    if named:
        return (_resolved(named.removesuffix("Fast")),)
    if config.get("tokenizer_class"):
        named = config["tokenizer_class"]
        return (_resolved(named if "PreTrainedTokenizerFast" in named else named.removesuffix("Fast")),)
    return (mapped or AS_WRITTEN,)


def _installed_class(class_name: str) -> Any:
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    found = tokenizer_class_from_name(class_name)
    if found is None or found.__name__ != class_name:
        import transformers

        raise ConfigError(
            f"the reference (transformers {REFERENCE_TRANSFORMERS}) loads this tokenizer as {class_name}, which "
            f"transformers {transformers.__version__} does not have: install transformers=={REFERENCE_TRANSFORMERS}, "
            "or tokenize as its files say (tokenizer.load: files)"
        )
    return found


def load_tokenizer(name: str, revision: str | None, load: TokenizerLoad) -> Any:
    """The transformers tokenizer for ``name``, built as ``load`` says (errors are transformers')."""
    from transformers import AutoTokenizer

    if load == "files" and tokenizer_json_path(name, revision) is not None:
        return _installed_class(AS_WRITTEN).from_pretrained(name, revision=revision)
    tried = _reference_classes(name, revision)
    if tried is None:
        return AutoTokenizer.from_pretrained(name, revision=revision, use_fast=True)
    *first, last = tried
    for class_name in first:
        try:
            return _installed_class(class_name).from_pretrained(name, revision=revision)
        except Exception:  # as 5.4.0 does: the next class
            continue
    return _installed_class(last).from_pretrained(name, revision=revision)


def tokenizer_json_path(name: str, revision: str | None) -> str | None:
    """The tokenizer's own ``tokenizer.json``, or ``None`` where it has none."""
    return _file(name, revision, "tokenizer.json")


def pipeline_changes(built: dict[str, Any], written: dict[str, Any]) -> list[str]:
    """What a built tokenizer (its ``to_str`` JSON) has in place of its file's parts that make ids (both as
    the tokenizers library writes them), in words: the normalizer, the pre-tokenizer and the model."""
    changes = []
    normalizers = [
        None if normalizer_does_nothing(t.get("normalizer")) else t["normalizer"] for t in (built, written)
    ]
    if normalizers[0] != normalizers[1]:
        changes.append(_in_place("normalizer", *normalizers))
    if built.get("pre_tokenizer") != written.get("pre_tokenizer"):
        changes.append(_in_place("pre-tokenizer", built.get("pre_tokenizer"), written.get("pre_tokenizer")))
    model, own = built.get("model") or {}, written.get("model") or {}
    settings = sorted(
        k for k in set(model) | set(own) if k not in ("vocab", "merges") and model.get(k) != own.get(k)
    )
    if settings:
        now = ", ".join(f"{k} {json.dumps(model.get(k))}" for k in settings)
        was = ", ".join(json.dumps(own.get(k)) for k in settings)
        changes.append(f"a {model.get('type')} model with {now} in place of its {was}")
    if model.get("vocab") != own.get("vocab") or model.get("merges") != own.get("merges"):
        changes.append("another vocabulary or other merges in place of its own")
    return changes


def _in_place(part: str, built: Any, written: Any) -> str:
    """``a Metaspace pre-tokenizer in place of tokenizer.json's Split, Split, Split, ByteLevel``."""
    now, was = _steps(built), _steps(written)
    if now == was and isinstance(built, dict) and isinstance(written, dict):
        keys = sorted(k for k in set(built) | set(written) if built.get(k) != written.get(k))
        now += " (" + ", ".join(f"{k} {json.dumps(built.get(k))}" for k in keys) + ")"
        was += " (" + ", ".join(f"{k} {json.dumps(written.get(k))}" for k in keys) + ")"
    article = "no" if built is None else "a"
    return f"{article} {now} {part} in place of tokenizer.json's {was}".replace("no none ", "no ")


def _steps(node: Any) -> str:
    """A pipeline part as its steps' types: ``Split, Split, ByteLevel``; ``none`` for no part."""
    if not isinstance(node, dict):
        return "none"
    inner = node.get("pretokenizers") or node.get("normalizers")
    if node.get("type") == "Sequence" and inner is not None:
        return ", ".join(_steps(step) for step in inner) or "empty sequence"
    return str(node.get("type"))


def built_as(load: TokenizerLoad, class_name: str) -> str:
    """How the run's tokenizer was built, for what is said of it (the fast encoder's proof, the plan)."""
    if load == "files":
        return f"{class_name} as its files say"
    return f"{class_name} as the reference's transformers {REFERENCE_TRANSFORMERS} builds it"


def reference_note(name: str, class_name: str, changes: tuple[str, ...], changed: int, sampled: int) -> str:
    """The warning for a tokenizer the reference builds otherwise than its own files say."""
    if sampled:
        share = f"token ids differ from its own files' in {changed:,} of {sampled:,} sampled rows ({changed / sampled:.0%})"
    else:
        share = "no rows were sampled to compare the ids"
    return (
        f"tokenizer {name}: the reference (transformers {REFERENCE_TRANSFORMERS}) loads it as {class_name}, "
        f"with {'; '.join(changes)}; {share}. The output has the reference's ids, not those of the "
        "tokenizer's own files: tokenizer.load files (--tokenizer_load files) tokenizes as its files say"
    )
