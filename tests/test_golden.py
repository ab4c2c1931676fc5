"""Byte-identity with the reference converter (outputs in tests/golden/expected, see PROVENANCE.md).

Each case runs through the real ``tokenize-mixer`` flow on a real Prefect API, with several slice sizes
and runners: the bytes must not depend on how the work was cut.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.tokenize_mixer import tokenize_mixer
from sftmix.cli import build_parser, mixer_from_convert_args
from sftmix.config import RunOptions
from sftmix.digest import compare
from tests.tokenizer_fixtures import GOLDEN

CASES = {c["name"]: c for c in json.loads((GOLDEN / "cases.json").read_text())["cases"]}

VARIANTS = {
    "whole": {"slice_rows": 100_000, "runner": "thread"},
    "slices-of-3": {"slice_rows": 3, "runner": "thread"},
}
PROCESS_VARIANT = {"slice_rows": 4, "runner": "process", "workers": 2}


def run_case(name: str, out: Path, work: Path, **options) -> dict:
    args = build_parser().parse_args(["convert", *CASES[name]["args"], "--output_dir", str(out)])
    return tokenize_mixer(mixer=mixer_from_convert_args(args), run=RunOptions(work_dir=str(work), **options))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference(case, variant, golden_dir, prefect_api, tmp_path, monkeypatch):
    monkeypatch.chdir(golden_dir)
    report = run_case(case, tmp_path / "out", tmp_path / "work", **VARIANTS[variant])
    result = compare(tmp_path / "out", golden_dir / "expected" / case)
    assert result.matches, result.render()
    assert report["slices_reused"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("case", ["olmo_truncated", "tulu_amounts"])
def test_matches_reference_with_worker_processes(case, golden_dir, prefect_api, tmp_path, monkeypatch):
    monkeypatch.chdir(golden_dir)
    report = run_case(case, tmp_path / "out", tmp_path / "work", **PROCESS_VARIANT)
    assert report["slices_total"] > 2
    result = compare(tmp_path / "out", golden_dir / "expected" / case)
    assert result.matches, result.render()


def test_rerun_reuses_every_slice(golden_dir, prefect_api, tmp_path, monkeypatch):
    monkeypatch.chdir(golden_dir)
    first = run_case("tulu_amounts", tmp_path / "a", tmp_path / "work", slice_rows=5, runner="thread")
    second = run_case("tulu_amounts", tmp_path / "b", tmp_path / "work", slice_rows=5, runner="thread")
    assert first["slices_computed"] == first["slices_total"] > 1
    assert second["slices_reused"] == second["slices_total"] and second["slices_computed"] == 0
    assert first["digests"] == second["digests"]
    assert compare(tmp_path / "b", golden_dir / "expected" / "tulu_amounts").matches


@pytest.mark.slow
def test_matches_reference_on_a_dask_local_cluster(golden_dir, prefect_api, tmp_path, monkeypatch):
    """runner=dask on a real distributed LocalCluster of 2 worker processes: the same bytes."""
    monkeypatch.chdir(golden_dir)
    report = run_case(
        "tulu_amounts", tmp_path / "out", tmp_path / "work", slice_rows=4, runner="dask", workers=2
    )
    assert report["slices_computed"] == report["slices_total"] > 2
    result = compare(tmp_path / "out", golden_dir / "expected" / "tulu_amounts")
    assert result.matches, result.render()
