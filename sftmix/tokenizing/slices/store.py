"""Where a slice's checkpoint lives and how it is read back, checked and shared: its directory, its
manifest, its digests verified (fetched again from a remote work directory, ``gs://``, where the local copy
is missing or bad), its progress while it runs, and the run's context on a machine that did not plan it."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import numpy as np

from sftmix.config.run_options import local_mirror
from sftmix.errors import ChecksumError
from sftmix.runtime.parallel import available_cpus
from sftmix.runtime.storage import (
    atomic_write_with,
    download_file,
    join_url,
    open_npy,
    read_npy_of,
    read_remote_bytes,
    sha256_file,
    storage_errors,
    temp_name,
    upload_file,
    write_remote_bytes,
)
from sftmix.sources import registry
from sftmix.tokenizing.slices.manifest import (
    MANIFEST,
    OVER_LENGTH,
    OVER_LENGTH_DTYPE,
    PROGRESS,
    ROW_DTYPE,
    FileDigest,
    SliceManifest,
)
from sftmix.tokenizing.slices.spec import SliceSpec, TokenizeContext

logger = logging.getLogger(__name__)


def slice_dir(work_dir: str | Path, key: str) -> Path:
    return Path(work_dir) / "slices" / key[:2] / key


def remote_slice_url(remote_work_dir: str, key: str) -> str:
    return join_url(remote_work_dir, "slices", key[:2], key)


def read_manifest(work_dir: str | Path, key: str, remote: str | None = None) -> SliceManifest | None:
    """The slice's manifest (the remote one when the work directory is remote), or ``None``."""
    try:
        if remote is not None:
            data = read_remote_bytes(join_url(remote_slice_url(remote, key), MANIFEST))
            return None if data is None else SliceManifest.model_validate_json(data)
        path = slice_dir(work_dir, key) / MANIFEST
        return SliceManifest.model_validate_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _local_problem(work_dir: str | Path, manifest: SliceManifest, hash_files: bool = True) -> str | None:
    root = slice_dir(work_dir, manifest.key)
    on_disk = read_manifest(work_dir, manifest.key)
    if on_disk is None:
        return "manifest missing or unreadable"
    if on_disk.files != manifest.files:
        return "manifest on disk differs from the recorded result"
    for name, digest in manifest.files.items():
        path = root / name
        if not path.is_file():
            return f"{name} missing"
        if path.stat().st_size != digest.bytes:
            return f"{name} has {path.stat().st_size} bytes, expected {digest.bytes}"
        if hash_files and sha256_file(path) != digest.sha256:
            return f"{name} fails its sha256"
    return None


def verify_slice(
    work_dir: str | Path, manifest: SliceManifest, remote: str | None = None, hash_files: bool = True
) -> str | None:
    """``None`` when every file is here with the recorded size and sha256; else what is wrong. With a
    remote work directory a missing or bad local copy is fetched again first."""
    problem = _local_problem(work_dir, manifest, hash_files)
    if problem is None or remote is None:
        return problem
    remote_manifest = read_manifest(work_dir, manifest.key, remote)
    if remote_manifest is None:
        return f"{problem}; remote manifest missing or unreadable"
    if remote_manifest.files != manifest.files:
        return f"{problem}; remote manifest differs from the recorded result"
    root, url = slice_dir(work_dir, manifest.key), remote_slice_url(remote, manifest.key)
    try:
        for name in [*manifest.files, MANIFEST]:
            download_file(join_url(url, name), root / name)
    except Exception as exc:  # a missing or unreadable object: the slice is recomputed
        return f"{problem}; cannot fetch it: {type(exc).__name__}: {exc}"
    problem = _local_problem(work_dir, manifest)
    return None if problem is None else f"remote copy: {problem}"


def verify_slices(
    work_dir: str | Path, checks: list[tuple[SliceManifest, bool]], remote: str | None = None
) -> list[str | None]:
    """:func:`verify_slice` of each ``(manifest, hash_files)``, on every core (reading and hashing
    release the GIL): a rerun that reuses its slices reads each once, and at 22 B tokens (~110 GB of
    slices) one core would take minutes for what the disk reads in well under one."""
    if not checks:
        return []
    pool = ThreadPoolExecutor(max_workers=min(len(checks), available_cpus()), thread_name_prefix="verify")
    try:
        found = [pool.submit(verify_slice, work_dir, m, remote, hash_files) for m, hash_files in checks]
        return [f.result() for f in found]
    finally:
        pool.shutdown(cancel_futures=True)  # (stopped: the slices not yet read are not read)


def push_slice(ctx: TokenizeContext, manifest: SliceManifest) -> None:
    """Upload a finished slice to the remote work directory, manifest object last."""
    if ctx.output.remote_work_dir is None:
        return
    root, url = (
        slice_dir(ctx.output.work_dir, manifest.key),
        remote_slice_url(ctx.output.remote_work_dir, manifest.key),
    )
    for name in manifest.files:
        upload_file(root / name, join_url(url, name))
    write_remote_bytes(join_url(url, MANIFEST), (root / MANIFEST).read_bytes())


def load_slice_rows(work_dir: str | Path, manifest: SliceManifest) -> np.ndarray:
    """The row records of a finished slice (small: the plan of the output needs only these)."""
    return _read_records(work_dir, manifest, "rows.npy", ROW_DTYPE)


def load_over_length(work_dir: str | Path, manifest: SliceManifest) -> np.ndarray:
    """The slice's kept rows longer than ``max_seq_length`` (:data:`OVER_LENGTH_DTYPE`); none are read
    where the manifest counts none."""
    if not manifest.findings.over_length:
        return np.zeros(0, OVER_LENGTH_DTYPE)
    return _read_records(work_dir, manifest, OVER_LENGTH, OVER_LENGTH_DTYPE)


def _read_records(work_dir: str | Path, manifest: SliceManifest, name: str, dtype: np.dtype) -> np.ndarray:
    try:
        return read_npy_of(slice_dir(work_dir, manifest.key) / name, dtype)
    except (OSError, ValueError, EOFError) as exc:  # (EOFError: numpy's, for an empty file)
        raise ChecksumError(f"slice {manifest.key[:12]} ({manifest.dataset}): unreadable: {exc}") from None


def unrecorded_over_length(ctx: TokenizeContext, manifest: SliceManifest) -> str | None:
    """Why a finished slice cannot serve this run: it was made before its over-length rows were recorded,
    and the run's ``over_length_strategy`` needs them."""
    if ctx.output.over_length_recorded and manifest.findings.over_length is None:
        return "made before over-length rows were recorded (over_length_strategy needs them)"
    return None


def load_slice_arrays(
    work_dir: str | Path, manifest: SliceManifest
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Memory-mapped tokens, mask and row records of a finished slice."""
    root = slice_dir(work_dir, manifest.key)
    try:
        tokens = open_npy(root / "tokens.npy")
        mask = open_npy(root / "mask.npy")
        rows = open_npy(root / "rows.npy")
    except (OSError, ValueError) as exc:
        raise ChecksumError(f"slice {manifest.key[:12]} ({manifest.dataset}): unreadable: {exc}") from None
    return tokens, mask, rows


class _Writer:
    """Hides the real file from ``np.save``: its ``tofile`` shortcut reports a full disk as a short
    write without an errno; plain ``write`` calls raise ENOSPC like everything else."""

    def __init__(self, fh: BinaryIO) -> None:
        self.write = fh.write


def save_npy(path: Path, array: np.ndarray) -> FileDigest:
    atomic_write_with(path, lambda fh: np.save(_Writer(fh), array, allow_pickle=False))
    return FileDigest(bytes=path.stat().st_size, sha256=sha256_file(path))


def remote_tokenizer_url(remote_work_dir: str, tokenizer_file: str) -> str:
    return join_url(remote_work_dir, "tokenizers", os.path.basename(tokenizer_file))


def push_worker_tokenizer(ctx: TokenizeContext) -> None:
    """Put the worker tokenizer in the remote work directory (once): a worker on another machine reads
    it there instead of needing the tokenizer's own location."""
    if ctx.output.remote_work_dir is None or not ctx.tokenizer.file:
        return
    url = remote_tokenizer_url(ctx.output.remote_work_dir, ctx.tokenizer.file)
    if read_remote_bytes(url) is None:
        upload_file(ctx.tokenizer.file, url)


def context_here(ctx: TokenizeContext) -> TokenizeContext:
    """With a remote work directory, the planning machine's local paths mean nothing on another machine
    (and are never taken from a caller): this process uses its own mirror of the work directory (slices,
    datasets cache) and fetches the worker tokenizer from the work directory."""
    if ctx.output.remote_work_dir is None:
        return ctx
    mirror = local_mirror(ctx.output.remote_work_dir)
    if Path(ctx.output.work_dir) == mirror:
        return ctx
    tokenizer_file = ctx.tokenizer.file
    if tokenizer_file:
        local = mirror / "tokenizers" / os.path.basename(tokenizer_file)
        if not local.is_file():
            url = remote_tokenizer_url(ctx.output.remote_work_dir, tokenizer_file)
            with storage_errors(f"cannot fetch the worker tokenizer {url}"):
                if read_remote_bytes(url) is not None:
                    download_file(url, local)
        tokenizer_file = str(local)
    output = ctx.output.model_copy(
        update={"work_dir": str(mirror), "datasets_cache": str(mirror / "datasets-cache")}
    )
    return ctx.model_copy(
        update={"output": output, "tokenizer": ctx.tokenizer.model_copy(update={"file": tokenizer_file})}
    )


def on_this_machine(ctx: TokenizeContext, spec: SliceSpec) -> tuple[TokenizeContext, SliceSpec]:
    """:func:`context_here`, and a slice that opens its dataset itself instead of reading the planner's
    Arrow files (or its copies of a hub dataset's or a ``gs://`` object's files), when the context is not
    the planner's."""
    here = context_here(ctx)
    return (ctx, spec) if here is ctx else (here, slice_here(spec))


def slice_here(spec: SliceSpec) -> SliceSpec:
    """The slice as a machine other than the planner's reads it: files the planner read that this machine
    lacks (its copies of a hub dataset's files) are opened here by datasets; files it has, and gs://
    objects, are read as planned (checksums agree)."""
    return spec.model_copy(update={"source": registry.here(spec.source)})


def note_progress(root: Path, rows: int, of: int) -> None:
    """Say that ``rows`` of the slice's ``of`` rows are tokenized (:data:`PROGRESS`)."""
    final = root / PROGRESS
    tmp = temp_name(final)
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(json.dumps({"rows": rows, "of": of}).encode("utf-8"))
        os.replace(tmp, final)
    except OSError as exc:
        logger.debug("cannot note the progress of %s: %s", root, exc)
        with contextlib.suppress(OSError):
            tmp.unlink()


def read_progress(root: Path, since: float) -> float | None:
    """The share of a running slice's rows done, as its worker last noted it at or after ``since`` (epoch
    seconds: an earlier run's note says nothing of this one); ``None`` where there is none."""
    path = root / PROGRESS
    try:
        if path.stat().st_mtime < since:
            return None
        noted = json.loads(path.read_bytes())
        return min(1.0, int(noted["rows"]) / max(1, int(noted["of"])))
    except (OSError, ValueError, KeyError, TypeError):
        return None
