"""A picture of an output: token-length histograms per dataset, trainable fraction, each dataset's share.

Everything comes from the written output (``dataset_statistics.json``, parts, ``.csv.gz`` boundaries)
plus, to split document lengths by dataset, the run's document map (``run_report.json`` points to it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sftmix.errors import ConfigError
from sftmix.output.digest import RUN_REPORT
from sftmix.output.olmo_format import BOUNDS_PART, STATS_JSON, read_boundaries
from sftmix.output.output_dir import record_output_files
from sftmix.runtime.storage import open_npy

REPORT_PNG = "report.png"
REPORT_MD = "report.md"


def upsampling_text(factor: float) -> str:
    """One way to show an upsampling factor everywhere (the UI's tables, report.md, report.png)."""
    return f"{factor:.3g}x"


@dataclass
class DatasetView:
    name: str
    documents: int
    tokens: int
    trainable: int
    upsampling: float
    share: float  # of all tokens, percent
    lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


def _document_lengths(out: Path) -> np.ndarray:
    """Every document's length, in output order, from the boundaries alone (the per-dataset trainable
    shares come from the statistics: reading the masks here held a whole part in memory at the end of
    every run)."""
    lengths = []
    part = 0
    while (out / BOUNDS_PART.format(part)).exists():
        bounds = read_boundaries(out / BOUNDS_PART.format(part))
        lengths.append(bounds[:, 1] - bounds[:, 0])
        part += 1
    return np.concatenate(lengths) if lengths else np.zeros(0, np.int64)


def _hf_lengths(out: Path, stats: dict) -> np.ndarray:
    """Document lengths of an unpacked hf_parquet output (packed rows hold several documents)."""
    if stats.get("hf_output", {}).get("packing"):
        return np.zeros(0, np.int64)
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    sizes = [
        pc.list_value_length(pq.read_table(p, columns=["input_ids"])["input_ids"]).to_numpy()
        for p in sorted((out / "data").glob("*.parquet"))
    ]
    return np.concatenate(sizes).astype(np.int64) if sizes else np.zeros(0, np.int64)


def collect(output: str | Path) -> list[DatasetView]:
    out = Path(output)
    try:
        stats = json.loads((out / STATS_JSON).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{out} has no readable {STATS_JSON}: {exc}") from None
    per = stats.get("per_dataset_statistics", [])
    views = [
        DatasetView(
            name=d["dataset_name"],
            documents=int(d["final_instances_in_output"]),
            tokens=int(d["final_tokens_in_output"]),
            trainable=int(d["final_trainable_tokens_in_output"]),
            upsampling=float(d.get("upsampling_factor") or 1.0),
            share=float(d.get("percentage_of_total_tokens") or 0.0),
        )
        for d in per
    ]
    lengths = _document_lengths(out)
    if lengths.size == 0 and (out / "data").is_dir():  # hf_parquet: one row per document unless packed
        lengths = _hf_lengths(out, stats)
    try:
        report = json.loads((out / RUN_REPORT).read_text(encoding="utf-8"))
        docmap = open_npy(report["documents_file"])
        names = list(report["datasets"])
        if docmap.shape[0] != lengths.shape[0]:
            raise ValueError("document map does not match")
        by_name = {v.name: v for v in views}
        for k, name in enumerate(names):
            if name in by_name:
                by_name[name].lengths = lengths[np.asarray(docmap["dataset"]) == k]
        # mixer order (the statistics list datasets in the reference's order)
        views.sort(key=lambda v: names.index(v.name) if v.name in names else len(names))
    except (OSError, KeyError, ValueError, TypeError):
        if len(views) == 1:
            views[0].lengths = lengths
    return views


def max_seq_length(output: str | Path) -> int | None:
    try:
        stats = json.loads((Path(output) / STATS_JSON).read_text(encoding="utf-8"))
        value = stats["configuration"]["max_sequence_length"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return int(value) if value else None


def write_png(views: list[DatasetView], path: Path, limit: int | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), dpi=110)
    hist, frac, share = axes
    top = max((int(v.lengths.max()) for v in views if v.lengths.size), default=1)
    bins = np.linspace(0, top, 41)
    for v in views:
        if v.lengths.size:
            hist.hist(v.lengths, bins=bins, histtype="step", linewidth=1.6, label=Path(v.name).name)
    if limit is not None:
        hist.axvline(limit, color="#555555", linestyle="--", linewidth=1)
        hist.text(limit, hist.get_ylim()[1] * 0.95, f" max_seq_length {limit:,}", fontsize=8, ha="right")
    hist.set(title="Document length (tokens)", xlabel="tokens", ylabel="documents")
    hist.legend(fontsize=8)
    labels = [Path(v.name).name for v in views]
    trainable = [100 * v.trainable / max(v.tokens, 1) for v in views]
    frac.barh(labels, trainable, color="#2a9d8f")
    for y, pct in enumerate(trainable):
        frac.text(pct, y, f" {pct:.1f}%", va="center", fontsize=8)
    frac.set(title="Trainable tokens (%)", xlim=(0, 115))
    share.barh(labels, [v.share for v in views], color="#e76f51")
    for y, v in enumerate(views):
        share.text(v.share, y, f" {v.share:.1f}% ({upsampling_text(v.upsampling)})", va="center", fontsize=8)
    share.set(title="Share of all tokens (%), upsampling", xlim=(0, 115))
    for ax in (frac, share):
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def markdown(views: list[DatasetView], image: str | None = REPORT_PNG) -> str:
    lines = ["# tokenize-mixer output report", ""]
    if image:
        lines += [f"![token lengths, trainable fraction, dataset shares]({image})", ""]
    lines += [
        "| dataset | documents | tokens | trainable % | share of tokens % | upsampling | median length | p95 length |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for v in views:
        med = f"{np.median(v.lengths):,.0f}" if v.lengths.size else "-"
        p95 = f"{np.percentile(v.lengths, 95):,.0f}" if v.lengths.size else "-"
        lines.append(
            f"| {v.name} | {v.documents:,} | {v.tokens:,} | {100 * v.trainable / max(v.tokens, 1):.1f} | "
            f"{v.share:.1f} | {upsampling_text(v.upsampling)} | {med} | {p95} |"
        )
    return "\n".join(lines) + "\n"


def write_report(output: str | Path, target: str | Path | None = None) -> tuple[Path, Path]:
    """Write ``report.png`` and ``report.md`` into ``target`` (default: the output directory)."""
    views = collect(output)
    where = Path(target or output)
    where.mkdir(parents=True, exist_ok=True)
    png, md = where / REPORT_PNG, where / REPORT_MD
    write_png(views, png, max_seq_length(output))
    md.write_text(markdown(views), encoding="utf-8")
    if target is None:  # written into the output: listed in its marker, so overwrite may replace them
        record_output_files(where, [REPORT_PNG, REPORT_MD])
    return png, md
