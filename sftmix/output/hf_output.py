"""The Hugging Face layout for trainers that are not OLMo-core (TRL, transformers' Trainer).

``data/train-XXXXX-of-YYYYY.parquet`` with ``input_ids``, ``labels`` (-100 where the mask is 0) and
``attention_mask``; ``datasets.load_dataset(OUTPUT)`` reads it. Built from the assembled parts (no
re-tokenizing), streamed in row batches so memory does not grow with the output. With packing, documents
are packed into ``max_seq_length`` sequences by best-fit decreasing and each row also has
``position_ids`` that restart at every document (what padding-free / flash-attention trainers use to
keep documents apart).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from sftmix.output.olmo_format import BOUNDS_PART, MASK_PART, TOKENS_PART, PartLayout

DATA_DIR = "data"
ROWS_PER_SHARD = 100_000
ROWS_PER_BATCH = 1_000


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Bins of document indices: longest first, each into the fullest bin it still fits (ties: the
    earliest bin). Deterministic; O(n log n) plus list moves bounded by the distinct free sizes."""
    order = np.argsort(-lengths, kind="stable")
    bins: list[list[int]] = []
    free_sizes: list[int] = []  # sorted distinct free capacities
    by_free: dict[int, list[int]] = {}  # free capacity -> bin ids (ascending)
    for i in order.tolist():
        n = int(lengths[i])
        if n > capacity:
            raise ValueError(f"document {i} has {n} tokens, more than the packing capacity {capacity}")
        k = bisect.bisect_left(free_sizes, n)
        if k < len(free_sizes):
            free = free_sizes[k]
            b = by_free[free].pop(0)
            if not by_free[free]:
                del by_free[free]
                free_sizes.pop(k)
            bins[b].append(i)
            free -= n
        else:
            b, free = len(bins), capacity - n
            bins.append([i])
        if free > 0:
            if free not in by_free:
                bisect.insort(free_sizes, free)
                by_free[free] = []
            bisect.insort(by_free[free], b)
    return [sorted(b) for b in bins]


class _Parts:
    """Reads any global token range across the assembled parts."""

    def __init__(self, staging: Path, dtype: np.dtype, layout: PartLayout) -> None:
        self.layout = layout
        self.tokens, self.masks = [], []
        k = 0
        while (staging / TOKENS_PART.format(k)).exists():
            self.tokens.append(np.memmap(staging / TOKENS_PART.format(k), dtype=dtype, mode="r"))
            self.masks.append(np.memmap(staging / MASK_PART.format(k), dtype=np.bool_, mode="r"))
            k += 1

    def read(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        ids, mask = [], []
        for k, local, _, take in self.layout.spans(start, length):
            ids.append(self.tokens[k][local : local + take])
            mask.append(self.masks[k][local : local + take])
        if not ids:
            return np.zeros(0, np.int64), np.zeros(0, bool)
        return np.concatenate(ids).astype(np.int64), np.concatenate(mask)


def _batches(
    parts: _Parts, starts: np.ndarray, lengths: np.ndarray, rows: list[list[int]], packed: bool
) -> Iterator[dict[str, list]]:
    batch: dict[str, list] = {"input_ids": [], "labels": [], "attention_mask": []}
    if packed:
        batch["position_ids"] = []
    for docs in rows:
        pieces = [parts.read(int(starts[d]), int(lengths[d])) for d in docs]
        ids = np.concatenate([p[0] for p in pieces])
        mask = np.concatenate([p[1] for p in pieces])
        batch["input_ids"].append(ids)
        batch["labels"].append(np.where(mask, ids, -100))
        batch["attention_mask"].append(np.ones(ids.shape[0], np.int8))
        if packed:
            batch["position_ids"].append(np.concatenate([np.arange(int(lengths[d])) for d in docs]))
        if len(batch["input_ids"]) == ROWS_PER_BATCH:
            yield batch
            batch = {k: [] for k in batch}
    if batch["input_ids"]:
        yield batch


def _table(batch: dict[str, list]):
    import pyarrow as pa

    columns = {}
    for name, arrays in batch.items():
        offsets = np.zeros(len(arrays) + 1, np.int64)
        np.cumsum([a.shape[0] for a in arrays], out=offsets[1:])
        dtype = np.int8 if name == "attention_mask" else np.int64
        values = np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype)
        columns[name] = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))
    return pa.table(columns)


def write_hf_parquet(
    staging: Path,
    starts: np.ndarray,
    lengths: np.ndarray,
    dtype: np.dtype,
    layout: PartLayout,
    pack_to: int | None,
) -> dict:
    """Write ``data/*.parquet`` from the parts in ``staging``; returns its statistics."""
    import pyarrow.parquet as pq

    parts = _Parts(staging, dtype, layout)
    rows = best_fit_decreasing(lengths, pack_to) if pack_to else [[i] for i in range(lengths.shape[0])]
    shards = max(1, math.ceil(len(rows) / ROWS_PER_SHARD))
    out = staging / DATA_DIR
    out.mkdir(parents=True, exist_ok=True)
    batches = _batches(parts, starts, lengths, rows, packed=pack_to is not None)
    for s in range(shards):
        path = out / f"train-{s:05d}-of-{shards:05d}.parquet"
        writer = None
        written = 0
        while written < ROWS_PER_SHARD:
            batch = next(batches, None)
            if batch is None:
                break
            table = _table(batch)
            if writer is None:
                writer = pq.ParquetWriter(path, table.schema, compression="zstd")
            writer.write_table(table)
            written += table.num_rows
        if writer is None:  # an empty output still has its (empty) shard
            writer = pq.ParquetWriter(
                path, _table({k: [] for k in ("input_ids", "labels", "attention_mask")}).schema
            )
        writer.close()
    stats = {"format": "hf_parquet", "rows": len(rows), "shards": shards}
    if pack_to:
        total = int(lengths.sum())
        per_row = [len(r) for r in rows]
        stats.update(
            packing="best_fit_decreasing",
            sequence_length=pack_to,
            packing_efficiency=round(total / (len(rows) * pack_to), 4) if rows else 0.0,
            documents_per_sequence_mean=round(float(np.mean(per_row)), 3) if rows else 0.0,
            documents_per_sequence_max=max(per_row, default=0),
        )
    return stats


def remove_olmo_parts(staging: Path) -> None:
    k = 0
    while (staging / TOKENS_PART.format(k)).exists():
        for name in (TOKENS_PART, MASK_PART, BOUNDS_PART):
            (staging / name.format(k)).unlink(missing_ok=True)
        k += 1
