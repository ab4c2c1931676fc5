"""A hub dataset read through a hub (``tests/hub_emulator.py``: the real ``huggingface_hub`` and
``datasets`` against a local server): its footers are read by range, its files download while the plan
reads them, and the first slice is handed on before the last file has landed; its rows are those of the
same files read locally, from this machine's hub cache or, without it, by range; a download that fails
is one clear error naming the dataset and the file; a dataset the cache holds is read from its copies."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.hub_emulator import (
    DECLARED_CARD,
    LOADED_CARD,
    PLAIN_CARD,
    HubEmulator,
    hub_environment,
    without_hub_settings,
)

ROOT = Path(__file__).parent.parent
EXAMPLES = ROOT / "examples"
REPO = "org/mixture"
FILES = [f"data/train-0000{k}-of-00003.parquet" for k in range(3)]

# Plans the hub dataset in a process of its own (the hub's settings are read at import): prints a line
# per slice handed on early, then what the plan found (each slice's row groups, or JSON Lines batches)
# and the rows its slices read; with "uncached", reads them again with this machine's hub cache moved
# away (a worker elsewhere reads by range).
_PLAN = """
import json, os, shutil, sys
from sftmix.sources.parquet import ParquetSource
from sftmix.config.config import DatasetEntry, MixerConfig, OutputSpec, TokenizerSpec
from sftmix.config.run_options import RunOptions
from sftmix.errors import DatasetError
from sftmix.planning.plan import build_plan
from sftmix.sources import jsonl
from sftmix.sources import parquet
path, examples, work, mode, slice_rows = sys.argv[1:6]
mixer = MixerConfig(
    datasets=[DatasetEntry(path=path)],
    tokenizer=TokenizerSpec(name_or_path=os.path.join(examples, "tokenizer"), chat_template="olmo"),
    max_seq_length=256,
    output=OutputSpec(path=os.path.join(work, "out")),
)
def early(spec, ctx):
    print("slice", spec.index, flush=True)
try:
    plan = build_plan(mixer, RunOptions(work_dir=work, slice_rows=int(slice_rows)), early)
except DatasetError as exc:
    print("error", json.dumps(str(exc)), flush=True)
    sys.exit(0)
def parts(s):
    return s.source.row_groups if isinstance(s.source, ParquetSource) else s.source.batches
def rows():
    return [
        r
        for s in plan.slices
        for r in (parquet.read_rows(s.source, list(range(s.row_start, s.row_end))) if isinstance(s.source, ParquetSource)
                  else jsonl.read_rows(s.source, list(range(s.row_start, s.row_end))))
    ]
found = {
    "slices": [[s.row_start, s.row_end, [p.sha256 for p in parts(s)]] for s in plan.slices],
    "paths": sorted({p.path for s in plan.slices for p in parts(s)}),
    "rows": rows(),
}
if mode == "uncached":
    shutil.move(os.path.join(os.environ["HF_HOME"], "hub"), os.path.join(work, "moved-away"))
    found["uncached_rows"] = rows()
print("plan", json.dumps(found), flush=True)
"""


def _rows(n: int) -> list[dict]:
    return [
        {
            "id": f"row-{i}",
            "messages": [
                {"role": "user", "content": f"What is {i} + {i}?"},
                {"role": "assistant", "content": f"{i} + {i} = {2 * i}."},
            ],
        }
        for i in range(n)
    ]


def _repo(root: Path, n: int = 240) -> Path:
    """A dataset laid out as the hub serves one: three train files of several row groups, and a card."""
    (root / "data").mkdir(parents=True)
    table = pa.Table.from_pylist(_rows(n))
    third = n // 3
    for k, name in enumerate(FILES):
        pq.write_table(table.slice(k * third, third), root / name, row_group_size=20)
    (root / "README.md").write_text("---\nlicense: odc-by\n---\n# a mixture\n")
    return root


def _plan(
    path: str, env: dict[str, str], work: Path, mode: str = "", on_slice=None, slice_rows: int = 40
) -> dict:
    """The plan's findings (``error`` where it refused), calling ``on_slice`` at the first early slice."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _PLAN, path, str(EXAMPLES), str(work), mode, str(slice_rows)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    found: dict = {"early": 0}
    assert proc.stdout is not None
    for line in proc.stdout:
        kind, _, rest = line.rstrip("\n").partition(" ")
        if kind == "slice":
            if found["early"] == 0 and on_slice is not None:
                on_slice()
            found["early"] += 1
        elif kind in ("plan", "error"):
            found[kind] = json.loads(rest)
    stderr = proc.stderr.read() if proc.stderr else ""
    assert proc.wait(120) == 0, stderr
    found["stderr"] = stderr
    return found


def test_a_hub_dataset_is_planned_while_its_files_download(tmp_path):
    """The last file's download is held until the first slice is handed on: the plan reads every
    footer by range, hashes each file as it lands, and cuts the same slices as from the files here."""
    repo = _repo(tmp_path / "repo")
    local = _plan(str(repo), _offline_environment(tmp_path / "home-local"), tmp_path / "work-local")
    with HubEmulator(repo, REPO) as hub:
        hub.held[FILES[-1]] = held = threading.Event()
        seen: list[int] = []

        def first_slice() -> None:
            seen.append(hub.whole_downloads(FILES[-1]))
            held.set()

        found = _plan(
            REPO, hub_environment(hub, tmp_path / "home"), tmp_path / "work", "uncached", first_slice
        )
        ranged = [r for m, p, r in hub.requests if m == "GET" and r is not None]
        assert seen == [0], "the first slice waited for the last file's download"
        assert all(hub.whole_downloads(f) == 1 for f in FILES)
        assert ranged, "the footers were not read by range"
    plan = found["plan"]
    assert plan["slices"] == local["plan"]["slices"] and found["early"] == len(plan["slices"]) > 3
    assert all(p.startswith(f"hf://datasets/{REPO}@{hub.commit}/") for p in plan["paths"])
    assert plan["rows"] == local["plan"]["rows"] == _rows(240)
    assert plan["uncached_rows"] == plan["rows"]  # read by range from the hub


@pytest.mark.parametrize("kind", ["parquet", pytest.param("jsonl", marks=pytest.mark.full)])  # (jsonl: below)
def test_a_download_that_fails_is_one_clear_error(tmp_path, kind):
    repo, files = (_repo(tmp_path / "repo"), FILES) if kind == "parquet" else _json_repo(tmp_path / "repo")
    with HubEmulator(repo, REPO) as hub:
        hub.failing.add(files[1])
        found = _plan(REPO, hub_environment(hub, tmp_path / "home"), tmp_path / "work")
    assert "plan" not in found, found
    error = found["error"]
    assert REPO in error and files[1] in error and "cannot download" in error, error
    assert "Traceback" not in found["stderr"]


def test_a_hub_dataset_the_cache_holds_is_read_from_its_copies(tmp_path):
    """Once the files are in this machine's hub cache, a plan reads them there: nothing downloads
    again, and the slices name the copies (as ``datasets`` would read them)."""
    repo = _repo(tmp_path / "repo")
    home = tmp_path / "home"
    with HubEmulator(repo, REPO) as hub:
        first = _plan(REPO, hub_environment(hub, home), tmp_path / "work")
        again = _plan(REPO, hub_environment(hub, home), tmp_path / "work-2")
        assert all(hub.whole_downloads(f) == 1 for f in FILES)  # downloaded once
    assert again["plan"]["slices"] == first["plan"]["slices"] and again["plan"]["rows"] == _rows(240)
    assert all(p.startswith("hf://") for p in first["plan"]["paths"])
    assert not any(p.startswith("hf://") for p in again["plan"]["paths"])


def _script(script: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``script`` run to its end in a process of its own (the hub's settings are read at import)."""
    return subprocess.run(
        [sys.executable, "-c", script, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def _run_while_held(
    script: tuple[str, ...], env: dict[str, str], held: threading.Event, until: Callable[[], bool], what: str
) -> tuple[int, str, str]:
    """``script`` (with its arguments) run in a process of its own while a file's download is ``held``,
    until ``until()`` (else the test fails, saying ``what``); then the download is let go and the script
    runs to its end: its exit code, stdout and stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-c", *script],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not until():
            assert time.monotonic() < deadline and proc.poll() is None, what
            time.sleep(0.05)
        held.set()
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, out, err


def _offline_environment(home: Path) -> dict[str, str]:
    """A process that reads local files only (the same files as a directory laid out like the hub)."""
    return {**without_hub_settings(), "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}


def _json_repo(root: Path, n: int = 240) -> tuple[Path, list[str]]:
    """The rows of :func:`_repo` as three JSON Lines files laid out as the hub serves them, and their names."""
    names = [f.replace(".parquet", ".jsonl") for f in FILES]
    (root / "data").mkdir(parents=True)
    rows, third = _rows(n), n // 3
    for k, name in enumerate(names):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows[k * third : (k + 1) * third]))
    (root / "README.md").write_text("---\nlicense: odc-by\n---\n# a mixture\n")
    return root, names


@pytest.mark.full  # (the quick loop: tests/tiers.py)
@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_a_stop_while_a_hub_file_downloads_ends_the_run_and_a_rerun_gives_the_local_bytes(tmp_path, kind):
    """Ctrl-C while the plan waits for a file that is still downloading (to read its row groups, or to
    scan its batches) ends the command within seconds (a download thread does not hold it), with one
    line; the rerun downloads the rest and writes the bytes of the same files read as a local directory."""
    from sftmix.output.digest import compare
    from tests.cli_runs import cli_env, convert_command
    from tests.test_stopping import STOP_WITHIN, Run, _one_line_reason

    repo, files = (_repo(tmp_path / "repo"), FILES) if kind == "parquet" else _json_repo(tmp_path / "repo")
    local = subprocess.run(
        convert_command(repo, tmp_path / "work-local", tmp_path / "out-local", 40),
        env={**cli_env(), **_offline_environment(tmp_path / "home-local")},
        capture_output=True,
        text=True,
    )
    assert local.returncode == 0, local.stderr[-3000:]
    hub_run = convert_command(Path(REPO), tmp_path / "work", tmp_path / "out", 40)
    with HubEmulator(repo, REPO) as hub:
        hub.held[files[-1]] = held = threading.Event()  # not let go while the first run lasts
        env = hub_environment(hub, tmp_path / "home")
        run = Run(hub_run, env=env)
        deadline = time.monotonic() + 120
        while not any(m == "GET" and p.endswith(files[-1]) and r is None for m, p, r in list(hub.requests)):
            assert time.monotonic() < deadline and run.proc.poll() is None, run.stderr[-3000:]
            time.sleep(0.05)
        time.sleep(0.5)
        since = time.monotonic()
        os.killpg(run.proc.pid, signal.SIGINT)
        assert run.stopped(since) == 130
        assert time.monotonic() - since < STOP_WITHIN
        _one_line_reason(run.stderr, "stopped by SIGINT")
        held.set()
        rerun = subprocess.run(hub_run, env={**cli_env(), **env}, capture_output=True, text=True)
        assert rerun.returncode == 0, rerun.stderr[-3000:]
        assert "HTTP Request:" not in rerun.stderr  # (a line per hub request is noise, not progress)
    result = compare(tmp_path / "out", tmp_path / "out-local")
    differ = [d.name for d in result.items if d.status != "OK"]
    assert differ == ["dataset_statistics.json"], result.render()  # (it names the dataset)


@pytest.mark.full
def test_a_hub_dataset_an_online_run_read_is_converted_offline_from_the_hub_cache(tmp_path):
    """``datasets`` never prepared the dataset (the plan read its files itself), so its loader has
    nothing under ``HF_HUB_OFFLINE``; the rerun reads the files the online plan found, from the hub
    cache: the same bytes out, slices and rows. A file the cache lacks is one error naming it, never
    fewer rows."""
    from sftmix.output.digest import compare
    from tests.cli_runs import cli_env, convert_command

    repo = _repo(tmp_path / "repo")
    home, work = tmp_path / "home", tmp_path / "work"
    with HubEmulator(repo, REPO) as hub:
        env = hub_environment(hub, home)
        online = subprocess.run(
            convert_command(Path(REPO), work, tmp_path / "out", 40),
            env={**cli_env(), **env},
            capture_output=True,
            text=True,
        )
        assert online.returncode == 0, online.stderr[-3000:]
        planned = _plan(REPO, env, tmp_path / "work-2")
    offline = {**env, "HF_HUB_OFFLINE": "1"}
    rerun = subprocess.run(
        convert_command(Path(REPO), work, tmp_path / "out-offline", 40),
        env={**cli_env(), **offline},
        capture_output=True,
        text=True,
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    result = compare(tmp_path / "out-offline", tmp_path / "out")
    assert result.matches, result.render()
    again = _plan(REPO, offline, work)
    assert "error" not in again, again["error"]
    assert again["plan"]["slices"] == planned["plan"]["slices"] and again["plan"]["rows"] == _rows(240)
    assert not any(p.startswith("hf://") for p in again["plan"]["paths"])
    assert "Traceback" not in again["stderr"]
    snapshot = next((home / "hub" / f"datasets--{REPO.replace('/', '--')}" / "snapshots").iterdir())
    (snapshot / FILES[1]).unlink()  # this machine's copy of one file gone
    missing = _plan(REPO, offline, work)
    assert "plan" not in missing, missing
    assert REPO in missing["error"] and FILES[1] in missing["error"] and "HF_HUB_OFFLINE" in missing["error"]


@pytest.mark.parametrize(
    ("suffix", "card"),
    [
        pytest.param(".jsonl", PLAIN_CARD, marks=pytest.mark.full),  # (the loop reads hub files by batch)
        pytest.param(".jsonl.gz", PLAIN_CARD, marks=pytest.mark.full),
        pytest.param(".jsonl", DECLARED_CARD, marks=pytest.mark.slow, id="declared"),
    ],
)
def test_a_hub_dataset_of_json_lines_files_is_read_by_batch_online_and_offline(tmp_path, suffix, card):
    """A hub dataset of JSON Lines files is read by batch from its downloaded files (not converted whole
    by ``datasets`` on one core), cast to the features its card declares where it does: the bytes
    ``datasets``' own load gives, online and, from the files and features the online plan kept, offline."""
    from sftmix.output.digest import compare
    from tests.cli_runs import cli_env, convert_command

    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    rows = _rows(240)
    for k in range(3):
        part = rows[k * 80 : (k + 1) * 80]  # the second file: keys in another order, half without "id"
        lines = [
            json.dumps({"messages": r["messages"], **({"id": r["id"]} if k != 1 or i % 2 else {})})
            for i, r in enumerate(part)
        ]
        data = ("\n".join(lines) + "\n").encode()
        (repo / "data" / f"train-0000{k}-of-00003{suffix}").write_bytes(
            gzip.compress(data, mtime=0) if suffix.endswith(".gz") else data
        )
    (repo / "README.md").write_text(card)
    home, work = tmp_path / "home", tmp_path / "work"

    def convert(out: str, env: dict[str, str]) -> None:
        done = subprocess.run(
            convert_command(Path(REPO), work, tmp_path / out, 40),
            env={**cli_env(), **env},
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert "Traceback" not in done.stderr

    with HubEmulator(repo, REPO) as hub:
        env = hub_environment(hub, home)
        convert("out", env)
        names = [f"data/train-0000{k}-of-00003{suffix}" for k in range(3)]
        assert [hub.whole_downloads(n) for n in names] == [1, 1, 1]  # (the plan made ahead shares them)
        convert("out-datasets", {**env, "TOKENIZE_MIXER_JSON_READER": "datasets"})
    kept = [json.loads(p.read_text()) for p in (work / "datasets-cache" / "hub-files").iterdir()]
    assert [(r["builder"], len(r["files"])) for r in kept] == [("json", 3)]  # the plan read the files
    assert [r["declared"] is not None for r in kept] == [card == DECLARED_CARD]
    convert("out-offline", {**env, "HF_HUB_OFFLINE": "1"})
    for other in ("out-datasets", "out-offline"):
        result = compare(tmp_path / other, tmp_path / "out")
        assert result.matches, result.render()


@pytest.mark.parametrize("suffix", [".jsonl", pytest.param(".jsonl.gz", marks=pytest.mark.full)])
def test_a_hub_dataset_of_json_lines_files_is_cut_into_slices_while_its_files_download(tmp_path, suffix):
    """JSON Lines files download in the background, each read as it lands (a compressed one, as soon as
    its copy is decompressed): the first slice is handed on before the last file has landed, and the
    slices and rows are those of the same files read as a local directory (the batches naming the hub
    cache's copies, or the decompressed copies)."""
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    names = [f"data/train-0000{k}-of-00003{suffix}" for k in range(3)]
    rows = [  # ~4.3 MB a file: more than one batch in all, so its slices are cut as it is read
        {
            "messages": [
                {"role": "user", "content": f"{i} " + "x" * 1000},
                {"role": "assistant", "content": f"{i}"},
            ]
        }
        for i in range(12_000)
    ]
    for k, name in enumerate(names):
        data = "".join(json.dumps(r) + "\n" for r in rows[k * 4000 : (k + 1) * 4000]).encode()
        (repo / name).write_bytes(gzip.compress(data, mtime=0) if suffix.endswith(".gz") else data)
    (repo / "README.md").write_text("---\nlicense: odc-by\n---\n# a mixture\n")

    local = _plan(
        str(repo), _offline_environment(tmp_path / "home-local"), tmp_path / "work-local", slice_rows=500
    )
    home = tmp_path / "home"
    with HubEmulator(repo, REPO) as hub:
        hub.held[names[-1]] = held = threading.Event()
        seen: list[int] = []

        def first_slice() -> None:
            seen.append(hub.whole_downloads(names[-1]))
            held.set()

        found = _plan(REPO, hub_environment(hub, home), tmp_path / "work", "", first_slice, 500)
        assert seen == [0], "the first slice waited for the last file's download"
        assert all(hub.whole_downloads(n) == 1 for n in names)
    got, want = found["plan"], local["plan"]
    assert got["slices"] == want["slices"] and found["early"] == len(got["slices"]) == 24
    assert got["rows"] == want["rows"] == rows
    snapshot = next((home / "hub" / f"datasets--{REPO.replace('/', '--')}" / "snapshots").iterdir())
    if suffix == ".jsonl":
        assert got["paths"] == sorted(str(snapshot / n) for n in names)
    else:
        copies = tmp_path / "work" / "datasets-cache" / "decompressed"
        assert sorted(Path(p).name for p in got["paths"]) == [Path(n).name.removesuffix(".gz") for n in names]
        assert all(Path(p).is_relative_to(copies) for p in got["paths"])


# Fetches a hub dataset's JSON Lines files in the background as the plan does, its progress lines on stderr.
_FETCH = """
import logging, sys
from sftmix.sources.data_files import json_data_files
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
files = json_data_files(sys.argv[1], "train", None, sys.argv[2])
assert files is not None and files.downloads is not None
for k in range(len(files.paths)):
    files.local(k)
"""


def test_the_download_line_counts_the_bytes_still_arriving(tmp_path):
    """A file that takes long to land is not "nothing yet": the line counts the bytes the hub cache is
    still writing."""
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    line = json.dumps(_rows(1)[0]) + "\\n"
    (repo / "data" / "train.jsonl").write_text(line * (30_000_000 // len(line)))
    (repo / "README.md").write_text("---\\nlicense: odc-by\\n---\\n")
    with HubEmulator(repo, REPO, rate=10e6) as hub:
        env = {**hub_environment(hub, tmp_path / "home"), "TOKENIZE_MIXER_PROGRESS_SECONDS": "0.5"}
        done = _script(_FETCH, env, REPO, str(tmp_path / "cache"))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [
        x for x in done.stderr.splitlines() if x.startswith(f"sftmix.sources.downloads: {REPO}: 0 of 1 files")
    ]
    arriving = [float(x.split(" GB more arriving")[0].rsplit(" ", 1)[1]) for x in lines]
    assert arriving and max(arriving) >= 0.01, lines


# Reads a hub dataset's JSON Lines files as the plan does; prints the copies it reads.
_FILES = """
import json, sys
from sftmix.sources.data_files import json_data_files
files = json_data_files(sys.argv[1], "train", None, sys.argv[2])
assert files is not None
print(json.dumps([files.local(k) for k in range(len(files.paths))]))
"""


def test_a_hub_datasets_compressed_files_are_decompressed_as_each_lands(tmp_path):
    """While the last file still downloads, the files that landed are already decompressed: at ~100 GB
    the decompression overlaps the download rather than following all of it. The copies hold the files'
    bytes."""
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    names = [f"data/train-0000{k}-of-00003.jsonl.gz" for k in range(3)]
    rows = _rows(300)
    for k, name in enumerate(names):
        data = "".join(json.dumps(r) + "\n" for r in rows[k * 100 : (k + 1) * 100]).encode()
        (repo / name).write_bytes(gzip.compress(data, mtime=0))
    (repo / "README.md").write_text("---\nlicense: odc-by\n---\n# a mixture\n")
    cache = tmp_path / "cache"
    with HubEmulator(repo, REPO) as hub:
        hub.held[names[-1]] = held = threading.Event()
        code, out, err = _run_while_held(
            (_FILES, REPO, str(cache)),
            hub_environment(hub, tmp_path / "home"),
            held,
            lambda: len(list(cache.glob("decompressed/*/*.jsonl"))) == 2,
            "not decompressed as they landed",
        )
    assert code == 0, err[-3000:]
    copies = json.loads(out)
    assert [Path(c).name for c in copies] == [Path(n).name.removesuffix(".gz") for n in names]
    assert [json.loads(x) for c in copies for x in Path(c).read_text().splitlines()] == rows


@pytest.mark.parametrize(
    "kind", [pytest.param("parquet", marks=pytest.mark.full), "jsonl.gz"]
)  # (parquet: above)
def test_a_hub_file_cut_short_is_named(tmp_path, kind):
    """One file of a hub dataset of several cut short (an upload that stopped): the error names the
    dataset and that file, so the user knows which to fix."""
    if kind == "parquet":
        repo, files = _repo(tmp_path / "repo"), FILES
    else:
        repo, plain = _json_repo(tmp_path / "repo")
        files = [f"{f}.gz" for f in plain]
        for f, g in zip(plain, files, strict=True):
            (repo / g).write_bytes(gzip.compress((repo / f).read_bytes(), mtime=0))
            (repo / f).unlink()
    cut = repo / files[1]
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    with HubEmulator(repo, REPO) as hub:
        found = _plan(REPO, hub_environment(hub, tmp_path / "home"), tmp_path / "work")
    assert "plan" not in found, found
    assert found["error"].startswith(f"dataset '{REPO}': {files[1]}: "), found["error"]
    assert "Traceback" not in found["stderr"]


@pytest.mark.full  # (the quick loop: tests/tiers.py)
@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_a_download_the_hub_was_too_busy_for_is_tried_again(tmp_path, kind):
    """The hub answers one file's download with 503 (too busy) once: it is tried again after a line
    saying so, and the plan reads the same rows as ever (JSON Lines: the files as the plan fetches them,
    whose plan of a dataset this small reads them after their downloads)."""
    repo, files = (_repo(tmp_path / "repo"), FILES) if kind == "parquet" else _json_repo(tmp_path / "repo")
    with HubEmulator(repo, REPO) as hub:
        hub.flaky[files[1]] = 1
        env = hub_environment(hub, tmp_path / "home")
        if kind == "parquet":
            found = _plan(REPO, env, tmp_path / "work")
            assert "error" not in found, found["error"]
            assert found["plan"]["rows"] == _rows(240)
            stderr = found["stderr"]
        else:
            done = _script(_FILES, env, REPO, str(tmp_path / "cache"))
            assert done.returncode == 0, done.stderr[-3000:]
            copies = [Path(c).read_bytes() for c in json.loads(done.stdout)]
            assert copies == [(repo / f).read_bytes() for f in files]
            stderr = done.stderr
        assert hub.flaky[files[1]] == 0 and hub.whole_downloads(files[1]) == 1
    assert f"{files[1]} failed (HfHubHTTPError: Server error '503 Service Unavailable'" in stderr, stderr
    assert "trying again in 2 s" in stderr and "Traceback" not in stderr


# Opens a hub dataset as the plan opens one ``datasets`` loads; prints its rows.
_OPEN = """
import json, sys
from sftmix.sources.whole.arrow import open_dataset
print(json.dumps(open_dataset(sys.argv[1], "train", None, sys.argv[2]).to_list()))
"""


def test_a_hub_dataset_datasets_loads_is_downloaded_first_as_the_plans_are(tmp_path):
    """A dataset ``datasets`` loads itself (its card names an encoding) downloads its files a few at a
    time, not one after another as ``datasets`` does below 16 files: the last lands while the first is
    still held. Each file downloads once; the rows are the files' own."""
    repo, files = _json_repo(tmp_path / "repo")
    (repo / "README.md").write_text(LOADED_CARD)
    with HubEmulator(repo, REPO) as hub:
        hub.held[files[0]] = held = threading.Event()
        code, out, err = _run_while_held(
            (_OPEN, REPO, str(tmp_path / "cache")),
            hub_environment(hub, tmp_path / "home"),
            held,
            lambda: hub.whole_downloads(files[-1]) == 1,
            "downloaded one after another",
        )
        assert [hub.whole_downloads(f) for f in files] == [1, 1, 1]
    assert code == 0, err[-3000:]
    assert json.loads(out) == _rows(240)


@pytest.mark.parametrize(
    "stopped", ["after its card", pytest.param("before datasets converted it", marks=pytest.mark.full)]
)
def test_offline_a_hub_dataset_the_cache_holds_only_part_of_is_one_clear_error(tmp_path, stopped):
    """An online run stopped after its first download leaves the hub cache holding part of the dataset
    (or, for one the datasets library loads, every file but not the library's converted copy); an
    offline rerun says so, and what to do, not the library's "Couldn't reach" or "Couldn't find cache"."""
    repo, files = _json_repo(tmp_path / "repo")
    fetch = "import sys\nfrom huggingface_hub import hf_hub_download\nhf_hub_download(sys.argv[1], 'README.md', repo_type='dataset')"
    if stopped == "before datasets converted it":  # the plan's own downloads, as a run makes them
        (repo / "README.md").write_text(LOADED_CARD)
        fetch = "import sys\nfrom sftmix.sources.whole.arrow import _fetch_first\n_fetch_first(sys.argv[1], 'train', None, sys.argv[2])"
    with HubEmulator(repo, REPO) as hub:
        env = hub_environment(hub, tmp_path / "home")
        fetched = _script(fetch, env, REPO, str(tmp_path / "cache"))
        assert fetched.returncode == 0, fetched.stderr[-2000:]
        if stopped == "before datasets converted it":
            assert all(hub.whole_downloads(f) == 1 for f in files)
    if stopped == "before datasets converted it":  # what the library's stopped conversion leaves
        (tmp_path / "cache" / REPO.replace("/", "___") / "default" / "0.0.0" / "0123abcd.incomplete").mkdir(
            parents=True
        )
    done = _script(_OPEN, {**env, "HF_HUB_OFFLINE": "1"}, REPO, str(tmp_path / "cache"))
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert (
        f"dataset '{REPO}': HF_HUB_OFFLINE is set, and this machine's caches hold only part of it" in last
    ), last
