"""Parquet written with large row groups (pyarrow's writer puts up to 1Mi rows in one by default): the
memory and time of a real `tokenize-mixer convert`, each row group decoded whole against batch by batch,
in turn, on the same file.

    python bench/row_groups.py --copies 4                   # ShareGPT 4x as one row group (~440 MiB of data)
    python bench/row_groups.py --copies 4 --group-rows 20000 --rounds 2

"whole" sets ``TOKENIZE_MIXER_PARQUET_STREAMED_BYTES`` above every row group (what every slice did before
row groups were read by batch); "by batch" leaves the default. Both outputs must have the same digests.
Prints wall seconds, the peak of the process tree's private memory (RSS less shared file pages, sampled
every 50 ms), and the largest single process's peak RSS (GNU time's for the command, from getrusage for
its workers). dolma2, olmo, 4096, a temporary Prefect API, every CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.memory import PeakMemory  # noqa: E402
from bench.scale import load_chats  # noqa: E402
from bench.startup import write_input, write_parquet  # noqa: E402

WHOLE = str(1 << 62)


def convert(data: Path, tokenizer: str, scratch: Path, mode: str) -> dict:
    work, out = scratch / f"work-{mode}", scratch / f"out-{mode}"
    argv = [
        str(ROOT / ".venv" / "bin" / "tokenize-mixer"), "convert", "--dataset_mixer_list", str(data), "1.0",
        "--tokenizer_name_or_path", tokenizer, "--chat_template_name", "olmo", "--max_seq_length", "4096",
        "--work_dir", str(work), "--output_dir", str(out),
    ]  # fmt: skip
    env = {**os.environ, "TOKENIZE_MIXER_PARQUET_STREAMED_BYTES": WHOLE if mode == "whole" else ""}
    started = time.perf_counter()
    proc = subprocess.Popen(
        ["/usr/bin/time", "-f", "peak-rss-kb %M", *argv],
        env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    mem = PeakMemory(proc.pid)
    _, err = proc.communicate()
    mem.stop()
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{mode}: exit {proc.returncode}\n{err[-3000:]}")
    rss = [int(line.split()[1]) for line in err.splitlines() if line.startswith("peak-rss-kb ")]
    digests = json.loads((out / "run_report.json").read_text())["digests"]
    digests.pop("dataset_statistics.json", None)  # (it names the work directory)
    subprocess.run(["rm", "-rf", str(work), str(out)], check=True)
    return {
        "wall": wall,
        "tree_private_mb": mem.peak_private / 2**20,
        "largest_process_mb": (rss[-1] / 1024) if rss else float("nan"),
        "digests": digests,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--group-rows", type=int, default=1 << 20, help="rows a row group (pyarrow's default)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()) / "tokenize-mixer-row-groups")
    args = ap.parse_args()
    from tests.tokenizer_fixtures import ensure_dolma2

    tokenizer = str(ensure_dolma2())
    args.scratch.mkdir(parents=True, exist_ok=True)
    lines = args.scratch / f"chats-{args.copies}.jsonl"
    if not lines.exists():
        write_input(load_chats(None), args.copies, lines)
    data = args.scratch / f"chats-{args.copies}-{args.group_rows}.parquet"
    if not data.exists():
        write_parquet(lines, data, args.group_rows)
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(data).metadata
    largest = max(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    print(
        f"input: {data} ({data.stat().st_size / 2**20:,.0f} MiB, {meta.num_rows:,} rows, {meta.num_row_groups} "
        f"row group(s), the largest {largest / 2**20:,.0f} MiB of data), {os.cpu_count()} CPUs"
    )
    results: dict[str, list[dict]] = {"whole": [], "by batch": []}
    for r in range(args.rounds):
        for mode in ("whole", "by batch"):
            got = convert(data, tokenizer, args.scratch, mode.replace(" ", "-"))
            results[mode].append(got)
            print(
                f"round {r + 1} {mode:>8}: {got['wall']:6.1f} s, tree private peak {got['tree_private_mb']:6,.0f} MB, "
                f"largest process {got['largest_process_mb']:6,.0f} MB"
            )
    first = results["whole"][0]["digests"]
    assert all(g["digests"] == first for rs in results.values() for g in rs), "the outputs differ"
    print("outputs: the same digests in every run")
    for mode, rs in results.items():
        print(
            f"{mode:>8}: wall {min(g['wall'] for g in rs):.1f}-{max(g['wall'] for g in rs):.1f} s, tree private "
            f"peak {max(g['tree_private_mb'] for g in rs):,.0f} MB"
        )


if __name__ == "__main__":
    main()
