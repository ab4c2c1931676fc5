"""gs:// for real: sources, the work directory, Prefect result storage and the published output, all on
the GCS JSON API served by gcp-storage-emulator on 127.0.0.1, through gcsfs."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import fsspec
import pytest

from sftmix.config.config import MixerConfig
from sftmix.config.run_options import RunOptions
from sftmix.errors import ConfigError, DatasetError, OutputConflictError
from sftmix.output.digest import OUTPUT_MANIFEST, output_digests, remote_output_digests
from sftmix.output.publish import publish_remote
from sftmix.planning.plan import build_plan
from sftmix.sources.jsonl import JsonlSource
from sftmix.sources.jsonl import batches as jsonl_batches
from sftmix.sources.jsonl import scanning as jsonl_scanning
from sftmix.sources.parquet import ParquetSource
from tests.ports import free_port
from tokenize_mixer.flows.tokenize_mixer import tokenize_mixer

ROOT = Path(__file__).parent.parent
EXAMPLES = ROOT / "examples"
DEMO_DIGESTS = json.loads((EXAMPLES / "demo.digests.json").read_text())["files"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gcs():
    """A GCS emulator for this module, with gcsfs pointed at it (here and in spawned workers)."""
    port = free_port()
    exe = Path(sys.executable).parent / "gcp-storage-emulator"
    proc = subprocess.Popen(
        [str(exe), "start", "--host=127.0.0.1", f"--port={port}", "--in-memory"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    env = {
        "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}",
        "FSSPEC_GS_TOKEN": "anon",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    saved_conf = fsspec.config.conf.get("gs")
    fsspec.config.conf["gs"] = {"token": "anon"}  # what FSSPEC_GS_TOKEN does at import time
    try:
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)
        fs = fsspec.filesystem("gs", skip_instance_cache=True)
        for bucket in ("src", "work", "out"):
            fs.mkdir(bucket)
        yield fs
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if saved_conf is None:
            fsspec.config.conf.pop("gs", None)
        else:
            fsspec.config.conf["gs"] = saved_conf


def demo_mixer(general: str, output: str, max_len: int = 256) -> MixerConfig:
    return MixerConfig.model_validate(
        {
            "datasets": [
                {"path": general, "amount": 3.0},
                {"path": str(EXAMPLES / "data" / "arithmetic.jsonl"), "amount": 0.5},
                {"path": str(EXAMPLES / "data" / "conversions.jsonl"), "amount": 100},
            ],
            "tokenizer": {"name_or_path": str(EXAMPLES / "tokenizer"), "chat_template": "olmo"},
            "max_seq_length": max_len,
            "shuffle_seed": 42,
            "output": {"path": output},
        }
    )


def parts(digests: dict[str, str]) -> dict[str, str]:
    """Everything but the statistics (they name the datasets, and a gs:// path is another name)."""
    return {k: v for k, v in digests.items() if k != "dataset_statistics.json"}


def test_the_suites_gcsfs_speaks_only_the_json_api_the_emulator_has(gcs):
    """gcsfs picks its file system class once, at import (``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT``, set by
    ``tests/conftest.py``; set in the emulator's fixture it came too late): the experimental one asks a gRPC
    control plane the emulator lacks before each call on a bucket, retrying it for seconds to a minute."""
    import gcsfs
    import gcsfs.core

    assert gcsfs.GCSFileSystem is gcsfs.core.GCSFileSystem
    assert type(gcs) is gcsfs.core.GCSFileSystem


def test_sources_work_dir_results_and_output_on_gcs(gcs, prefect_api, tmp_path, monkeypatch):
    run_id = uuid.uuid4().hex[:8]
    general = f"gs://src/{run_id}/general.jsonl"
    gcs.put_file(str(EXAMPLES / "data" / "general.jsonl"), general)
    work, out = f"gs://work/{run_id}", f"gs://out/{run_id}/demo"
    run = RunOptions(work_dir=work, slice_rows=64)

    monkeypatch.setenv("TOKENIZE_MIXER_WORK_DIR", str(tmp_path / "machine-a"))
    first = tokenize_mixer(mixer=demo_mixer(general, out), run=run)
    n = first["slices_total"]
    assert (first["slices_computed"], first["publish"]) == (n, "created")
    assert parts(remote_output_digests(out)) == parts(DEMO_DIGESTS)  # the bytes of the local demo
    manifest = json.loads(gcs.cat_file(f"{out}/{OUTPUT_MANIFEST}"))
    assert set(manifest["files"]) >= {
        "token_ids_part_0000.npy",
        "run_report.json",
        "tokenizer/tokenizer.json",
    }
    assert len(gcs.glob(f"{work}/slices/*/*/manifest.json")) == n
    assert len(gcs.ls(f"{work}/prefect-results")) == n  # Prefect's result records live on GCS too

    # Another machine (an empty local mirror) finds every slice on GCS and fetches it, digests checked.
    monkeypatch.setenv("TOKENIZE_MIXER_WORK_DIR", str(tmp_path / "machine-b"))
    second = tokenize_mixer(mixer=demo_mixer(general, out), run=run)
    assert (second["slices_reused"], second["slices_computed"], second["publish"]) == (n, 0, "replaced")

    # A slice damaged on GCS is caught by its digest on the way in and recomputed; only that one.
    victim = sorted(gcs.glob(f"{work}/slices/*/*/tokens.npy"))[0]
    data = bytearray(gcs.cat_file(victim))
    data[-1] ^= 0xFF
    gcs.pipe_file(victim, bytes(data))
    monkeypatch.setenv("TOKENIZE_MIXER_WORK_DIR", str(tmp_path / "machine-c"))
    third = tokenize_mixer(mixer=demo_mixer(general, out), run=run)
    assert (third["slices_rechecked"], third["slices_computed"], third["slices_reused"]) == (1, 1, n - 1)
    assert parts(remote_output_digests(out)) == parts(DEMO_DIGESTS)
    assert gcs.cat_file(victim) != bytes(data)  # re-uploaded whole


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_an_object_is_read_by_batch_or_row_group_not_converted_whole(gcs, prefect_api, tmp_path, suffix):
    """A gs:// JSON Lines object is read by batch, and a Parquet object by row group, in place, by byte
    range of the generation the plan pinned: no copy, the demo's bytes either way, and a worker on
    another machine reads the same ranges."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sftmix.tokenizing.slices import on_this_machine

    general = f"gs://src/{uuid.uuid4().hex[:8]}/general{suffix}"
    if suffix == ".parquet":
        rows = [json.loads(line) for line in (EXAMPLES / "data" / "general.jsonl").read_text().splitlines()]
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "general.parquet", row_group_size=7)
        gcs.put_file(str(tmp_path / "general.parquet"), general)
    else:
        gcs.put_file(str(EXAMPLES / "data" / "general.jsonl"), general)
    pinned = f"{general}#{gcs.info(general)['generation']}"
    mixer = demo_mixer(general, str(tmp_path / "out"))
    run = RunOptions(work_dir=str(tmp_path / "work"), runner="thread")
    plan = build_plan(mixer, run)
    prefix = "parquet-row-groups:" if suffix == ".parquet" else "jsonl-batches:"
    assert plan.datasets[0].fingerprint.startswith(prefix)
    first = plan.slices[plan.datasets[0].slices[0]]
    moved = plan.context.output.model_copy(update={"remote_work_dir": f"gs://work/{uuid.uuid4().hex[:8]}"})
    elsewhere = plan.context.model_copy(update={"output": moved})
    if suffix == ".jsonl":
        assert isinstance(first.source, JsonlSource) and first.source.path == pinned
        assert on_this_machine(elsewhere, first)[1].source == first.source  # read in place anywhere
    else:
        assert isinstance(first.source, ParquetSource) and {f.path for f in first.source.footers} == {pinned}
        assert {
            g.path for s in plan.slices if isinstance(s.source, ParquetSource) for g in s.source.row_groups
        } == {pinned}
        assert on_this_machine(elsewhere, first)[1].source == first.source  # read in place anywhere
    assert not (tmp_path / "work" / "datasets-cache" / "remote-files").exists()  # no copy
    result = tokenize_mixer(mixer=mixer, run=run)
    assert parts(result["digests"]) == parts(DEMO_DIGESTS)


def test_a_large_jsonl_object_is_read_in_place_by_byte_range_while_it_is_planned(gcs, prefect_api, tmp_path):
    """A gs:// JSON Lines object is not fetched whole before its first slice (minutes at 100 GB): the plan
    pins its generation, reads its ranges on many threads and cuts each slice as its batches are
    counted; a slice reads its own ranges. The batches and the output are the local file's; an object
    replaced after the plan is one clear error where it is read, never rows of two versions."""
    from sftmix.output.digest import compare
    from sftmix.sources import jsonl
    from tests.test_head_start import _mixer, arithmetic

    local = tmp_path / "large.jsonl"
    with open(local, "w", encoding="utf-8") as fh:
        for k, row in enumerate(arithmetic(random.Random(9), 7_600)):
            fh.write(json.dumps({**row, "id": f"{k:05d}-" + "x" * 3000}) + "\n")
    assert local.stat().st_size > 2 * jsonl_batches.BATCH_BYTES
    url = f"gs://src/{uuid.uuid4().hex[:8]}/large.jsonl"
    gcs.put_file(str(local), url)
    pinned = f"{url}#{gcs.info(url)['generation']}"
    jsonl_scanning._SCANS.clear()
    mixer, run = _mixer(url, tmp_path / "out"), RunOptions(work_dir=str(tmp_path / "w"), runner="thread")  # type: ignore[arg-type]
    early: list[str] = []
    plan = build_plan(mixer, run, lambda spec, ctx: early.append(spec.key))
    assert early == [s.key for s in plan.slices]  # each handed on as its batches were counted
    assert {s.source.path for s in plan.slices} == {pinned}  # type: ignore[union-attr]
    assert not (tmp_path / "w" / "datasets-cache" / "remote-files").exists()  # no copy
    here = build_plan(_mixer(local, tmp_path / "here"), RunOptions(work_dir=str(tmp_path / "w2")))
    assert [s.source.batches for s in plan.slices] == [s.source.batches for s in here.slices]  # type: ignore[union-attr]
    tokenize_mixer(mixer=mixer, run=run)
    tokenize_mixer(mixer=_mixer(local, tmp_path / "here"), run=RunOptions(work_dir=str(tmp_path / "w2")))
    result = compare(tmp_path / "out", tmp_path / "here")
    differ = {i.name for i in result.items if i.status != "OK"}
    assert differ <= {"dataset_statistics.json", "dataset_statistics.txt"}, result.render()  # (they name it)

    data = local.read_bytes()
    gcs.pipe_file(url, data.replace(b"xxxx", b"yyyy", 1))  # replaced: the same size, another generation
    jsonl.release()
    with pytest.raises(DatasetError, match=r"large.jsonl.*changed since the run was planned"):
        jsonl.read_rows(plan.slices[0].source, [0])  # type: ignore[arg-type]
    with pytest.raises(DatasetError, match=r"large.jsonl.*changed while it was planned"):
        jsonl.scan(pinned)


def test_a_large_compressed_jsonl_object_is_sliced_as_its_copy_is_written(gcs, tmp_path):
    """A gs:// .jsonl.gz of several batches: its copy is decompressed as its ranges arrive and scanned as
    it is written, each slice cut (and handed on) from the copy still being written; the slices are the
    plain file's."""
    import gzip

    from sftmix.sources import jsonl
    from tests.test_head_start import _mixer, arithmetic

    local = tmp_path / "large.jsonl"
    with open(local, "w", encoding="utf-8") as fh:
        for k, row in enumerate(arithmetic(random.Random(9), 7_600)):
            fh.write(json.dumps({**row, "id": f"{k:05d}-" + "x" * 3000}) + "\n")
    url = f"gs://src/{uuid.uuid4().hex[:8]}/large.jsonl.gz"
    gcs.pipe_file(url, gzip.compress(local.read_bytes(), compresslevel=1, mtime=0))
    jsonl_scanning._SCANS.clear()
    early: list = []
    plan = build_plan(
        _mixer(url, tmp_path / "out"),  # type: ignore[arg-type]
        RunOptions(work_dir=str(tmp_path / "w")),
        lambda spec, ctx: early.append(spec),
    )
    assert [s.key for s in early] == [s.key for s in plan.slices] and len(early) >= 3
    assert all(b.growing for s in early for b in s.source.batches)  # cut from the copy being written
    copy = Path(early[0].source.path)
    assert copy.read_bytes() == local.read_bytes()  # (made since)
    here = build_plan(_mixer(local, tmp_path / "here"), RunOptions(work_dir=str(tmp_path / "w2")))
    assert [s.key for s in plan.slices] == [s.key for s in here.slices]
    assert jsonl.read_rows(early[-1].source, [early[-1].row_start]) == jsonl.read_rows(
        here.slices[-1].source,  # type: ignore[arg-type]
        [here.slices[-1].row_start],
    )


def test_a_parquet_object_is_read_by_row_group_in_place_and_a_replaced_one_is_refused(
    gcs, prefect_api, tmp_path, monkeypatch
):
    """A gs:// Parquet object is never fetched whole: the plan reads its footer and hashes its row groups
    by range; each slice reads its own row groups' ranges (here batch by batch, as a large row group is
    read). The row groups and the output are the local file's; an object replaced after the plan is one
    clear error where it is read, never rows of two versions."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sftmix.output.digest import compare
    from sftmix.sources import parquet
    from tests.test_head_start import _mixer, arithmetic

    rows = [{**row, "id": f"{k:05d}"} for k, row in enumerate(arithmetic(random.Random(11), 3_000))]
    local = tmp_path / "chats.parquet"
    pq.write_table(pa.Table.from_pylist(rows), local, row_group_size=700)
    url = f"gs://src/{uuid.uuid4().hex[:8]}/chats.parquet"
    gcs.put_file(str(local), url)
    pinned = f"{url}#{gcs.info(url)['generation']}"
    monkeypatch.setenv("TOKENIZE_MIXER_PARQUET_STREAMED_BYTES", "16384")  # every row group by batch
    mixer, run = _mixer(url, tmp_path / "out"), RunOptions(work_dir=str(tmp_path / "w"), runner="thread")  # type: ignore[arg-type]
    plan = build_plan(mixer, run)
    here = build_plan(_mixer(local, tmp_path / "here"), RunOptions(work_dir=str(tmp_path / "w2")))  # type: ignore[arg-type]
    groups = [g for s in plan.slices for g in s.source.row_groups]  # type: ignore[union-attr]
    assert {g.path for g in groups} == {pinned} and len({g.index for g in groups}) == 5
    assert [(g.index, g.sha256) for g in groups] == [
        (g.index, g.sha256)
        for s in here.slices
        for g in s.source.row_groups  # type: ignore[union-attr]
    ]
    assert plan.datasets[0].fingerprint == here.datasets[0].fingerprint
    assert not (tmp_path / "w" / "datasets-cache" / "remote-files").exists()  # no copy
    tokenize_mixer(mixer=mixer, run=run)
    tokenize_mixer(mixer=_mixer(local, tmp_path / "here"), run=RunOptions(work_dir=str(tmp_path / "w2")))  # type: ignore[arg-type]
    result = compare(tmp_path / "out", tmp_path / "here")
    differ = {i.name for i in result.items if i.status != "OK"}
    assert differ <= {"dataset_statistics.json", "dataset_statistics.txt"}, result.render()  # (they name it)

    rows[0]["id"] = "zzzzz"  # replaced: another generation
    pq.write_table(pa.Table.from_pylist(rows), local, row_group_size=700)
    gcs.put_file(str(local), url)
    for streamed in ("16384", str(1 << 30)):  # a row group read batch by batch, and one read whole
        monkeypatch.setenv("TOKENIZE_MIXER_PARQUET_STREAMED_BYTES", streamed)
        parquet.release()
        with pytest.raises(DatasetError, match=r"chats.parquet.*changed since the run was planned"):
            parquet.read_rows(plan.slices[0].source, [0])  # type: ignore[arg-type]
            parquet.confirm()
    parquet.release()
    with pytest.raises(DatasetError, match=r"chats.parquet.*changed while it was planned"):
        parquet.counted([pinned])


def test_a_compressed_jsonl_object_is_decompressed_as_it_is_read_not_fetched_first(
    gcs, prefect_api, tmp_path, monkeypatch
):
    """A gs:// .jsonl.gz is decompressed as its ranges arrive (fetched ahead on many threads), into the
    copy the plan reads by batch: no compressed copy is fetched first. The demo's bytes; an object
    replaced after it was pinned is refused and leaves no copy."""
    import gzip

    from sftmix.sources import pinned
    from sftmix.sources.copies import decompressed_copy

    lines = (EXAMPLES / "data" / "general.jsonl").read_bytes()
    url = f"gs://src/{uuid.uuid4().hex[:8]}/general.jsonl.gz"
    gcs.pipe_file(url, gzip.compress(lines, mtime=0))
    mixer = demo_mixer(url, str(tmp_path / "out"))
    run = RunOptions(work_dir=str(tmp_path / "work"), runner="thread")
    plan = build_plan(mixer, run)
    first = plan.slices[plan.datasets[0].slices[0]]
    assert isinstance(first.source, JsonlSource) and Path(first.source.path).read_bytes() == lines
    assert Path(first.source.path).is_relative_to(tmp_path / "work" / "datasets-cache" / "decompressed")
    assert not (tmp_path / "work" / "datasets-cache" / "remote-files").exists()  # no compressed copy
    result = tokenize_mixer(mixer=mixer, run=run)
    assert parts(result["digests"]) == parts(DEMO_DIGESTS)

    monkeypatch.setattr(pinned, "RANGE_BYTES", 1000)  # many ranges, fetched ahead out of order
    copy = decompressed_copy(pinned.pin(url), str(tmp_path / "cache"))
    assert Path(copy).read_bytes() == lines
    pinned_url = pinned.pin(url)
    gcs.pipe_file(url, gzip.compress(lines.replace(b"e", b"o"), mtime=0))  # replaced after it was pinned
    with pytest.raises(DatasetError, match=r"general.jsonl.gz.*changed"):
        decompressed_copy(pinned_url, str(tmp_path / "cache2"))
    assert not any(p.is_file() for p in (tmp_path / "cache2").rglob("*"))


def test_an_object_replaced_while_it_is_fetched_is_refused_not_stored_as_the_old_version(gcs, tmp_path):
    """The copy's name says which version it holds: an object replaced between asking for its version
    and fetching it is refused (the emulator ignores the pinned generation GCS would honour), and a
    fetch killed earlier leaves a temp file the next fetch of that version removes."""
    from sftmix.runtime.storage import temp_name
    from sftmix.sources.copies import fetch_version, localize

    url = f"gs://src/{uuid.uuid4().hex[:8]}/general.jsonl"
    first = (EXAMPLES / "data" / "general.jsonl").read_bytes()
    gcs.pipe_file(url, first)
    old = gcs.info(url)
    second = first.replace(b"e", b"o")  # the same size: only its generation tells
    gcs.pipe_file(url, second)
    local = tmp_path / "copy" / "general.jsonl"
    with pytest.raises(DatasetError, match=r"gs://src/.*the object changed while it was fetched"):
        fetch_version(url, old, str(local))
    assert not local.parent.exists() or not any(local.parent.iterdir())

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    left = temp_name(local).name.split("-")
    left[-2] = dead.stdout.strip()  # written by a process that is gone
    abandoned = local.parent / "-".join(left)
    abandoned.write_bytes(b"half")
    fetch_version(url, gcs.info(url), str(local))
    assert local.read_bytes() == second and not abandoned.exists()
    copy = Path(localize(url, str(tmp_path / "cache")))
    assert copy.read_bytes() == second and [p.name for p in copy.parent.iterdir()] == [copy.name]


def test_remote_errors_name_the_object(gcs, tmp_path):
    mixer = demo_mixer("gs://src/nowhere/general.jsonl", str(tmp_path / "o"))
    with pytest.raises(DatasetError, match=r"gs://src/nowhere/general.jsonl.*object not found"):
        build_plan(mixer, RunOptions(work_dir=str(tmp_path / "w")))
    from sftmix.output.output_dir import check_output_free

    with pytest.raises(ConfigError, match="bucket 'no-such-bucket' does not exist"):
        check_output_free("gs://no-such-bucket/out")
    with pytest.raises(ConfigError, match="no complete output"):
        remote_output_digests("gs://out/never-published")


@pytest.fixture(scope="module")
def two_outputs(prefect_api, tmp_path_factory):
    """Two different finished local outputs (max length 256 and 128) to publish."""
    root = tmp_path_factory.mktemp("outputs")
    for name, max_len in (("a", 256), ("b", 128)):
        mixer = demo_mixer(str(EXAMPLES / "data" / "general.jsonl"), str(root / name), max_len)
        tokenize_mixer(mixer=mixer, run=RunOptions(work_dir=str(root / "work")))
    return root / "a", root / "b"


PUBLISH = (
    "import sys, time; from pathlib import Path; from sftmix.output.publish import publish_remote; "
    "print('go', flush=True); t = time.perf_counter(); "
    "publish_remote(Path(sys.argv[1]), sys.argv[2], overwrite=True); print(time.perf_counter() - t)"
)


def test_publish_to_gcs_is_all_or_nothing_even_when_killed(gcs, two_outputs, tmp_path):
    a, b = two_outputs
    digests_a, digests_b = output_digests(a), output_digests(b)
    assert digests_a != digests_b
    url = f"gs://out/{uuid.uuid4().hex[:8]}/shards"

    def staged(src: Path) -> Path:
        dst = tmp_path / f"staging-{uuid.uuid4().hex[:6]}"
        shutil.copytree(src, dst)
        return dst

    def publish_in_subprocess(src: Path, kill_after: float | None) -> float:
        """Publish in a process of its own; killed ``kill_after`` seconds into the publish itself."""
        proc = subprocess.Popen(
            [sys.executable, "-c", PUBLISH, str(staged(src)), url], cwd=ROOT, start_new_session=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert proc.stdout.readline().strip() == "go", proc.stderr.read()[-2000:]
        if kill_after is None:
            assert proc.wait(timeout=120) == 0, proc.stderr.read()[-2000:]
            return float(proc.stdout.read().split()[-1])
        time.sleep(kill_after)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return kill_after

    def seen() -> dict[str, str] | None:
        """What a reader sees: a complete output's digests, or None (nothing complete)."""
        try:
            return remote_output_digests(url)
        except ConfigError:
            return None

    whole = publish_in_subprocess(a, None)
    assert seen() == digests_a

    # Overwrite A with B, killed at random moments: a reader sees A, B or nothing, never a mix.
    rng = random.Random(20261126)
    outcomes = set()
    current = a
    for _ in range(8):
        current = b if current is a else a  # always a real overwrite
        publish_in_subprocess(current, kill_after=rng.uniform(0.0, 1.0) * whole)
        now = seen()
        assert now in (None, digests_a, digests_b), "a reader saw a mix of two outputs"
        outcomes.add("none" if now is None else "a" if now == digests_a else "b")

    # The worst moment on purpose: the old manifest is gone and the new shards are going up.
    publish_in_subprocess(a, None)
    proc = subprocess.Popen(
        [sys.executable, "-c", PUBLISH, str(staged(b)), url], cwd=ROOT, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    manifest_url = f"{url}/{OUTPUT_MANIFEST}"
    while gcs.exists(manifest_url) and proc.poll() is None:
        gcs.invalidate_cache()
        time.sleep(0.005)
    with contextlib.suppress(ProcessLookupError):  # it may have finished between two looks
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if proc.returncode == -signal.SIGKILL:
        # killed in the window (nothing complete), or, on a loaded machine, just after the new manifest
        # landed (B complete): never a mix
        now = seen()
        assert now in (None, digests_b), "a reader saw a mix of two outputs"
        outcomes.add("none" if now is None else "b")

    publish_in_subprocess(b, None)
    assert seen() == digests_b
    listed = json.loads(gcs.cat_file(f"{url}/{OUTPUT_MANIFEST}"))["files"]
    on_gcs = {p.split("/shards/", 1)[1] for p in gcs.find(url)} - {OUTPUT_MANIFEST}
    assert on_gcs == set(listed)  # nothing of A or of an interrupted publish is left behind
    print(f"publish {whole:.2f}s; reader outcomes after kills:", sorted(outcomes))


def test_publish_to_gcs_refuses_to_clobber_different_shards(gcs, two_outputs, tmp_path):
    a, b = two_outputs
    url = f"gs://out/{uuid.uuid4().hex[:8]}/shards"
    assert publish_remote(Path(shutil.copytree(a, tmp_path / "sa")), url, overwrite=False) == "created"
    assert publish_remote(Path(shutil.copytree(a, tmp_path / "sa2")), url, overwrite=False) == "replaced"
    with pytest.raises(OutputConflictError, match="already holds different shards"):
        publish_remote(Path(shutil.copytree(b, tmp_path / "sb")), url, overwrite=False)
    assert remote_output_digests(url) == output_digests(a)  # untouched
    report = json.loads(gcs.cat_file(f"{url}/run_report.json"))
    assert report["publish"] == "replaced"


def test_hf_parquet_output_publishes_to_gcs(gcs, prefect_api, tmp_path):
    """The hf_parquet layout keeps its shards under data/: they go up, are listed, and are digested."""
    local = tmp_path / "hf"
    mixer = demo_mixer(str(EXAMPLES / "data" / "general.jsonl"), str(local))
    mixer = mixer.model_copy(update={"output": mixer.output.model_copy(update={"format": "hf_parquet"})})
    tokenize_mixer(mixer=mixer, run=RunOptions(work_dir=str(tmp_path / "work")))
    url = f"gs://out/{uuid.uuid4().hex[:8]}/hf"
    assert (
        publish_remote(Path(shutil.copytree(local, tmp_path / "staged")), url, overwrite=False) == "created"
    )
    remote = remote_output_digests(url)
    assert remote == output_digests(local)
    assert any(name.startswith("data/") and name.endswith(".parquet") for name in remote)


def test_publish_to_gcs_never_touches_objects_it_did_not_write(gcs, two_outputs, tmp_path):
    a, b = two_outputs
    url = f"gs://out/{uuid.uuid4().hex[:8]}/shards"
    gcs.pipe_file(f"{url}/notes/thesis.txt", b"four years of work")
    with pytest.raises(OutputConflictError, match="did not write .*notes/thesis.txt"):
        publish_remote(Path(shutil.copytree(a, tmp_path / "sa")), url, overwrite=True)
    gcs.invalidate_cache()
    assert [p.rsplit("/shards/", 1)[1] for p in gcs.find(url)] == ["notes/thesis.txt"]
    gcs.rm_file(f"{url}/notes/thesis.txt")
    assert publish_remote(Path(shutil.copytree(a, tmp_path / "sa2")), url, overwrite=False) == "created"
    gcs.pipe_file(f"{url}/mine.bin", b"\x00")  # dropped into a published output
    gcs.invalidate_cache()
    with pytest.raises(OutputConflictError, match="mine.bin"):
        publish_remote(Path(shutil.copytree(b, tmp_path / "sb")), url, overwrite=True)
    assert remote_output_digests(url) == output_digests(a)
