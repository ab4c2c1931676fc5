"""The fast encoder against the tokenizers library on every ShareGPT chat: same ids and offsets, and speed.

    python bench/encoders.py                       # dolma2 (olmo template) and Llama-3 (tulu), all chats
    python bench/encoders.py --rows 2000 --tokenizers dolma2

For each tokenizer, in this one process and one thread: the proof (:func:`sftmix.encoders.analyse`,
timed), then every rendered chat encoded by both encoders, compared id for id and offset for offset,
and the characters per second of each (the library's ``encode_batch`` with one Rayon thread, tiktoken
through :class:`sftmix.encoders.FastEncoder` with its offsets built). Prints one row per tokenizer and
the texts handed to the library (those with a token the proof could not vouch for).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.data import dolma2_dir, llama3_dir, sharegpt_chats  # noqa: E402
from sftmix.encoders import FastEncoder, analyse  # noqa: E402
from sftmix.templates import ChatRenderer, named_template  # noqa: E402

SETUPS = {"dolma2": (dolma2_dir, "olmo"), "llama3": (llama3_dir, "tulu")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=0, help="chats (0: all)")
    ap.add_argument("--tokenizers", default="dolma2,llama3")
    ap.add_argument("--out", type=Path, default=None, help="write the rows here as JSON")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    chats = sharegpt_chats(args.rows)
    rows = []
    for name in args.tokenizers.split(","):
        folder, template = SETUPS[name]
        path = folder() / "tokenizer.json"
        config = json.loads((path.parent / "tokenizer_config.json").read_text())
        specials = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
        renderer = ChatRenderer(named_template(template), specials)
        texts = [renderer.render(c, None, False) for c in chats]
        rust = Tokenizer.from_file(str(path))
        rust.no_truncation()
        rust.no_padding()
        t = time.perf_counter()
        analysis = analyse(rust.to_str())
        prove = time.perf_counter() - t
        fast = FastEncoder(rust, analysis)
        t = time.perf_counter()
        library = rust.encode_batch(texts, add_special_tokens=False)
        library_s = time.perf_counter() - t
        t = time.perf_counter()
        ours = fast.encode_batch(texts)
        for e in ours:
            e.offsets  # noqa: B018  (built, as the engine builds them)
        fast_s = time.perf_counter() - t
        differ = sum(
            1
            for a, b in zip(library, ours, strict=True)
            if list(a.ids) != list(b.ids)
            or [tuple(o) for o in a.offsets] != [tuple(map(int, o)) for o in b.offsets]
        )
        chars = sum(map(len, texts))
        row = {
            "tokenizer": name,
            "template": template,
            "chats": len(texts),
            "characters": chars,
            "tokens": sum(len(e.ids) for e in library),
            "prove_seconds": round(prove, 2),
            "unproven_tokens": len(analysis.unsafe),
            "one_merge_per_token": analysis.one_merge_per_token,
            "texts_to_library": fast.fallbacks,
            "differing_texts": differ,
            "library_chars_per_s": round(chars / library_s),
            "fast_chars_per_s": round(chars / fast_s),
            "speedup": round(library_s / fast_s, 2),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    line = "{:<8} {:>7} {:>11} {:>12} {:>8} {:>9} {:>9} {:>8} {:>12} {:>12} {:>8}"
    print(
        line.format(
            "tok",
            "chats",
            "chars",
            "tokens",
            "prove s",
            "unproven",
            "to lib",
            "differ",
            "lib char/s",
            "fast char/s",
            "speedup",
        )
    )
    for r in rows:
        print(
            line.format(
                r["tokenizer"],
                r["chats"],
                f"{r['characters']:,}",
                f"{r['tokens']:,}",
                r["prove_seconds"],
                r["unproven_tokens"],
                r["texts_to_library"],
                r["differing_texts"],
                f"{r['library_chars_per_s']:,}",
                f"{r['fast_chars_per_s']:,}",
                f"{r['speedup']}x",
            )
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
