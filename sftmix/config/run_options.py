"""How a run goes, not what it writes: workers, slices, where it works and its checkpoints live, what it
checks. None of these changes a byte of the output (each is declared ``NO_BYTES``); the UI shows them beside the mixer."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    model_validator,
)

from sftmix.config.config import OptionalList, OptionalText
from sftmix.config.form import form_schema, lift_advanced
from sftmix.runtime import settings


class RunOptions(BaseModel):
    """How to run: where checkpoints live, slice size, parallelism, validation."""

    model_config = ConfigDict(
        extra="forbid",
        title="Run options",
        json_schema_extra=form_schema(
            advanced=(
                "runner",
                "slice_rows",
                "slice_bytes",
                "dask_address",
                "slice_deployment",
                "batch_slices",
                "allowed_roots",
            ),
            title="Slices, runners and allowed paths",
            description="How big slices are, where they run, and which paths a run may touch. Rarely changed.",
        ),
    )

    work_dir: OptionalText = Field(
        default=None,
        title="Work directory",
        description="Where finished slices are kept, so a rerun redoes only what did not finish: a local "
        "directory, or a gs://bucket/prefix every worker reaches. Empty: $TOKENIZE_MIXER_WORK_DIR or the user "
        "cache directory (the worker's, from the UI). Deleting it means starting cold.",
    )
    workers: int | None = Field(
        default=None,
        gt=0,
        title="Workers",
        description="Worker processes. Empty: one per CPU this run may use.",
    )
    check: Literal["report", "strict", "off"] = Field(
        default="report",
        title="Check before publishing",
        description="Reads the shards once more before they are published, as `tokenize-mixer check` does. "
        "report: its findings go to the run report and the UI. strict: any finding fails the run and nothing "
        "is published. off: no check.",
    )
    reference: OptionalText = Field(
        default=None,
        title="Reference output",
        description="An output directory or a digests JSON file the shards must match byte for byte; a "
        "mismatch fails the run. Empty: none.",
    )
    force: bool = Field(
        default=False,
        title="Rebuild an up-to-date output",
        description="Make and publish the output again even when it already holds this run's shards (the "
        "same recipe and inputs, every file as published); finished slices are still reused.",
    )
    force_recache: bool = Field(
        default=False,
        title="Recompute every slice",
        description="Ignore finished slices and compute them again, replacing them.",
    )
    disable_cache: bool = Field(
        default=False,
        title="Keep no slices",
        description="Neither reuse nor keep finished slices: they go to a scratch directory removed after the run.",
    )
    runner: Literal["auto", "process", "thread", "dask", "work_pool"] = Field(
        default="auto",
        title="Runner",
        description="auto: a process pool when there is enough work for several workers, else in this process. "
        "process: a process pool on this machine. dask: a Dask cluster (the scheduler address below, or a "
        "local cluster of the workers above). work_pool: batches of slices as runs of the slice deployment "
        "below, on whichever machines serve its work pool (needs a gs:// work directory). thread: in this "
        "process, for debugging.",
    )
    slice_rows: int | None = Field(
        default=None,
        gt=0,
        title="Rows per slice",
        description="Source rows in each slice (one task per slice). Empty: about the bytes per slice below.",
    )
    slice_bytes: int | None = Field(
        default=None,
        gt=0,
        title="Bytes per slice",
        description="Source bytes in each slice when rows per slice is empty: small enough to balance the "
        "workers, large enough that orchestration costs little. Empty: by the whole mixture's size, 4 MiB "
        "up to 2 GiB of data, doubling to at most 64 MiB so that a mixture makes at most ~512 slices (one "
        "Prefect API core dispatches ~25 task runs a second). It does not depend on the number of workers, "
        "so finished slices are reused whatever the parallelism. A local JSON Lines file of several 10 MiB "
        "batches is cut into whole batches (the nearest number of them, at least one).",
    )
    dask_address: OptionalText = Field(
        default=None,
        title="Dask scheduler address",
        description="Runner dask: the scheduler of an existing cluster (tcp://host:8786); its workers need "
        "tokenize-mixer installed and the work directory in reach. Empty: a local cluster.",
    )
    slice_deployment: str = Field(
        default="tokenize-slices/cpu",
        title="Slice deployment",
        description="Runner work_pool: the deployment of the tokenize-slices flow that runs each batch.",
    )
    batch_slices: int = Field(
        default=16,
        gt=0,
        title="Slices per batch",
        description="Runner work_pool: slices per batch (one run of the slice deployment).",
    )
    allowed_roots: OptionalList = Field(
        default=None,
        title="Allowed roots",
        description="Absolute local directories and gs://bucket/prefix URLs that every path this run reads or "
        "writes must lie in: dataset files, a local tokenizer, a .jinja template, the output (strictly below a "
        "root), the work directory and the reference; hub names are not paths. Empty: no narrowing. A worker "
        "that sets TOKENIZE_MIXER_ALLOWED_ROOTS bounds every run, and these may only narrow it.",
    )

    @model_validator(mode="before")
    @classmethod
    def _form_shape(cls, data: object) -> object:
        return lift_advanced(data, "run")


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME``, else ``~/.cache``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"))


def cache_subdir(name: str) -> Path:
    """``$XDG_CACHE_HOME/tokenize-mixer/NAME``: what a machine keeps across runs and work directories
    (encoder proofs, tokenizer facts, schemas), each made again where it is missing."""
    return user_cache_dir() / "tokenize-mixer" / name


def default_work_dir() -> Path:
    """``$TOKENIZE_MIXER_WORK_DIR``, else the user cache directory."""
    env = settings.WORK_DIR.get()
    if env:
        return Path(env).expanduser()
    return user_cache_dir() / "tokenize-mixer"


def local_mirror(remote_work_dir: str) -> Path:
    """Where this machine keeps its copies of a remote work directory's files (slices it reads, the
    datasets cache, staging)."""
    tag = hashlib.sha256(remote_work_dir.rstrip("/").encode("utf-8")).hexdigest()[:16]
    return default_work_dir() / "mirrors" / tag
