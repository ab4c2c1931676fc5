"""What a worker saves when the run's template skeletons are already in the work directory.

    python bench/skeletons.py                 # 3,000 ShareGPT chats, dolma2, olmo
    python bench/skeletons.py --rows 0        # every chat

Each case is a fresh process that masks the same chats (render, encode, spans; one thread), as a
worker's first slices do: without a store (as before: every process builds every shape's skeleton),
with an empty store (the first worker: it builds them and writes them), and with the store the first
left (every later worker of the run: it reads them). The rows' ids and masks are compared across the
three cases (they must be equal).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _mask(rows: int, store: str | None) -> dict:
    from tokenizers import Tokenizer

    from bench.data import dolma2_dir, sharegpt_chats
    from sftmix.sources.formats import Conversation
    from sftmix.tokenizing.encoder_proof import analyse
    from sftmix.tokenizing.encoders import FastEncoder
    from sftmix.tokenizing.labels import LabelMasker, MaskerEncoding
    from sftmix.tokenizing.masking import Masking
    from sftmix.tokenizing.prefix_renders import SkeletonStore
    from sftmix.tokenizing.templates import ChatRenderer, named_template
    from sftmix.tokenizing.tokenizer import boundaries_of

    specials = {"eos_token": "<|endoftext|>"}
    rust = Tokenizer.from_file(str(dolma2_dir() / "tokenizer.json"))
    rust.no_truncation()
    rust.no_padding()
    fast = FastEncoder(rust, analyse(rust.to_str()))
    text = named_template("olmo")
    skeletons = None if store is None else SkeletonStore(store, SkeletonStore.renderer_key_of(text, specials))
    encoding = MaskerEncoding(fast.encode_batch, fast.decode, boundaries_of(rust))
    masker = LabelMasker(ChatRenderer(text, specials), encoding, Masking(4096), skeletons=skeletons)
    chats = [Conversation(c, None) for c in sharegpt_chats(rows)]
    digest = hashlib.sha256()
    began = time.perf_counter()
    for i in range(0, len(chats), 500):
        for row in masker.tokenize(chats[i : i + 500]):
            digest.update(row.ids.tobytes() + row.mask.tobytes() + str(row.status).encode())
    seconds = time.perf_counter() - began
    return {
        "seconds": round(seconds, 2),
        "chats": len(chats),
        "shapes": len(masker.prefixes._skeletons),
        "read": 0 if skeletons is None else skeletons.read,
        "written": 0 if skeletons is None else skeletons.written,
        "rows_sha256": digest.hexdigest(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=3000, help="ShareGPT chats (0: all)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", nargs=2, metavar=("ROWS", "STORE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        store = None if args.child[1] == "-" else args.child[1]
        print(json.dumps(_mask(int(args.child[0]), store)))
        return
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

    def run(store: str | None) -> dict:
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(args.rows), store or "-"],
            env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        return json.loads(out.stdout.strip().splitlines()[-1])

    results: dict[str, list[dict]] = {
        "no store": [],
        "empty store (first worker)": [],
        "filled store (later workers)": [],
    }
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            results["no store"].append(run(None))
            results["empty store (first worker)"].append(run(tmp))
            results["filled store (later workers)"].append(run(tmp))
    digests = {r["rows_sha256"] for rs in results.values() for r in rs}
    print(
        f"{args.rows or 'all'} ShareGPT chats, dolma2, olmo, one thread per process; rows equal: {len(digests) == 1}"
    )
    for case, rs in results.items():
        seconds = " / ".join(f"{r['seconds']:.2f}" for r in rs)
        r = rs[-1]
        print(f"{case:<30} {seconds} s   shapes {r['shapes']}, read {r['read']}, written {r['written']}")


if __name__ == "__main__":
    main()
