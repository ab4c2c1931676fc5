"""Refuse before work a run whose local disks cannot hold what it will write: its slices still to tokenize
(finished ones are reused) and the output, staged beside where it is published (a remote
output is staged in the work directory). Sizes are the plan's estimate from sampled rows; an output being
replaced is no credit (it is removed only once the new one is published). ``gs://`` locations are not
checked."""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sftmix.errors import StorageError
from sftmix.output.publish import staging_parent
from sftmix.planning.plan import Plan
from sftmix.planning.slice_sizes import size_text
from sftmix.runtime import settings
from sftmix.tokenizing.slices import MANIFEST, SliceSpec, slice_dir


@dataclass
class _Disk:
    """What the run writes on one file system (``parts``: each kind of thing, in words) and its free bytes."""

    free: int
    need: int = 0
    parts: list[str] = field(default_factory=list)

    def add(self, nbytes: int, what: str) -> None:
        if nbytes > 0:
            self.need += nbytes
            self.parts.append(f"~{size_text(nbytes)} {what}")


def free_bytes(path: Path) -> tuple[int, int]:
    """The file system of ``path`` (or of its nearest existing parent): its device and its bytes free to an
    unprivileged writer."""
    at = path
    while not at.exists() and at.parent != at:
        at = at.parent
    found = os.statvfs(at)
    return os.stat(at).st_dev, found.f_bavail * found.f_frsize


def slices_to_make(plan: Plan) -> list[SliceSpec]:
    """The slices without a finished checkpoint in the local work directory (its manifest is written last)."""
    if plan.context.output.remote_work_dir is not None:
        return []  # (their files go to the remote work directory)
    return [
        s for s in plan.slices if not (slice_dir(plan.context.output.work_dir, s.key) / MANIFEST).exists()
    ]


def refuse_short_disk(plan: Plan) -> None:
    """A :class:`StorageError` naming the numbers where the run's estimated writes exceed a disk's free space
    (unless ``TOKENIZE_MIXER_DISK_CHECK`` is off)."""
    if settings.DISK_CHECK.get() == "off":
        return
    per_token = np.dtype(plan.context.output.token_dtype).itemsize + 1
    per_row = {d.index: d.tokens_per_row for d in plan.datasets}
    work = Path(plan.context.output.work_dir)
    disks: dict[int, _Disk] = {}

    def disk(path: Path) -> _Disk:
        device, free = free_bytes(path)
        return disks.setdefault(device, _Disk(free))

    todo = slices_to_make(plan)
    rows: defaultdict[int, int] = defaultdict(int)
    for s in todo:
        rows[s.dataset_index] += len(s.rows) if s.rows is not None else s.row_end - s.row_start
    slice_bytes = round(sum(n * per_row[i] for i, n in rows.items()) * per_token)
    disk(work).add(slice_bytes, f"of {len(todo):,} slices to tokenize in {work}")
    output = sum(d.estimated_tokens() for d in plan.datasets) * per_token
    staged = staging_parent(plan.mixer.output.path, work).parent
    disk(staged).add(output, f"of output staged in {staged}")
    for d in disks.values():
        if d.need > d.free:
            raise StorageError(
                f"not enough free disk for this run: it will write ~{size_text(d.need)} ({', '.join(d.parts)}; "
                f"estimated from sampled rows) where {size_text(d.free)} is free. Free space there, or set "
                f"work_dir or the output elsewhere ({settings.DISK_CHECK.name}=off runs it anyway)"
            )
