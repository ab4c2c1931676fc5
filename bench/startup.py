"""Start-up at users' scale: how long the plan (what runs before the first slice can start) takes on one
large .jsonl read by batch (sftmix.sources.jsonl), or .parquet read by row group (sftmix.sources.parquet), against
datasets' whole-file Arrow conversion, side by side.

    python bench/startup.py --copies 40        # all ShareGPT chats 40x, each copy in its own seeded order (~4.8 GB)
    python bench/startup.py --copies 40 --format parquet   # the same chats as Parquet, 1,000 chats a row group
    python bench/startup.py --copies 40 --format jsonl.gz  # the same .jsonl, gzipped (decompressed to a copy)
    python bench/startup.py --copies 40 --format hub       # that Parquet as a hub dataset's files (a directory)
    python bench/startup.py --copies 40 --format hub-jsonl # that .jsonl as a hub dataset's 8 JSON Lines files
    python bench/startup.py --copies 40 --format hub-jsonl.gz  # those 8 files gzipped
    python bench/startup.py --copies 40 --format hub-declared  # plain, a card declaring the features
    python bench/startup.py --copies 4 --data tests/golden/data/sharegpt_mt150.jsonl

Each plan runs in a fresh process with a fresh work directory (nothing cached), on the same file, with
the dolma2 tokenizer and the olmo template; both plans must select the same rows. Prints wall seconds,
CPU seconds (all threads) and peak RSS of each, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.scale import copy_of, load_chats  # noqa: E402
from tests.hub_emulator import declared_card  # noqa: E402

PLAN = """
import json, sys, time
from sftmix.config.config import DatasetEntry, MixerConfig, OutputSpec, TokenizerSpec
from sftmix.config.run_options import RunOptions
from sftmix.planning.plan import build_plan
data, tokenizer, work = sys.argv[1:4]
mixer = MixerConfig(
    datasets=[DatasetEntry(path=data, amount=1.0)],
    tokenizer=TokenizerSpec(name_or_path=tokenizer, chat_template="olmo"),
    max_seq_length=4096,
    output=OutputSpec(path=work + "/out"),
)
started = time.perf_counter()
plan = build_plan(mixer, RunOptions(work_dir=work))
print(json.dumps({"seconds": time.perf_counter() - started, "rows": plan.datasets[0].n_rows,
                  "slices": len(plan.slices), "fingerprint": plan.datasets[0].fingerprint}))
"""


def write_input(chats: list[list[dict]], copies: int, path: Path) -> Path:
    """Every chat ``copies`` times, each copy in its own seeded order (new text: the copy number)."""
    with open(path, "w", encoding="utf-8") as fh:
        for j in range(copies):
            order = list(range(len(chats)))
            random.Random(j).shuffle(order)
            for i in order:
                fh.write(json.dumps({"messages": copy_of(chats[i], j)}, ensure_ascii=False) + "\n")
    return path


def write_parquet(jsonl: Path, path: Path, group_rows: int = 1000) -> Path:
    """The chats of a .jsonl written as Parquet, ``group_rows`` chats a row group (written as it is read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))])
    with open(jsonl, encoding="utf-8") as fh, pq.ParquetWriter(path, schema) as writer:
        while rows := [json.loads(line) for _, line in zip(range(group_rows), fh, strict=False)]:
            writer.write_table(pa.Table.from_pylist(rows, schema=schema), row_group_size=group_rows)
    return path


def write_gzip(path: Path, packed: Path) -> Path:
    """``path`` compressed as ``gzip`` does by default (level 6)."""
    import gzip
    import shutil

    with open(path, "rb") as src, gzip.open(packed, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst, 4 << 20)
    return packed


def write_hub_layout(parquet: Path, repo: Path, files: int = 8) -> Path:
    """A Parquet file's row groups as a hub dataset's split of ``files`` files (``data/train-*.parquet``)."""
    import pyarrow.parquet as pq

    source = pq.ParquetFile(parquet)
    groups = list(range(source.num_row_groups))
    (repo / "data").mkdir(parents=True)
    for k in range(files):
        mine = groups[k * len(groups) // files : (k + 1) * len(groups) // files]
        name = repo / "data" / f"train-{k:05d}-of-{files:05d}.parquet"
        with pq.ParquetWriter(name, source.schema_arrow) as writer:
            for g in mine:
                writer.write_table(source.read_row_group(g))
    (repo / "README.md").write_text("---\nlicense: other\n---\n# ShareGPT copies\n")
    return repo


def write_hub_jsonl(jsonl: Path, repo: Path, files: int = 8, gzipped: bool = False) -> Path:
    """A .jsonl's lines as a hub dataset's split of ``files`` JSON Lines files (``data/train-*.jsonl``),
    each gzipped (``.jsonl.gz``) where asked."""
    size = jsonl.stat().st_size
    (repo / "data").mkdir(parents=True)
    with open(jsonl, "rb") as src:
        for k in range(files):
            with open(repo / "data" / f"train-{k:05d}-of-{files:05d}.jsonl", "wb") as dst:
                while src.tell() < (k + 1) * size // files and (
                    block := src.read(min(64 << 20, (k + 1) * size // files - src.tell()))
                ):
                    dst.write(block)
                dst.write(src.readline())  # the rest of the line
            if gzipped:
                plain = repo / "data" / f"train-{k:05d}-of-{files:05d}.jsonl"
                write_gzip(plain, plain.with_suffix(".jsonl.gz"))
                plain.unlink()
    (repo / "README.md").write_text("---\nlicense: other\n---\n# ShareGPT copies\n")
    return repo


def plan_once(data: Path, tokenizer: Path, reader: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="startup-") as work:
        parquet = data.suffix == ".parquet" or (data.is_dir() and any(data.rglob("*.parquet")))
        setting = "TOKENIZE_MIXER_PARQUET_READER" if parquet else "TOKENIZE_MIXER_JSON_READER"
        env = {**os.environ, setting: "datasets" if reader == "datasets" else ""}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        wall = time.perf_counter()
        proc = subprocess.run(  # GNU time for this child's own peak RSS (getrusage's is the largest child's)
            ["/usr/bin/time", "-f", "peak-rss-kb %M", sys.executable, "-c", PLAN, str(data), str(tokenizer), work],
            env=env, capture_output=True, text=True, check=True, cwd=ROOT,
        )  # fmt: skip
        wall = time.perf_counter() - wall
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    rss = [line.split()[1] for line in proc.stderr.splitlines() if line.startswith("peak-rss-kb ")]
    result.update(
        process_seconds=wall,
        cpu_seconds=(after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        peak_rss_mb=int(rss[-1]) / 1024 if rss else float("nan"),
    )
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=40)
    ap.add_argument(
        "--data", type=Path, default=None, help="chats (.jsonl with messages); default: all ShareGPT"
    )
    ap.add_argument("--tokenizer", type=Path, default=None, help="default: the dolma2 tokenizer of the tests")
    ap.add_argument(
        "--format",
        choices=("jsonl", "jsonl.gz", "parquet", "hub", "hub-jsonl", "hub-jsonl.gz", "hub-declared"),
        default="jsonl",
    )
    ap.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()) / "tokenize-mixer-startup")
    args = ap.parse_args()
    if args.tokenizer is None:
        from tests.tokenizer_fixtures import ensure_dolma2

        args.tokenizer = ensure_dolma2()
    args.scratch.mkdir(parents=True, exist_ok=True)
    data = args.scratch / f"chats-{args.copies}.jsonl"
    if not data.exists():
        write_input(load_chats(args.data), args.copies, data)
    if args.format == "jsonl.gz":
        lines, data = data, data.with_suffix(".jsonl.gz")
        if not data.exists():
            write_gzip(lines, data)
    if args.format in ("parquet", "hub"):
        lines, data = data, data.with_suffix(".parquet")
        if not data.exists():
            write_parquet(lines, data)
    if args.format == "hub":
        parquet, data = data, args.scratch / f"hub-{args.copies}"
        if not data.exists():
            write_hub_layout(parquet, data)
    if args.format in ("hub-jsonl", "hub-jsonl.gz", "hub-declared"):
        lines, data = data, args.scratch / f"{args.format.replace('.', '-')}-{args.copies}"
        if not data.exists():
            write_hub_jsonl(lines, data, gzipped=args.format.endswith(".gz"))
            if args.format == "hub-declared":
                (data / "README.md").write_text(declared_card())  # (the rows: messages alone)
    size = sum(p.stat().st_size for p in data.rglob("train-*")) if data.is_dir() else data.stat().st_size
    print(f"input: {data} ({size / 2**30:.2f} GiB), {os.cpu_count()} CPUs")
    results = {}
    ours = "row groups" if args.format in ("parquet", "hub") else "batches"
    for reader in ("datasets", ours):
        results[reader] = r = plan_once(data, args.tokenizer, reader)
        print(
            f"{reader:>9}: plan {r['seconds']:.1f} s (process {r['process_seconds']:.1f} s, CPU {r['cpu_seconds']:.1f} s, "
            f"peak RSS {r['peak_rss_mb']:.0f} MB), {r['rows']:,} rows, {r['slices']:,} slices"
        )
    assert results["datasets"]["rows"] == results[ours]["rows"], "the two plans select different rows"
    ratio = results[ours]["seconds"] / results["datasets"]["seconds"]
    print(
        f"plan by {ours} / plan through datasets: {ratio:.3f} ({size / 2**20 / results[ours]['seconds']:,.0f} MiB/s)"
    )


if __name__ == "__main__":
    main()
