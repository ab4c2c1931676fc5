"""Seconds from a `tokenize-mixer convert` command's start to its first slice checkpoint (a manifest), cold
(the page cache dropped first where this process may), then the run is stopped with SIGINT.

    python bench/first_slice.py /tmp/tokenize-mixer-startup/chats-40.parquet            # our reader
    python bench/first_slice.py /tmp/tokenize-mixer-startup/chats-40.parquet --datasets # datasets' conversion

    python bench/first_slice.py chats-40.jsonl --gcs   # the file as a gs:// object (a GCS emulator)
    python bench/first_slice.py /tmp/tokenize-mixer-startup/hub-10 --hub --rate 100   # served as a hub

The inputs are bench/startup.py's (`--format parquet` writes the Parquet copy); dolma2, olmo, 4096.
With ``--gcs`` the file is put on a GCS emulator (gcp-storage-emulator, in memory, on loopback) and the
command reads the object: the time to its first slice, against the file's size, says whether the plan
waits for the whole object. With ``--hub`` the input is a directory laid out as a hub dataset
(`bench/startup.py --format hub`), served by ``tests/hub_emulator.py`` (each answer at ``--rate`` MB/s, a
link's speed) to a command with an empty hub cache: does the plan wait for every file's download?
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", type=Path)
    ap.add_argument("--datasets", action="store_true", help="read through datasets' Arrow conversion")
    ap.add_argument("--gcs", action="store_true", help="read the file as a gs:// object of a GCS emulator")
    ap.add_argument("--hub", action="store_true", help="serve the directory as a hub dataset (an emulator)")
    ap.add_argument("--rate", type=float, default=None, help="with --hub: MB/s of each answer")
    ap.add_argument("--to-end", action="store_true", help="let the run finish; print its whole time too")
    ap.add_argument("--amount", default="1.0", help="the dataset's amount (below 1.0: counted first)")
    args = ap.parse_args()
    from tests.tokenizer_fixtures import ensure_dolma2

    tokenizer = str(ensure_dolma2())
    reader = "datasets" if args.datasets else ""
    env = {**os.environ, "TOKENIZE_MIXER_PARQUET_READER": reader, "TOKENIZE_MIXER_JSON_READER": reader}
    data, emulator = str(args.data), None
    if args.gcs:
        from tests.soak import Emulator

        emulator = Emulator(None)
        data = f"gs://soak/{args.data.name}"
        emulator.fs.put_file(str(args.data), data)
        env.update(emulator.env)
    hub, scratch_hub = None, tempfile.TemporaryDirectory(prefix="first-slice-hub-")
    if args.hub:
        from tests.hub_emulator import HubEmulator, hub_environment

        hub = HubEmulator(
            args.data, "bench/chats", None if args.rate is None else args.rate * 1e6
        ).__enter__()
        data = hub.repo
        env.update(hub_environment(hub, Path(scratch_hub.name) / "home"))
    subprocess.run(["sync"], check=False)
    cold = False
    with contextlib.suppress(OSError), open("/proc/sys/vm/drop_caches", "w") as fh:
        fh.write("3\n")
        cold = True
    with tempfile.TemporaryDirectory(prefix="first-slice-") as scratch:
        argv = [
            str(ROOT / ".venv" / "bin" / "tokenize-mixer"), "convert", "--dataset_mixer_list", data,
            args.amount, "--tokenizer_name_or_path", tokenizer, "--chat_template_name", "olmo",
            "--max_seq_length", "4096", "--work_dir", f"{scratch}/work", "--output_dir", f"{scratch}/out",
        ]  # fmt: skip
        started = time.monotonic()
        proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        first = whole = None
        while proc.poll() is None and time.monotonic() - started < 600:
            if first is None and next(Path(scratch, "work", "slices").glob("*/*/manifest.json"), None):
                first = time.monotonic() - started
                if not args.to_end:
                    break
            time.sleep(0.05)
        if args.to_end and proc.poll() == 0:
            whole = time.monotonic() - started
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        proc.wait(120)
    if emulator is not None:
        emulator.stop()
    if hub is not None:
        hub.__exit__(None, None, None)
    scratch_hub.cleanup()
    found = {
        "data": data,
        "amount": args.amount,
        "reader": reader or "ours",
        "cold": cold,
        "first_slice_done_s": first,
    }
    print(json.dumps({**found, "whole_run_s": whole} if args.to_end else found))


if __name__ == "__main__":
    main()
