"""The fast encoder against the tokenizers library on every ShareGPT chat: same ids and offsets, and speed.

    python bench/encoders.py                       # dolma2 (olmo template), Llama-3 and tekken (tulu), all chats
    python bench/encoders.py --tokenizers mistral-v3,deepseek-v3,gemma3   # fastokens only
    python bench/encoders.py --rows 2000 --tokenizers dolma2

For each tokenizer, in this one process and one thread: the proof (:func:`sftmix.tokenizing.encoder_proof.analyse`,
timed), then every rendered chat encoded by both encoders, compared id for id and offset for offset,
and the characters per second of each (the library's ``encode_batch`` with one Rayon thread, each engine
of :data:`sftmix.tokenizing.engines.ENGINES` (fastokens, tiktoken) through :class:`sftmix.tokenizing.encoders.FastEncoder` with
its offsets built). Prints one row per tokenizer: per engine its speed, the texts handed to the library
(those with a token the proof could not vouch for) and the texts that differ (must be 0).
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

from bench.data import (  # noqa: E402
    deepseek_v3_dir,
    dolma2_dir,
    gemma3_dir,
    llama3_dir,
    mistral_sp_dir,
    sharegpt_chats,
    tekken_dir,
)
from sftmix.tokenizing.encoder_proof import analyse  # noqa: E402
from sftmix.tokenizing.encoders import FastEncoder  # noqa: E402
from sftmix.tokenizing.engines import ENGINES  # noqa: E402
from sftmix.tokenizing.templates import ChatRenderer, named_template  # noqa: E402

SETUPS = {
    "dolma2": (dolma2_dir, "olmo"),
    "llama3": (llama3_dir, "tulu"),
    "tekken": (tekken_dir, "tulu"),
    "mistral-v3": (mistral_sp_dir, "tulu"),
    "deepseek-v3": (deepseek_v3_dir, "tulu"),
    "gemma3": (gemma3_dir, "tulu"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=0, help="chats (0: all)")
    ap.add_argument("--tokenizers", default="dolma2,llama3,tekken")
    ap.add_argument("--out", type=Path, default=None, help="write the rows here as JSON")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    chats = sharegpt_chats(args.rows)
    rows = []
    for name in args.tokenizers.split(","):
        folder, template = SETUPS[name]
        path = folder() / "tokenizer.json"
        config = json.loads((path.parent / "tokenizer_config.json").read_text())
        specials = {  # (DeepSeek's config writes them as AddedToken objects)
            k: v["content"] if isinstance(v, dict) else v
            for k, v in config.items()
            if k.endswith("_token") and isinstance(v, str | dict)
        }
        renderer = ChatRenderer(named_template(template), specials)
        texts = [renderer.render(c, None, False) for c in chats]
        rust = Tokenizer.from_file(str(path))
        rust.no_truncation()
        rust.no_padding()
        t = time.perf_counter()
        analysis = analyse(rust.to_str())
        prove = time.perf_counter() - t
        t = time.perf_counter()
        library = rust.encode_batch(texts, add_special_tokens=False)
        library_s = time.perf_counter() - t
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
            "library_chars_per_s": round(chars / library_s),
        }
        for engine in ENGINES:  # each engine behind the one FastEncoder, offsets built as the engine does
            fast = FastEncoder(rust, analysis, engine=engine)
            if fast.engine != engine:
                continue  # not installed here, or not proven for this tokenizer's pattern
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
            row[engine] = {
                "chars_per_s": round(chars / fast_s),
                "speedup": round(library_s / fast_s, 2),
                "texts_to_library": fast.fallbacks,
                "differing_texts": differ,
            }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    line = "{:<11} {:>7} {:>12} {:>8} {:>9} {:>12}" + " {:>28}" * len(ENGINES)
    print(line.format("tok", "chats", "chars", "prove s", "unproven", "lib char/s", *ENGINES))
    print(line.format("", "", "", "", "", "", *["char/s, speedup, to lib, differ"] * len(ENGINES)))
    for r in rows:
        cells = [
            f"{r[e]['chars_per_s']:,}, {r[e]['speedup']}x, {r[e]['texts_to_library']}, {r[e]['differing_texts']}"
            if e in r
            else "-"
            for e in ENGINES
        ]
        print(
            line.format(
                r["tokenizer"],
                r["chats"],
                f"{r['characters']:,}",
                r["prove_seconds"],
                r["unproven_tokens"],
                f"{r['library_chars_per_s']:,}",
                *cells,
            )
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
