"""Virtual environments of their own for tests that run other versions of things (OLMo-core with torch,
the reference's locked transformers), made once with pip and cached."""

from __future__ import annotations

import os
import subprocess
import venv
from pathlib import Path

from tests.tokenizer_fixtures import cache_dir, one_at_a_time


def cached_venv(name: str, requirements: list[str]) -> Path:
    """The python of ``cache_dir()/name`` with ``requirements`` installed (made again when they change)."""
    home = cache_dir() / name
    python = home / "bin" / "python"
    marker = home / ("installed-" + "-".join(requirements).replace("=", "") + ".txt")
    with one_at_a_time(f"venv-{name}"):  # (pytest -n: one worker makes it, the others wait)
        if not marker.exists():
            _make_venv(home, python, marker, requirements)
    return python


def _make_venv(home: Path, python: Path, marker: Path, requirements: list[str]) -> None:
    venv.EnvBuilder(with_pip=True, clear=True).create(home)
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", *requirements], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"cannot install {requirements}: {done.stderr[-3000:]}")
    marker.write_text("".join(f"{r}\n" for r in requirements))


def venv_env(**extra: str) -> dict[str, str]:
    """This process's environment for a program of such a virtual environment: without what points it at
    ours (``PYTHONPATH``, ``VIRTUAL_ENV``), with ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, **extra}
