"""Worker scaling of `tokenize-mixer run`: the same mixer at 1, 2, 4, ... worker processes.

    python bench/scaling.py --data .devdata/sharegpt.jsonl.xz --tokenizer .devdata/dolma2 \\
        --workers 1,2,4,8,16 --out /tmp/scaling

For each worker count: one config (template olmo, max length 4096, amount 1.0, runner process, a fresh
work directory and output directory), run as ``python -m tokenize_mixer.cli run CONFIG`` in a subprocess, with
the wall time and the peak summed RSS of the whole process tree (CLI, temporary Prefect API, workers)
measured from outside, plus the CPU seconds of that tree. ``--workers 16:1048576`` runs 16 workers with
``slice_bytes`` 1 MiB (more, smaller slices). An untimed warm-up run on a few rows goes first (bytecode,
the temporary API's database migration, page cache). Every run must produce the same digests (exit 1
otherwise). Prints a table and writes it, with the raw run reports, to ``OUT/scaling.json`` (rewritten
after every run, so a cut-off keeps what finished). Needs only the project's own dependencies plus
psutil; works offline (no Prefect server: the CLI starts a temporary local API; PREFECT_HOME is a
temporary folder; Hugging Face offline).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import importlib.metadata as md
import json
import lzma
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.memory import PeakMemory  # noqa: E402
from sftmix.runtime.parallel import available_cpus  # noqa: E402

PACKAGES = (
    "prefect",
    "pydantic",
    "pydantic-core",
    "datasets",
    "huggingface-hub",
    "transformers",
    "tokenizers",
    "numpy",
    "pyarrow",
    "pandas",
    "fsspec",
    "sqlalchemy",
    "psutil",
)
RUNNER_LINE = re.compile(r"(\d+) slices on (\d+) worker\(s\) \((\w+)\)")


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def prepare_data(path: Path, scratch: Path) -> Path:
    """A plain .jsonl the loader reads: ``path`` itself, or decompressed (.xz / .gz) into ``scratch``."""
    opener = {".xz": lzma.open, ".gz": gzip.open}.get(path.suffix)
    if opener is None:
        return path.resolve()
    target = scratch / "data" / path.stem  # sharegpt.jsonl.xz -> sharegpt.jsonl
    target.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    with opener(path, "rb") as src, open(target, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    print(
        f"decompressed {path} -> {target} ({target.stat().st_size / 2**20:.1f} MiB, "
        f"{time.perf_counter() - t:.1f} s)"
    )
    return target


def run_env(scratch: Path) -> dict[str, str]:
    """Offline, no server, nothing written outside ``scratch``; the CLI starts its own temporary API."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    home = scratch / "prefect-home"
    home.mkdir(parents=True, exist_ok=True)
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        # a fresh PREFECT_HOME migrates its database at the first start (20+ s on a slow machine)
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="300",
        DO_NOT_TRACK="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(scratch / "hf-home"),
        TOKENIZE_MIXER_WORK_DIR=str(scratch / "default-work"),
        PYTHONUNBUFFERED="1",
    )
    paths = [str(ROOT), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def write_config(
    path: Path,
    data: Path,
    args: argparse.Namespace,
    workers: int,
    slice_bytes: int | None,
    work_dir: Path,
    out_dir: Path,
) -> Path:
    run: dict = {"runner": "process", "workers": workers, "work_dir": str(work_dir)}
    if slice_bytes:
        run["slice_bytes"] = slice_bytes
    config = {
        "mixer": {
            "datasets": [{"path": str(data), "amount": 1.0}],
            "tokenizer": {"name_or_path": str(args.tokenizer), "chat_template": args.template},
            "max_seq_length": args.max_seq_length,
            "output": {"path": str(out_dir), "overwrite": True},
        },
        "run": run,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


def parse_runs(text: str, default_slice_bytes: int | None) -> list[tuple[str, int, int | None]]:
    """``1,2,4,16:1048576`` -> (label, workers, slice_bytes): ``N:B`` runs N workers with slice_bytes B."""
    runs = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        n, _, sb = item.partition(":")
        slice_bytes = int(sb) if sb else default_slice_bytes
        label = f"w{int(n)}" + (f"-s{slice_bytes}" if sb else "")
        runs.append((label, int(n), slice_bytes))
    labels = [r[0] for r in runs]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"--workers lists a run twice: {text}")
    return runs


def _kill_tree(proc: subprocess.Popen) -> None:
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_once(
    label: str, config: Path, out_dir: Path, env: dict[str, str], log_path: Path, timeout: float
) -> dict:
    cmd = [sys.executable, "-m", "tokenize_mixer.cli", "run", str(config)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load_before = os.getloadavg()  # other load on the machine skews the timings: recorded
    with open(log_path, "w", encoding="utf-8") as log:
        t = time.perf_counter()
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        mem = PeakMemory(proc.pid)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            rc = proc.wait()
            rc = rc if rc else -9
        wall = time.perf_counter() - t
        peak = mem.stop()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # every reaped descendant: CLI, API, workers
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    text = log_path.read_text(encoding="utf-8", errors="replace")
    result: dict = {
        "label": label,
        "returncode": rc,
        "wall": wall,
        "peak_rss": peak,
        "cpu_seconds": cpu,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    match = RUNNER_LINE.search(text)
    if match:
        result["slices"], result["effective_workers"] = int(match[1]), int(match[2])
        result["task_runner"] = match[3]
    report_path = out_dir / "run_report.json"
    if rc == 0 and report_path.exists():
        result["report"] = json.loads(report_path.read_text())
    else:
        result["log_tail"] = text[-6000:]
        print(f"  {label}: FAILED (exit {rc}, {wall:.1f} s); last lines of {log_path}:\n{text[-3000:]}")
    return result


def timeline(work_dir: Path, launched: float, workers: int) -> dict:
    """Where the steady window goes, from the slices' own start/finish stamps: how long after launch
    the first slice started, how far apart the first ``workers`` slices started (workers coming up
    one by one), and how busy the workers were in the window (the rest is orchestration and idling)."""
    stamps = []
    for path in work_dir.glob("slices/*/*/manifest.json"):
        m = json.loads(path.read_text())
        stamps.append((m["started_at"], m["finished_at"]))
    if not stamps:
        return {}
    stamps.sort()
    first, last = stamps[0][0], max(end for _, end in stamps)
    busy = sum(end - start for start, end in stamps)
    nth = stamps[min(workers, len(stamps)) - 1][0]
    return {
        "first_slice_after_launch_s": round(first - launched, 2),
        "worker_starts_spread_s": round(nth - first, 2),
        "busy_share": round(busy / max(workers * (last - first), 1e-9), 3),
        "mean_slice_s": round(busy / len(stamps), 3),
    }


def table(results: list[dict]) -> tuple[list[dict], str]:
    ok = [r for r in results if "report" in r]
    if not ok:
        return [], "(no successful run)"
    plain = [r for r in ok if r["label"] == f"w{r['workers']}"] or ok
    base = min(plain, key=lambda r: r["workers"])
    b_n, b_wall, b_tps = base["workers"], base["wall"], base["report"]["steady_tokens_per_second"]
    rows, lines = [], []
    head = (
        f"{'run':>12} {'eff.':>4} {'slices':>6} {'wall s':>8} {'steady s':>8} {'startup s':>9} "
        f"{'steady tok/s':>13} {'e2e tok/s':>11} {'speedup st':>10} {'speedup e2e':>11} "
        f"{'eff st':>6} {'eff e2e':>7} {'peak MiB':>9} {'CPU s':>7}"
    )
    lines.append(head)
    for r in ok:
        rep = r["report"]
        tps = rep["steady_tokens_per_second"]
        sp_steady = tps / b_tps * b_n if b_tps else float("nan")
        sp_e2e = b_wall / r["wall"] * b_n
        row = {
            "run": r["label"],
            "workers": r["workers"],
            "slice_bytes": r.get("slice_bytes"),
            "effective_workers": r.get("effective_workers"),
            "slices": r.get("slices"),
            "wall_s": round(r["wall"], 2),
            "steady_s": round(rep["steady_seconds"], 2),
            "startup_s": round(r["wall"] - rep["steady_seconds"], 2),
            "steady_tokens_per_s": round(tps),
            "e2e_tokens_per_s": round(rep["tokens"] / r["wall"]),
            "speedup_steady": round(sp_steady, 3),
            "speedup_e2e": round(sp_e2e, 3),
            "efficiency_steady": round(sp_steady / r["workers"], 3),
            "efficiency_e2e": round(sp_e2e / r["workers"], 3),
            "peak_rss_mib": round(r["peak_rss"] / 2**20),
            "cpu_s": round(r["cpu_seconds"], 1),
        }
        rows.append(row)
        lines.append(
            f"{row['run']:>12} {row['effective_workers'] or '?':>4} {row['slices'] or '?':>6} "
            f"{row['wall_s']:>8.1f} {row['steady_s']:>8.1f} {row['startup_s']:>9.1f} "
            f"{row['steady_tokens_per_s']:>13,} {row['e2e_tokens_per_s']:>11,} "
            f"{row['speedup_steady']:>10.2f} {row['speedup_e2e']:>11.2f} "
            f"{row['efficiency_steady']:>6.2f} {row['efficiency_e2e']:>7.2f} {row['peak_rss_mib']:>9,} {row['cpu_s']:>7.1f}"
        )
    note = "" if b_n == 1 else f" (speedups scaled as if the {b_n}-worker run were linear)"
    lines.append(
        f"run wN = N workers, wN-sB = N workers with slice_bytes B; "
        f"speedup = vs {base['label']}{note}; st = steady state (first slice start to last slice end, "
        "from run_report.json), e2e = wall of the whole command (Python + Prefect start-up, plan, assemble, "
        "validate, publish); eff. = worker processes really used (min(workers, slices)); "
        "efficiency = speedup / workers; CPU s = user+sys seconds of the whole process tree"
    )
    return rows, "\n".join(lines)


def summarize(info: dict, results: list[dict], path: Path) -> dict:
    """The table, the digest check and the raw runs, written to ``path`` (JSON) and returned."""
    ok = [r for r in results if "report" in r]
    digests = {r["label"]: r["report"]["digests"] for r in ok}
    first = next(iter(digests.values()), {})
    differing = {
        n: sorted(k for k in set(d) | set(first) if d.get(k) != first.get(k))
        for n, d in digests.items()
        if d != first
    }
    rows, text = table(results)
    summary = {
        "info": info,
        "table": rows,
        "table_text": text,
        "digests_identical": bool(ok) and not differing and len(ok) == len(results),
        "digests_differing": differing,
        "artifacts": len(first),
        "runs": results,
    }
    path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, required=True, help="a .jsonl, .jsonl.xz or .jsonl.gz of chats")
    ap.add_argument("--tokenizer", type=Path, required=True, help="tokenizer directory (e.g. dolma2)")
    ap.add_argument(
        "--workers",
        default="1,2,4,8,16",
        help="comma-separated worker counts, run in order; N:B = N workers with slice_bytes B",
    )
    ap.add_argument("--out", type=Path, required=True, help="folder for scaling.json")
    ap.add_argument("--template", default="olmo")
    ap.add_argument("--max-seq-length", type=int, default=4096)
    ap.add_argument(
        "--slice-bytes",
        type=int,
        default=None,
        help="run.slice_bytes of runs without :B (default: the tool's)",
    )
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per run before it is killed")
    ap.add_argument(
        "--warmup-rows", type=int, default=300, help="rows of a small untimed first run (0: none)"
    )
    ap.add_argument("--scratch", type=Path, default=None, help="parent of the temporary folder")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (outputs, logs)")
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # progress lines show up at once in a tee'd log

    runs = parse_runs(args.workers, args.slice_bytes)
    counts = [n for _, n, _ in runs]
    args.tokenizer = args.tokenizer.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.scratch:
        args.scratch.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="tm-scaling-", dir=args.scratch))
    cpus = available_cpus()
    info = {
        "available_cpus": cpus,
        "os_cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "memory_total_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "versions": versions(),
        "runs": [label for label, _, _ in runs],
        "scratch": str(scratch),
    }
    print(f"available_cpus() = {cpus}, os.cpu_count() = {os.cpu_count()}; {info['cpu_model']}")
    print(f"python {info['python']} ({sys.executable}) on {info['platform']}, {info['memory_total_gib']} GiB")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    if max(counts) > cpus:
        print(f"note: up to {max(counts)} workers asked for, {cpus} CPUs usable")

    data = prepare_data(args.data, scratch)
    n_rows = chars = 0
    with open(data, encoding="utf-8") as fh:
        for line in fh:
            n_rows += 1
            chars += sum(len(m.get("content") or "") for m in json.loads(line)["messages"])
    info.update(data=str(args.data), rows=n_rows, characters=chars, data_mib=data.stat().st_size / 2**20)
    print(
        f"{n_rows} chats, {chars / 1e6:.1f}M characters; tokenizer {args.tokenizer}; template "
        f"{args.template}; max length {args.max_seq_length}; slice_bytes {args.slice_bytes or 'default'}"
    )
    env = run_env(scratch)
    logs = scratch / "logs"
    logs.mkdir()

    if args.warmup_rows:
        # compiles bytecode, migrates the temporary API's database, loads the page cache: untimed
        small = scratch / "data" / "warmup.jsonl"
        small.parent.mkdir(parents=True, exist_ok=True)
        with open(data, encoding="utf-8") as src, open(small, "w", encoding="utf-8") as dst:
            for i, line in enumerate(src):
                if i >= args.warmup_rows:
                    break
                dst.write(line)
        cfg = write_config(
            scratch / "configs" / "warmup.json",
            small,
            args,
            min(2, cpus),
            args.slice_bytes,
            scratch / "work" / "warmup",
            scratch / "out" / "warmup",
        )
        print(f"warm-up: {args.warmup_rows} rows on {min(2, cpus)} workers ...", flush=True)
        warm = run_once("warmup", cfg, scratch / "out" / "warmup", env, logs / "warmup.log", args.timeout)
        info["warmup"] = {k: warm.get(k) for k in ("returncode", "wall", "peak_rss")}
        print(f"  warm-up: exit {warm['returncode']}, {warm['wall']:.1f} s", flush=True)
        if warm["returncode"] != 0:
            (args.out / "scaling.json").write_text(json.dumps({"info": info, "warmup": warm}, indent=2))
            raise SystemExit("the warm-up run failed; not going on")

    results: list[dict] = []
    for label, n, slice_bytes in runs:
        out_dir = scratch / "out" / label
        work_dir = scratch / "work" / label
        cfg = write_config(
            scratch / "configs" / f"{label}.json", data, args, n, slice_bytes, work_dir, out_dir
        )
        print(f"{label}: {n} workers, slice_bytes {slice_bytes or 'default'} ...", flush=True)
        launched = time.time()
        r = run_once(label, cfg, out_dir, env, logs / f"{label}.log", args.timeout)
        r.update(workers=n, slice_bytes=slice_bytes)
        r["timeline"] = timeline(work_dir, launched, r.get("effective_workers", n))
        results.append(r)
        if "report" in r:
            rep = r["report"]
            print(
                f"  {label} ({r.get('effective_workers', '?')} workers used, {r.get('slices', '?')} slices): "
                f"wall {r['wall']:.1f} s, steady {rep['steady_seconds']:.1f} s, "
                f"{rep['steady_tokens_per_second']:,.0f} steady tok/s, {rep['tokens']:,} tokens, "
                f"peak {r['peak_rss'] / 2**20:,.0f} MiB, CPU {r['cpu_seconds']:.0f} s; {r['timeline']}",
                flush=True,
            )
        if not args.keep:  # disk: the report and digests are read, the shards are not needed
            shutil.rmtree(work_dir, ignore_errors=True)
            shutil.rmtree(out_dir, ignore_errors=True)
        summarize(info, results, args.out / "scaling.json")  # after every run: survives a cut-off

    summary = summarize(info, results, args.out / "scaling.json")
    print()
    print(summary["table_text"])
    print()
    differing, n_ok = summary["digests_differing"], len(summary["table"])
    if differing:
        print(f"DIGESTS DIFFER from the first run's: {differing}")
    elif n_ok < len(results):
        print(f"{len(results) - n_ok} run(s) failed; the others have identical digests")
    else:
        print(f"digests identical across all {n_ok} runs ({summary['artifacts']} artifacts)")
    print(f"available_cpus() = {cpus}, os.cpu_count() = {os.cpu_count()}")
    print(f"wrote {args.out / 'scaling.json'}")
    if args.keep:
        print(f"kept {scratch}")
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    sys.exit(0 if summary["digests_identical"] else 1)


if __name__ == "__main__":
    main()
