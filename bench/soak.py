"""The long form of the fault soak (tests/soak.py): N trials of `tokenize-mixer convert` (and of
deployment runs on a local Prefect stack), each with one fault at a drawn moment, then a rerun.

    python bench/soak.py --trials 20                       # a random seed, printed
    python bench/soak.py --trials 50 --seed 1234 --kinds pipe-grep,kill-api-early
    python bench/soak.py --trials 20 --no-server           # no local Prefect stack

Prints the per-kind table and writes it with every trial's record to
bench/results/<YYYY-MM-DD>-soak-<N>.md, and the raw records to the .json beside it. Exit 1 when a
trial failed (or the setup did).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.soak import KINDS, default_seed, kinds_arg, run_soak  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, required=True)
    parser.add_argument(
        "--seed", type=int, default=None, help="default: TOKENIZE_MIXER_SOAK_SEED, else random"
    )
    parser.add_argument("--kinds", default=None, help=f"comma-separated, of: {','.join(KINDS)}")
    parser.add_argument(
        "--no-server", action="store_true", help="no local Prefect stack: no cancel, kill-prefect-worker"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    seed = default_seed() if args.seed is None else args.seed
    print(f"soak seed {seed}, {args.trials} trials (replay: --seed {seed})", flush=True)
    result = run_soak(
        trials=args.trials, seed=seed, kinds=kinds_arg(args.kinds), server=not args.no_server, log=_log
    )
    table = result.table()
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{datetime.date.today().isoformat()}-soak-{args.trials}"
    setup = ", ".join(f"{k} {v}" for k, v in result.setup.items())
    failures = result.failures() or "none"
    stem.with_suffix(".md").write_text(
        f"# Fault soak: {args.trials} trials, seed {seed}\n\n"
        f"`python bench/soak.py --trials {args.trials} --seed {seed}"
        f"{' --kinds ' + args.kinds if args.kinds else ''}{' --no-server' if args.no_server else ''}`\n\n"
        f"Setup: {setup}\n\n{table}\n\n## Trials\n\n{result.trial_lines()}\n\n"
        f"## Failures\n\n```\n{failures}\n```\n"
    )
    stem.with_suffix(".json").write_text(json.dumps(result.to_json(), indent=1) + "\n")
    print(f"wrote {stem.with_suffix('.md')} and {stem.with_suffix('.json')}")
    if not result.ok:
        print(result.failures())
    return 0 if result.ok else 1


def _log(line: str) -> None:
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
