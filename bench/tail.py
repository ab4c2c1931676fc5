"""The tail of a run (what follows tokenizing), phase by phase, on slices a convert already made.

    python bench/tail.py --data /tmp/tail/chats-10.jsonl --work-dir /tmp/tail/work [--repeat 2]

Plans the same mixer as ``tokenize-mixer convert --dataset_mixer_list DATA 1.0`` (dolma2, olmo, 4096; every
slice must be in WORK_DIR already), then times, in this one process, on the CPUs it may use (run it under
``taskset -c 0`` for one core): the global order, the assembly into a fresh staging directory, the output's
digests, the check without and with the digests (hashed in the same read), and the assembly with the
check following the writers (what a run does: each chunk checked once written).
Each phase is run ``--repeat`` times; the page cache is warm after the first assembly, as it is in a run.
``--against-disk N``: then N rounds in turn of the disk's own time to write the output (its parts' bytes
written sequentially from one 1 MiB buffer into a new file beside the staging, then fsync: ``dd bs=1M
conv=fsync``, and the same with O_DIRECT: the disk alone) and the tail (assembled, checked as written), with their ratio per round.
``--memory``: each phase's peak of memory allocated in this process above what it held before (Python
objects and numpy arrays, by ``tracemalloc``; slower, so its times are not the phases' own), in MiB and in
bytes per output document: what the tail holds that grows with rows.
"""

from __future__ import annotations

import argparse
import functools
import json
import mmap
import os
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def timed(label: str, fn, results: dict, repeat: int):  # type: ignore[no-untyped-def]
    best, value, peak = float("inf"), None, 0
    for _ in range(repeat):
        value = None  # (the last value is not held while the phase runs again)
        if tracemalloc.is_tracing():
            held = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
        started = time.perf_counter()
        value = fn()
        best = min(best, time.perf_counter() - started)
        if tracemalloc.is_tracing():
            peak = max(peak, tracemalloc.get_traced_memory()[1] - held)
    results[label] = round(best, 3)
    extra = ""
    if tracemalloc.is_tracing():
        results.setdefault("peak_bytes", {})[label] = peak
        extra = f"   peak {peak / 2**20:9.1f} MiB"
    print(f"{label:<28} {best:8.2f} s{extra}", flush=True)
    return value


def disk_time(path: Path, nbytes: int, direct: bool = False) -> float:
    """Seconds to write ``nbytes`` to a new file from one 1 MiB buffer and make them durable: the disk's
    own time for an output of that size, as ``dd bs=1M conv=fsync`` measures it (through the page cache)
    or, ``direct``, ``dd bs=1M oflag=direct conv=fsync`` (the disk alone; rounded up to 4 KiB)."""
    buffer = memoryview(mmap.mmap(-1, 1 << 20))  # page-aligned, as O_DIRECT needs
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    if direct:
        nbytes = -(-nbytes // 4096) * 4096
    started = time.perf_counter()
    fd = os.open(path, flags, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, buffer[: min(left, len(buffer))])
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--work-dir", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, default=None, help="default: the dolma2 tokenizer of the tests")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument(
        "--against-disk", type=int, default=0, metavar="N", help="N rounds: the disk, then the tail"
    )
    ap.add_argument("--memory", action="store_true", help="each phase's peak memory (tracemalloc)")
    ap.add_argument("--reference", type=Path, default=None, help="an output of the same mixer: same digests")
    ap.add_argument("--out", type=Path, default=None, help="write the timings here as JSON")
    ap.add_argument(
        "--by",
        choices=["window", "slice"],
        default=None,
        help="how to write the parts (default: ask the page cache)",
    )
    args = ap.parse_args()

    from sftmix.assembly.assemble import assemble
    from sftmix.assembly.document_order import global_order
    from sftmix.check.findings import Recorded, check_output
    from sftmix.config.config import DatasetEntry, MixerConfig, OutputSpec, TokenizerSpec
    from sftmix.config.run_options import RunOptions
    from sftmix.output.digest import output_digests
    from sftmix.planning.plan import build_plan
    from sftmix.runtime.parallel import available_cpus
    from sftmix.tokenizing.slices import read_manifest

    if args.tokenizer is None:
        from tests.tokenizer_fixtures import ensure_dolma2

        args.tokenizer = ensure_dolma2()
    mixer = MixerConfig(
        datasets=[DatasetEntry(path=str(args.data), amount=1.0)],
        tokenizer=TokenizerSpec(name_or_path=str(args.tokenizer), chat_template="olmo"),
        max_seq_length=4096,
        output=OutputSpec(path=str(args.work_dir / "bench-tail-out")),
    )
    import sftmix.assembly.assemble

    sftmix.assembly.assemble.ASSEMBLE_BY = args.by
    results: dict = {"cpus": available_cpus(), "by": args.by or "page cache"}
    print(f"{available_cpus()} CPUs", flush=True)
    if args.memory:
        tracemalloc.start()
    plan = timed("plan", lambda: build_plan(mixer, RunOptions(work_dir=str(args.work_dir))), results, 1)
    manifests = [read_manifest(plan.context.output.work_dir, s.key) for s in plan.slices]
    missing = sum(m is None for m in manifests)
    if missing:
        sys.exit(f"{missing} of {len(manifests)} slices are not in {args.work_dir}: convert first")
    timed("global order", lambda: global_order(plan, manifests), results, args.repeat)  # type: ignore[arg-type]
    with tempfile.TemporaryDirectory(prefix="tail-", dir=args.work_dir) as tmp:
        staging = Path(tmp) / "staging"

        def assemble_once():  # type: ignore[no-untyped-def]
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            return assemble(plan, manifests, staging, Path(tmp) / "documents.npy")  # type: ignore[arg-type]

        result = timed("assemble", assemble_once, results, args.repeat)
        results["tokens"] = result.tokens
        results["documents"] = result.documents
        results["parts"] = result.parts
        digests = timed("digests", lambda: output_digests(staging), results, args.repeat)
        if args.reference is not None:
            reference = output_digests(args.reference)
            differ = sorted(k for k in set(digests) | set(reference) if digests.get(k) != reference.get(k))
            assert not differ, f"the output differs from {args.reference}: {differ}"
            print(f"same digests as {args.reference}", flush=True)
        recorded = Recorded(
            token_dtype=plan.context.output.token_dtype, documents_file=str(Path(tmp) / "documents.npy")
        )
        timed(
            "check (no digests)",
            lambda: check_output(staging, 4096, digests=False, recorded=recorded),
            results,
            args.repeat,
        )
        checked = timed(
            "check + digests, one read",
            lambda: check_output(staging, 4096, digests=True, recorded=recorded),
            results,
            args.repeat,
        )
        assert checked.digests == digests, "the check's digests differ from output_digests"

        def follow_writers():  # type: ignore[no-untyped-def]
            return functools.partial(check_output, staging, 4096, digests=True, recorded=recorded)

        def assemble_checked():  # type: ignore[no-untyped-def]
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            return assemble(plan, manifests, staging, Path(tmp) / "documents.npy", follow_writers())  # type: ignore[arg-type]

        both = timed("assemble, checked as written", assemble_checked, results, args.repeat)
        assert both.checked is not None and both.checked.digests == digests, (
            "checked as written: digests differ"
        )
        results["written"] = both.written_seconds
        print(f"{'  of it, until written':<28} {both.written_seconds:8.2f} s", flush=True)
        output_bytes = sum(p.stat().st_size for p in staging.glob("*_part_*.npy"))
        rounds = []
        for k in range(args.against_disk):
            # Each writes its bytes after the other's are freed (the page cache's pages, and on a VM the
            # host's behind them, cost the same to both): the last tail's staging goes before the disk.
            shutil.rmtree(staging)
            disk = disk_time(Path(tmp) / "disk.bin", output_bytes)
            direct = disk_time(Path(tmp) / "disk.bin", output_bytes, direct=True)
            staging.mkdir()
            started = time.perf_counter()
            assemble(plan, manifests, staging, Path(tmp) / "documents.npy", follow_writers())  # type: ignore[arg-type]
            tail = time.perf_counter() - started
            rounds.append(
                {
                    "disk": round(disk, 3),
                    "direct": round(direct, 3),
                    "tail": round(tail, 3),
                    "ratio": round(tail / disk, 2),
                    "ratio_direct": round(tail / direct, 2),
                }
            )
            print(
                f"round {k + 1}: disk {disk:6.2f} s (direct {direct:5.2f} s), tail {tail:6.2f} s: "
                f"{tail / disk:5.2f}x ({tail / direct:5.2f}x direct)",
                flush=True,
            )
        if rounds:
            middle = len(rounds) // 2
            ratios = sorted(r["ratio"] for r in rounds)
            direct_ratios = sorted(r["ratio_direct"] for r in rounds)
            results["against_disk"] = {
                "bytes": output_bytes,
                "rounds": rounds,
                "median": ratios[middle],
                "median_direct": direct_ratios[middle],
            }
            print(
                f"tail / disk, median of {len(rounds)}: {ratios[middle]:.2f}x "
                f"({direct_ratios[middle]:.2f}x against the disk alone)",
                flush=True,
            )
    if args.memory:
        documents = int(results["documents"])
        for label, peak in results["peak_bytes"].items():
            print(f"{label:<28} {peak / max(1, documents):8.1f} bytes per document", flush=True)
    print(json.dumps(results), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
