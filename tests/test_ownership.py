"""Only ever delete what we wrote: outputs carry our marker, staging carries a lease, publishes are
serialised, and dangerous outputs are refused before any work."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import time
from pathlib import Path

import pytest

from sftmix.check.report_page import write_report
from sftmix.errors import ConfigError, OutputConflictError
from sftmix.output.output_dir import OUTPUT_MARKER, check_output_free
from sftmix.output.publish import publish_local, staging_dir
from sftmix.runtime.ownership import LEASE_MARKER, lease_abandoned, leased, remove_abandoned, write_lease
from tests.test_cli import cli

SHARD = "token_ids_part_0000.npy"


def _publish(out: Path, root: Path, content: bytes, overwrite: bool = False, seen_id="unchecked") -> str:
    with staging_dir(out, root) as staging:
        (staging / SHARD).write_bytes(content)
        return publish_local(staging, out, overwrite, seen_id)


def _user_dir(path: Path) -> Path:
    (path / "sub").mkdir(parents=True)
    (path / "thesis.txt").write_text("four years of work")
    (path / "sub" / "keep.bin").write_bytes(b"\x00" * 10)
    return path


def test_overwrite_never_replaces_a_directory_we_did_not_write(tmp_path):
    victim = _user_dir(tmp_path / "victim")
    with pytest.raises(OutputConflictError, match=r"not a tokenize-mixer output .*sub/keep.bin, thesis.txt"):
        check_output_free(victim)
    with pytest.raises(OutputConflictError, match="not a tokenize-mixer output"):
        _publish(victim, tmp_path, b"\x01", overwrite=True)
    assert (victim / "thesis.txt").read_text() == "four years of work"
    assert (victim / "sub" / "keep.bin").exists() and not (victim / SHARD).exists()


def test_a_file_dropped_into_our_output_is_never_deleted(tmp_path):
    out = tmp_path / "out"
    assert _publish(out, tmp_path, b"\x01") == "created"
    assert json.loads((out / OUTPUT_MARKER).read_text())["files"] == [SHARD]
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputConflictError, match="files tokenize-mixer did not write there: notes.txt"):
        _publish(out, tmp_path, b"\x02", overwrite=True)
    with pytest.raises(OutputConflictError, match="notes.txt"):  # an identical rerun swaps too: refused
        _publish(out, tmp_path, b"\x01")
    assert (out / "notes.txt").read_text() == "mine" and (out / SHARD).read_bytes() == b"\x01"
    (out / "notes.txt").unlink()
    assert _publish(out, tmp_path, b"\x02", overwrite=True) == "overwritten"


@pytest.mark.full  # (a whole demo run; the loop has the marker's other tests)
def test_the_report_written_into_an_output_stays_replaceable(demo_output, tmp_path):
    write_report(demo_output)
    marker = json.loads((demo_output / OUTPUT_MARKER).read_text())
    assert {"report.png", "report.md"} <= set(marker["files"])
    check_output_free(demo_output)  # still wholly ours


@pytest.fixture(scope="module")
def demo_output(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("demo")
    out, work = root / "out", root / "work"
    cli("run", "examples/mixer.yaml", "--output_dir", str(out), "--work_dir", str(work), "--runner", "thread")
    return out


@pytest.mark.slow
def test_dangerous_outputs_are_refused_before_any_work(tmp_path):
    data = tmp_path / "inputs"
    data.mkdir()
    (data / "general.jsonl").write_bytes(Path("examples/data/general.jsonl").read_bytes())
    work = tmp_path / "work"
    cases = {
        "/": "is the file system root",
        str(Path.home()): "is your home directory",
        str(work): "is the work directory",
        str(tmp_path): "contains the work directory",
        str(data): "contains the input dataset",
        ".": "is the current directory",
    }
    for output, expected in cases.items():
        started = time.monotonic()
        proc = cli(
            "convert",
            "--dataset_mixer_list", str(data / "general.jsonl"), "1.0",
            "--tokenizer_name_or_path", "examples/tokenizer",
            "--chat_template_name", "olmo",
            "--max_seq_length", "256",
            "--output_dir", output,
            "--work_dir", str(work),
            "--overwrite",
            check=False,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert time.monotonic() - started < 60  # no Prefect server was started, nothing tokenized
        assert not (work / "slices").exists()
    assert sorted(p.name for p in data.iterdir()) == ["general.jsonl"]


def _other_host_lease(directory: Path, age: float) -> None:
    directory.mkdir()
    lease = {"host": "another-machine", "boot_id": "x", "pid": os.getpid(), "since": 0}
    (directory / LEASE_MARKER).write_text(json.dumps(lease))
    then = time.time() - age
    os.utime(directory / LEASE_MARKER, (then, then))


def test_staging_clean_up_needs_our_lease_and_proof_it_is_abandoned(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENIZE_MIXER_LEASE_SECONDS", "600")
    live_elsewhere = tmp_path / ".out.tmp-111-live"
    _other_host_lease(live_elsewhere, age=5)  # another machine's live staging on a shared disk
    expired_elsewhere = tmp_path / ".out.tmp-222-expired"
    _other_host_lease(expired_elsewhere, age=3600)
    legacy = tmp_path / ".out.tmp-999999-legacy"  # no lease: not provably ours, never removed
    legacy.mkdir()
    dead_here = tmp_path / ".out.old-dead"
    dead_here.mkdir()
    child = multiprocessing.get_context("spawn").Process(target=write_lease, args=(dead_here,))
    child.start()
    child.join()
    assert json.loads((dead_here / LEASE_MARKER).read_text())["host"] == socket.gethostname()
    mine = tmp_path / ".out.tmp-mine"
    mine.mkdir()
    write_lease(mine)

    assert lease_abandoned(dead_here) and lease_abandoned(expired_elsewhere)
    assert not lease_abandoned(live_elsewhere) and not lease_abandoned(mine) and not lease_abandoned(legacy)
    removed = remove_abandoned(tmp_path, ".out.")
    assert sorted(p.name for p in removed) == [".out.old-dead", ".out.tmp-222-expired"]
    assert live_elsewhere.is_dir() and legacy.is_dir() and mine.is_dir()


def _begin_lease(directory: str) -> None:
    """What a process killed outright between making a leased directory and renaming it leaves."""
    from sftmix.runtime.storage import temp_name

    temp_name(Path(directory)).mkdir()


def test_a_leased_directory_appears_with_its_lease_and_a_half_made_one_is_ours_to_remove(tmp_path):
    with leased(tmp_path / "api-1") as held:
        assert (held / LEASE_MARKER).is_file() and [p.name for p in tmp_path.iterdir()] == ["api-1"]
        with pytest.raises(FileExistsError), leased(held):
            pass
    assert not (tmp_path / "api-1").exists()
    child = multiprocessing.get_context("spawn").Process(target=_begin_lease, args=(str(tmp_path / "api-2"),))
    child.start()
    child.join()
    [half] = list(tmp_path.iterdir())  # no lease in it: its temp name says whose it was
    assert half.name.startswith("api-2.tmp-") and not lease_abandoned(half)
    (tmp_path / "api-3.tmp-999-x").mkdir()  # a name like ours, no writer tag: not ours
    assert remove_abandoned(tmp_path, "api-") == [half]
    assert [p.name for p in tmp_path.iterdir()] == ["api-3.tmp-999-x"]


def _racer(out: str, root: str, content: bytes, overwrite: bool, barrier, results) -> None:
    barrier.wait()
    try:
        results.put(_publish(Path(out), Path(root), content, overwrite, seen_id=None))
    except OutputConflictError as exc:
        results.put(f"refused: {exc}")
    except BaseException as exc:  # anything else is the bug this test is about
        results.put(f"crashed: {type(exc).__name__}: {exc}")


def _race(tmp_path: Path, name: str, contents: list[bytes], overwrite: bool) -> list[str]:
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(len(contents)), ctx.Queue()
    out = tmp_path / name
    procs = [
        ctx.Process(target=_racer, args=(str(out), str(tmp_path), c, overwrite, barrier, results))
        for c in contents
    ]
    for p in procs:
        p.start()
    outcomes = sorted(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join()
    return outcomes


@pytest.mark.full  # (the quick loop: tests/tiers.py)
def test_concurrent_publishes_get_a_one_line_outcome(tmp_path):
    for trial in range(5):
        same = _race(tmp_path, f"same{trial}", [b"\x01", b"\x01"], overwrite=False)
        assert same == ["created", "replaced"], same
        differ = _race(tmp_path, f"differ{trial}", [b"\x01", b"\x02"], overwrite=True)
        assert differ[0] == "created" and differ[1].startswith("refused: "), differ
        assert "published by another run while this one worked" in differ[1]
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".differ{trial}.tmp-")]


def test_reference_inputs_and_the_work_dir_are_protected(tmp_path):
    work = tmp_path / "w"
    with pytest.raises(ConfigError, match="contains the work directory"):
        check_output_free(tmp_path, [("the work directory", work)])
    check_output_free(tmp_path / "shards", [("the work directory", work)])
