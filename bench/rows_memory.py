"""What the command's own process holds that grows with the input: its peak RSS against rows and slices.

    python bench/rows_memory.py --data /tmp/mem/chats-2.jsonl,/tmp/mem/chats-8.jsonl
    python bench/rows_memory.py --data /tmp/mem/chats-2.jsonl --slice-rows 0,10 --out rows-memory.json

Each input is converted (dolma2, ``olmo``, 4096; fresh work and output directories) once per slice size
(``--slice-rows``; 0, the default slicing: a JSON Lines file's 10 MiB batches);
the command's own process (the plan, the flow, the tail, the check) is sampled every 50 ms, its workers
apart. The peak's growth per slice (one input sliced two ways) and per document (two inputs), and with
them the projection for a 22 B-token job (:func:`project`). Below ~100k documents the peak's growth per
document is within the noise of its fixed part (~500 MB: Prefect, the tokenizer's facts); bench/tail.py
``--memory`` measures the tail's own per document. Make the inputs with bench/scale.py's
``write_copies`` (copies of the ShareGPT set, each copy new text).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.data import dolma2_dir  # noqa: E402
from bench.run import run_ours  # noqa: E402

#: The job projected: Dolci-Think-SFT's size (issue 41).
PROJECT_TOKENS = 22e9


def project(rows: list[dict]) -> dict:
    """Bytes per slice from runs of one input sliced two ways; bytes per document from runs of two inputs
    sliced the default way (less their slices' share); the 22 B-token job's peak from the largest
    default run, its documents and slices grown in the same proportion as its tokens."""
    per_slice, per_document = 0.0, 0.0
    by_data: dict[str, list[dict]] = {}
    for r in rows:
        by_data.setdefault(r["data"], []).append(r)
    for same in by_data.values():
        a, b = min(same, key=lambda r: r["slices"]), max(same, key=lambda r: r["slices"])
        if b["slices"] > a["slices"]:
            per_slice = (b["peak_root_mib"] - a["peak_root_mib"]) * 2**20 / (b["slices"] - a["slices"])
    default = sorted((r for r in rows if not r["slice_rows"]), key=lambda r: r["documents"])
    if len(default) >= 2 and default[-1]["documents"] > default[0]["documents"]:
        a, b = default[0], default[-1]
        grown = (b["peak_root_mib"] - a["peak_root_mib"]) * 2**20 - per_slice * (b["slices"] - a["slices"])
        # below ~100k documents the growth is within the noise of the fixed part: then none is projected
        per_document = max(0.0, grown / (b["documents"] - a["documents"]))
    base = (default or rows)[-1]
    scale = PROJECT_TOKENS / base["tokens"]
    documents, slices = base["documents"] * scale, base["slices"] * scale
    peak = base["peak_root_mib"] * 2**20 + per_document * (documents - base["documents"])
    peak += per_slice * (slices - base["slices"])
    return {
        "bytes_per_slice": round(per_slice),
        "bytes_per_document": round(per_document, 1),
        "projection": {
            "tokens": PROJECT_TOKENS,
            "documents": round(documents),
            "slices": round(slices),
            "peak_root_gib": round(peak / 2**30, 2),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="comma-separated .jsonl inputs of different sizes")
    ap.add_argument("--slice-rows", default="0", help="comma-separated rows per slice (0: the default)")
    ap.add_argument("--scratch", type=Path, default=None, help="work and output directories (default: tmp)")
    ap.add_argument("--out", type=Path, default=None, help="write the rows and the fit here as JSON")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="rows-memory-", dir=args.scratch))
    rows = []
    try:
        for data in [Path(d) for d in args.data.split(",")]:
            for slice_rows in [int(b) for b in args.slice_rows.split(",")]:
                work, out = scratch / "work", scratch / "out"
                extra = ["--slice_rows", str(slice_rows)] if slice_rows else []
                got = run_ours(data, str(dolma2_dir()), "olmo", 4096, work, out, *extra)
                row = {
                    "data": data.name,
                    "input_bytes": data.stat().st_size,
                    "slice_rows": slice_rows,
                    "documents": got["documents"],
                    "tokens": got["tokens"],
                    "slices": got["slices_total"],
                    "peak_root_mib": round(got["peak_root"] / 2**20, 1),
                    "peak_tree_mib": round(got["peak"] / 2**20, 1),
                    "wall_s": round(got["wall"], 1),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
                shutil.rmtree(work, ignore_errors=True)
                shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = project(rows)
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "fit": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
