"""Cost as the input grows: the whole command against the limit at 1x, 4x, 16x of the ShareGPT set.

    python bench/scale.py                          # 1x and 4x of the 17.5k ShareGPT chats, all CPUs
    python bench/scale.py --copies 1,4,16          # 16x too: ~1.9 GB of chats, ~460M rendered tokens
    python bench/scale.py --data .devdata/sharegpt.jsonl.xz --tokenizer .devdata/dolma2   # offline

Copy ``j`` of a chat is the chat with `` (j)`` appended to its first message, so every copy is new text
(no slice is shared or deduplicated) of nearly the same length. For each size, measured in this one
run on the same file: the *limit* (render with the template + Rust ``encode_batch``, every row in full,
no masking, on as many warm spawned processes as ours has workers) and `tokenize-mixer convert` end to
end in a fresh work directory (start-up, tokenizing, assemble/validate/check, publish, exit), with the
peak summed RSS of its process tree (and of its private part, and its anonymous memory counted
once). Prints per size: wall, tokens/s, ours/limit, the tail's share, and time per token and peak
RSS relative to the smallest size. Writes the rows to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.run import _fast_limit_chunk, _limit_chunk, _pool_run, run_ours  # noqa: E402
from sftmix.runtime.parallel import available_cpus  # noqa: E402


def load_chats(data: Path | None) -> list[list[dict]]:
    if data is None:
        from bench.data import sharegpt_chats

        return sharegpt_chats(0)
    opener = lzma.open if data.suffix == ".xz" else open
    with opener(data, "rt", encoding="utf-8") as fh:
        return [json.loads(line)["messages"] for line in fh if line.strip()]


def copy_of(chat: list[dict], j: int) -> list[dict]:
    if j == 0:
        return chat
    first = {**chat[0], "content": f"{chat[0]['content']} ({j})"}
    return [first, *chat[1:]]


def write_copies(chats: list[list[dict]], copies: int, path: Path) -> Path:
    with open(path, "w", encoding="utf-8") as fh:
        for j in range(copies):
            for chat in chats:
                fh.write(json.dumps({"messages": copy_of(chat, j)}, ensure_ascii=False) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", default="1,4", help="comma-separated input sizes, in copies of the set")
    ap.add_argument(
        "--data", type=Path, default=None, help=".jsonl or .jsonl.xz of chats (default: ShareGPT)"
    )
    ap.add_argument("--tokenizer", type=Path, default=None, help="tokenizer directory (default: dolma2)")
    ap.add_argument("--template", default="olmo")
    ap.add_argument("--max-seq-length", type=int, default=4096)
    ap.add_argument("--workers", type=int, default=0, help="0: every CPU this process may use")
    ap.add_argument("--out", type=Path, default=None, help="write the rows here as JSON")
    ap.add_argument("--logs", type=Path, default=None, help="keep each convert's log (timed lines) here")
    ap.add_argument(
        "--library-too",
        action="store_true",
        help="also run ours with --encoder hf (the tokenizers library) on the same file, and compare bytes",
    )
    ap.add_argument(
        "--skip-library-limit",
        action="store_true",
        help="leave out the tokenizers library's limit (the slowest part of this bench); keep the best parts",
    )
    args = ap.parse_args()

    from sftmix.tokenizing.templates import named_template

    workers = args.workers or available_cpus()
    if args.tokenizer is None:
        from bench.data import dolma2_dir

        args.tokenizer = dolma2_dir()
    tokenizer = str(args.tokenizer.resolve())
    template = named_template(args.template)
    chats = load_chats(args.data)
    scratch = Path(tempfile.mkdtemp(prefix="tm-scale-"))
    print(
        f"machine: {workers} workers ({available_cpus()} usable CPUs, {os.cpu_count()} on the host); "
        f"{len(chats)} chats per copy; template {args.template}; max length {args.max_seq_length}\n",
        flush=True,
    )
    rows = []
    try:
        # untimed warm-up: the temporary API's first database migration, bytecode, page cache
        warm = write_copies(chats[:50], 1, scratch / "warm.jsonl")
        run_ours(warm, tokenizer, args.template, args.max_seq_length, scratch / "w0", scratch / "o0")
        for copies in [int(c) for c in args.copies.split(",")]:
            data = write_copies(chats, copies, scratch / f"chats-{copies}.jsonl")
            every = [copy_of(c, j) for j in range(copies) for c in chats]
            fast_wall, fast_tokens = _pool_run(_fast_limit_chunk, every, (template,), tokenizer, workers)
            limit_wall, limit_tokens = float("nan"), fast_tokens
            if not args.skip_library_limit:
                limit_wall, limit_tokens = _pool_run(_limit_chunk, every, (template,), tokenizer, workers)
                assert fast_tokens == limit_tokens, (fast_tokens, limit_tokens)
            del every
            library = {}
            if args.library_too:  # ours with the tokenizers library, for the encoder's share
                library = run_ours(
                    data,
                    tokenizer,
                    args.template,
                    args.max_seq_length,
                    scratch / f"work-{copies}-hf",
                    scratch / f"out-{copies}-hf",
                    "--workers",
                    str(workers),
                    "--encoder",
                    "hf",
                )
                shutil.rmtree(scratch / f"work-{copies}-hf", ignore_errors=True)
            ours = run_ours(
                data,
                tokenizer,
                args.template,
                args.max_seq_length,
                scratch / f"work-{copies}",
                scratch / f"out-{copies}",
                "--workers",
                str(workers),
            )
            if args.logs:
                args.logs.mkdir(parents=True, exist_ok=True)
                (args.logs / f"convert-{copies}x.log").write_text(ours["log"])
            command = ours.get("command_seconds") or ours["wall"]
            tail = max(0.0, ours["wall"] - (command - ours["wall_seconds"]) - ours["tokenize_seconds"])
            row = {
                "copies": copies,
                "chats": copies * len(chats),
                "input_mib": round(data.stat().st_size / 2**20, 1),
                "limit_seconds": round(limit_wall, 2),
                "limit_tokens": limit_tokens,
                "ours_seconds": round(ours["wall"], 2),
                "ours_tokens": ours["tokens"],
                "startup_seconds": round(command - ours["wall_seconds"], 2),
                "tokenize_seconds": ours["tokenize_seconds"],
                "tail_seconds": round(tail, 2),
                "peak_rss_mib": round(ours["peak"] / 2**20),
                "peak_private_mib": round(ours["peak_private"] / 2**20),
                "peak_anonymous_mib": round(ours["peak_anonymous"] / 2**20),
                "ours_over_limit": round(ours["wall"] / limit_wall, 3),
                "fast_limit_seconds": round(fast_wall, 2),
                "ours_over_fast_limit": round(ours["wall"] / fast_wall, 3),
                "tokenize_over_fast_limit": round(ours["tokenize_seconds"] / fast_wall, 3),
                **(
                    {
                        "ours_library_seconds": round(library["wall"], 2),
                        "ours_library_tokenize_seconds": library["tokenize_seconds"],
                        "same_bytes": (scratch / f"out-{copies}-hf" / "token_ids_part_0000.npy").read_bytes()
                        == (scratch / f"out-{copies}" / "token_ids_part_0000.npy").read_bytes(),
                    }
                    if library
                    else {}
                ),
            }
            shutil.rmtree(scratch / f"out-{copies}-hf", ignore_errors=True)
            rows.append(row)
            print(json.dumps(row), flush=True)
            data.unlink()
            shutil.rmtree(scratch / f"work-{copies}", ignore_errors=True)
            shutil.rmtree(scratch / f"out-{copies}", ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    base = rows[0]
    per_token = base["ours_seconds"] / base["ours_tokens"]
    line = "{:>6} {:>8} {:>9} {:>9} {:>9} {:>11} {:>9} {:>9} {:>12} {:>7} {:>11} {:>9} {:>9} {:>12} {:>12} {:>9} {:>9}"
    print()
    print(
        line.format(
            "copies", "chats", "input MiB", "limit s", "fast lim", "ours s", "ours/lim", "ours/fast", "ours tok/s", "tail %",
            "s/token rel", "peak MiB", "peak rel", "private MiB", "private rel", "anon MiB", "anon rel",
        )
    )  # fmt: skip
    for r in rows:
        print(
            line.format(
                r["copies"],
                f"{r['chats']:,}",
                f"{r['input_mib']:,.0f}",
                f"{r['limit_seconds']:.1f}",
                f"{r['fast_limit_seconds']:.1f}",
                f"{r['ours_seconds']:.1f}",
                f"{r['ours_over_limit']:.2f}x",
                f"{r['ours_over_fast_limit']:.2f}x",
                f"{r['ours_tokens'] / r['ours_seconds']:,.0f}",
                f"{100 * r['tail_seconds'] / r['ours_seconds']:.1f}",
                f"{(r['ours_seconds'] / r['ours_tokens']) / per_token:.3f}",
                f"{r['peak_rss_mib']:,}",
                f"{r['peak_rss_mib'] / base['peak_rss_mib']:.3f}",
                f"{r['peak_private_mib']:,}",
                f"{r['peak_private_mib'] / base['peak_private_mib']:.3f}",
                f"{r['peak_anonymous_mib']:,}",
                f"{r['peak_anonymous_mib'] / max(1, base['peak_anonymous_mib']):.3f}",
            )
        )
    print(
        "\nlimit: render + the tokenizers library's encode_batch; fast lim: render + the fast encoder (fastokens where installed); "
        "ours s: the whole command (start-up, tokenizing, assemble/validate/check, publish, exit); "
        "tail: the rest of it after start-up (by the command's own clock) and tokenizing, i.e. assemble, "
        "validate, check, publish, exit and the interpreter's own start; ours tokens are after truncation and drops, the limit's before; "
        "peak: summed RSS of the process tree; private: the same less shared file-backed pages (the page cache of "
        "memory-mapped files, which the kernel can drop); anon: anonymous memory of the tree with each shared page "
        "counted once (PSS), which private overstates for workers forked from one server"
    )
    print("\nthe tokenizing phase against the best parts (issue 32's target: at most 2x):")
    for r in rows:
        print(
            f"  {r['copies']}x: best parts {r['fast_limit_seconds']:.1f} s, ours tokenizing "
            f"{r['tokenize_seconds']:.1f} s ({r['tokenize_over_fast_limit']:.2f}x), end to end {r['ours_seconds']:.1f} s"
        )
    if args.out:
        args.out.write_text(json.dumps({"workers": workers, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
