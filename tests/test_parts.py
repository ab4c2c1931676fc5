"""The output's parts: the reference's layout cuts the document at each part boundary (and ``check`` counts
them, naming the setting that avoids it); ``output.parts: whole_documents`` ends each part at a document's
end, with the same tokens in the same order. OLMo-core reads both back: ``tests/test_olmo_core.py``."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from sftmix.check.findings import check_output
from sftmix.output.olmo_format import BOUNDS_PART, MASK_PART, TOKENS_PART, read_boundaries
from tests.test_check import chat, run

#: Bytes of token ids a part holds here: a few documents each.
PART_BYTES = 512
CUT = "documents cut in two by a part boundary"


def parts_of(out: Path) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Each part's tokens, mask and (start, end) lines."""
    dtype = np.dtype(json.loads((out / "run_report.json").read_text())["token_dtype"])
    tokens, masks, bounds, k = [], [], [], 0
    while (out / TOKENS_PART.format(k)).exists():
        tokens.append(np.fromfile(out / TOKENS_PART.format(k), dtype=dtype))
        masks.append(np.fromfile(out / MASK_PART.format(k), dtype=np.uint8))
        bounds.append(
            read_boundaries(out / BOUNDS_PART.format(k))
        )  # (start, end): lineage's columns left out
        k += 1
    return tokens, masks, bounds


def findings(out: Path) -> dict[str, int]:
    return {f.what.split(" (")[0].split(";")[0]: f.count for f in check_output(out, 256).findings}


@pytest.fixture(scope="module")
def outputs(prefect_api, tmp_path_factory) -> dict[str, Path]:
    """One mix written as one part, in the reference's layout of small parts, and in whole-document parts."""
    tmp = tmp_path_factory.mktemp("parts")
    rows = [chat(f"question {i}? " * (1 + i % 7), f"answer number {i}. " * (1 + i % 5)) for i in range(60)]
    made = {}
    for name, output in (
        ("one", {}),
        ("reference", {"part_bytes": PART_BYTES}),
        ("whole", {"parts": "whole_documents", "part_bytes": PART_BYTES}),
    ):
        (tmp / name).mkdir()
        made[name] = run(tmp / name, rows, "out", slice_rows=16, shuffle_seed=4, output_options=output)
    return made


def test_small_reference_parts_cut_documents_and_check_counts_them(outputs):
    (one,), (one_mask,), (one_bounds,) = parts_of(outputs["one"])
    tokens, masks, bounds = parts_of(outputs["reference"])
    per_part = PART_BYTES // tokens[0].dtype.itemsize
    assert len(tokens) > 3 and all(t.size == per_part for t in tokens[:-1])
    assert np.array_equal(np.concatenate(tokens), one) and np.array_equal(np.concatenate(masks), one_mask)
    ends = one_bounds[:, 1]
    boundaries = np.arange(per_part, one.size, per_part)
    cut = int(np.isin(boundaries, ends, invert=True).sum())  # a boundary inside a document
    assert cut > 0
    assert sum(b.shape[0] for b in bounds) == one_bounds.shape[0] + cut  # clipped into both parts
    found = findings(outputs["reference"])
    assert found[CUT] == cut
    assert "documents that do not end with EOS" not in found  # each first piece is counted as cut, once
    report = check_output(outputs["reference"], 256)
    assert report.documents == one_bounds.shape[0]
    assert "--parts whole_documents" in next(f.line() for f in report.findings if f.what.startswith(CUT))
    assert CUT not in findings(outputs["one"])


def test_whole_document_parts_hold_every_document_whole(outputs):
    (one,), (one_mask,), (one_bounds,) = parts_of(outputs["one"])
    tokens, masks, bounds = parts_of(outputs["whole"])
    eos = int(one[one_bounds[0, 1] - 1])
    assert len(tokens) > 3 and all(t.nbytes <= PART_BYTES for t in tokens)
    assert np.array_equal(np.concatenate(tokens), one) and np.array_equal(np.concatenate(masks), one_mask)
    offsets = np.cumsum([0] + [t.size for t in tokens[:-1]])
    assert np.array_equal(np.concatenate([b + o for b, o in zip(bounds, offsets, strict=True)]), one_bounds)
    for part, lines in zip(tokens, bounds, strict=True):
        assert lines[0, 0] == 0 and lines[-1, 1] == part.size and (part[lines[:, 1] - 1] == eos).all()
    found = findings(outputs["whole"])
    assert CUT not in found and check_output(outputs["whole"], 256).documents == one_bounds.shape[0]


def test_every_writer_writes_the_same_whole_document_parts(outputs, tmp_path, monkeypatch):
    """By slice on worker processes, as by window on threads: the same parts."""
    import sftmix.assembly.assemble
    from sftmix.output.digest import output_digests

    monkeypatch.setattr(sftmix.assembly.assemble, "ASSEMBLE_BY", "slice")
    monkeypatch.setattr(sftmix.assembly.assemble, "ASSEMBLE_THREADS", 2)
    monkeypatch.setattr(sftmix.assembly.assemble, "PROCESSES_FROM_TOKENS", 1)
    rows = [chat(f"question {i}? " * (1 + i % 7), f"answer number {i}. " * (1 + i % 5)) for i in range(60)]
    options = {"parts": "whole_documents", "part_bytes": PART_BYTES}
    again = run(tmp_path, rows, "out", slice_rows=16, shuffle_seed=4, output_options=options)
    theirs, mine = output_digests(outputs["whole"]), output_digests(again)
    parts = [k for k in theirs if k.startswith(("token_ids", "labels_mask"))]
    assert len(parts) > 6 and all(mine[k] == theirs[k] for k in parts)


def test_convert_takes_the_part_settings_and_a_rerun_with_others_makes_them_again(
    prefect_api, tmp_path, capsys
):
    """``--parts``/``--part_bytes`` set them from the reference's command line; they are in the output's
    recipe, so the same command with other parts writes the output again (from the same slices); hf_parquet,
    whose shards are its own, refuses them."""
    from sftmix.config.config import OutputSpec
    from tests.cli_runs import convert_args
    from tokenize_mixer.cli import main

    data, out, work = tmp_path / "chats.jsonl", tmp_path / "out", tmp_path / "work"
    data.write_text("".join(json.dumps(chat(f"q{i}?", f"answer {i}. " * 9)) + "\n" for i in range(40)))
    assert main(convert_args(data, work, out)) == 0
    assert not (out / TOKENS_PART.format(1)).exists()
    whole = ("--parts", "whole_documents", "--part_bytes", str(PART_BYTES))
    assert main(convert_args(data, work, out, *whole, "--overwrite")) == 0
    assert (out / TOKENS_PART.format(3)).exists() and CUT not in findings(out)
    said = capsys.readouterr().out
    assert "40 in 1 part(s), " in said and "0 computed, 1 reused" in said
    assert "40 in 40 part(s) of whole documents" in said
    with pytest.raises(ValueError, match="parts, part_bytes and lineage apply to format olmo"):
        OutputSpec(path=str(out), format="hf_parquet", parts="whole_documents")


def test_lineage_names_each_documents_dataset_and_row(outputs, tmp_path):
    """``output.lineage``: two more columns of the .csv.gz files (each piece of a cut document carries its
    document's), which our readers, like OLMo-core's, read past; the tokens and masks are the same, and the
    statistics name what each dataset index was read from."""
    from tokenize_mixer.cli import main

    rows = [chat(f"question {i}? " * (1 + i % 7), f"answer number {i}. " * (1 + i % 5)) for i in range(60)]
    options = {"part_bytes": PART_BYTES, "lineage": True}
    out = run(tmp_path, rows, "out", slice_rows=16, shuffle_seed=4, output_options=options)
    tokens, masks, bounds = parts_of(outputs["reference"])
    mine = parts_of(out)
    assert all(np.array_equal(a, b) for a, b in zip(mine[0] + mine[1], tokens + masks, strict=True))
    assert all(np.array_equal(a, b) for a, b in zip(mine[2], bounds, strict=True))  # (start, end) as before
    report = json.loads((out / "run_report.json").read_text())
    documents = np.load(report["documents_file"])
    lines = [
        np.array([line.split(",") for line in gzip.decompress(p.read_bytes()).decode().split()], np.int64)
        for p in sorted(out.glob("token_ids_part_*.csv.gz"))
    ]
    assert {line.shape[1] for line in lines} == {4}
    every = np.concatenate(lines)
    per_part, ends = (
        PART_BYTES // tokens[0].dtype.itemsize,
        set((documents["start"] + documents["length"]).tolist()),
    )
    firsts = np.cumsum([0] + [line.shape[0] for line in lines[:-1]])  # each part's first line
    whole = np.ones(every.shape[0], bool)  # a cut document's second piece is not another document
    whole[[firsts[k] for k in range(1, len(lines)) if k * per_part not in ends]] = False
    assert every.shape[0] == documents.shape[0] + findings(out)[CUT]
    assert [tuple(x) for x in every[:, 2:][whole].tolist()] == list(
        zip(documents["dataset"].tolist(), documents["row"].tolist(), strict=True)
    )
    stats = json.loads((out / "dataset_statistics.json").read_text())
    assert stats["lineage"]["columns"] == ["start", "end", "dataset", "row"]
    assert stats["lineage"]["datasets"][0]["dataset"] == 0 and stats["lineage"]["datasets"][0]["fingerprint"]
    assert main(["inspect", str(out), "--doc", "3"]) == 0
