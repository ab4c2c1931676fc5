"""The layers point one way (``[tool.importlinter]`` in pyproject.toml): the command line over the flows over
the tasks over the pure core, the core imports no Prefect, and its modules import one another without a
circle.

import-linter reads packages from the file system, which knows nothing of setuptools' ``package-dir``
(``flows/`` installs as ``tokenize_mixer.flows``): the contract is checked on the installed layout, made
here from pyproject.toml's own package list and mapping.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def installed_layout(target: Path) -> Path:
    """The packages where an install puts them: each listed package's own ``.py`` files."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = setup.get("package-dir", {})
    for package in setup["packages"]:
        source = ROOT / mapping.get(package, package.replace(".", "/"))
        destination = target / package.replace(".", "/")
        destination.mkdir(parents=True, exist_ok=True)
        for module in source.glob("*.py"):
            shutil.copy2(module, destination / module.name)
    return target


def test_the_layers_point_one_way(tmp_path):
    site = installed_layout(tmp_path / "site")
    lint = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run(
        [str(lint), str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=site, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_every_tokenize_mixer_setting_is_read_in_one_module():
    """``sftmix.runtime.settings`` names and documents each; no other module spells one out."""
    from sftmix.runtime import settings

    spelled = []
    for folder in ("sftmix", "flows", "tasks", "tokenize_mixer"):
        for module in (ROOT / folder).rglob("*.py"):
            if module.name != "settings.py" and '"TOKENIZE_MIXER_' in module.read_text():
                spelled.append(str(module.relative_to(ROOT)))
    assert spelled == []
    assert all(s.name.startswith("TOKENIZE_MIXER_") and s.help for s in settings.ALL)


def test_every_package_installs():
    """A package left out of pyproject.toml's list would be missing from a wheel (an editable install
    finds it on disk, so only a built wheel would tell)."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "sftmix").rglob("__init__.py")}
    for folder in ("flows", "tasks"):
        on_disk |= {
            ".".join(("tokenize_mixer", *p.parent.relative_to(ROOT).parts))
            for p in (ROOT / folder).rglob("__init__.py")
        }
    assert on_disk <= set(setup["packages"])
    mapping = setup["package-dir"]
    assert all((ROOT / mapping[p]).is_dir() for p in setup["packages"] if p.startswith("tokenize_mixer."))


def test_no_function_is_over_100_lines():
    """A function that reads at once: the core, the tasks, the flows and the command line (issue 70)."""
    import ast

    long = []
    for folder in ("sftmix", "flows", "tasks", "tokenize_mixer"):
        for module in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(module.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                if (lines := node.end_lineno - node.lineno + 1) > 100:  # type: ignore[operator]
                    long.append(f"{module.relative_to(ROOT)}: {node.name} ({lines} lines)")
    assert long == []
