"""When the plan hands on each dataset's slices (in process, no workers): seconds from ``build_plan``'s
start to each dataset's first and last slice handed on, and to the plan's end, for a mixture of the
files given (each at 1.0; dolma2, olmo, 4096; a fresh work dir each run, so nothing is reused).

    python bench/plan_handoff.py /tmp/tokenize-mixer-startup/pq-one-10.parquet chats-10.jsonl --runs 2

The head start begins each slice as it is handed on: a dataset that waits here is cores that wait on a
large machine. To compare two trees of the code, run it from each with ``PYTHONPATH`` set to that tree.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # after PYTHONPATH: another tree of the code can be timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", type=Path, nargs="+")
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()
    from sftmix.config.config import DatasetEntry, MixerConfig, OutputSpec, TokenizerSpec
    from sftmix.config.run_options import RunOptions
    from sftmix.planning.plan import build_plan
    from tests.tokenizer_fixtures import ensure_dolma2

    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="plan-handoff-") as work:
            mixer = MixerConfig(
                datasets=[DatasetEntry(path=str(p), amount=1.0) for p in args.data],
                tokenizer=TokenizerSpec(name_or_path=str(ensure_dolma2()), chat_template="olmo"),
                max_seq_length=4096,
                output=OutputSpec(path=work + "/out"),
            )
            handed: dict[int, list[float]] = {}
            started = time.perf_counter()

            def early(spec, ctx, handed=handed, started=started) -> None:
                handed.setdefault(spec.dataset_index, []).append(time.perf_counter() - started)

            plan = build_plan(mixer, RunOptions(work_dir=work), early)
            seconds = time.perf_counter() - started
            for d, dataset in enumerate(plan.datasets):
                times = handed.get(d, [])
                print(
                    f"run {run + 1}: dataset {d} ({Path(dataset.name).name}): {len(dataset.slices)} slices, "
                    + (
                        f"{len(times)} handed on, first at {times[0]:.2f} s, last at {times[-1]:.2f} s"
                        if times
                        else "none handed on as cut"
                    )
                )
            print(f"run {run + 1}: the plan {seconds:.2f} s")


if __name__ == "__main__":
    main()
