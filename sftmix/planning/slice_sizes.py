"""How large a mixture's slices are: a tier of bytes that gives every worker a few slices (a run dispatches a
limited number of task runs a second, whatever the cores), and the plan's words for it."""

from __future__ import annotations

from sftmix.config.run_options import RunOptions
from sftmix.runtime.parallel import available_cpus
from sftmix.sources.jsonl import batches as jsonl_batches
from sftmix.tokenizing.slices import (
    SliceSpec,
)


def size_text(nbytes: int) -> str:
    """Bytes as a person reads them (decimal units, kB to TB)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes / 1e3:,.1f} kB"


#: Bytes per slice when the run leaves them to the tool: the smallest of these that cuts the mixture into
#: at most ``AUTO_SLICES`` slices (the largest one beyond that).
AUTO_SLICE_BYTES = (4 << 20, 8 << 20, 16 << 20, 32 << 20, 64 << 20)


AUTO_SLICES = 512


#: A mixture too small to give each worker this many slices of the smallest tier above is cut finer.
SLICES_PER_WORKER = 2


SMALLEST_SLICE_BYTES = 256 << 10


def slice_bytes_for(run: RunOptions, nbytes: int) -> int:
    """The bytes per slice of a mixture of ``nbytes``: the run's, or by the mixture's size. Each slice is a
    task run, and one Prefect API core dispatches ~25 a second whatever the cores: a mixture cut into at
    most ~512 slices (up to 32 GiB) costs at most ~20 s of dispatch; beyond, 64 MiB slices are dispatched
    as fast as 64 cores tokenize them. The whole mixture decides, not each dataset (20 Parquet datasets of
    1 GB each were ~4,800 task runs, over 3 minutes of dispatch for ~13 s of work on 64 cores), and not
    the workers, so finished slices are reused whatever the parallelism; in tiers, so a mixture that
    grows a little keeps its slices. Only a small mixture (:func:`cuts_batches`) is cut by the workers too:
    finer, down to SMALLEST_SLICE_BYTES, until each gets two slices (two 10 MiB batches of a 17 MB file were
    two slices, so two workers did it all and a stop kept nothing); its slices are cheap to make again."""
    if run.slice_bytes is not None:
        return run.slice_bytes
    tier = next((b for b in AUTO_SLICE_BYTES if nbytes <= b * AUTO_SLICES), AUTO_SLICE_BYTES[-1])
    enough = SLICES_PER_WORKER * (run.workers or available_cpus())
    while tier > SMALLEST_SLICE_BYTES and nbytes < tier * enough:
        tier //= 2
    return tier


def cuts_batches(run: RunOptions, nbytes: int) -> bool:
    """Whether JSON Lines batches (``BATCH_BYTES``, parsed whole) are cut into slices: only in a mixture too
    small to give each worker SLICES_PER_WORKER whole batches, where slices are left to the tool (each piece
    parses its batch again: a larger mixture keeps whole batches, and the slices it had)."""
    enough = SLICES_PER_WORKER * (run.workers or available_cpus())
    return run.slice_bytes is None and nbytes < jsonl_batches.BATCH_BYTES * enough


def slicing_summary(run: RunOptions, data_bytes: int, slices: list[SliceSpec]) -> str:
    """How the slices were sized, for the plan's summary: what decided it, and what a person sets to
    change it (the size a mixture's slices get follows from its total, so adding a dataset can change it)."""
    if run.slice_rows:
        return f"{run.slice_rows:,} rows each (slice_rows)"
    average = sum(s.est_bytes for s in slices) / max(1, len(slices))
    how = (
        "slice_bytes"
        if run.slice_bytes
        else f"by the mixture's {data_bytes / 1e9:,.2f} GB; slice_bytes sets another"
    )
    return f"{average / 1e6:,.1f} MB of data each on average ({how})"
