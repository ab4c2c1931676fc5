"""Seconds from the command's start to the first slice checkpoint (a manifest), then the run is stopped."""
import glob, json, os, shutil, signal, subprocess, sys, tempfile, time
data, reader = sys.argv[1], sys.argv[2]
root = "/work/main"
tok = os.path.expanduser("~/.cache/tokenize-mixer-tests")
from pathlib import Path
sys.path.insert(0, root)
from tests.tokenizer_fixtures import ensure_dolma2
tokenizer = str(ensure_dolma2())
scratch = tempfile.mkdtemp(prefix="fs-", dir="/tmp/s30")
assert scratch.startswith("/tmp/s30/fs-")
env = {**os.environ, "TOKENIZE_MIXER_PARQUET_READER": "datasets" if reader == "datasets" else ""}
subprocess.run(["sync"]); open("/proc/sys/vm/drop_caches", "w").write("3\n")
argv = [f"{root}/.venv/bin/tokenize-mixer", "convert", "--dataset_mixer_list", data, "1.0",
        "--tokenizer_name_or_path", tokenizer, "--chat_template_name", "olmo", "--max_seq_length", "4096",
        "--work_dir", f"{scratch}/work", "--output_dir", f"{scratch}/out"]
t0 = time.monotonic()
p = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
first = None
while p.poll() is None and time.monotonic() - t0 < 300:
    if glob.glob(f"{scratch}/work/slices/*/*/manifest.json"):
        first = time.monotonic() - t0
        break
    time.sleep(0.05)
os.killpg(p.pid, signal.SIGINT)
p.wait(60)
print(json.dumps({"data": data, "reader": reader, "first_slice_done_s": first and round(first, 2)}))
shutil.rmtree(scratch)
