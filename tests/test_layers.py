"""The layers point one way (``[tool.importlinter]`` in pyproject.toml): the command line over the flows over
the tasks over the pure core, the core imports no Prefect, and its modules import one another without a
circle. The tree is the installed layout (no ``package-dir``), so the contracts are checked on it as it is.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("sftmix", "tokenize_mixer")


def test_the_layers_point_one_way():
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run(
        [str(lint), str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_every_tokenize_mixer_setting_is_read_in_one_module():
    """``sftmix.runtime.settings`` names and documents each; no other module spells one out."""
    from sftmix.runtime import settings

    spelled = []
    for folder in PACKAGES:
        for module in (ROOT / folder).rglob("*.py"):
            if module.name != "settings.py" and '"TOKENIZE_MIXER_' in module.read_text():
                spelled.append(str(module.relative_to(ROOT)))
    assert spelled == []
    assert all(s.name.startswith("TOKENIZE_MIXER_") and s.help for s in settings.ALL)


def test_every_package_installs():
    """setuptools finds a package by its ``__init__.py``: a folder of modules without one would be missing
    from a wheel (an editable install finds it on disk, so only a built wheel would tell). And the tree is
    what installs: no ``package-dir`` maps a folder elsewhere."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "package-dir" not in setup
    assert setup["packages"]["find"]["include"] == [f"{p}*" for p in PACKAGES]
    folders = {m.parent for p in PACKAGES for m in (ROOT / p).rglob("*.py")}
    assert [str(f.relative_to(ROOT)) for f in sorted(folders) if not (f / "__init__.py").exists()] == []


def test_no_function_is_over_60_lines():
    """A function that reads at once: the core, the tasks, the flows and the command line (issues 70, 80;
    ruff keeps their parameters to 8 and their complexity to 15)."""
    import ast

    long = []
    for folder in PACKAGES:
        for module in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(module.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                if (lines := node.end_lineno - node.lineno + 1) > 60:  # type: ignore[operator]
                    long.append(f"{module.relative_to(ROOT)}: {node.name} ({lines} lines)")
    assert long == []


def test_no_module_is_over_600_lines():
    """A module that holds one concept: the core, the tasks, the flows and the command line (issue 80). A
    module that grows past it holds two; split it by concept (CONTRIBUTING's map names each)."""
    long = []
    for folder in PACKAGES:
        for module in sorted((ROOT / folder).rglob("*.py")):
            if (lines := len(module.read_text(encoding="utf-8").splitlines())) > 600:
                long.append(f"{module.relative_to(ROOT)} ({lines} lines)")
    assert long == []


def test_a_data_format_is_its_package_and_its_registry_line():
    """Each format in the registry names its own source (its ``data_format``) and reader, from its own
    package, and a slice's source is one of theirs: a new format is its package and a line in ``FORMATS``."""
    import typing

    from sftmix.sources import registry

    members = set(typing.get_args(typing.get_args(registry.SliceSource)[0]))
    assert members == {f.source for f in registry.FORMATS}
    for f in registry.FORMATS:
        assert f.source.model_fields["data_format"].default == f.name
        assert f.source.__module__.split(".")[2] == type(f.reader).__module__.split(".")[2], f.name
    assert tuple(f.reader for f in registry.FORMATS) == registry.READERS


def test_contributings_module_map_is_the_tree():
    """CONTRIBUTING's "How the layers fit" names every module of the core, the tasks, the flows and the
    command line, and no module that is gone: the map a newcomer reads first stays true."""
    import re

    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    section = text.split("## How the layers fit", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"([A-Za-z_][\w/]*\.py)\b", section))
    modules = {m for p in PACKAGES for m in (ROOT / p).rglob("*.py") if m.name != "__init__.py"}
    missing = sorted(str(m.relative_to(ROOT)) for m in modules if not _named(m, named))
    known = {m.name for m in modules} | {str(m.relative_to(ROOT)) for m in modules}
    gone = sorted(n for n in named if n.rsplit("/", 1)[-1] not in known and not (ROOT / n).exists())
    assert (missing, gone) == ([], [])


def _named(module: Path, named: set[str]) -> bool:
    return module.name in named or any(str(module).endswith("/" + n) for n in named)


def test_the_smoke_tier_is_whole():
    """Every test id the smoke tier names still exists (a renamed test would leave the tier quietly smaller)."""
    from tests import tiers

    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "--collect-only", "-m", "smoke"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    collected = [line for line in proc.stdout.splitlines() if "::" in line]
    for test in tiers.SMOKE:
        assert any(c == test or c.startswith(test + "::") for c in collected), test


#: The classes of the core, the tasks, the flows and the command line allowed more than 20 fields, each with
#: its count now: a count may only go down, and an entry goes once its class has 20 or fewer (issue 80).
OVER_20_FIELDS: dict[str, int] = {}


def _field_counts() -> dict[str, int]:
    """Each pydantic model's ``model_fields`` and each dataclass's fields, by the class's module and name,
    for the classes at the top of every module of the packages (run in a process of its own: it imports them
    all)."""
    import dataclasses
    import importlib
    import inspect

    from pydantic import BaseModel

    counts = {}
    for folder in PACKAGES:
        for module in sorted((ROOT / folder).rglob("*.py")):
            name = ".".join(module.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            for cls in vars(importlib.import_module(name)).values():
                if not inspect.isclass(cls) or cls.__module__ != name:
                    continue
                if issubclass(cls, BaseModel):
                    counts[f"{name}.{cls.__qualname__}"] = len(cls.model_fields)
                elif dataclasses.is_dataclass(cls):
                    counts[f"{name}.{cls.__qualname__}"] = len(dataclasses.fields(cls))
    return counts


def test_no_class_has_over_20_fields():
    """A class that reads at once (issue 80): a model or dataclass over 20 fields is split into sections
    (``sftmix.runtime.sections`` keeps a file it writes flat). The config's models hold the mixer's settings
    as users write them, and none is over 20 either."""
    import json

    proc = subprocess.run(
        [sys.executable, "-c", "import json, tests.test_layers as t; print(json.dumps(t._field_counts()))"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    counts = json.loads(proc.stdout.splitlines()[-1])
    assert "sftmix.output.report.RunReport" in counts and len(counts) > 50  # (it found the classes)
    grown = {name: n for name, n in counts.items() if n > OVER_20_FIELDS.get(name, 20)}
    left = sorted(name for name, n in OVER_20_FIELDS.items() if counts.get(name, 0) <= 20)
    assert grown == {}, "split these into sections, or fewer fields"
    assert left == [], "at 20 fields or fewer now (or gone): take them off OVER_20_FIELDS"


#: The options whose words live with them (issue 80): each named in at most three modules' code (its
#: declaration, the spec that carries it to the workers, the module that says what it means), so a new use
#: asks that module rather than testing the value again.
HELD_OPTIONS = (
    "literal_special_tokens",
    "drop_untrainable",
    "mask_thinking",
    "mask_tool_calls",
    "mask_tool_outputs",
)


def _code_words(module: Path) -> set[str]:
    """The names a module's code uses: identifiers, attributes, arguments, and the words of its strings
    other than docstrings and fields' descriptions (prose about a setting is not a use of it; comments are
    not in the tree)."""
    tree = ast.parse(module.read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    docstrings |= {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.keyword)
        and node.arg == "description"
        and isinstance(node.value, ast.Constant)
    }
    words: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
        elif isinstance(node, ast.keyword | ast.arg) and node.arg:
            words.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words.update(re.findall(r"\w+", node.value))
    return words


def test_a_byte_changing_option_is_named_in_at_most_three_modules():
    modules = [m for p in PACKAGES for m in (ROOT / p).rglob("*.py")]
    words = {m: _code_words(m) for m in modules}
    for option in HELD_OPTIONS:
        naming = sorted(str(m.relative_to(ROOT)) for m in modules if option in words[m])
        assert len(naming) <= 3, (option, naming)
