"""The consumer reads it: OLMo-core's own dataset configs over our shards yield our tokens, our label
masks and our documents. OLMo-core (ai2-olmo-core with CPU torch 2.13.0) lives in a virtual environment
of its own, made once with pip and cached, so the project's environment stays free of torch."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from sftmix.config.config import DatasetEntry, MixerConfig, OutputSpec, TokenizerSpec
from sftmix.config.run_options import RunOptions
from tests.venvs import cached_venv, venv_env
from tokenize_mixer.flows.tokenize_mixer import tokenize_mixer

EXAMPLES = Path(__file__).parent.parent / "examples"
READER = Path(__file__).parent / "consumers" / "olmo_core_reader.py"
REQUIREMENTS = ["torch==2.13.0", "ai2-olmo-core==3.0.0"]
SEQUENCE_LENGTH = 512

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def olmo_core_python() -> Path:
    return cached_venv("olmo-core-venv", REQUIREMENTS)


def documents(out: Path, dtype: np.dtype) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    tokens = np.fromfile(out / "token_ids_part_0000.npy", dtype=dtype)
    mask = np.fromfile(out / "labels_mask_part_0000.npy", dtype=np.bool_).astype(int)
    with gzip.open(out / "token_ids_part_0000.csv.gz", "rt") as fh:
        bounds = [tuple(int(x) for x in line.split(",")) for line in fh]
    return [(tuple(tokens[s:e].tolist()), tuple(mask[s:e].tolist())) for s, e in bounds]


def packed_documents(packed: list[dict], pad: int) -> Counter:
    """The documents of packed instances, with their masks (padding left out)."""
    found: Counter = Counter()
    for inst in packed:
        assert len(inst["input_ids"]) == SEQUENCE_LENGTH
        start = 0
        for length in inst["doc_lens"]:
            ids = tuple(inst["input_ids"][start : start + length])
            labels = tuple(inst["label_mask"][start : start + length])
            start += length
            if not (set(ids) == {pad} and not any(labels)):
                found[(ids, labels)] += 1
    return found


def test_olmo_core_reads_our_tokens_masks_and_documents(olmo_core_python, prefect_api, tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "out"
    mixer = MixerConfig(
        datasets=[
            DatasetEntry(path=str(EXAMPLES / "data" / "general.jsonl"), amount=2.0),
            DatasetEntry(path=str(EXAMPLES / "data" / "arithmetic.jsonl"), amount=0.5),
        ],
        tokenizer=TokenizerSpec(name_or_path=str(EXAMPLES / "tokenizer"), chat_template="olmo"),
        max_seq_length=256,
        output=OutputSpec(path=str(out)),
    )
    report = tokenize_mixer(mixer=mixer, run=RunOptions(work_dir=str(tmp_path / "work")))
    dtype = np.dtype(report["token_dtype"])
    tok = AutoTokenizer.from_pretrained(EXAMPLES / "tokenizer")
    env = venv_env()
    done = subprocess.run(
        [
            str(olmo_core_python), str(READER), str(out), str(tmp_path / "olmo-work"), str(SEQUENCE_LENGTH),
            str(len(tok)), str(tok.eos_token_id), str(tok.pad_token_id), dtype.name,
        ],
        capture_output=True, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout)

    # Concat-and-chunk: instance i is tokens [i*L, (i+1)*L) of our part, with our mask.
    tokens = np.fromfile(out / "token_ids_part_0000.npy", dtype=dtype)
    mask = np.fromfile(out / "labels_mask_part_0000.npy", dtype=np.bool_).astype(int)
    fsl = seen["fsl"]
    assert len(fsl) == tokens.shape[0] // SEQUENCE_LENGTH > 0
    n = len(fsl) * SEQUENCE_LENGTH
    assert sum((i["input_ids"] for i in fsl), []) == tokens[:n].tolist()
    assert sum((i["label_mask"] for i in fsl), []) == mask[:n].tolist()

    # Packed (best-fit decreasing, boundaries read from our .csv.gz): every document of ours, whole,
    # exactly once, with its mask; the rest of each instance is padding with no loss.
    packed_docs = packed_documents(seen["packed"], tok.pad_token_id)
    ours = documents(out, dtype)
    assert packed_docs == Counter(ours)
    assert report["documents"] == len(ours)
    print(
        f"OLMo-core: {len(fsl)} FSL instances, {len(seen['packed'])} packed instances, {len(ours)} documents"
    )


def test_olmo_core_reads_whole_document_parts_with_every_document_whole(
    olmo_core_python, prefect_api, tmp_path
):
    """Several parts of 16 KiB: in the reference's layout OLMo-core reads the document at each part boundary
    as two (as many as ``check`` counts); in ``whole_documents`` parts it reads every document whole, exactly
    once, with its mask, whether it finds documents in the .csv.gz files or by EOS (its default locally),
    and the lineage columns of those .csv.gz files change nothing it reads."""
    from transformers import AutoTokenizer

    from sftmix.check.findings import check_output

    tok = AutoTokenizer.from_pretrained(EXAMPLES / "tokenizer")
    seen, outs = {}, {}
    for name, options in (
        ("one", {}),
        ("reference", {"part_bytes": 16384}),
        ("whole", {"parts": "whole_documents", "part_bytes": 16384, "lineage": True}),
    ):
        out = outs[name] = tmp_path / name
        mixer = MixerConfig(
            datasets=[
                DatasetEntry(path=str(EXAMPLES / "data" / "general.jsonl"), amount=2.0),
                DatasetEntry(path=str(EXAMPLES / "data" / "arithmetic.jsonl"), amount=1.0),
            ],
            tokenizer=TokenizerSpec(name_or_path=str(EXAMPLES / "tokenizer"), chat_template="olmo"),
            max_seq_length=SEQUENCE_LENGTH,  # (none is truncated: each ends with its EOS)
            output=OutputSpec(path=str(out), **options),
        )
        report = tokenize_mixer(mixer=mixer, run=RunOptions(work_dir=str(tmp_path / "work")))
        done = subprocess.run(
            [
                str(olmo_core_python), str(READER), str(out), str(tmp_path / f"olmo-{name}"), str(SEQUENCE_LENGTH),
                str(len(tok)), str(tok.eos_token_id), str(tok.pad_token_id), report["token_dtype"],
            ],
            capture_output=True, text=True, env=venv_env(), cwd=tmp_path,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        seen[name] = json.loads(done.stdout)
    assert not (outs["one"] / "token_ids_part_0001.npy").exists()
    assert (outs["whole"] / "token_ids_part_0002.npy").exists()
    ours = Counter(documents(outs["one"], np.dtype(report["token_dtype"])))
    for way in ("packed", "packed_by_eos"):
        assert packed_documents(seen["whole"][way], tok.pad_token_id) == ours, way
        assert packed_documents(seen["one"][way], tok.pad_token_id) == ours, way
    cut = next(f.count for f in check_output(outs["reference"]).findings if "part boundary" in f.what)
    theirs = packed_documents(seen["reference"]["packed"], tok.pad_token_id)
    assert cut > 0 and sum(theirs.values()) == sum(ours.values()) + cut  # each cut document read as two
    by_eos = packed_documents(seen["reference"]["packed_by_eos"], tok.pad_token_id)
    assert sum((ours - by_eos).values()) == cut  # by EOS, the cut documents are not read whole


COUNT_LENGTHS = (64, 128, 512)  # shorter than the longest documents (truncate/fragment differ) and longer


def olmo_core_counts(python: Path, out: Path, work: Path) -> dict[str, int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(EXAMPLES / "tokenizer")
    dtype = json.loads((out / "run_report.json").read_text())["token_dtype"]
    env = venv_env()
    done = subprocess.run(
        [
            str(python), str(READER), str(out), str(work), str(SEQUENCE_LENGTH), str(len(tok)),
            str(tok.eos_token_id), str(tok.pad_token_id), dtype, ",".join(map(str, COUNT_LENGTHS)),
        ],
        capture_output=True, text=True, env=env, cwd=work.parent,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)["counts"]


@pytest.mark.parametrize("output", ["demo", "mixture"])
def test_check_simulates_olmo_core_instance_counts(olmo_core_python, prefect_api, tmp_path, output):
    """``tokenize-mixer check --sequence_length L`` predicts the instances OLMo-core 3.0's own plain and
    packed FSL datasets make of the output, at lengths below and above its longest documents, with
    both long-document strategies and both sources of boundaries (.csv.gz and EOS scanning)."""
    from sftmix.check.findings import check_output
    from sftmix.config.run_file import load_run_file

    out = tmp_path / "out"
    if output == "demo":
        config = load_run_file(EXAMPLES / "mixer.yaml")
        mixer = config.mixer.model_copy(
            update={
                "datasets": [
                    d.model_copy(update={"path": str(EXAMPLES.parent / d.path)})
                    for d in config.mixer.datasets
                ],
                "tokenizer": config.mixer.tokenizer.model_copy(
                    update={"name_or_path": str(EXAMPLES / "tokenizer")}
                ),
                "output": OutputSpec(path=str(out)),
            }
        )
        run = config.run.model_copy(update={"work_dir": str(tmp_path / "work")})
    else:
        mixer = MixerConfig(
            datasets=[
                DatasetEntry(path=str(EXAMPLES / "data" / "general.jsonl"), amount=2.0),
                DatasetEntry(path=str(EXAMPLES / "data" / "arithmetic.jsonl"), amount=0.5),
                DatasetEntry(path=str(EXAMPLES / "data" / "conversions.jsonl"), amount=40),
            ],
            tokenizer=TokenizerSpec(name_or_path=str(EXAMPLES / "tokenizer"), chat_template="tulu"),
            max_seq_length=200,
            output=OutputSpec(path=str(out)),
        )
        run = RunOptions(work_dir=str(tmp_path / "work"), slice_rows=16)
    tokenize_mixer(mixer=mixer, run=run)
    theirs = olmo_core_counts(olmo_core_python, out, tmp_path / "olmo-work")
    ours: dict[str, int] = {}
    for length in COUNT_LENGTHS:
        for strategy in ("truncate", "fragment"):
            fit = check_output(out, length, long_doc_strategy=strategy).olmo_core
            assert fit is not None
            ours[f"fsl/{length}"] = fit.fsl_instances
            ours[f"packed/{length}/{strategy}/csv"] = fit.packed.instances
            ours[f"packed/{length}/{strategy}/eos"] = fit.packed_by_eos.instances
    assert ours == theirs
    assert theirs["packed/64/fragment/csv"] > theirs["packed/64/truncate/csv"]  # long documents were there


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q", "-s"]))
