"""The hf_parquet output (and its best-fit-decreasing packing) read back with ``datasets``: the same
documents, tokens and masks as the OLMo layout, deterministic, from the same slice checkpoints."""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from sftmix.config.config import DatasetEntry, MixerConfig, OutputSpec, TokenizerSpec
from sftmix.config.run_options import RunOptions
from sftmix.output.digest import output_digests
from sftmix.output.hf_output import best_fit_decreasing
from tests.tiers import examples
from tokenize_mixer.flows.tokenize_mixer import tokenize_mixer

EXAMPLES = Path(__file__).parent.parent / "examples"
MAX_LEN = 256


def mixer(out: Path, **output) -> MixerConfig:
    return MixerConfig(
        datasets=[
            DatasetEntry(path=str(EXAMPLES / "data" / "general.jsonl"), amount=2.0),
            DatasetEntry(path=str(EXAMPLES / "data" / "arithmetic.jsonl"), amount=0.5),
        ],
        tokenizer=TokenizerSpec(name_or_path=str(EXAMPLES / "tokenizer"), chat_template="olmo"),
        max_seq_length=MAX_LEN,
        output=OutputSpec(path=str(out), **output),
    )


def olmo_documents(out: Path) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    dtype = np.dtype(json.loads((out / "run_report.json").read_text())["token_dtype"])
    tokens = np.fromfile(out / "token_ids_part_0000.npy", dtype=dtype).astype(np.int64)
    mask = np.fromfile(out / "labels_mask_part_0000.npy", dtype=np.bool_)
    with gzip.open(out / "token_ids_part_0000.csv.gz", "rt") as fh:
        bounds = [tuple(int(x) for x in line.split(",")) for line in fh]
    return [
        (tuple(tokens[s:e].tolist()), tuple(np.where(mask[s:e], tokens[s:e], -100).tolist()))
        for s, e in bounds
    ]


@pytest.fixture(scope="module")
def outputs(prefect_api, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    run = RunOptions(work_dir=str(root / "work"))
    made = {}
    for name, output in {
        "olmo": {},
        "hf": {"format": "hf_parquet"},
        "packed": {"format": "hf_parquet", "packing": "best_fit_decreasing"},
    }.items():
        report = tokenize_mixer(mixer=mixer(root / name, **output), run=run)
        assert report["slices_computed"] == (
            report["slices_total"] if name == "olmo" else 0
        )  # no re-tokenizing
        made[name] = root / name
    return made


def test_hf_rows_are_the_olmo_documents(outputs):
    import datasets

    ds = datasets.load_dataset(str(outputs["hf"]), split="train")
    assert set(ds.column_names) == {"input_ids", "labels", "attention_mask"}
    rows = [(tuple(r["input_ids"]), tuple(r["labels"])) for r in ds]
    assert rows == olmo_documents(outputs["olmo"])  # same order, tokens, and -100 exactly where no loss
    assert all(set(r["attention_mask"]) == {1} for r in ds)
    assert not list(outputs["hf"].glob("token_ids_part_*"))


def test_packed_rows_hold_every_document_once(outputs):
    import datasets

    ds = datasets.load_dataset(str(outputs["packed"]), split="train")
    docs: Counter = Counter()
    for r in ds:
        ids, labels, pos = r["input_ids"], r["labels"], r["position_ids"]
        assert 0 < len(ids) <= MAX_LEN and len(ids) == len(labels) == len(pos)
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(ids)]
        for a, b in zip(starts, starts[1:], strict=False):
            assert pos[a:b] == list(range(b - a))
            docs[(tuple(ids[a:b]), tuple(labels[a:b]))] += 1
    assert docs == Counter(olmo_documents(outputs["olmo"]))
    stats = json.loads((outputs["packed"] / "dataset_statistics.json").read_text())["hf_output"]
    n_tokens = sum(len(d[0]) for d in docs.elements())
    assert stats["rows"] == len(ds) and stats["packing"] == "best_fit_decreasing"
    assert stats["packing_efficiency"] == round(n_tokens / (len(ds) * MAX_LEN), 4)
    assert stats["documents_per_sequence_max"] >= 2  # documents of 70-220 tokens in 256: few pairs fit
    print(
        f"packed {sum(docs.values())} documents into {len(ds)} rows: efficiency {stats['packing_efficiency']}"
    )


def test_hf_output_is_deterministic_whatever_the_slicing(outputs, tmp_path):
    again = tmp_path / "packed"
    run = RunOptions(work_dir=str(tmp_path / "work"), slice_rows=7)
    tokenize_mixer(mixer=mixer(again, format="hf_parquet", packing="best_fit_decreasing"), run=run)
    assert output_digests(again) == output_digests(outputs["packed"])
    assert any(name.startswith("data/") for name in output_digests(again))


def test_packing_needs_the_hf_format_and_a_length(tmp_path):
    with pytest.raises(ValidationError, match="packing applies to format hf_parquet"):
        OutputSpec(path=str(tmp_path), packing="best_fit_decreasing")
    fields = mixer(tmp_path, format="hf_parquet", packing="best_fit_decreasing").model_dump()
    with pytest.raises(ValidationError, match="needs max_seq_length"):
        MixerConfig.model_validate({**fields, "max_seq_length": None})


def naive_bfd(lengths: list[int], capacity: int) -> list[list[int]]:
    bins: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [b for b in range(len(bins)) if free[b] >= lengths[i]]
        if fits:
            b = min(fits, key=lambda b: (free[b], b))
            bins[b].append(i)
            free[b] -= lengths[i]
        else:
            bins.append([i])
            free.append(capacity - lengths[i])
    return [sorted(b) for b in bins]


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.integers(1, 64), max_size=80), st.integers(64, 100))
def test_best_fit_decreasing_matches_the_textbook_rule(lengths, capacity):
    assert best_fit_decreasing(np.array(lengths, dtype=np.int64), capacity) == naive_bfd(lengths, capacity)


def test_report_reads_hf_outputs(outputs, tmp_path):
    from sftmix.check.report_page import collect

    views = {Path(v.name).name: v for v in collect(outputs["hf"])}
    olmo = {Path(v.name).name: v for v in collect(outputs["olmo"])}
    for name, view in views.items():
        assert np.array_equal(np.sort(view.lengths), np.sort(olmo[name].lengths))
