"""What the command's own process holds that grows with the input: its peak RSS against rows and slices.

    python bench/rows_memory.py --data /tmp/mem/chats-2.jsonl,/tmp/mem/chats-8.jsonl
    python bench/rows_memory.py --data ... --slice-bytes 4194304,262144 --out rows-memory.json

Each input is converted (dolma2, ``olmo``, 4096; fresh work and output directories) once per slice size;
the command's own process (the plan, the flow, the tail, the check) is sampled every 50 ms, its workers
apart. A least-squares fit of its peak over (1, documents, slices) gives the fixed part, the bytes per
document and the bytes per slice; with them, the projection for a 22 B-token job (documents and slices
from this input's tokens per document and bytes per token). Make the inputs with bench/scale.py's
``write_copies`` (copies of the ShareGPT set, each copy new text).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.data import dolma2_dir  # noqa: E402
from bench.run import run_ours  # noqa: E402

#: The job projected: Dolci-Think-SFT's size (issue 41).
PROJECT_TOKENS = 22e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="comma-separated .jsonl inputs of different sizes")
    ap.add_argument(
        "--slice-bytes", default="4194304", help="comma-separated slice sizes (the default first)"
    )
    ap.add_argument("--scratch", type=Path, default=None, help="work and output directories (default: tmp)")
    ap.add_argument("--out", type=Path, default=None, help="write the rows and the fit here as JSON")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="rows-memory-", dir=args.scratch))
    rows = []
    try:
        for data in [Path(d) for d in args.data.split(",")]:
            for slice_bytes in [int(b) for b in args.slice_bytes.split(",")]:
                work, out = scratch / "work", scratch / "out"
                got = run_ours(
                    data, str(dolma2_dir()), "olmo", 4096, work, out, "--slice_bytes", str(slice_bytes)
                )
                row = {
                    "data": data.name,
                    "input_bytes": data.stat().st_size,
                    "slice_bytes": slice_bytes,
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
    design = np.array([[1.0, r["documents"], r["slices"]] for r in rows])
    peaks = np.array([r["peak_root_mib"] * 2**20 for r in rows])
    if np.linalg.matrix_rank(design) < 3:  # one slice size: slices follow the documents
        design = design[:, :2]
    fit, *_ = np.linalg.lstsq(design, peaks, rcond=None)
    fixed, per_document = float(fit[0]), float(fit[1])
    per_slice = float(fit[2]) if fit.shape[0] > 2 else 0.0
    biggest = max(rows, key=lambda r: r["tokens"])
    documents = PROJECT_TOKENS / (biggest["tokens"] / biggest["documents"])
    slices = (
        PROJECT_TOKENS * (biggest["input_bytes"] / biggest["tokens"]) / int(args.slice_bytes.split(",")[0])
    )
    projected = fixed + per_document * documents + per_slice * slices
    summary = {
        "fixed_mib": round(fixed / 2**20, 1),
        "bytes_per_document": round(per_document, 1),
        "bytes_per_slice": round(per_slice, 1),
        "projection": {
            "tokens": PROJECT_TOKENS,
            "documents": round(documents),
            "slices": round(slices),
            "peak_root_gib": round(projected / 2**30, 2),
        },
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "fit": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
