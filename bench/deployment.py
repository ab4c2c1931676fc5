"""The deployment path against the command on the same mix: `prefect deployment run tokenize-mixer/demo`
(a local stack from infra/local_up.sh: server, process work pool, worker) and `tokenize-mixer convert`,
in turn, each in a fresh work directory and output; per pair, the tokenizing seconds and tokens/s each run
reports (run_report.json) and their ratio.

    python bench/deployment.py                  # ShareGPT (17.5k chats) with dolma2 and olmo, 3 pairs
    python bench/deployment.py --pairs 5 --copies 2 --max_seq_length 4096
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.run import run_ours  # noqa: E402
from bench.scale import load_chats, write_copies  # noqa: E402
from tests.ports import free_port  # noqa: E402

BIN = Path(sys.executable).parent


def local_stack(home: Path) -> dict[str, str]:
    """A local Prefect stack (infra/local_up.sh) in ``home``; the environment that reaches it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PATH=f"{BIN}{os.pathsep}{env['PATH']}",
        PREFECT_HOME=str(home),
        TOKENIZE_MIXER_PORT=str(free_port()),
        TOKENIZE_MIXER_POOL="tokenize-mixer-bench",
    )
    up = subprocess.run(["bash", "infra/local_up.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    if up.returncode != 0:
        raise SystemExit(f"infra/local_up.sh failed:\n{up.stdout}{up.stderr}")
    env["PREFECT_API_URL"] = f"http://127.0.0.1:{env['TOKENIZE_MIXER_PORT']}/api"
    env["PREFECT_API_AUTH_STRING"] = (home / "auth-string").read_text().strip()
    return env


def run_deployment(
    env: dict[str, str], data: Path, tokenizer: str, max_len: int, work: Path, out: Path
) -> dict:
    params = {
        "mixer": {
            "datasets": [{"path": str(data), "amount": "1.0"}],
            "tokenizer": {"name_or_path": tokenizer, "chat_template": "olmo"},
            "max_seq_length": max_len,
            "output": {"path": str(out), "overwrite": True},
        },
        "run": {"work_dir": str(work)},
    }
    started = time.perf_counter()
    done = subprocess.run(
        [str(BIN / "prefect"), "deployment", "run", "tokenize-mixer/demo", "--watch", "--watch-interval", "1"]
        + ["--params", json.dumps(params)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - started
    if done.returncode != 0 or not (out / "run_report.json").exists():
        raise SystemExit(f"the deployment run failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    report = json.loads((out / "run_report.json").read_text())
    return {"wall_s": wall, **_tokenizing(report)}


def _tokenizing(report: dict) -> dict:
    return {"tokenize_s": report["tokenize_seconds"], "tokens_per_s": report["tokens_per_second"]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--copies", type=int, default=1)
    parser.add_argument("--max_seq_length", type=int, default=4096)
    parser.add_argument("--data", type=Path, default=None, help="a .jsonl[.xz] of chats (default: ShareGPT)")
    parser.add_argument("--tokenizer", default=None, help="default: the OLMo-2 dolma2 tokenizer")
    args = parser.parse_args()
    if args.tokenizer is None:
        from bench.data import dolma2_dir

        args.tokenizer = str(dolma2_dir())
    with tempfile.TemporaryDirectory(prefix="bench-deployment-") as tmp_name:
        tmp = Path(tmp_name)
        data = write_copies(load_chats(args.data), args.copies, tmp / "chats.jsonl")
        env = local_stack(tmp / "prefect-home")
        rows = []
        try:
            for i in range(args.pairs):
                ours = run_ours(
                    data, args.tokenizer, "olmo", args.max_seq_length, tmp / f"w-cli-{i}", tmp / f"o-cli-{i}"
                )
                cli = {"wall_s": ours["wall"], **_tokenizing(ours)}
                dep = run_deployment(
                    env, data, args.tokenizer, args.max_seq_length, tmp / f"w-dep-{i}", tmp / f"o-dep-{i}"
                )
                ratio = dep["tokenize_s"] / cli["tokenize_s"]
                rows.append(ratio)
                print(
                    f"pair {i + 1}: command tokenizing {cli['tokenize_s']:.1f} s ({cli['tokens_per_s']:,.0f} tokens/s, "
                    f"{cli['wall_s']:.1f} s end to end); deployment {dep['tokenize_s']:.1f} s "
                    f"({dep['tokens_per_s']:,.0f} tokens/s, {dep['wall_s']:.1f} s from `prefect deployment run` "
                    f"to --watch's end); deployment/command {ratio:.3f}",
                    flush=True,
                )
        finally:
            subprocess.run(["bash", "infra/local_down.sh"], cwd=ROOT, env=env, capture_output=True)
        print(
            f"deployment/command tokenizing time: median {statistics.median(rows):.3f} over {len(rows)} pairs"
        )


if __name__ == "__main__":
    main()
