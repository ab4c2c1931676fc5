"""The OLMo-core layout: raw token/label parts, .csv.gz document boundaries, statistics files."""

from __future__ import annotations

import bisect
import gzip
import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from sftmix.config.config import REFERENCE_PART_BYTES
from sftmix.errors import ConfigError
from sftmix.runtime.parallel import available_cpus
from sftmix.runtime.storage import pwrite_all, reserve_file

TOKENS_PART = "token_ids_part_{:04d}.npy"
MASK_PART = "labels_mask_part_{:04d}.npy"
BOUNDS_PART = "token_ids_part_{:04d}.csv.gz"
STATS_JSON = "dataset_statistics.json"
STATS_TXT = "dataset_statistics.txt"
#: What a run made, beside its output (``sftmix.output.report.RunReport``).
RUN_REPORT = "run_report.json"
#: gzip level of the boundary files: their bytes are hashed after decompression (any level reads the
#: same), and level 1 compresses a part's lines ~18x faster than ``gzip.open``'s 9 for ~1.4x the size
#: (0.02 against 0.39 s, 0.80 against 0.56 MB for 112,530 lines; a part's ids are 1 GiB).
BOUNDS_GZIP_LEVEL = 1


#: Parts an output may have: their names have four digits (0000 to 9999), and OLMo-core pairs token and
#: mask parts by their sorted names.
MAX_PARTS = 10_000


def part_bytes_problem(
    part_bytes: int, dtype: np.dtype, max_seq_length: int | None, tokens: int, whole: bool = False
) -> str | None:
    """Why ``output.part_bytes`` cannot serve an output of about ``tokens`` tokens, or ``None``: parts smaller
    than one ``max_seq_length`` document, or more parts than four-digit names sort. ``whole``: parts end at
    documents' ends (each may leave up to a document's tokens short of the size)."""
    itemsize = np.dtype(dtype).itemsize
    per_part = part_tokens(dtype, part_bytes)
    if max_seq_length is not None and part_bytes < max_seq_length * itemsize:
        return (
            f"output.part_bytes {part_bytes:,} holds {per_part:,} token ids ({np.dtype(dtype).name}), "
            f"fewer than one document of max_seq_length {max_seq_length:,}: give at least {max_seq_length * itemsize:,}"
        )
    short = max_seq_length if whole and max_seq_length else 0  # what a part may end short of its size
    parts = -(-tokens // max(per_part - short + 1, 1)) if short else -(-tokens // per_part)
    if parts > MAX_PARTS:
        least = (-(-tokens // MAX_PARTS) + short) * itemsize
        return (
            f"output.part_bytes {part_bytes:,} would cut the output's ~{tokens:,} tokens into ~{parts:,} parts, "
            f"past the {MAX_PARTS:,} that four-digit part names hold (0000 to 9999): give at least {least:,}"
        )
    return None


def part_tokens(dtype: np.dtype, part_bytes: int = REFERENCE_PART_BYTES) -> int:
    """Tokens per part: the reference splits purely by count, 1 GiB of ids per part."""
    return max(1, part_bytes // np.dtype(dtype).itemsize)


@dataclass(frozen=True)
class PartLayout:
    """Where each part begins in the output's tokens (``firsts``, ascending, from 0) and ends (``total``)."""

    firsts: tuple[int, ...]
    total: int

    @classmethod
    def by_count(cls, total: int, per_part: int) -> PartLayout:
        """The reference's: a new part every ``per_part`` tokens, wherever a document lies."""
        return cls(tuple(range(0, total, per_part)), total)

    @classmethod
    def whole_documents(cls, doc_ends: np.ndarray, per_part: int) -> PartLayout:
        """Each part ends at the last document end within ``per_part`` tokens of its start (one document
        longer than that: at its own end), so no document is cut."""
        total = int(doc_ends[-1]) if doc_ends.size else 0
        firsts, at = [], 0
        while at < total:
            firsts.append(at)
            k = int(np.searchsorted(doc_ends, at + per_part, side="right")) - 1
            if k < 0 or int(doc_ends[k]) <= at:  # the document starting here is longer than a part
                k = int(np.searchsorted(doc_ends, at, side="right"))
            at = int(doc_ends[k])
        return cls(tuple(firsts), total)

    def __len__(self) -> int:
        return len(self.firsts)

    def bounds(self, part: int) -> tuple[int, int]:
        """Part ``part``'s tokens ``[lo, hi)`` in the output."""
        return self.firsts[part], self.firsts[part + 1] if part + 1 < len(self.firsts) else self.total

    def part_of(self, offset: int) -> int:
        """The part that holds token ``offset``."""
        return bisect.bisect_right(self.firsts, offset) - 1

    def spans(self, offset: int, n: int) -> Iterator[tuple[int, int, int, int]]:
        """The pieces of tokens ``[offset, offset + n)``: (part, offset in part, offset in the range,
        length), cut where a part ends."""
        done = 0
        while done < n:
            k = self.part_of(offset + done)
            lo, hi = self.bounds(k)
            take = min(n - done, hi - (offset + done))
            yield k, offset + done - lo, done, take
            done += take


def part_layout(parts: str, part_bytes: int, dtype: np.dtype, doc_ends: np.ndarray) -> PartLayout:
    """The parts of an output whose documents end at ``doc_ends`` (``output.parts`` and ``part_bytes``)."""
    per_part = part_tokens(dtype, part_bytes)
    if parts == "whole_documents":
        layout = PartLayout.whole_documents(doc_ends, per_part)
    else:
        layout = PartLayout.by_count(int(doc_ends[-1]) if doc_ends.size else 0, per_part)
    if len(layout) > MAX_PARTS:  # (the plan refuses what its estimate foresees; this is what was made)
        raise ConfigError(
            f"output.part_bytes {part_bytes:,} cut the output's {int(doc_ends[-1]):,} tokens into {len(layout):,} "
            f"parts, past the {MAX_PARTS:,} that four-digit part names hold (0000 to 9999); nothing was written, "
            "and a rerun with a larger part_bytes reuses every slice"
        )
    return layout


class PartSet:
    """Token and mask parts written at precomputed global offsets with ``pwrite``: the pages go to the
    page cache and not into this process's resident memory (a map written through would hold a whole
    part's pages resident until closed), so assembling a large output keeps memory flat."""

    def __init__(self, directory: Path, layout: PartLayout, dtype: np.dtype) -> None:
        self.layout = layout
        self.dtype = np.dtype(dtype)
        self.tokens: list[int] = []
        self.masks: list[int] = []
        for k in range(len(layout)):
            lo, hi = layout.bounds(k)
            for files, path, nbytes in (
                (self.tokens, directory / TOKENS_PART.format(k), (hi - lo) * self.dtype.itemsize),
                (self.masks, directory / MASK_PART.format(k), hi - lo),
            ):
                reserve_file(path, nbytes)
                files.append(os.open(path, os.O_WRONLY))

    def files(self, part: int) -> tuple[int, int]:
        """The open token and mask files of ``part``."""
        return self.tokens[part], self.masks[part]

    def write(self, offset: int, tokens: np.ndarray, mask: np.ndarray) -> None:
        tokens = np.ascontiguousarray(tokens, dtype=self.dtype)
        mask = np.ascontiguousarray(mask, dtype=np.uint8)
        for k, local, done, take in self.layout.spans(offset, tokens.shape[0]):
            _write_at(self.tokens[k], tokens[done : done + take], local * self.dtype.itemsize)
            _write_at(self.masks[k], mask[done : done + take], local)

    def close(self, sync: bool = True) -> None:
        """Make the parts durable (as a map's flush would; ``sync=False`` on the way out of an error)
        and close them."""
        try:
            for fd in (*self.tokens, *self.masks) if sync else ():
                os.fsync(fd)
        finally:
            for fd in (*self.tokens, *self.masks):
                os.close(fd)
            self.tokens.clear()
            self.masks.clear()


def _write_at(fd: int, data: np.ndarray, position: int) -> None:
    # (``a.data``: ``memoryview(a)``, which numpy's stubs allow from Python 3.12 only)
    pwrite_all(fd, data.data.cast("B"), position)


def read_boundaries(path: Path) -> np.ndarray:
    """A part's ``token_ids_part_*.csv.gz`` as an (n, 2) array of (start, end) token offsets."""
    return parse_boundaries(gzip.decompress(path.read_bytes()))


def parse_boundaries(text: bytes) -> np.ndarray:
    """The decompressed ``start,end`` lines as an (n, 2) array (a ``ValueError`` when they are not); the
    columns after them (``output.lineage``'s) are left out, as OLMo-core leaves them."""
    columns = text[: text.find(b"\n")].count(b",") + 1 if text else 2
    return np.array(text.replace(b",", b" ").split(), dtype=np.int64).reshape(-1, columns)[:, :2]


def write_boundaries(
    directory: Path,
    doc_starts: np.ndarray,
    doc_ends: np.ndarray,
    layout: PartLayout,
    lineage: tuple[np.ndarray, np.ndarray] | None = None,
) -> None:
    """One ``start,end`` line per document overlapping each part, clipped to it (no header), and with
    ``lineage`` (each document's dataset and source row) two more columns; parts on threads (gzip
    releases the GIL)."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(layout), available_cpus(), 8))) as pool:
        for done in [
            pool.submit(_write_part_boundaries, directory, doc_starts, doc_ends, layout.bounds(k), k, lineage)
            for k in range(len(layout))
        ]:
            done.result()


def _write_part_boundaries(
    directory: Path,
    doc_starts: np.ndarray,
    doc_ends: np.ndarray,
    bounds: tuple[int, int],
    k: int,
    lineage: tuple[np.ndarray, np.ndarray] | None,
) -> None:
    lo, hi = bounds
    first = int(np.searchsorted(doc_ends, lo, side="right"))
    last = int(np.searchsorted(doc_starts, hi, side="left"))
    starts = np.maximum(doc_starts[first:last], lo) - lo
    ends = np.minimum(doc_ends[first:last], hi) - lo
    keep = ends > starts
    columns = [starts[keep], ends[keep]]
    if lineage is not None:
        columns += [column[first:last][keep] for column in lineage]
    line = ",".join(["{}"] * len(columns)) + "\n"
    # No name and no time in the header: the same boundaries give the same bytes, run after run.
    with (
        open(directory / BOUNDS_PART.format(k), "wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=BOUNDS_GZIP_LEVEL, mtime=0) as fh,
    ):
        for a in range(0, columns[0].shape[0], 100_000):
            rows = zip(*(c[a : a + 100_000].tolist() for c in columns), strict=True)
            if lineage is None:  # (an f-string: the faster, for the reference's tens of millions of lines)
                fh.write("".join(f"{s},{e}\n" for s, e in rows).encode())
            else:
                fh.write("".join(line.format(*row) for row in rows).encode())


@dataclass
class DocumentTotals:
    """The output's documents counted in all, and per dataset name in order of first appearance (a name
    listed twice in a mixer is one dataset of the statistics)."""

    instances: int
    tokens: int
    trainable: int
    filtered: int  # documents with no trainable token
    names: list[str] = field(default_factory=list)
    per_dataset: dict[str, list[int]] = field(
        default_factory=dict
    )  # [instances, tokens, trainable, filtered]

    def add(self, name: str, instances: int, tokens: int, trainable: int, filtered: int) -> None:
        if name not in self.per_dataset:
            self.names.append(name)
            self.per_dataset[name] = [0, 0, 0, 0]
        counted = self.per_dataset[name]
        for k, n in enumerate((instances, tokens, trainable, filtered)):
            counted[k] += n


def dataset_statistics(
    *,
    output_dir: str,
    tokenizer: str,
    max_seq_length: int | None,
    chat_template: str | None,
    pre: dict[str, dict[str, Any]],
    totals: DocumentTotals,
) -> dict[str, Any]:
    """The reference's ``dataset_statistics.json`` object, key for key and float for float."""
    merged = [_dataset_entry(name, pre.get(name, {}), totals) for name in totals.names]
    total_instances, total_tokens, total_trainable = totals.instances, totals.tokens, totals.trainable
    return {
        "timestamp": datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
        "output_directory": output_dir,
        "configuration": {
            "tokenizer": tokenizer,
            "max_sequence_length": max_seq_length,
            "chat_template": chat_template,
        },
        "per_dataset_statistics": merged,
        "overall_statistics": {
            "total_datasets": len(totals.names),
            "total_instances": total_instances,
            "total_tokens": total_tokens,
            "trainable_tokens": total_trainable,
            "trainable_percentage": (total_trainable / total_tokens * 100) if total_tokens > 0 else 0,
            "instances_filtered": totals.filtered,
            "average_sequence_length": total_tokens / total_instances if total_instances > 0 else 0,
        },
    }


def _dataset_entry(name: str, p: dict[str, Any], totals: DocumentTotals) -> dict[str, Any]:
    """One dataset's entry of ``per_dataset_statistics``, the reference's keys in its order."""
    count, tokens, trainable, filtered = totals.per_dataset[name]
    return {
        "dataset_name": name,
        "dataset_split": p.get("dataset_split", "unknown"),
        "initial_instances": p.get("initial_instances", "N/A"),
        "instances_after_transformation": p.get("final_instances", "N/A"),
        "instances_filtered_during_transformation": p.get("instances_filtered", "N/A"),
        "frac_or_num_samples": p.get("frac_or_num_samples"),
        "original_dataset_size": p.get("original_dataset_size"),
        "is_upsampled": p.get("is_upsampled", False),
        "upsampling_factor": p.get("upsampling_factor", 1.0),
        "final_instances_in_output": count,
        "final_tokens_in_output": tokens,
        "final_trainable_tokens_in_output": trainable,
        "instances_filtered_after_tokenization": filtered,
        "avg_tokens_per_instance": tokens / count if count > 0 else 0,
        "percentage_of_total_tokens": (tokens / totals.tokens * 100) if totals.tokens > 0 else 0,
        "percentage_of_total_instances": (count / totals.instances * 100) if totals.instances > 0 else 0,
    }


def statistics_text(stats: dict[str, Any]) -> str:
    """The human-readable report the reference writes next to the JSON."""
    cfg, overall = stats["configuration"], stats["overall_statistics"]
    out = [
        "Dataset Statistics Report\n",
        "=" * 80 + "\n",
        f"Generated: {stats['timestamp']}\n",
        f"Output Directory: {stats['output_directory']}\n\n",
        "Configuration:\n",
        "-" * 40 + "\n",
        f"- Tokenizer: {cfg['tokenizer']}\n",
        f"- Max Sequence Length: {cfg['max_sequence_length']}\n",
        f"- Chat Template: {cfg['chat_template']}\n\n",
        "Per-Dataset Statistics:\n",
        "=" * 80 + "\n",
    ]
    for entry in stats["per_dataset_statistics"]:
        out += _dataset_text(entry)
    out += [
        "\n" + "=" * 80 + "\n",
        "Overall Statistics:\n",
        "=" * 80 + "\n",
        f"- Total datasets: {overall['total_datasets']}\n",
        f"- Total instances: {overall['total_instances']:,}\n",
        f"- Total tokens: {overall['total_tokens']:,}\n",
        f"- Trainable tokens: {overall['trainable_tokens']:,} ",
        f"({overall['trainable_percentage']:.1f}%)\n",
        f"- Instances filtered out: {overall['instances_filtered']}\n",
        f"- Average sequence length: {overall['average_sequence_length']:.1f}\n",
    ]
    return "".join(out)


def _dataset_text(s: dict[str, Any]) -> list[str]:
    """One dataset's section of the report, as the reference words it."""
    out = [
        f"\nDataset: {s['dataset_name']}\n",
        f"- Split: {s['dataset_split']}\n",
        "\nPre-transformation:\n",
        f"  - Instances loaded: {s.get('initial_instances', 'N/A')}\n",
        f"  - Instances after transformation: {s.get('instances_after_transformation', 'N/A')}\n",
        f"  - Instances filtered during transformation: {s.get('instances_filtered_during_transformation', 'N/A')}\n",
    ]
    amount = s.get("frac_or_num_samples")
    if amount is not None:
        label = (
            "Sampling fraction"
            if isinstance(amount, float)
            else "Token budget"  # (ours: the reference has none)
            if isinstance(amount, str)
            else "Sample count"
        )
        out.append(f"  - {label}: {amount}\n")
    if s.get("is_upsampled", False):
        out += [
            f"  - Original dataset size: {s.get('original_dataset_size', 'N/A')}\n",
            f"  - Upsampling factor: {s.get('upsampling_factor', 1.0):.2f}x\n",
            f"  - Upsampled to: {s.get('instances_after_transformation', 'N/A')} instances\n",
        ]
    out += [
        "\nFinal output statistics (after shuffling):\n",
        f"  - Instances in output: {s['final_instances_in_output']:,}\n",
        f"  - Total tokens: {s['final_tokens_in_output']:,}\n",
        f"  - Trainable tokens: {s['final_trainable_tokens_in_output']:,}\n",
        f"  - Instances with no labels: {s['instances_filtered_after_tokenization']}\n",
        f"  - Average tokens per instance: {s['avg_tokens_per_instance']:.1f}\n",
        f"  - Percentage of total tokens: {s['percentage_of_total_tokens']:.1f}%\n",
        f"  - Percentage of total instances: {s['percentage_of_total_instances']:.1f}%\n",
    ]
    return out


def write_statistics(directory: Path, stats: dict[str, Any]) -> None:
    (directory / STATS_JSON).write_text(json.dumps(stats, indent=2), encoding="utf-8")
    (directory / STATS_TXT).write_text(statistics_text(stats), encoding="utf-8")
