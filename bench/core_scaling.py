"""Scaling of the tokenizing engine alone: the same slices on N spawned worker processes, no Prefect.

    python bench/core_scaling.py --data .devdata/sharegpt.jsonl.xz --tokenizer .devdata/dolma2 \\
        --workers 1,2,4,8,16 --slice-bytes 1048576 --out /tmp/core-scaling

The flow's steady state (bench/scaling.py) includes each worker's start-up (imports of Prefect,
transformers and datasets, ~10-15 CPU-seconds each); this separates the two: worker start-up is timed
on its own (pool creation until every worker has loaded the tokenizer), then the slices are timed on
warm workers, and then the limit on the same slices (render + Rust encode, no masking, no writes) on
the same workers, so the speed-up of the work itself is printed beside ours. Each worker count writes into a fresh work directory; digests of every slice must agree.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.scaling import prepare_data  # noqa: E402


def _init() -> None:
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import sftmix.tokenizing.slices  # noqa: F401  (what a flow worker imports: no transformers, no datasets)


def _warm(args: tuple) -> float:
    spec, ctx = args

    ctx.masker()  # loads (and caches) the tokenizer in this worker
    return time.time()


def _limit(args: tuple) -> int:
    """The physical limit on the same rows: render each with the template, Rust ``encode_batch``."""
    from sftmix.sources.formats import conversation_from_row
    from sftmix.tokenizing.slices import rows_of

    spec, ctx = args
    masker = ctx.masker()
    rows = spec.row_list()
    tokens = 0
    for b in range(0, len(rows), ctx.batch_size):
        raw = rows_of(spec, ctx.output.datasets_cache, rows[b : b + ctx.batch_size])
        convs = [conversation_from_row(r, spec.row_format, spec.messages_key) for r in raw]
        texts = [masker.renderer.render(c.messages, c.tools, False) for c in convs]
        tokens += sum(len(e.ids) for e in masker.encode_batch(texts))
    return tokens


def _run(args: tuple) -> dict:
    from sftmix.tokenizing.slices import tokenize_slice

    spec, ctx = args
    m = tokenize_slice(spec, ctx)
    return {"key": m.key, "tokens": m.tokens, "sha": {k: v.sha256 for k, v in m.files.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--workers", default="1,2,4,8,16")
    ap.add_argument("--slice-bytes", type=int, default=1 << 20)
    ap.add_argument("--out", type=Path, default=Path("/tmp/core-scaling"))
    args = ap.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    from sftmix.config.config import MixerConfig
    from sftmix.config.run_options import RunOptions
    from sftmix.planning.plan import build_plan

    scratch = Path(tempfile.mkdtemp(prefix="core-scaling-"))
    data = prepare_data(args.data, scratch)
    mixer = MixerConfig.model_validate(
        {
            "datasets": [{"path": str(data), "amount": 1.0}],
            "tokenizer": {"name_or_path": str(Path(args.tokenizer).resolve()), "chat_template": "olmo"},
            "max_seq_length": 4096,
            "output": {"path": str(scratch / "unused")},
        }
    )
    t = time.perf_counter()
    plan = build_plan(mixer, RunOptions(work_dir=str(scratch / "plan"), slice_bytes=args.slice_bytes))
    print(f"plan: {len(plan.slices)} slices in {time.perf_counter() - t:.1f} s; {os.cpu_count()} CPUs")
    results = []
    reference = None
    base = limit_base = None
    for n in [int(x) for x in args.workers.split(",")]:
        output = plan.context.output.model_copy(update={"work_dir": str(scratch / f"w{n}")})
        ctx = plan.context.model_copy(update={"output": output})
        t0 = time.perf_counter()
        with mp.get_context("spawn").Pool(n, initializer=_init) as pool:
            pool.map(_warm, [(plan.slices[0], ctx)] * n, chunksize=1)
            startup = time.perf_counter() - t0
            t1 = time.perf_counter()
            done = pool.map(_run, [(s, ctx) for s in plan.slices], chunksize=1)
            wall = time.perf_counter() - t1
            t2 = time.perf_counter()
            limit_tokens = sum(pool.map(_limit, [(s, ctx) for s in plan.slices], chunksize=1))
            limit_wall = time.perf_counter() - t2
        digests = [d["sha"] for d in done]
        if reference is None:
            reference = digests
        assert digests == reference, f"{n} workers: slice digests differ"
        tokens = sum(d["tokens"] for d in done)
        rate = tokens / wall
        base = base or rate
        limit_rate = limit_tokens / limit_wall
        limit_base = limit_base or limit_rate
        row = {
            "workers": n,
            "startup_s": round(startup, 1),
            "wall_s": round(wall, 2),
            "tok_per_s": round(rate),
        }
        row["speedup"] = round(rate / base, 2)
        row["efficiency"] = round(rate / base / n, 2)
        row["limit_wall_s"] = round(limit_wall, 2)
        row["limit_tok_per_s"] = round(limit_rate)  # before truncation (ours counts after)
        row["limit_speedup"] = round(limit_rate / limit_base, 2)
        row["ours_over_limit"] = round(limit_wall / wall, 2)
        results.append(row)
        print(
            f"{n:>3} workers: start-up {startup:5.1f} s, slices {wall:6.2f} s, {rate:>10,.0f} tok/s, "
            f"speedup {row['speedup']:5.2f}, efficiency {row['efficiency']:.2f}; limit {limit_wall:6.2f} s, "
            f"speedup {row['limit_speedup']:5.2f}; ours/limit {row['ours_over_limit']:.2f}",
            flush=True,
        )
    print("slice digests identical for every worker count")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "core_scaling.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
