"""Properties of whole runs: the same bytes for any slice size, runner and worker count, and outputs
whose token and mask parts have equal lengths, whose boundaries tile each part, and whose mask is
never set on a token outside an assistant turn's document."""

from __future__ import annotations

import gzip
import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sftmix.config.config import DatasetEntry, MixerConfig, OutputSpec, TokenizerSpec
from sftmix.config.run_options import RunOptions
from sftmix.output.digest import output_digests
from sftmix.output.olmo_format import BOUNDS_PART, MASK_PART, TOKENS_PART
from tests.tiers import examples
from tokenize_mixer.flows.tokenize_mixer import tokenize_mixer

EXAMPLES = Path(__file__).parent.parent / "examples"

pytestmark = pytest.mark.slow


def mixer(out: Path) -> MixerConfig:
    data = EXAMPLES / "data"
    return MixerConfig(
        datasets=[
            DatasetEntry(path=str(data / "general.jsonl"), amount=3.0),
            DatasetEntry(path=str(data / "arithmetic.jsonl"), amount=0.5),
            DatasetEntry(path=str(data / "conversions.jsonl"), amount=100),
        ],
        tokenizer=TokenizerSpec(name_or_path=str(EXAMPLES / "tokenizer"), chat_template="olmo"),
        max_seq_length=256,
        shuffle_seed=42,
        output=OutputSpec(path=str(out)),
    )


def check_layout(out: Path) -> None:
    """Equal token/mask lengths, boundaries tiling every part, masks only inside documents that have
    an assistant turn's tokens (each kept document has at least one trainable token)."""
    dtype = np.dtype(json.loads((out / "run_report.json").read_text())["token_dtype"])
    k = 0
    while (out / TOKENS_PART.format(k)).exists():
        tokens = np.fromfile(out / TOKENS_PART.format(k), dtype=dtype)
        mask = np.fromfile(out / MASK_PART.format(k), dtype=np.bool_)
        assert tokens.shape == mask.shape
        with gzip.open(out / BOUNDS_PART.format(k), "rt") as fh:
            bounds = np.array([[int(x) for x in line.split(",")] for line in fh], dtype=np.int64)
        assert bounds[0, 0] == 0 and bounds[-1, 1] == tokens.shape[0]
        assert (bounds[1:, 0] == bounds[:-1, 1]).all() and (bounds[:, 1] > bounds[:, 0]).all()
        per_doc = np.add.reduceat(mask.astype(np.int64), bounds[:, 0])
        assert (per_doc > 0).all()  # a document without trainable tokens is dropped, never written
        k += 1
    assert k >= 1


@pytest.fixture(scope="module")
def baseline(prefect_api, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("baseline")
    tokenize_mixer(mixer=mixer(root / "out"), run=RunOptions(work_dir=str(root / "work")))
    check_layout(root / "out")
    return output_digests(root / "out")


@settings(
    max_examples=examples(5), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    slice_rows=st.integers(min_value=1, max_value=300),
    runner=st.sampled_from(["thread", "process"]),
    workers=st.integers(min_value=1, max_value=2),
)
def test_same_bytes_for_any_slice_size_runner_and_worker_count(baseline, slice_rows, runner, workers):
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        run = RunOptions(
            work_dir=str(Path(tmp) / "work"), slice_rows=slice_rows, runner=runner, workers=workers
        )
        report = tokenize_mixer(mixer=mixer(out), run=run)
        assert report["slices_computed"] == report["slices_total"]  # really recomputed, not reused
        check_layout(out)
        assert output_digests(out) == baseline
